"""One rule says what names the local disk (``storage.base.is_local_location``): a path, taken
literally, or a ``file://`` or fsspec ``local://`` URL. Each test here failed while some module
wrote a rule of its own (``file://`` only, or fsspec's URL parsing of a plain path).
"""

from __future__ import annotations

import pytest
import torch

import distckpt
from cli_runner import run_cli
from distckpt.integrations.lightning_pointers import check_pointer_path
from distckpt.storage.base import Storage, is_local_location, local_path

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")

STEP = "step_{:09d}".format


def test_the_rule(tmp_path):
    for location in ("a/b", "runs/lr=1::b", "~/x", f"file://{tmp_path}", f"local://{tmp_path}"):
        assert is_local_location(location), location
    for location in ("s3://bucket/x", "memory://x", "simplecache::s3://bucket/x"):
        assert not is_local_location(location) and local_path(location) is None, location
    assert local_path("runs/lr=1::b").endswith("/runs/lr=1::b")
    assert local_path(f"local://{tmp_path}") == local_path(f"file://{tmp_path}") == str(tmp_path)


def test_a_root_whose_name_holds_a_double_colon_is_that_folder(tmp_path):
    """fsspec read ``runs/lr=1::b`` as a chain of URLs: the steps went to ``runs/lr=1``, another
    folder (another run's, possibly)."""
    root = tmp_path / "lr=1::b"
    assert Storage(str(root)).path == str(root)
    with distckpt.Checkpointer(str(root)) as ckpt:
        ckpt.save(1, {"w": torch.arange(4.0)})
    assert (root / STEP(1) / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr=1::b"]
    state = {"w": torch.zeros(4)}
    assert distckpt.Checkpointer(str(root)).load(state) == 1
    assert torch.equal(state["w"], torch.arange(4.0))
    done = run_cli("ls", str(root))
    assert done.returncode == 0 and "committed" in done.stdout, done


def test_storage_options_for_a_local_root_are_refused_however_it_is_named(tmp_path):
    """``local://`` roots took storage_options and ignored them (only ``file://`` was known)."""
    for root in (str(tmp_path), f"file://{tmp_path}", f"local://{tmp_path}", str(tmp_path / "a::b")):
        with pytest.raises(ValueError, match="local path, where they would be ignored"):
            distckpt.Checkpointer(root, storage_options={"anon": True})


def test_a_local_dir_inside_a_local_url_root_is_refused(tmp_path):
    """The overlap check skipped ``local://`` roots: the tier's retention would then delete
    committed steps of the root."""
    for root in (f"local://{tmp_path}/root", f"file://{tmp_path}/root", str(tmp_path / "root")):
        with pytest.raises(ValueError, match="overlap"):
            distckpt.Checkpointer(root, local_dir=str(tmp_path / "root" / "tier"))
        with pytest.raises(ValueError, match="overlap"):
            distckpt.Checkpointer(root, local_dir=str(tmp_path))


def test_a_lightning_pointer_inside_a_step_of_a_local_url_root_is_refused(tmp_path):
    """A pointer path was compared with a ``local://`` root as if one of them were remote: a
    pointer inside a step directory (it would replace a committed file) passed."""
    root = tmp_path / "root"
    for given in (f"local://{root}", f"file://{root}", str(root)):
        with pytest.raises(ValueError, match="step directory"):
            check_pointer_path(str(root / STEP(3) / "manifest.json"), given)
        with pytest.raises(ValueError, match="is the root"):
            check_pointer_path(f"local://{root}", given)
    check_pointer_path(str(root / "last.ckpt"), f"local://{root}")  # beside the steps: fine


def test_import_from_paths_whose_names_hold_a_double_colon(tmp_path):
    """The importer's directory check parsed the source as a chain of URLs (``a::b``: protocol
    ``a``): a Hugging Face folder named ``hf::v2`` was taken for a torch.save file and refused."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf::v2"
    folder.mkdir()
    save_file({"w": torch.arange(3.0)}, str(folder / "model.safetensors"))
    done = run_cli("convert", str(folder), "--to", "dcp", str(tmp_path / "out"), "-q")
    assert done.returncode == 0, done
    assert (tmp_path / "out" / STEP(0) / "manifest.json").is_file()
    src = tmp_path / "epoch=1::step=7.pt"
    torch.save({"model": {"w": torch.ones(2)}, "step": 7}, src)
    done = run_cli("convert", str(src), "--to", "dcp", str(tmp_path / "out2"), "-q")
    assert done.returncode == 0, done
    assert (tmp_path / "out2" / STEP(7) / "manifest.json").is_file()
