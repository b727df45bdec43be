"""URLs whose path holds a glob character (``*``, ``?``, ``[``) are taken literally.

fsspec's ``rm``/``mv``/``copy`` read such a path as a pattern: s3fs's recursive ``rm`` of a
failed save's leftovers under ``s3://b/exp[12]`` deleted ``exp1``'s committed step and a user's
file in ``exp2`` (and not its own), and a replica's retention under ``s3://b/rep*`` deleted
another job's step. distckpt now moves and deletes such paths by name: saves, retention, the
replica and CLI outputs there work, and touch nothing the pattern would match. Against a real S3
server (moto) and ``memory://``.
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


@pytest.mark.parametrize("pattern", ["exp[12]", "exp*", "exp[!x]"])
def test_a_root_and_a_replica_with_a_glob_character_touch_nothing_they_would_match(s3_server, s3_bucket: str, tmp_path: Path, pattern: str) -> None:
    opts = s3_server.storage_options
    other = distckpt.Checkpointer(f"s3://{s3_bucket}/exp1", storage_options=opts)
    other.save(1, {"w": torch.ones(3)})
    rep_other = distckpt.Checkpointer(f"s3://{s3_bucket}/rep1", storage_options=opts)
    rep_other.save(1, {"w": torch.ones(3)})
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe_file(f"{s3_bucket}/exp2/step_000000001/notes.txt", b"mine")
    fs.pipe_file(f"{s3_bucket}/rep2/step_000000001/notes.txt", b"mine")
    root = f"s3://{s3_bucket}/{pattern}"
    replica = f"s3://{s3_bucket}/{pattern.replace('exp', 'rep')}"
    with distckpt.Checkpointer(root, storage_options=opts, keep_last=1, replicate_to=replica, replicate_storage_options=opts) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((3,), float(step))})
        ckpt.wait()
        ckpt.replica.wait(timeout=120)
        assert ckpt.steps() == [3] and ckpt.steps(tier="replica") == [3]
        state = {"w": torch.zeros(3)}
        assert ckpt.load(state) == 3 and torch.equal(state["w"], torch.full((3,), 3.0))
    fs.invalidate_cache()
    assert other.steps() == [1] and rep_other.steps() == [1]
    assert fs.cat_file(f"{s3_bucket}/exp2/step_000000001/notes.txt") == b"mine"
    assert fs.cat_file(f"{s3_bucket}/rep2/step_000000001/notes.txt") == b"mine"


def test_remove_tree_of_a_path_with_a_glob_character_removes_only_that_path() -> None:
    """Its folders too, on a filesystem that has folders (memory://): a retired step left one,
    shown as an incomplete step."""
    base = f"memory://lit-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    for name in ("a1/x", "a2/x", "a[12]/y", "a[12]/sub/z"):
        fs.pipe_file(f"{base[len('memory://'):]}/{name}", b"1")
    storage = FsspecStorage(base)
    storage.remove_tree("a[12]")
    left = sorted(p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p in fs.find(base[len("memory://"):]))
    assert left == ["a1/x", "a2/x"] and storage.list_dirs() == ["a1", "a2"]


def test_a_memory_root_with_a_glob_character_keeps_only_its_newest_step() -> None:
    root = f"memory://pat-{uuid.uuid4().hex[:8]}/run[1]"
    with distckpt.Checkpointer(root, keep_last=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((3,), float(step))})
        assert ckpt.storage.list_dirs() == ["step_000000003"]
        with pytest.raises(FileNotFoundError, match=r"not found .*committed steps: \[3\]"):
            ckpt.load({"w": torch.zeros(3)}, step=1)


@pytest.mark.parametrize("url", ["memory://q/a?b/run", "memory://q/exp?", "memory://q/exp?a=b", "s3://b/exp?versionId=1"])
def test_a_question_mark_in_a_literal_path_is_refused(url: str) -> None:
    """Shown and marked without what follows '?' (a query), "exp?new" or "exp?a=b" was named as
    "exp": another root, whose local tier copies it overwrote and retired, and whose load took
    its copies."""
    with pytest.raises(ValueError, match=r"'\?' in the path of a (memory|s3):// URL is taken literally"):
        distckpt.Checkpointer(url)
    distckpt.Storage("https://bucket/prefix?token=abc")  # an HTTP query: as before


def test_cli_output_url_with_a_glob_character_is_written_literally(tmp_path: Path) -> None:
    """memory:// writes under a temporary name and moves it into place: fsspec's mv globbed the
    temporary name's pattern."""
    ckpt = distckpt.Checkpointer(tmp_path / "root")
    ckpt.save(1, {"model": {"w": torch.ones(3)}})
    fs = fsspec.filesystem("memory")
    base = f"out-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{base}/m1.safetensors", b"other")
    code = cli_main(["convert", str(tmp_path / "root"), "--to", "safetensors", f"memory://{base}/m[12].safetensors", "--key", "model"])
    assert code == 0
    assert fs.cat_file(f"{base}/m1.safetensors") == b"other"
    assert fs.cat_file(f"/{base}/m[12].safetensors")[:8] != b"other"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"/{base}")) == ["m1.safetensors", "m[12].safetensors"]
