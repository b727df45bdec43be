"""DCP's storage writer on a :class:`~distckpt.storage.base.Storage` (the reader is :mod:`distckpt.load.reader`).

:class:`CheckpointWriter` is DCP's ``FileSystemWriter`` writing one file per rank (and thread)
through the storage's DCP filesystem, its files written by :mod:`distckpt.save.records` (DCP's
layout; torch.save's per-record CRC chosen per call), wrapped so that

* every file's size and checksum are computed while it is written (no second pass), for the
  manifest;
* a write error (a full disk, a failed upload) is recorded with the file's path and raised
  after the writer threads stopped, never lost inside them;
* every planned item is checked to have been written.
"""

from __future__ import annotations

import io
import os
import threading
import time
import uuid
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalDcpFS
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from distckpt._process import has_spare_cores, pools_refuse
from distckpt.integrity.checksums import DEFAULT as DEFAULT_CHECKSUM
from distckpt.integrity.checksums import Buffer, new_hasher
from distckpt.save.d2h import PARTS as D2H_PARTS
from distckpt.save.records import write_items
from distckpt.storage.base import Storage, WritableFile, named_os_error
from distckpt.storage.local_tier import LocalCopy, rename_copy, root_mark


_BUFFER = 1 << 20
#: Pieces of at least this many bytes (a tensor's data: torch.save hands it over in one piece)
#: are checksummed on a helper thread while they are written, instead of before, where the host
#: has a spare core for it (:func:`distckpt._process.has_spare_cores`): on a lent H100
#: a sync save of 4 GB to tmpfs spent 0.43 of its 3.4 writer-thread-seconds on CRC-32C, in line
#: with the writes. Both only read the piece; the write returns after both are done, so the
#: digest still takes the pieces in order. Smaller pieces are not worth a thread handoff.
BESIDE_BYTES = 4 << 20


class WriteTimings:
    """Seconds the writer threads spent in each part of writing files (summed over threads).

    ``files``: from opening each file to closing it (all of the work for it); ``checksum`` (the
    writer threads' part of it: large pieces are checksummed beside their write, and count only
    for the wait after it), ``io_write`` and ``fsync`` are the parts distckpt can see, and so are the device-to-host
    copies' parts of a sync save (:data:`distckpt.save.d2h.PARTS`: issuing copies, waiting for
    them, waiting for their proofs); the rest of ``files`` is DCP's serialization (``torch.save``
    of each item). Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {"files": 0.0, "checksum": 0.0, "io_write": 0.0, "fsync": 0.0}
        self.seconds.update(dict.fromkeys(D2H_PARTS, 0.0))

    def add(self, part: str, dt: float) -> None:
        with self._lock:
            self.seconds[part] += dt

    def breakdown(self) -> dict[str, float]:
        """``serialize``, ``checksum``, ``io_write``, ``fsync`` (thread-seconds), and the parts of
        device-to-host copies that took any time."""
        s = dict(self.seconds)
        seen = s["checksum"] + s["io_write"] + s["fsync"] + sum(s[p] for p in D2H_PARTS)
        out = {"serialize": max(0.0, s["files"] - seen), "checksum": s["checksum"], "io_write": s["io_write"], "fsync": s["fsync"]}
        out.update({p: s[p] for p in D2H_PARTS if s[p]})
        return out


class _ChecksumStream(io.RawIOBase):
    """Write-through stream that hashes every byte on its way to the file.

    The checksum is computed while the data is written, so integrity costs no second pass.
    An ``OSError`` from the file (a full disk, a failed upload) is handed to ``on_error`` and
    the rest of the file is dropped instead of raised: DCP writes from threads of its own that
    print an exception and lose it, and ``torch.save`` would replace ENOSPC with
    "enforce fail ... unexpected pos". :meth:`CheckpointWriter.write_data` raises the recorded
    error once DCP returns, with its errno and the file's path.
    """

    def __init__(
        self,
        raw: WritableFile | None,
        on_close: Callable[[int, str | None], None],
        algorithm: str | None,
        on_error: Callable[[BaseException], None],
        sync: Callable[[WritableFile], None] | None,
        timings: WriteTimings,
        copy: LocalCopy | None = None,
        beside: bool = False,
    ) -> None:
        """``raw``: the file (``None``: it could not be created, the error is recorded already);
        ``on_close(size, digest)`` once it is written whole; ``sync(raw)`` makes it durable;
        ``copy``: the node-local tier's copy of the file, written alike (never failing it);
        ``beside``: checksum large pieces beside their write (:data:`BESIDE_BYTES`)."""
        self._hash_beside = beside
        self._copy = copy
        self._timings = timings
        self._t_checksum = 0.0
        self._t_write = 0.0
        self._raw = raw
        self._hasher = new_hasher(algorithm) if algorithm else None
        self._size = 0
        self._on_close = on_close
        self._on_error = on_error
        self._sync = sync
        self.failed = raw is None
        self._hasher_thread: ThreadPoolExecutor | None = None  # made at the first large piece

    def writable(self) -> bool:
        return True

    def _fail(self, exc: BaseException) -> None:
        self.failed = True
        self._on_error(exc)

    def write(self, b: Buffer) -> int:  # type: ignore[override]
        # Called for every piece torch.save writes (thousands per save): kept lean, timings
        # summed here and handed over once, at close.
        if self.failed:
            return memoryview(b).nbytes
        hashing = None
        t0 = time.perf_counter()
        if self._hasher is not None:
            if self._hash_beside and memoryview(b).nbytes >= BESIDE_BYTES:
                if self._hasher_thread is None:
                    self._hasher_thread = ThreadPoolExecutor(1, thread_name_prefix="distckpt-checksum")
                try:
                    hashing = self._hasher_thread.submit(self._hasher.update, b)
                except RuntimeError as exc:  # (an async save finished by the close at exit)
                    if not pools_refuse(exc):
                        raise
                    self._hasher.update(b)
            else:
                self._hasher.update(b)
        t1 = time.perf_counter()
        try:
            try:
                n = self._raw.write(b)
            except OSError as exc:
                self._fail(exc)
                return memoryview(b).nbytes
            if self._copy is not None:
                self._copy.write(b)
        finally:
            t2 = time.perf_counter()
            if hashing is not None:
                # ``b`` is only valid until this call returns, and the next piece must follow it.
                hashing.result()
            t3 = time.perf_counter()
            # checksum: what the writer thread spent on it (a piece hashed beside its write
            # counts only the wait after the write).
            self._t_checksum += (t1 - t0) + (t3 - t2)
            self._t_write += t2 - t1
        n = memoryview(b).nbytes if n is None else n
        self._size += n
        return n

    def tell(self) -> int:
        return self._size if self.failed else self._raw.tell()

    def flush(self) -> None:
        if not self.failed:
            try:
                self._raw.flush()
            except OSError as exc:
                self._fail(exc)

    def close(self) -> None:
        if not self.closed:
            # Explicit flush before close: some fsspec files drop unflushed data otherwise.
            self.flush()
            if self._sync is not None and not self.failed:
                t0 = time.perf_counter()
                try:
                    self._sync(self._raw)
                except OSError as exc:
                    self._fail(exc)
                self._timings.add("fsync", time.perf_counter() - t0)
            if not self.failed:
                self._on_close(self._size, self._hasher.hexdigest() if self._hasher is not None else None)
            if self._copy is not None:
                if self.failed:
                    self._copy.abandon()
                else:
                    self._copy.finish()
            self._timings.add("checksum", self._t_checksum)
            self._timings.add("io_write", self._t_write)
            if self._hasher_thread is not None:
                self._hasher_thread.shutdown(wait=True)
                self._hasher_thread = None
        super().close()


class _ChecksummingFS(FileSystemBase):
    """A DCP filesystem that hashes every file it writes, recording ``name -> (size, digest)``.

    Write errors of the files are recorded in :attr:`errors` (with the file's path) rather than
    raised inside DCP's writer threads; see :class:`_ChecksumStream`.
    """

    def __init__(
        self,
        inner: FileSystemBase,
        algorithm: str | None,
        sync: Callable[[WritableFile], None] | None = None,
        local_dir: str | None = None,
        beside: bool = False,
        local_root: str | None = None,
    ) -> None:
        self.inner = inner
        # The root the tier's directory must be marked with (LocalCopy writes nowhere else).
        self.local_root = local_root
        self.beside = beside  # checksum large pieces beside their write (writer.BESIDE_BYTES)
        # The node-local tier's directory for this step: every file is also written there.
        self.local_dir = local_dir
        self.local_errors: list[str] = []
        self.algorithm = algorithm
        self.sync = sync  # makes a written file durable (Storage.sync_file), or None
        self.files: dict[str, tuple[int, str | None]] = {}
        self.errors: list[BaseException] = []
        self.timings = WriteTimings()
        self._lock = threading.Lock()

    def _record_error(self, exc: BaseException, where: str) -> None:
        if isinstance(exc, OSError):
            exc = named_os_error(exc, where)
        with self._lock:
            self.errors.append(exc)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as raw:
                yield raw
            return
        name = os.path.basename(os.fspath(path))
        where = os.fspath(path)

        def record(size: int, digest: str | None) -> None:
            with self._lock:
                self.files[name] = (size, digest)

        def on_error(exc: BaseException) -> None:
            self._record_error(exc, where)

        opened = time.perf_counter()
        cm = self.inner.create_stream(path, mode)
        try:
            raw = cm.__enter__()
        except OSError as exc:  # cannot even create the file: nothing written, error recorded
            on_error(exc)
            cm, raw = None, None
        copy = LocalCopy(self.local_dir, name, self.local_errors, self.local_root) if self.local_dir and raw is not None else None
        stream = _ChecksumStream(raw, record, self.algorithm, on_error, self.sync, self.timings, copy, self.beside)
        # torch.save writes each item in ~40 pieces, most of a few bytes: a C-level buffer in
        # front of the (Python) checksumming stream turns them into a few large writes.
        buffered = io.BufferedWriter(stream, buffer_size=_BUFFER)
        try:
            yield buffered  # type: ignore[misc]
        except BaseException as exc:
            # DCP's extra writer threads drop their exceptions; remember them here.
            on_error(exc)
            raise
        finally:
            buffered.close()  # flushes into the stream, then closes it
            if cm is not None:
                closing = time.perf_counter()
                try:
                    cm.__exit__(None, None, None)
                except OSError as exc:  # closing commits remote files: a failed upload lands here
                    on_error(exc)
                self.timings.add("io_write", time.perf_counter() - closing)  # an upload happens here
            self.timings.add("files", time.perf_counter() - opened)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return self.inner.concat_path(path, suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        if self.local_dir:
            rename_copy(self.local_dir, old, new)
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return self.inner.init_path(path) if isinstance(self.inner, _LocalDcpFS) else path

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)


class CheckpointWriter(FileSystemWriter):
    """(each rank) DCP's file writer for the directory ``parts`` under ``storage``, recording a
    checksum of each file it writes.

    Call order is DCP's (all ranks: ``set_up_storage_writer``, ``prepare_local_plan``,
    ``write_data``; coordinator: ``prepare_global_plan``, ``finish``). After ``dcp.save``
    returns, :attr:`files` maps each file this rank wrote to ``(size, digest)``.

    Args:
        storage, parts: where the step's files go.
        thread_count: files (and writer threads) per rank.
        sync_files: make each file durable before it is closed (:meth:`Storage.sync_file`).
        checksum: the algorithm of the recorded digests (``None``: sizes only).
        skip_record_crc: leave out torch.save's per-record CRC where ``checksum`` covers the file.
        prove_copies: prove every copy of an accelerator tensor to host memory it makes
            (``verify_staging``, :mod:`distckpt.save.d2h`).
        local_dir: the node-local tier's directory for this step: each file is also written
            there (:class:`~distckpt.storage.local_tier.LocalCopy`); its failures are recorded in
            ``fs.local_errors``, never raised.
        local_ranks: the job's ranks on this host (default: ``LOCAL_WORLD_SIZE``, else 1): large
            pieces are checksummed beside their write only where every rank's writer threads
            leave a core per helper thread (:func:`distckpt._process.has_spare_cores`).
    """

    def __init__(
        self,
        storage: Storage,
        *parts: str,
        thread_count: int = 2,
        sync_files: bool = True,
        checksum: str | None = DEFAULT_CHECKSUM,
        skip_record_crc: bool = True,
        prove_copies: bool = True,
        local_dir: str | None = None,
        local_ranks: int | None = None,
    ) -> None:
        # ``path`` is what the storage's DCP filesystem takes (Storage.dcp_path). Files are made
        # durable by Storage.sync_file (remote files have no fileno(), and DCP would fall back
        # to os.sync() per file; closing an fsspec file is what commits it).
        path = storage.dcp_path(*parts)
        super().__init__(
            path,
            single_file_per_rank=True,
            # Each file is fsynced by its stream (so a failed fsync is recorded, not raised in a
            # DCP writer thread), not by DCP.
            sync_files=False,
            thread_count=thread_count,
            overwrite=True,
        )
        self.storage = storage
        self.skip_record_crc = skip_record_crc
        self.prove_copies = prove_copies
        self.fs = _ChecksummingFS(
            storage.dcp_filesystem(),
            checksum,
            sync=storage.sync_file if sync_files else None,
            local_dir=local_dir,
            beside=has_spare_cores(thread_count, local_ranks),
            local_root=root_mark(storage),  # the tier's mark (LocalTier.root)
        )
        self.path = path

    @property
    def files(self) -> dict[str, tuple[int, str | None]]:
        return dict(self.fs.files)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # DCP's files, written by distckpt.save.records: DCP (2.13) runs writer threads whose
        # exceptions are printed and lost (the save would commit without their items), and its
        # torch.save computes a CRC-32 of every record that only a process-wide switch turns off.
        # torch's record CRC is left out where distckpt's own checksum covers the file.
        crc = not (self.skip_record_crc and self.fs.algorithm)
        results = write_items(
            self.fs, self.path, plan.storage_data.prefix, plan.items, planner, self.transforms, self.thread_count, crc,
            self.prove_copies,
        )  # fmt: skip
        if self.fs.errors:
            raise self.fs.errors[0]
        if len(results) != len(plan.items):
            raise OSError(f"only {len(results)} of {len(plan.items)} items were written (a writer thread failed)")
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # The directory is fixed at construction; a checkpoint_id must not silently redirect it.
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


#: (each rank) A DCP ``StorageWriter`` for the directory ``parts`` under ``storage`` that records
#: per-file checksums: ``checkpoint_writer(storage, *parts, thread_count=..., ...)``.
checkpoint_writer = CheckpointWriter
