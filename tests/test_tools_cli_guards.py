"""The command line never writes into a checkpoint and never falls through silently (issue #28).

* ``convert`` refuses an output inside any checkpoint step (the one it reads or another: a folder
  holding ``manifest.json`` or ``.metadata``, or a ``step_*`` folder of a checkpoint root) and an
  output that is its input: one-line error, exit 1, the checkpoint still verifies.
* ``ls`` on a file says it is a file (not "does not exist"); so do ``inspect`` and ``verify``.
* ``--storage-option`` given only with local paths is a usage error (exit 2), not ignored.

Single process; ``distckpt`` runs in process (``tests/cli_runner.py``); one S3 case on the moto
server of ``tests/conftest.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from cli_runner import run_cli
from distckpt import Checkpointer
from distckpt.integrity.manifest import step_dir

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4))


@pytest.fixture
def root(tmp_path) -> Path:
    """A root with committed steps 10 and 20."""
    r = tmp_path / "root"
    ckpt = Checkpointer(r, save_rng=False)
    ckpt.save(10, {"model": _model(0), "epoch": 1})
    ckpt.save(20, {"model": _model(1), "epoch": 2})
    ckpt.close()
    return r


def _digests(where: Path) -> dict[str, str]:
    return {str(p.relative_to(where)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(where.rglob("*")) if p.is_file()}


def _one_line_error(done, code: int, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and lines[0].startswith("distckpt: error: "), (done.returncode, done.stderr)
    for w in words:
        assert w in lines[0], lines[0]


S20, S10 = step_dir(20), step_dir(10)
INSIDE = [
    ("torch", f"{S20}/__0_0.distcp"),        # a data file of the step it reads
    ("torch", f"{S20}/.metadata"),
    ("safetensors", f"{S20}/manifest.json"),
    ("safetensors", f"{S20}/model.safetensors"),  # a new file inside the step it reads
    ("torch", f"{S10}/__0_0.distcp"),        # another step of the root
    ("hf", f"{S20}/hf"),                     # a new folder inside a step
    ("hf", step_dir(50)),                    # a new folder named like a step of the root (an incomplete step to `ls`, removed by the next save)
    ("torch", "link/__0_0.distcp"),          # through a symbolic link to the step
]  # fmt: skip


@pytest.mark.parametrize("to,out", INSIDE, ids=[f"{t}:{o}" for t, o in INSIDE])
def test_convert_refuses_an_output_inside_a_checkpoint(root, to, out):
    os.symlink(root / S20, root.parent / "link")
    target = root / out if not out.startswith("link/") else root.parent / out
    before = _digests(root)
    done = run_cli("convert", str(root), "--to", to, str(target), "-q")
    _one_line_error(done, 1, "checkpoint", str(target) if not out.startswith("link/") else "__0_0.distcp")
    assert _digests(root) == before, "the checkpoint's files changed"
    assert sorted(os.listdir(root)) == [S10, S20], "nothing was added to the root"
    for step in (S10, S20):
        assert run_cli("verify", str(root / step), "-q").returncode == 0


def test_import_refuses_an_output_inside_a_checkpoint_or_over_its_input(root, tmp_path):
    src = tmp_path / "weights.pt"
    torch.save(_model(3).state_dict(), src)
    before = _digests(root)
    for out in (root / S20, root / S20 / "imported", root / step_dir(60)):
        _one_line_error(run_cli("convert", str(src), "--to", "dcp", str(out), "-q"), 1, "checkpoint")
    assert _digests(root) == before and sorted(os.listdir(root)) == [S10, S20]
    data = src.read_bytes()
    _one_line_error(run_cli("convert", str(src), "--to", "dcp", str(src), "-q"), 1, "input")
    assert src.read_bytes() == data
    # A Hugging Face folder imported into itself.
    hf_dir = tmp_path / "hf"
    from distckpt.tools import hf

    hf.save_pretrained(_model(3), str(hf_dir))
    listing = sorted(os.listdir(hf_dir))
    _one_line_error(run_cli("convert", str(hf_dir), "--to", "dcp", str(hf_dir), "-q"), 1, "input")
    assert sorted(os.listdir(hf_dir)) == listing


def test_convert_refuses_an_output_inside_an_s3_checkpoint(s3_server, s3_bucket, tmp_path):
    import fsspec

    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/run"
    Checkpointer(url, storage_options=opts, save_rng=False).save(5, {"model": _model(0)})
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    fs = fsspec.filesystem("s3", **opts)
    data = fs.cat_file(f"{s3_bucket}/run/{step_dir(5)}/__0_0.distcp")
    done = run_cli("convert", url, "--to", "torch", f"{url}/{step_dir(5)}/__0_0.distcp", "-q", *flags)
    _one_line_error(done, 1, "checkpoint", f"{url}/{step_dir(5)}")
    fs.invalidate_cache()
    assert fs.cat_file(f"{s3_bucket}/run/{step_dir(5)}/__0_0.distcp") == data
    assert run_cli("verify", url, "-q", *flags).returncode == 0


def test_ls_inspect_verify_on_a_file_say_it_is_a_file(root, tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    _one_line_error(run_cli("ls", str(f)), 1, str(f), "is a file, not a checkpoint root")
    for cmd in ("inspect", "verify"):
        _one_line_error(run_cli(cmd, str(f)), 1, str(f), "is a file")
    _one_line_error(run_cli("ls", str(tmp_path / "missing")), 1, "does not exist")


def test_storage_options_with_only_local_paths_are_a_usage_error(root, tmp_path):
    for args in (["ls", str(root)], ["inspect", str(root)], ["verify", str(root)],
                 ["convert", str(root), "--to", "torch", str(tmp_path / "x.pt")]):  # fmt: skip
        _one_line_error(run_cli(*args, "--storage-option", "anon=true"), 2, "--storage-option", "URL")
    assert not (tmp_path / "x.pt").exists()
    _one_line_error(run_cli("ls", f"file://{root}", "-o", "anon=true"), 2, "URL")
    _one_line_error(run_cli("ls", f"local://{root}", "-o", "anon=true"), 2, "URL")  # fsspec's other name for it


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_convert_replaces_an_existing_file_only_with_overwrite(root, tmp_path, to):
    """An existing output file (the user's only copy of other weights) was replaced without a
    word; now it takes ``--overwrite``, checked before anything is read or written."""
    out = tmp_path / f"model.{to}"
    out.write_bytes(b"my only copy of the fine-tuned weights")
    _one_line_error(run_cli("convert", str(root), "--to", to, str(out), "-q"), 1, str(out), "exists", "--overwrite")
    assert out.read_bytes() == b"my only copy of the fine-tuned weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, "root"]  # no temporary file left
    assert run_cli("convert", str(root), "--to", to, str(out), "-q", "--overwrite").returncode == 0
    assert out.stat().st_size > 100
    _one_line_error(run_cli("convert", str(root), "--to", to, f"{tmp_path}/newdir/", "-q"), 1, "newdir/", "ends with '/'")
    assert not (tmp_path / "newdir").exists()  # (a file named newdir was written)


def test_a_second_hf_export_takes_overwrite_and_keeps_other_files(root, tmp_path):
    """``--to hf`` into its own previous export said "pass overwrite=True", which the command
    line had no way to say."""
    out = tmp_path / "hf"
    assert run_cli("convert", str(root), "--to", "hf", str(out), "-q").returncode == 0
    (out / "tokenizer.json").write_text("{}")
    _one_line_error(run_cli("convert", str(root), "--to", "hf", str(out), "-q"), 1, "--overwrite")
    done = run_cli("convert", str(root), "--to", "hf", str(out), "-q", "--overwrite", "--step", "10")
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in _model(0).state_dict().items())
    assert (out / "tokenizer.json").read_text() == "{}"
    _one_line_error(run_cli("convert", str(out), "--to", "dcp", str(tmp_path / "imp"), "--overwrite"), 2, "--overwrite")


def test_an_existing_s3_object_is_replaced_only_with_overwrite(root, s3_server, s3_bucket):
    import fsspec

    opts = s3_server.storage_options
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe_file(f"{s3_bucket}/exports/model.pt", b"theirs")
    url = f"s3://{s3_bucket}/exports/model.pt"
    _one_line_error(run_cli("convert", str(root), "--to", "torch", url, "-q", *flags), 1, url, "exists")
    fs.invalidate_cache()
    assert fs.cat_file(f"{s3_bucket}/exports/model.pt") == b"theirs"
    assert run_cli("convert", str(root), "--to", "torch", url, "-q", "--overwrite", *flags).returncode == 0
    fs.invalidate_cache()
    assert fs.cat_file(f"{s3_bucket}/exports/model.pt") != b"theirs"


def test_an_export_killed_half_way_leaves_nothing_behind(tmp_path):
    """A killed export left its temporary file (``model.pt.tmp-1a2b3c4d``) beside the output for
    good: no later run removed it. The output is written as an unnamed file and linked into place
    once complete, so a kill (SIGKILL, once the writer has written: observed, not timed) leaves
    nothing, with and without ``--overwrite``."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from distckpt.tools.outputs import open_output\n"
        "with open_output(sys.argv[1], overwrite=sys.argv[2] == '1') as f:\n"
        "    f.write(b'x' * 1_000_000); f.flush()\n"
        "    print('written', flush=True); sys.stdin.read()\n"  # until killed
    )
    for overwrite in ("0", "1"):
        out = tmp_path / f"model{overwrite}.pt"
        if overwrite == "1":
            out.write_bytes(b"previous")
        proc = subprocess.Popen([sys.executable, "-c", code, str(out), overwrite], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "written"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=60)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == (["model1.pt"] if overwrite == "1" else []), left  # the previous file only
        if overwrite == "1":
            assert out.read_bytes() == b"previous"
    # A complete write appears whole, with the mode a new file gets (the umask applied).
    from distckpt.tools.outputs import open_output

    umask = os.umask(0o022)
    os.umask(umask)
    for overwrite in (False, True):
        with open_output(str(tmp_path / "done.pt"), overwrite=overwrite) as f:
            f.write(b"abc" if overwrite else b"ab")
        assert (tmp_path / "done.pt").read_bytes() == (b"abc" if overwrite else b"ab")
        assert (tmp_path / "done.pt").stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.pt", "model1.pt"]


def test_outputs_without_unnamed_files_use_a_temporary_name(tmp_path, monkeypatch):
    """Where the file system has no O_TMPFILE (or the system no /proc): a named temporary file,
    renamed into place; an existing file is still replaced only with ``overwrite``."""
    from distckpt.tools import outputs

    monkeypatch.setattr(outputs, "_unnamed_file", lambda folder: None)
    out = tmp_path / "m.pt"
    with outputs.open_output(str(out)) as f:
        f.write(b"one")
    with pytest.raises(FileExistsError, match="--overwrite"):
        with outputs.open_output(str(out)) as f:
            f.write(b"two")
    with outputs.open_output(str(out), overwrite=True) as f:
        f.write(b"three")
    with pytest.raises(RuntimeError):
        with outputs.open_output(str(out), overwrite=True) as f:
            f.write(b"four")
            raise RuntimeError("failed half-way")
    assert out.read_bytes() == b"three" and sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_local_urls_are_checked_as_local_paths(root, tmp_path):
    """``local://`` (fsspec's name for the local disk) was taken for a remote URL: no link
    resolved, written in place through fsspec. A link to a checkpoint's data file, exported over
    with ``--overwrite``, corrupted the committed step; a link's target was overwritten."""
    data = root / S20 / "__0_0.distcp"
    before = data.read_bytes()
    (tmp_path / "evil.pt").symlink_to(data)
    done = run_cli("convert", str(root), "--to", "torch", f"local://{tmp_path}/evil.pt", "-q", "--overwrite")
    _one_line_error(done, 1, "inside the checkpoint")
    assert data.read_bytes() == before and run_cli("verify", str(root), "-q").returncode == 0
    (tmp_path / "precious.bin").write_bytes(b"PRECIOUS")
    (tmp_path / "link.pt").symlink_to(tmp_path / "precious.bin")
    _one_line_error(run_cli("convert", str(root), "--to", "torch", f"local://{tmp_path}/link.pt", "-q", "--overwrite"), 1, "symbolic link")
    assert (tmp_path / "precious.bin").read_bytes() == b"PRECIOUS"
    _one_line_error(run_cli("convert", str(root), "--to", "torch", f"{tmp_path}/newdir/.", "-q"), 1, "names a folder")
    assert not (tmp_path / "newdir").exists()


def test_a_failed_export_to_a_url_without_uploads_keeps_the_previous_file(root, tmp_path):
    """On ``memory://`` (sftp, HDFS: files appear as they are written, no upload to discard) a
    failed export left its partial file, and with ``--overwrite`` truncated the user's previous
    one. It is written under a temporary name and moved into place once complete."""
    import fsspec

    data = root / S20 / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a checksum failure, found while the export streams
    data.write_bytes(bytes(raw))
    fs = fsspec.filesystem("memory")
    base = f"/{tmp_path.name}-partial"
    fs.pipe_file(f"{base}/keep.pt", b"USER'S ONLY COPY")
    for out, flags in ((f"{base}/keep.pt", ["--overwrite"]), (f"{base}/new.pt", [])):
        done = run_cli("convert", str(root), "--to", "torch", f"memory://{out}", "-q", *flags)
        _one_line_error(done, 1, "does not match")
    assert fs.cat_file(f"{base}/keep.pt") == b"USER'S ONLY COPY"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)) == ["keep.pt"]


def test_hf_export_over_weights_distckpt_did_not_write_takes_replace(root, tmp_path):
    """The refusal said "pass replace=['model.safetensors']", which the command line could not
    say: ``--replace NAME`` (names or patterns, repeatable; a bad pattern is an error)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"theirs")
    (out / "README.md").write_text("card")
    _one_line_error(run_cli("convert", str(root), "--to", "hf", str(out), "-q"), 1, "--replace NAME")
    assert (out / "model.safetensors").read_bytes() == b"theirs"
    assert run_cli("convert", str(root), "--to", "hf", str(out), "-q", "--replace", "model.safetensors").returncode == 0
    from safetensors.torch import load_file

    assert set(load_file(out / "model.safetensors")) == set(_model(1).state_dict())
    assert (out / "README.md").read_text() == "card"
    _one_line_error(run_cli("convert", str(root), "--to", "torch", str(tmp_path / "x.pt"), "--replace", "a"), 2, "--replace")


def test_a_folder_appearing_at_the_output_is_named_as_the_output(tmp_path):
    """A folder created at the output while an ``--overwrite`` export ran made the error name
    the temporary file (``Is a directory: b.st.tmp-f3a6e847``), a name the user never gave."""
    from distckpt.tools import outputs

    out = tmp_path / "b.st"
    with pytest.raises(IsADirectoryError) as caught:
        with outputs.open_output(str(out), overwrite=True) as f:
            f.write(b"x")
            out.mkdir()
    assert caught.value.filename == str(out) and ".tmp-" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.st"]
