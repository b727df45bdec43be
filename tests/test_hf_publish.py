"""Publishing Hugging Face checkpoints is atomic: a publish that fails part-way (here: the N-th
shard file cannot be created) leaves the previous checkpoint (local) or nothing loadable (object
stores, where the index is the commit), never a mix of new and old shards and no temporary
directory. Single process; the S3 cases run against the local moto server."""

from __future__ import annotations

import contextlib
import errno

import pytest
import torch
from torch import nn

import distckpt
from distckpt import hf

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")
SHARD = 3000  # bytes: the model below publishes as 3 shard files


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@contextlib.contextmanager
def _failing_put(monkeypatch, cls: type, n: int):
    """``cls.open`` refuses the ``n``-th file opened for writing (counted as the publish goes)."""
    original = cls.open
    puts = []

    @contextlib.contextmanager
    def open_(self, rel, mode="rb"):
        if "w" in mode:
            puts.append(rel)
            if len(puts) == n:
                raise OSError(errno.EIO, "injected failure", rel)
        with original(self, rel, mode) as f:
            yield f

    monkeypatch.setattr(cls, "open", open_)
    try:
        yield puts
    finally:
        monkeypatch.setattr(cls, "open", original)


def test_failed_local_publish_keeps_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    from distckpt._storage_local import LocalStorage

    out = tmp_path / "pub"
    old, new = _model(0), _model(1)
    assert len(hf.save_pretrained(old, str(out), max_shard_size=SHARD)["files"]) == 3
    with _failing_put(monkeypatch, LocalStorage, 2) as puts, pytest.raises((OSError, distckpt.CheckpointError)):
        hf.save_pretrained(new, str(out), max_shard_size=SHARD, overwrite=True)
    assert len(puts) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub"], "no temporary or backup directory left"
    fresh = _model(5)
    hf.load_pretrained(fresh, str(out))
    assert _equal(fresh, old), "the previous checkpoint is intact"
    # A first publish that fails leaves nothing at all.
    with _failing_put(monkeypatch, LocalStorage, 3), pytest.raises((OSError, distckpt.CheckpointError)):
        hf.save_pretrained(new, str(tmp_path / "first"), max_shard_size=SHARD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub"]


def test_failed_s3_overwrite_leaves_no_mix_of_shards(s3_server, s3_bucket, monkeypatch):
    import fsspec

    from distckpt._storage_fsspec import FsspecStorage

    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/pub"
    fs = fsspec.filesystem("s3", **opts)
    old, new = _model(0), _model(1)
    hf.save_pretrained(old, url, storage_options=opts, max_shard_size=SHARD)
    with _failing_put(monkeypatch, FsspecStorage, 2) as puts, pytest.raises((OSError, distckpt.CheckpointError)):
        hf.save_pretrained(new, url, storage_options=opts, max_shard_size=SHARD, overwrite=True)
    assert len(puts) == 2
    fs.invalidate_cache()
    left = [p.rsplit("/", 1)[1] for p in fs.glob(f"{s3_bucket}/pub/*") if p.endswith(".safetensors")]
    assert left == [], f"the failed publish left shard files behind: {left}"
    fresh = _model(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises((distckpt.IntegrityError, FileNotFoundError)):
        hf.load_pretrained(fresh, url, storage_options=opts)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    # A later overwrite with fewer files commits and removes the old checkpoint's stale shards.
    hf.save_pretrained(new, url, storage_options=opts, max_shard_size="1MB", overwrite=True)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.glob(f"{s3_bucket}/pub/*")) == ["model.safetensors", "model.safetensors.index.json"]
    hf.load_pretrained(fresh, url, storage_options=opts)
    assert _equal(fresh, new)


def test_shards_without_their_index_are_refused(tmp_path):
    from distckpt.safetensors_io import INDEX_NAME

    model = _model(0)
    hf.save_pretrained(model, str(tmp_path / "sharded"), max_shard_size=SHARD)
    (tmp_path / "sharded" / INDEX_NAME).unlink()
    with pytest.raises(distckpt.IntegrityError, match=f"3 safetensors files .*no {INDEX_NAME}"):
        hf.load_pretrained(_model(5), str(tmp_path / "sharded"))
    # A single file needs no index (what transformers writes for small models).
    hf.save_pretrained(model, str(tmp_path / "single"))
    (tmp_path / "single" / INDEX_NAME).unlink()
    fresh = _model(5)
    hf.load_pretrained(fresh, str(tmp_path / "single"))
    assert _equal(fresh, model)
