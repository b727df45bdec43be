"""Writing one rank's planned items into its data files, as DCP's ``FileSystemWriter`` does.

The files are DCP's: the items split into ``thread_count`` buckets by DCP's own rule
(``split_by_size_and_type``), one file per bucket named ``<prefix><i>.distcp``, byte items first,
every tensor a ``torch.save`` record, and the same :class:`WriteResult` for each item, so
``.metadata`` and the files are those plain DCP writes and plain ``dcp.load`` reads them.

What differs is one thing: torch.save computes a CRC-32 over every record's bytes (most of its
CPU time, ~2 GB/s here), and torch offers only a process-wide switch for it
(``torch.serialization.set_crc32_options``). Each record is written with torch's own
serializer (:func:`distckpt._compat.write_torch_record`: ``torch.serialization._save`` into a
``PyTorchFileWriter``) with the CRC chosen for that one call, so distckpt can leave it out where
its own checksum covers every byte of the file (``torch.load`` does not check it) without
touching other ``torch.save`` calls in the process.

Not collective: each rank writes its own files, from ``thread_count`` threads.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from distckpt._compat import StorageInfo, split_by_size_and_type, write_torch_record

DCP_SUFFIX = ".distcp"


def _host_tensor(data: Any) -> torch.Tensor:
    """What DCP writes for a tensor item: on the CPU, with a storage of its own size (a view of
    a larger storage would write all of it), as DCP's ``_SerialCpuLoader`` prepares it."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def _write_file(
    create_stream: Callable[[Any, str], Any],
    path: Any,
    file_name: str,
    items: list[Any],
    planner: Any,
    transforms: Any,
    crc: bool,
) -> list[WriteResult]:
    """One file: byte items, then tensors, each at the stream's position (DCP's order)."""
    results = []
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    with create_stream(path, "wb") as stream:
        for item in byte_items + tensor_items:
            data = planner.resolve_data(item)
            offset = stream.tell()
            if transforms.extensions:
                transform_to, descriptors = transforms.transform_save_stream(item, stream)
            else:  # no stream extensions: the file's stream itself (DCP's wrapper only flushes per item)
                transform_to, descriptors = stream, []
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"item {item.index.fqn}: bytes to write must be io.BytesIO, got {type(data).__name__}")
                transform_to.write(data.getbuffer())
            else:
                host = _host_tensor(data)
                serializing = getattr(planner, "serializing", None)
                if serializing is not None:  # distckpt's planner checks what is written (verify_staging)
                    serializing(item, host)
                write_torch_record(host, transform_to, crc)
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
    return results


def write_items(
    fs: Any,
    directory: Any,
    prefix: str,
    items: list[Any],
    planner: Any,
    transforms: Any,
    thread_count: int,
    crc: bool,
) -> list[WriteResult]:
    """(each rank) Write ``items`` into ``thread_count`` files ``<prefix><i>.distcp`` under
    ``directory`` of DCP filesystem ``fs``, from as many threads; returns every item's result.

    The first error of any thread is raised after all threads stopped (the file streams record
    I/O errors themselves, see :mod:`distckpt.save.writer`)."""
    jobs: queue.Queue = queue.Queue()
    for i, bucket in enumerate(split_by_size_and_type(thread_count, items)):
        name = f"{prefix}{i}{DCP_SUFFIX}"
        jobs.put((fs.concat_path(directory, name), name, bucket))
    results: list[WriteResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        while True:
            try:
                path, name, bucket = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                done = _write_file(fs.create_stream, path, name, bucket, planner, transforms, crc)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the calling thread
                with lock:
                    errors.append(exc)
                return
            with lock:
                results.extend(done)

    threads = [threading.Thread(target=work, name=f"distckpt-write-{t}", daemon=True) for t in range(1, thread_count)]
    for t in threads:
        t.start()
    work()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
