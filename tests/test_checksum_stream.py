"""The checksum of a written file, with large pieces hashed on a helper thread beside their write
(distckpt.save.writer.BESIDE_BYTES): the recorded digest is still the one of the file's bytes in
order, whatever mix of small and large pieces, and a failing write neither hangs nor records one."""

from __future__ import annotations

import errno
import random
import threading

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

import distckpt
from distckpt.integrity.checksums import new_hasher
from distckpt.save import writer as _writer


class _Recording:
    """The default hasher, noting which thread hashed each piece."""

    def __init__(self, threads: list[str]) -> None:
        self._inner = new_hasher("crc32c")
        self._threads = threads

    def update(self, data) -> None:
        self._threads.append(threading.current_thread().name)
        self._inner.update(data)

    def hexdigest(self) -> str:
        return self._inner.hexdigest()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_hashed_beside_their_write_give_the_file_s_digest(tmp_path, monkeypatch, seed):
    # Above the 1 MiB buffer the stream's writer coalesces small pieces into.
    monkeypatch.setattr(_writer, "BESIDE_BYTES", 2 << 20)
    threads: list[str] = []
    monkeypatch.setattr(_writer, "new_hasher", lambda algorithm: _Recording(threads))
    rng = random.Random(seed)
    pieces = [rng.randbytes(rng.choice([1, 100, 5000, 300_000, 1 << 20, 3 << 20])) for _ in range(30)]
    fs = _writer._ChecksummingFS(FileSystem(), "crc32c", sync=None, beside=True)
    path = tmp_path / "f.distcp"
    with fs.create_stream(path, "wb") as stream:
        for p in pieces:
            stream.write(memoryview(p))
    data = path.read_bytes()
    assert data == b"".join(pieces)
    assert fs.files["f.distcp"] == (len(data), f"{crc32c.crc32c(data):08x}")
    assert any(t.startswith("distckpt-checksum") for t in threads), "no piece was hashed beside its write"
    assert any(not t.startswith("distckpt-checksum") for t in threads), "small pieces are hashed in line"
    timings = fs.timings.breakdown()
    assert timings["checksum"] >= 0 and timings["io_write"] > 0


def test_pieces_are_hashed_in_line_where_thread_pools_refuse_work_at_exit(tmp_path, monkeypatch):
    # An async save finished by the close at interpreter exit: thread pools refuse new work by
    # then, and the hash beside a piece's write raised "cannot schedule new futures".
    from concurrent.futures import ThreadPoolExecutor

    def refused(self, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(_writer, "BESIDE_BYTES", 64 << 10)
    monkeypatch.setattr(ThreadPoolExecutor, "submit", refused)
    fs = _writer._ChecksummingFS(FileSystem(), "crc32c", sync=None, beside=True)
    path = tmp_path / "h.distcp"
    pieces = [bytes([i]) * (100 << 10) for i in range(5)]
    with fs.create_stream(path, "wb") as stream:
        for p in pieces:
            stream.write(memoryview(p))
    data = path.read_bytes()
    assert data == b"".join(pieces) and fs.files["h.distcp"] == (len(data), f"{crc32c.crc32c(data):08x}")


def test_a_failing_write_of_a_large_piece_is_recorded_without_a_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(_writer, "BESIDE_BYTES", 64 << 10)
    fs = _writer._ChecksummingFS(FileSystem(), "crc32c", sync=None, beside=True)
    path = tmp_path / "g.distcp"
    real_open = FileSystem.create_stream

    class Full:
        def __init__(self, raw) -> None:
            self.raw = raw

        def write(self, b):
            if memoryview(b).nbytes >= 64 << 10:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.raw.write(b)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    from contextlib import contextmanager

    @contextmanager
    def full_stream(self, p, mode):
        with real_open(self, p, mode) as raw:
            yield Full(raw)

    monkeypatch.setattr(FileSystem, "create_stream", full_stream)
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"x" * 10)
        stream.write(memoryview(bytes(1 << 20)))
        stream.write(b"y" * 10)
    assert "g.distcp" not in fs.files
    assert len(fs.errors) == 1 and fs.errors[0].errno == errno.ENOSPC and "g.distcp" in str(fs.errors[0])


def test_pieces_are_hashed_beside_their_write_only_with_a_spare_core(monkeypatch):
    # A helper thread per writer needs a core of its own: on a host the writers of every
    # co-located rank fill, the checksum stays in line (no thread switches, no cores taken from
    # training beside an async save).
    from distckpt import _process

    for cores, local, threads, beside in [(16, None, 8, True), (2, None, 2, False), (16, "2", 8, False), (16, "2", 4, True), (4, "x", 2, True)]:
        monkeypatch.setattr(_process.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert _process.has_spare_cores(threads) is beside, (cores, local, threads)
    # The ranks on this host, when the caller knows them, rule over the environment.
    monkeypatch.setattr(_process.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _process.has_spare_cores(1) is True
    assert _process.has_spare_cores(1, local_ranks=2) is False  # 2 ranks' writers fill 2 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _process.has_spare_cores(1, local_ranks=1) is True


def _writer_cores(rank: int, world: int, root: str) -> list:
    """Each save's writer is told how many ranks share this host (both ranks here)."""
    from distckpt.save import writer

    asked = []
    real = writer.has_spare_cores

    def spy(threads, local_ranks=None):
        asked.append((threads, local_ranks))
        return real(threads, local_ranks)

    writer.has_spare_cores = spy
    with distckpt.Checkpointer(root, async_mode="thread") as ckpt:
        ckpt.save(1, {"w": torch.randn(64)})
        ckpt.save(2, {"w": torch.randn(64)}, blocking=False)
        ckpt.wait()
    return asked


def test_the_writers_know_the_ranks_on_their_host(tmp_path, monkeypatch):
    # Without LOCAL_WORLD_SIZE (not torchrun) the save still counts both ranks of this host, so
    # 2 ranks of 1-2 writer threads on 2 cores keep their checksums in line.
    from dist_harness import run_ranks

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for asked in run_ranks(_writer_cores, 2, tmp_path, str(tmp_path / "root")):
        assert [local for _, local in asked] == [2, 2], asked
