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
from distckpt.storage.base import Storage, is_local_location, local_path, overlaps

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


# -- two roots by other names (found by an attack on this rule) ----------------------------------
def test_a_local_dir_that_is_the_root_behind_a_chain_of_caches_is_refused(tmp_path):
    """``simplecache::file://ROOT`` writes into ROOT; a ``local_dir`` of ROOT was accepted, and
    the tier's retention (``local_keep=1``) deleted the root's committed steps (``keep_last=None``)."""
    root = tmp_path / "root"
    for given in (f"simplecache::file://{root}", f"filecache::local://{root}"):
        with pytest.raises(ValueError, match="local_dir .* and root .* overlap"):
            distckpt.Checkpointer(given, local_dir=str(root), local_keep=1)


@pytest.mark.parametrize("spelling", ["{p}", "file://{p}", "local://{p}/", "{p}/sub"])
def test_a_replica_that_is_the_root_or_inside_it_is_refused(tmp_path, spelling):
    """``replicate_to`` naming the root: every save "replicated", and the replica's retention
    (``replicate_keep_last=1``) deleted the root's steps, which the user kept (``keep_last=None``)."""
    root = tmp_path / "root"
    with pytest.raises(ValueError, match="replicate_to .* and root .* overlap"):
        distckpt.Checkpointer(str(root), replicate_to=spelling.format(p=root), replicate_keep_last=1)
    with pytest.raises(ValueError, match="overlap"):  # the root inside the replica: the same
        distckpt.Checkpointer(str(root / "inner"), replicate_to=spelling.format(p=root).removesuffix("/sub"))
    distckpt.Checkpointer(str(root), replicate_to=str(tmp_path / "root2")).close()  # a sibling: fine


def test_a_local_dir_that_is_the_replica_is_refused(tmp_path):
    """The tier made its steps in the replica's folder and its retention deleted the replica's."""
    with pytest.raises(ValueError, match="local_dir .* and replicate_to .* overlap"):
        distckpt.Checkpointer(str(tmp_path / "root"), replicate_to=str(tmp_path / "rep"), local_dir=str(tmp_path / "rep"))


def test_url_roots_overlap_by_filesystem_path_and_options():
    assert overlaps("s3://b/run", {}, "s3a://b/run/replica/", {})  # (s3a: the same filesystem)
    assert not overlaps("s3://b/run", {}, "s3://b/run2", {})
    # Another endpoint may hold the same bucket name: not refused.
    assert not overlaps("s3://b/run", {"endpoint_url": "http://a"}, "s3://b/run", {"endpoint_url": "http://b"})
    assert overlaps("memory://x/run", None, "memory:///x/run/r", None)
    # Options that change how, not where (found by a helper: the replica's retention then deleted
    # the root's steps), and a chain of caches over the same place.
    here = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "key": "k"}
    assert overlaps("s3://b/run", here, "s3://b/run", {**here, "default_block_size": 8 << 20})
    assert overlaps("s3://b/run", here, "simplecache::s3://b/run", {"s3": here})
    assert not overlaps("s3://b/run", here, "s3://b/run", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:10"}})
    assert not overlaps("/b/run", None, "s3://b/run", {})
    # One server spelt two ways (found by a helper: with a trailing '/', the replica's retention
    # deleted the root's steps): case, the default port, a trailing '/', loopback's names.
    for other in ("http://127.0.0.1:9/", "HTTP://LOCALHOST:9", "http://[::1]:9"):
        assert overlaps("s3://b/run", here, "s3://b/run", {"endpoint_url": other}), other
    assert overlaps("s3://b/r", {"endpoint_url": "https://s3.example.com"}, "s3://b/r", {"endpoint_url": "https://S3.example.com:443/"})
    assert not overlaps("s3://b/r", {"endpoint_url": "https://s3.example.com"}, "s3://b/r", {"endpoint_url": "http://s3.example.com"})
    # Given twice on one side (top-level and in client_kwargs); a host name's case.
    assert overlaps("s3://b/run", {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}},
                    "s3://b/run", here)  # fmt: skip
    assert overlaps("s3://b/run", {"client_kwargs": {"host": "MinIO"}}, "s3://b/run", {"client_kwargs": {"host": "minio"}})


def test_an_s3_endpoint_from_the_environment_is_the_server_it_names(monkeypatch):
    here = {"endpoint_url": "http://127.0.0.1:9"}
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://localhost:9/")
    assert overlaps("s3://b/run", {}, "s3://b/run", here)  # botocore takes the root's from the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://elsewhere:9")
    assert not overlaps("s3://b/run", {}, "s3://b/run", here)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert not overlaps("s3://b/run", {}, "s3://b/run", here)


def test_replica_options_for_a_local_replica_are_refused(tmp_path):
    """``replicate_storage_options`` for a local ``replicate_to`` were ignored silently (the same
    for the root were refused)."""
    for rep in (str(tmp_path / "rep"), f"file://{tmp_path}/rep", f"local://{tmp_path}/rep"):
        with pytest.raises(ValueError, match="replicate_storage_options .* local path"):
            distckpt.Checkpointer(str(tmp_path / "root"), replicate_to=rep, replicate_storage_options={"anon": True})


def test_file_localhost_is_the_root_of_the_local_disk(tmp_path):
    """``file://localhost/x`` is ``/x`` (RFC 8089); it named ``$CWD/localhost/x``."""
    assert Storage(f"file://localhost{tmp_path}").path == str(tmp_path)
    assert local_path("file://localhost") == "/"
    # One slash: fsspec reads file:/x as /x; it named ./file:/x (a folder "file:" made in the working directory).
    assert Storage(f"file:{tmp_path}").path == local_path(f"local:{tmp_path}") == str(tmp_path)


def test_unclear_locations_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"FILE:///nowhere/x: Protocol not known"):
        distckpt.Checkpointer("FILE:///nowhere/x")

    class BytesPath:
        def __fspath__(self):
            return str(tmp_path).encode()

    with pytest.raises(ValueError, match=r"root must be .* \(as text\)"):
        distckpt.Checkpointer(BytesPath())
    for args in (("ls", ""), ("verify", " "), ("convert", "", "--to", "torch", str(tmp_path / "x.pt"))):
        done = run_cli(*args)
        assert done.returncode == 2 and "is empty" in done.stderr, done


def test_a_pointer_in_a_temporary_folder_of_a_cached_root_is_refused(tmp_path):
    """A root behind a chain of caches was compared as a remote URL with a local pointer path:
    a pointer inside the root's temporary folder (where a save is being written) passed."""
    root = tmp_path / "r"
    with pytest.raises(ValueError, match="step directory"):
        check_pointer_path(f"file://{root}/.distckpt-new-x/y.ckpt", f"simplecache::file://{root}")
    with pytest.raises(ValueError, match="is the root"):
        check_pointer_path(str(root), f"simplecache::file://{root}")


def test_a_root_that_is_a_link_to_a_folder_not_made_yet_is_made(tmp_path, monkeypatch):
    """``ckpt -> runs/8`` for a new run, runs/8 not made yet: mkdir of the link's name failed
    with EEXIST, which the claim took for another writer's step (every save refused: "being
    written by another writer"). The link's folder is made, as a root's is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").symlink_to("runs/8")
    with distckpt.Checkpointer("ckpt") as ckpt:
        ckpt.save(4, {"w": torch.ones(2)})
        assert ckpt.steps() == [4]
    assert (tmp_path / "runs" / "8" / "step_000000004" / "manifest.json").is_file()
    (tmp_path / "deep").symlink_to("runs/9")  # a root beneath a dangling link: a bare FileNotFoundError
    with distckpt.Checkpointer("deep/sub") as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    assert (tmp_path / "runs" / "9" / "sub" / "step_000000001" / "manifest.json").is_file()
