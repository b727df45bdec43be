"""Hugging Face checkpoints in a distributed job: start from pretrained weights, publish weights.

* :func:`load_pretrained` loads a safetensors directory (``model.safetensors``, or shards with
  ``model.safetensors.index.json``) from a local path or any fsspec URL into a plain, DDP or FSDP2
  model at any world size. DCP plans the reads, so each rank reads only the byte ranges of the
  blocks it owns (an FSDP2 rank: its row shards) and no rank materialises the full model.
  Headers are parsed as JSON; nothing is unpickled.
* :func:`save_pretrained` writes a model's weights as a Hugging Face checkpoint (sharded
  safetensors + index, optional dtype cast, ``max_shard_size``) from all ranks: every shard
  file has one writer rank; the blocks of each tensor are gathered to that rank one tensor at a
  time (memory: the largest tensor). The directory is committed like a step: written under a
  temporary name and renamed (local), or completed by writing the index last (object stores,
  which have no rename: a directory without its index is incomplete, and a reader refuses
  several shard files without an index). A publish that fails removes what it wrote.

Both are collective over the given process group (default: every rank): all ranks call them
with the same arguments, and an error on any rank is raised on every rank.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from distckpt._dist import Group, capture, exchange, on_coordinator, raise_if_any
from distckpt.state.shape import numel
from distckpt.errors import StateMismatchError
from distckpt.load.phases import read
from distckpt.tools.safetensors_io import INDEX_NAME, NAMES, SafetensorsIndex, SafetensorsReader
from distckpt.state.entries import ModuleEntry, tied_duplicates
from distckpt.storage.base import Storage

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


@dataclass
class PretrainedReport:
    """What :func:`load_pretrained` did (identical on every rank).

    Attributes:
        loaded: number of tensors loaded.
        missing: model keys the checkpoint does not hold (only with ``strict=False``).
        unexpected: checkpoint tensors nothing in the model asked for.
        mismatched: key -> (shape in checkpoint, shape in model).
        tied: model key -> the key it shares its tensor with and was filled through.
        bytes_read: bytes this rank read from the files.
    """

    loaded: int
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    bytes_read: int = 0


def _group(process_group: Any) -> Group:
    if isinstance(process_group, Group):
        return process_group
    return Group(process_group if dist.is_available() and dist.is_initialized() else None)


def _map_key(name: str, strip_prefix: str | None, add_prefix: str | None, key_map: Callable[[str], str | None] | None) -> str | None:
    if key_map is not None:
        return key_map(name)
    if strip_prefix:
        if not name.startswith(strip_prefix):
            return None
        name = name[len(strip_prefix) :]
    return f"{add_prefix}{name}" if add_prefix else name


def load_pretrained(
    module: nn.Module,
    path: str,
    *,
    strict: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    key_map: Callable[[str], str | None] | None = None,
    process_group: Any = None,
    thread_count: int = 2,
) -> PretrainedReport:
    """(all ranks, collective) Load Hugging Face safetensors weights into ``module`` in place.

    Args:
        module: plain, DDP or FSDP2 model, already wrapped/sharded (FSDP2 parameters an eval
            forward left unsharded are resharded first, as :meth:`Checkpointer.load` does).
        path: directory with ``model.safetensors`` or shards + ``model.safetensors.index.json``
            (local path or fsspec URL).
        strict: raise :class:`StateMismatchError` (on every rank) if keys or shapes differ;
            with ``False`` load what matches and report the rest.
        storage_options: fsspec options for URLs.
        strip_prefix / add_prefix: rename checkpoint keys (e.g. ``strip_prefix="model."`` to
            load a ``LlamaForCausalLM`` checkpoint into a bare ``LlamaModel``); a checkpoint key
            without ``strip_prefix`` is then unexpected.
        key_map: full control instead: checkpoint key -> model key, or ``None`` to skip it.
        process_group: group of the ranks that load together (default: all).
        thread_count: files each rank reads at the same time.

    Tied weights (e.g. ``lm_head.weight`` sharing the input embedding) are filled through the
    key the checkpoint holds; checkpoints saved with ``tie_word_embeddings`` omit the duplicate.
    Floating-point tensors are cast to the model's dtype.

    Returns:
        A :class:`PretrainedReport`.
    """
    group = _group(process_group)
    storage = Storage(path, dict(storage_options or {}))
    where = storage.display()

    def plan() -> tuple[tuple[dict[str, Any], dict[str, str], SafetensorsIndex, dict[str, str]], Any]:
        index = SafetensorsIndex(storage)
        # FSDP2 parameters left unsharded (after a no_grad forward) would keep serving the old
        # values to the next forward: reshard first (local), as Checkpointer.load does.
        ModuleEntry("model", module).settle()
        sd = get_model_state_dict(module)
        aliases = tied_duplicates(sd)
        rename: dict[str, str] = {}  # model key -> checkpoint key
        unexpected: list[str] = []
        for ckpt_key in index.spans:
            target = _map_key(ckpt_key, strip_prefix, add_prefix, key_map)
            if target is None or target not in sd:
                unexpected.append(ckpt_key)
            elif target in rename:
                raise ValueError(f"{where}: checkpoint keys {rename[target]!r} and {ckpt_key!r} both map to {target!r}")
            else:
                rename[target] = ckpt_key
        missing, tied = [], {}
        mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        request: dict[str, Any] = {}
        for key, value in sd.items():
            if key in rename:
                span = index.spans[rename[key]]
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
                if not isinstance(value, torch.Tensor) or span.shape != shape:
                    mismatched[key] = (span.shape, shape)
                elif not (span.dtype == value.dtype or (span.dtype.is_floating_point and value.dtype.is_floating_point)):
                    raise TypeError(f"{where}: tensor {rename[key]!r} is {span.dtype}; model key {key!r} is {value.dtype}")
                else:
                    request[key] = value
            elif key in aliases and aliases[key] in rename:
                tied[key] = aliases[key]
            elif key in aliases.values() and any(a in rename for a, k in aliases.items() if k == key):
                # Only the duplicate is in the checkpoint: fill this tensor through it.
                partner = next(a for a, k in aliases.items() if k == key and a in rename)
                tied[key] = partner
            else:
                missing.append(key)
        view = (sorted(missing), sorted(unexpected), mismatched, tied)
        return (request, rename, index, tied), view

    (request, rename, index, _), views = exchange(group, f"load_pretrained from {where}", plan)
    missing = sorted({k for v in views for k in v[0]})
    unexpected = sorted(set(views[0][1]).intersection(*[set(v[1]) for v in views]))
    mismatched: dict[str, Any] = {}
    tied: dict[str, str] = {}
    for v in views:
        mismatched.update(v[2])
        tied.update(v[3])
    report = PretrainedReport(len(request), missing, unexpected, mismatched, tied)
    if strict and (missing or unexpected or mismatched):
        raise StateMismatchError(missing, unexpected, mismatched, f"Hugging Face checkpoint {where}")
    reader = SafetensorsReader(index, {k: rename[k] for k in request if rename[k] != k}, thread_count=thread_count)
    read(group, where, request, reader, DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(module, request, options=StateDictOptions(strict=False))
    report.bytes_read = reader.bytes_read
    return report


# --------------------------------------------------------------------------------------------------
# publishing
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5GB`` (10**9, as Hugging Face counts), ``5GiB`` (2**30) or a byte count -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclass
class _Planned:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _plan_files(tensors: list[_Planned], max_bytes: int) -> list[list[_Planned]]:
    """Hugging Face's sharding: tensors in order, a new file when the next would overflow."""
    files: list[list[_Planned]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def _file_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _header(entries: list[_Planned]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in entries:
        header[t.key] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def save_pretrained(
    module: nn.Module,
    out: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: Mapping[str, Any] | None = None,
    config: Any = None,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    process_group: Any = None,
) -> dict[str, Any]:
    """(all ranks, collective) Write ``module``'s weights as a Hugging Face checkpoint directory.

    Args:
        module: plain, DDP or FSDP2 model (the same on every rank).
        out: the directory to create (local path, or fsspec URL). Local directories must be on a
            filesystem every writer rank sees (one node, or a shared filesystem).
        dtype: cast floating-point tensors (e.g. ``torch.bfloat16``).
        max_shard_size: largest file, ``"5GB"`` by default (Hugging Face's default).
        config: optional object with ``to_json_string()`` (a ``transformers`` config): written
            as ``config.json`` so that ``from_pretrained(out)`` needs nothing else.
        strip_prefix: remove this prefix from every key (keys without it are skipped).
        overwrite: replace an existing checkpoint at ``out`` (else ``FileExistsError``).
        process_group: the ranks that publish together (default: all).

    Tied weights are written once (under the first key), as Hugging Face's own ``save_pretrained``
    does. Returns a summary (files, tensors, bytes) on every rank.
    """
    group = _group(process_group)
    storage = Storage(out, dict(storage_options or {}))
    limit = parse_size(max_shard_size)

    def prepare() -> tuple[tuple[dict[str, Any], list[list[_Planned]]], Any]:
        sd = get_model_state_dict(module)
        tied = tied_duplicates(sd)
        planned: list[_Planned] = []
        tensors: dict[str, Any] = {}
        for key, value in sd.items():
            if key in tied or not isinstance(value, torch.Tensor):
                continue
            name = key
            if strip_prefix:
                if not key.startswith(strip_prefix):
                    continue
                name = key[len(strip_prefix) :]
            odt = dtype if dtype is not None and value.dtype.is_floating_point else value.dtype
            if odt not in NAMES:
                raise TypeError(f"tensor {key!r} has dtype {odt}, which safetensors cannot store")
            shape = tuple(int(d) for d in value.shape)
            planned.append(_Planned(name, shape, odt, numel(shape) * torch.empty((), dtype=odt).element_size()))
            tensors[name] = value
        if not planned:
            raise ValueError("the model has no tensors to publish")
        files = _plan_files(planned, limit)
        digest = repr([(t.key, t.shape, str(t.dtype)) for t in planned])
        return (tensors, files), digest

    (tensors, files), digests = exchange(group, f"save_pretrained to {storage.display()}", prepare)
    if len(set(digests)) > 1:
        raise ValueError("ranks disagree on the model's keys, shapes or dtypes; every rank must publish the same model")
    names = _file_names(len(files))
    # Largest files first, each to the least-loaded rank: the same assignment on every rank.
    load = [0] * group.world_size
    owner: dict[int, int] = {}
    for i in sorted(range(len(files)), key=lambda i: -sum(t.nbytes for t in files[i])):
        r = min(range(group.world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sum(t.nbytes for t in files[i])

    staging = on_coordinator(group, "save_pretrained", lambda: _begin(storage, overwrite))
    target = Storage(staging, dict(storage_options or {})) if staging != storage.url else storage
    try:
        total = _write_and_commit(group, storage, target, staging, overwrite, files, names, owner, tensors, config)
    except BaseException:
        if group.is_coordinator:
            # The temporary directory (local), or this publish's shards (object stores: without
            # their index they are no checkpoint; a previous one was uncommitted first).
            storage.abandon_directory(staging, names)
        raise
    return {"output": storage.display(), "files": names, "tensors": sum(len(e) for e in files), "bytes": total}


def _write_and_commit(
    group: Group,
    storage: Storage,
    target: Storage,
    staging: str,
    overwrite: bool,
    files: list[list[_Planned]],
    names: list[str],
    owner: dict[int, int],
    tensors: dict[str, Any],
    config: Any,
) -> int:
    """(all ranks) Write each rank's shard files into ``target``, then commit on the coordinator
    (config, index, rename or stale-shard removal); returns the tensor bytes published."""
    # Every rank walks the same tensors in the same order, since gathering a DTensor is
    # collective. An I/O error on an owner must not leave the others inside a gather: it is
    # recorded, the rank stops writing but keeps gathering, and errors are exchanged at the end.
    sizes: dict[str, int] = {}
    error: BaseException | None = None
    for i, entries in enumerate(files):
        mine = owner[i] == group.rank and error is None
        cm: Any = None
        f: Any = None
        if mine:
            try:
                cm = target.open(names[i], "wb")
                f = cm.__enter__()
                f.write(_header(entries))
            except Exception as exc:  # noqa: BLE001 - see above
                error, mine = exc, False
        for t in entries:
            value = tensors[t.key]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if mine:
                try:
                    data = full.detach().to(device="cpu", dtype=t.dtype).contiguous()
                    if data.numel():
                        f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
                except Exception as exc:  # noqa: BLE001 - see above
                    error, mine = exc, False
            del full
        if cm is not None:
            try:
                cm.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 - see above
                error = error or exc
            if error is None:
                sizes[names[i]] = len(_header(entries)) + sum(t.nbytes for t in entries)
    outcome = capture(error) if error is not None else None
    gathered = group.all_gather((outcome, sizes))
    raise_if_any([o for o, _ in gathered], f"save_pretrained to {storage.display()}")
    weight_map = {t.key: names[i] for i, entries in enumerate(files) for t in entries}
    total = sum(t.nbytes for entries in files for t in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}

    def commit() -> None:
        if config is not None:
            target.write_bytes(config.to_json_string().encode(), "config.json")
        target.write_bytes(json.dumps(index, indent=2, sort_keys=True).encode(), INDEX_NAME)
        # Object stores: an overwritten checkpoint's shard files the new index does not name go.
        storage.commit_directory(staging, overwrite=overwrite, stale=lambda n: bool(_SHARD_NAME.match(n)) and n not in names)

    on_coordinator(group, f"commit of {storage.display()}", commit)
    return total


def _begin(storage: Storage, overwrite: bool) -> str:
    """(coordinator) Refuse to replace a checkpoint without ``overwrite``; return where to write
    (:meth:`Storage.stage_directory`: a temporary sibling directory, or ``out`` itself with its
    index removed first)."""
    if storage.exists(INDEX_NAME) or storage.exists("model.safetensors"):
        if not overwrite:
            raise FileExistsError(f"{storage.display()} already holds a Hugging Face checkpoint (pass overwrite=True)")
    return storage.stage_directory(uncommit=INDEX_NAME if overwrite else None)


_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


# --------------------------------------------------------------------------------------------------
# offline import (``distckpt convert HF_DIR --to dcp OUT_ROOT``)
def import_hf(
    src: str,
    out_root: str,
    *,
    step: int = 0,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Import a Hugging Face safetensors directory as entry ``model`` of a distckpt checkpoint.

    Like the ``torch.save`` import (:func:`distckpt.tools.importer.import_torch_save`): afterwards
    ``Checkpointer(out_root).load({"model": model})`` works at any world size. Local files are
    memory-mapped (copy-on-write, never modified) so that resident memory stays bounded by what
    DCP writes at a time; a URL is downloaded to a temporary directory first. Not collective.

    Returns:
        A summary: output, step, tensors, bytes.
    """
    import mmap
    import tempfile

    from distckpt.checkpointer import Checkpointer

    opts = dict(storage_options or {})
    with tempfile.TemporaryDirectory(prefix="distckpt-hf-import-") as tmp:
        source = Storage(src, opts)
        index = SafetensorsIndex(source)
        # The files themselves (local), or a download of them; re-validated against those bytes.
        local = source.local_dir(sorted({s.file for s in index.spans.values()}), tmp)
        index = SafetensorsIndex(Storage(local))
        maps: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        try:
            for key, span in index.spans.items():
                if span.file not in maps:
                    with open(os.path.join(local, span.file), "rb") as f:
                        maps[span.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                raw = torch.frombuffer(maps[span.file], dtype=torch.uint8)
                block = raw[span.start : span.start + span.nbytes]
                itemsize = torch.empty((), dtype=span.dtype).element_size()
                if span.start % itemsize:  # unaligned for its dtype: copy this one tensor
                    block = block.clone()
                tensors[key] = block.view(span.dtype).reshape(span.shape)
            ckpt = Checkpointer(out_root, storage_options=opts, save_rng=False)
            try:
                ckpt.save(step, {"model": tensors}, metadata={"imported_from": source.display()})
            finally:
                ckpt.close()
        finally:
            tensors.clear()
            for m in maps.values():
                try:
                    m.close()
                except BufferError:  # a view is still alive somewhere: the GC closes it
                    pass
    return {
        "output": Storage(out_root, opts).display(),
        "step": step,
        "tensors": len(index.spans),
        "bytes": sum(s.nbytes for s in index.spans.values()),
    }


# --------------------------------------------------------------------------------------------------
# offline export (``distckpt convert CKPT --to hf OUT_DIR``)
def export_hf(
    found: Any,
    out: str,
    *,
    key: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write a distckpt checkpoint's model as a Hugging Face directory (sharded safetensors + index).

    Streams tensor by tensor from the checkpoint's data files (memory: about one block), like the
    other exports. The model is the checkpoint's single module entry, or the entry/prefix
    ``key`` (removed from the names, as for ``--to safetensors``). Each data file of the
    checkpoint is read once, in on-disk order, and checked against the manifest before the
    output is committed: written to a temporary directory renamed into place (local) or with
    the index last (object stores); a failed export removes what it wrote. Not collective.

    Args:
        found: a located checkpoint (:func:`distckpt.tools.catalog.locate`).
        out: the directory to create (must not hold a checkpoint yet).
        key, dtype, max_shard_size: what to export, cast and how to split it.
        storage_options: fsspec options for ``out``.
        progress: ``progress(bytes done, bytes total)``.

    Returns:
        A summary: output, files, tensors, bytes.
    """
    from distckpt.tools.convert import CheckpointSource, select_tensors

    source = CheckpointSource(found)
    picked = select_tensors(found, source, model_only=key is None, key=key)
    # Tensors in the order their bytes lie in the checkpoint's data files (as the other exports
    # read them): writing the shard files one after another then reads each data file once,
    # front to back, hashed as it goes. Shards are cut from this order; the index maps names.
    planned: list[_Planned] = []
    for name, k in sorted(picked, key=lambda p: source.position(p[1])):
        info = source.tensors[k]
        odt = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
        if odt not in NAMES:
            raise TypeError(f"tensor {k} has dtype {odt}, which safetensors cannot store")
        planned.append(_Planned(name, tuple(info.shape), odt, info.nbytes(odt)))
    by_name = dict(picked)
    files = _plan_files(planned, parse_size(max_shard_size))
    names = _file_names(len(files))
    storage = Storage(out, dict(storage_options or {}))
    staging = _begin(storage, overwrite=False)
    target = Storage(staging, dict(storage_options or {})) if staging != storage.url else storage
    total = sum(t.nbytes for t in planned)
    done = 0
    opened: list[str] = []
    try:
        for i, entries in enumerate(files):
            opened.append(names[i])
            with target.open(names[i], "wb") as f:
                f.write(_header(entries))
                for t in entries:
                    written = 0
                    for block in source.iter_bytes(by_name[t.key], t.dtype):
                        f.write(block)
                        written += len(block)
                    if written != t.nbytes:
                        raise RuntimeError(f"tensor {by_name[t.key]}: wrote {written} bytes, expected {t.nbytes}")
                    done += t.nbytes
                    if progress:
                        progress(done, total)
                if i == len(files) - 1:
                    # Every data file read is checked whole before the last shard closes (an
                    # object store publishes a file when it closes; one shard needs no index).
                    source.finish()
        weight_map = {t.key: names[i] for i, entries in enumerate(files) for t in entries}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        target.write_bytes(json.dumps(index, indent=2, sort_keys=True).encode(), INDEX_NAME)
        storage.commit_directory(staging, overwrite=False)
    except BaseException:
        storage.abandon_directory(staging, opened)  # nothing unverified or partial stays behind
        raise
    return {"output": storage.display(), "format": "hf", "files": names, "tensors": len(planned), "bytes": total}
