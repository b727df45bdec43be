"""Writing one rank's planned items into its data files, as DCP's ``FileSystemWriter`` does.

The files are DCP's: the items split into ``thread_count`` buckets by DCP's own rule
(``split_by_size_and_type``), one file per bucket named ``<prefix><i>.distcp``, byte items first,
every tensor a ``torch.save`` record, and the same :class:`WriteResult` for each item, so
``.metadata`` and the files are those plain DCP writes and plain ``dcp.load`` reads them.

What differs is one thing: torch.save computes a CRC-32 over every record's bytes (most of its
CPU time; measured: benchmarks/README.md), and torch offers only a process-wide switch for it
(``torch.serialization.set_crc32_options``). Each record is written with torch's own
serializer (:func:`distckpt._compat.write_torch_record`: ``torch.serialization._save`` into a
``PyTorchFileWriter``) with the CRC chosen for that one call, so distckpt can leave it out where
its own checksum covers every byte of the file (``torch.load`` does not check it) without
touching other ``torch.save`` calls in the process.

Not collective: each rank writes its own files, from ``thread_count`` threads.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import IO, Protocol

import torch
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from distckpt._compat import StorageInfo, split_by_size_and_type, write_torch_record
from distckpt.save.d2h import Timings, caller_streams, follow, host_tensors

DCP_SUFFIX = ".distcp"


class StreamTransforms(Protocol):
    """A DCP writer's stream extensions (``FileSystemWriter.transforms``, of a private DCP
    class): what :func:`write_items` uses of them."""

    extensions: Sequence[object]

    def transform_save_stream(self, write_item: WriteItem, raw_stream: io.IOBase) -> tuple[IO[bytes], list[str]]: ...


def _host_tensor(data: torch.Tensor) -> torch.Tensor:
    """What DCP writes for a tensor item: on the CPU, with a storage of its own size (a view of
    a larger storage would write all of it, so DCP's ``_SerialCpuLoader`` clones it). A
    contiguous view (e.g. of a staging arena) is aliased by a tensor whose storage is exactly its
    bytes instead: the same record, without copying them."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = _exact_alias(tensor)
    return tensor


def _exact_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with a storage of exactly their bytes: an alias of ``t``'s memory where it
    is a plain contiguous tensor, else a contiguous clone."""
    if (
        t.numel() == 0
        or not t.is_contiguous()
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    ):
        return t.clone()
    raw = t.reshape(-1).view(torch.uint8)
    return torch.frombuffer(memoryview(raw.numpy()), dtype=torch.uint8).view(t.dtype).view(t.shape)


def _write_file(
    create_stream: Callable[[str | os.PathLike, str], AbstractContextManager[io.IOBase]],
    path: str | os.PathLike,
    file_name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    transforms: StreamTransforms,
    crc: bool,
    prove: bool = False,
    callers: Mapping[int, torch.cuda.Stream] | None = None,
    timings: Timings | None = None,
) -> list[WriteResult]:
    """One file: byte items, then tensors, each at the stream's position (DCP's order).
    Accelerator tensors reach host memory through :func:`distckpt.save.d2h.host_tensors`
    (``prove``: each copy proven, ``callers``: the streams the copies follow, ``timings``: where
    its waits are counted)."""
    results = []
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    serializing = getattr(planner, "serializing", None)  # distckpt's planner checks what is written

    with create_stream(path, "wb") as stream:

        def record(item: WriteItem, write: Callable[[IO[bytes]], object]) -> None:
            offset = stream.tell()
            if transforms.extensions:
                transform_to, descriptors = transforms.transform_save_stream(item, stream)
            else:  # no stream extensions: the file's stream itself (DCP's wrapper only flushes per item)
                transform_to, descriptors = stream, []
            write(transform_to)
            if transform_to is not stream:
                transform_to.close()  # flushes into the file's stream, which stays open
            length = stream.tell() - offset
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=length,
                    storage_data=StorageInfo(file_name, offset, length, transform_descriptors=descriptors or None),
                )
            )

        for item in byte_items:
            data = planner.resolve_data(item)
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"item {item.index.fqn}: bytes to write must be io.BytesIO, got {type(data).__name__}")
            record(item, lambda to: to.write(data.getbuffer()))
        tensors = host_tensors(
            tensor_items, planner.resolve_data, _host_tensor, prove=prove, callers=callers, where=file_name, timings=timings
        )
        with contextlib.closing(tensors):  # on an error too, no copy is left landing in the ring
            for item, _, host in tensors:
                if serializing is not None:  # (verify_staging of an async save's staged copy)
                    serializing(item, host)
                record(item, lambda to: write_torch_record(host, to, crc))
    return results


def write_items(
    fs: FileSystemBase,
    directory: str | os.PathLike,
    prefix: str,
    items: list[WriteItem],
    planner: SavePlanner,
    transforms: StreamTransforms,
    thread_count: int,
    crc: bool,
    prove_copies: bool = False,
) -> list[WriteResult]:
    """(each rank) Write ``items`` into ``thread_count`` files ``<prefix><i>.distcp`` under
    ``directory`` of DCP filesystem ``fs``, from as many threads; returns every item's result.

    Accelerator tensors are copied to host memory ahead of each thread (:mod:`distckpt.save.d2h`),
    after the work queued on the calling thread's current streams; ``prove_copies``: each copy
    is proven (``verify_staging``).

    The first error of any thread is raised after all threads stopped (the file streams record
    I/O errors themselves, see :mod:`distckpt.save.writer`)."""
    jobs: queue.Queue[tuple[str | os.PathLike, str, list[WriteItem]]] = queue.Queue()
    for i, bucket in enumerate(split_by_size_and_type(thread_count, items)):
        name = f"{prefix}{i}{DCP_SUFFIX}"
        jobs.put((fs.concat_path(directory, name), name, bucket))
    results: list[WriteResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    # The tensors' devices, from the planner's state (resolving items is the writer threads' job).
    state = getattr(planner, "state_dict", None) or {}
    callers = caller_streams(state.get(item.index.fqn) for item in items if item.type != WriteItemType.BYTE_IO)

    def work(spawned: bool) -> None:
        if spawned:
            follow(callers)
        while True:
            try:
                path, name, bucket = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                done = _write_file(
                    fs.create_stream, path, name, bucket, planner, transforms, crc, prove_copies, callers,
                    getattr(fs, "timings", None),
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - raised below, on the calling thread
                with lock:
                    errors.append(exc)
                return
            with lock:
                results.extend(done)

    threads = [threading.Thread(target=work, args=(True,), name=f"distckpt-write-{t}", daemon=True) for t in range(1, thread_count)]
    for t in threads:
        t.start()
    work(False)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
