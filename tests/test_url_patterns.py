"""URLs whose path holds a glob character (``*``, ``?``, ``[``) are refused.

fsspec's ``rm``/``mv``/``copy`` read such a path as a pattern: s3fs's recursive ``rm`` of a
failed save's leftovers under ``s3://b/exp[12]`` deleted ``exp1``'s committed step and a user's
file in ``exp2`` (and not its own), and a replica's retention under ``s3://b/rep*`` deleted
another job's step. Against a real S3 server (moto) and ``memory://``.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import distckpt
from distckpt.storage.objectstore import FsspecStorage
from distckpt.tools.cli import main as cli_main

pytestmark = pytest.mark.timeout(120)


def _opts(s3_server) -> dict:
    return s3_server.storage_options


@pytest.mark.parametrize("pattern", ["exp[12]", "exp*", "exp?"])
def test_a_root_or_replica_with_a_glob_character_is_refused_and_nothing_is_deleted(s3_server, s3_bucket: str, tmp_path: Path, pattern: str) -> None:
    opts = _opts(s3_server)
    other = distckpt.Checkpointer(f"s3://{s3_bucket}/exp1", storage_options=opts)
    other.save(1, {"w": torch.ones(3)})
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe_file(f"{s3_bucket}/exp2/step_000000001/notes.txt", b"mine")
    with pytest.raises(ValueError, match=r"glob pattern") as exc:
        distckpt.Checkpointer(f"s3://{s3_bucket}/{pattern}", storage_options=opts)
    assert repr(next(c for c in "*?[" if c in pattern)) in str(exc.value)
    with pytest.raises(ValueError, match=r"glob pattern"):
        distckpt.Checkpointer(tmp_path / "run", replicate_to=f"s3://{s3_bucket}/{pattern}", replicate_storage_options=opts, replicate_keep_last=1)
    fs.invalidate_cache()
    assert other.steps() == [1]
    assert fs.cat_file(f"{s3_bucket}/exp2/step_000000001/notes.txt") == b"mine"


def test_remove_tree_of_a_path_with_a_glob_character_removes_only_that_path() -> None:
    """Defence in depth: a path holding '[' (never a root's, they are refused) is deleted literally."""
    base = f"memory://lit-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    for name in ("a1/x", "a2/x", "a[12]/y"):
        fs.pipe_file(f"{base[len('memory://'):]}/{name}", b"1")
    storage = FsspecStorage(base)
    storage.remove_tree("a[12]")
    left = sorted(p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p in fs.find(base[len("memory://"):]))
    assert left == ["a1/x", "a2/x"]


def test_cli_output_url_with_a_glob_character_is_refused(tmp_path: Path, capsys) -> None:
    ckpt = distckpt.Checkpointer(tmp_path / "root")
    ckpt.save(1, {"model": {"w": torch.ones(3)}})
    fs = fsspec.filesystem("memory")
    base = f"out-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{base}/m1.safetensors.tmp-x", b"other")
    code = cli_main(["convert", str(tmp_path / "root"), "--to", "safetensors", f"memory://{base}/m[12].safetensors", "--key", "model"])
    assert code == 1
    assert "glob pattern" in capsys.readouterr().err
    assert fs.cat_file(f"{base}/m1.safetensors.tmp-x") == b"other"
    assert not fs.exists(f"{base}/m[12].safetensors")
