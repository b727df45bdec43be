"""Writing one rank's planned items into its data files, as DCP's ``FileSystemWriter`` does.

The files are DCP's: the items split into buckets by DCP's own rule
(``split_by_size_and_type``), one file per bucket named ``<prefix><i>.distcp``, byte items first,
every tensor a ``torch.save`` record, and the same :class:`WriteResult` for each item, so
``.metadata`` and the files are DCP's format and plain ``dcp.load`` reads them.

Two things differ from DCP's ``FileSystemWriter``:

* **Which items share a file** (:func:`buckets`). A rank that writes both items only it reads
  back (its shards, its ZeRO partition) and items other ranks read back (non-tensor values: an
  optimizer's hyper-parameters, the LR scheduler, plain values; and the replicated tensors
  distckpt's planner gave it to write, such as FSDP2's step counters) writes the second kind
  into file(s) of their own. DCP's rule deals byte items round robin into every file, so every
  file held something every rank reads, and a load, which verifies whole files, read the whole
  checkpoint on every rank: an FSDP2 state with AdamW at world size 4 read 4x its share per
  rank, and a node recovering from a peer was sent every file of the step. Now a rank reads its
  own files and the small shared ones.
* torch.save computes a CRC-32 over every record's bytes (most of its CPU time; measured:
  benchmarks/README.md), and torch offers only a process-wide switch for it
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
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import IO, Protocol

import torch
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from distckpt._compat import StorageInfo, byte_viewable, split_by_size_and_type, write_torch_record
from distckpt.save.d2h import Timings, caller_streams, follow, host_tensors, item_bytes

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
    # A lazy conjugate or negative view (``t.conj()``) resolved into its values: its memory holds
    # those before the conjugation, which a sync save wrote. (Any other tensor stays itself.)
    tensor = data.detach().cpu().resolve_conj().resolve_neg()
    if type(tensor) is not torch.Tensor:
        # A subclass (t.as_subclass(MyT)) is written as its values: its record would pickle the
        # class, which no weights-only load rebuilds (the whole step failed to load). An async
        # save's staged copy is a plain tensor too, and a load fills the destination in place.
        tensor = tensor.as_subclass(torch.Tensor)
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = _exact_alias(tensor)
    return tensor


def _exact_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with a storage of exactly their bytes: an alias of ``t``'s memory where it
    is a plain contiguous tensor, else a contiguous clone."""
    if (
        t.numel() == 0
        or t.layout != torch.strided
        or t.is_quantized
        or not byte_viewable(t)
    ):
        return t.clone(memory_format=torch.contiguous_format)
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


#: Bytes of shared items (see :func:`buckets`) per file of their own, up to ``thread_count``
#: files: mostly a few KiB of hyper-parameters (one file); a DDP model beside ZeRO's partitions,
#: gigabytes, written and read by several threads.
SHARED_FILE_BYTES = 64 << 20
#: Below this many bytes of its own items (a DDP rank's RNG state), a rank's items share files as
#: DCP splits them: what the other ranks then read needlessly costs less than a file more.
OWN_FILE_MIN_BYTES = 1 << 20


def buckets(items: list[WriteItem], thread_count: int, shared: Collection[str] | None = None) -> list[list[WriteItem]]:
    """(pure) ``items`` split into the files of one rank, in file order.

    Items other ranks read back too are the non-tensor values (hyper-parameters, a scheduler's
    and the user's plain values; every rank of a ZeRO job reads every parameter's
    hyper-parameters) and the keys in ``shared`` (a :class:`~distckpt.save.assign.PlanInput`'s
    ``writers``: the replicated items this rank was given to write). Where a rank writes both
    those and at least :data:`OWN_FILE_MIN_BYTES` of items only it reads (its shards), the second
    kind fills ``thread_count`` files by DCP's rule (fewer if it has fewer items) and the first
    follows in files of its own (one per :data:`SHARED_FILE_BYTES`, at most ``thread_count``), so
    that a load reading only the shared items does not read (and verify) this rank's shards.
    Otherwise DCP's own split into ``thread_count`` files.
    """
    shared = shared or ()
    common: list[WriteItem] = []
    own: list[WriteItem] = []
    for item in items:
        (common if item.type == WriteItemType.BYTE_IO or item.index.fqn in shared else own).append(item)
    if common and sum(item_bytes(i) for i in own) >= OWN_FILE_MIN_BYTES:
        files = max(1, min(thread_count, len(common), -(-sum(item_bytes(i) for i in common) // SHARED_FILE_BYTES)))
        return split_by_size_and_type(min(thread_count, len(own)), own) + split_by_size_and_type(files, common)
    return split_by_size_and_type(thread_count, items)


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
    plan_input = getattr(planner, "plan_input", None)  # distckpt's planner: who writes replicated items
    shared = getattr(plan_input, "writers", None)
    for i, bucket in enumerate(buckets(items, thread_count, shared)):
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

    threads = []
    for t in range(1, min(thread_count, jobs.qsize())):
        thread = threading.Thread(target=work, args=(True,), name=f"distckpt-write-{t}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no more threads in this process: the started ones and this one write the rest
            break
        threads.append(thread)
    work(False)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
