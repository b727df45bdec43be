"""Hugging Face checkpoints in a distributed job: start from pretrained weights, publish weights.

* :func:`load_pretrained` loads a safetensors directory (``model.safetensors``, or shards with
  ``model.safetensors.index.json``) from a local path or any fsspec URL into a plain, DDP or FSDP2
  model at any world size. DCP plans the reads, so each rank reads only the byte ranges of the
  blocks it owns (an FSDP2 rank: its row shards) and no rank materialises the full model.
  Headers are parsed as JSON; nothing is unpickled.
* :func:`save_pretrained` writes a model's weights as a Hugging Face checkpoint (sharded
  safetensors + index, optional dtype cast, ``max_shard_size``) from all ranks: every shard
  file has one writer rank; the blocks of each tensor are gathered to that rank one tensor at a
  time (memory: the largest tensor). The directory is committed like a step: a new one is
  written under a temporary name and renamed; into an existing one (which may hold a
  tokenizer, a README ...) the shards are written aside and moved in (local) or written in
  place (object stores, which have no rename), and the index, written last, commits it (a
  reader refuses several shard files without an index). A publish that fails removes what it
  wrote. Files distckpt did not write are never replaced unless named (``replace=``): a record,
  ``.distckpt-publish.json``, names the files it wrote (:class:`PublishRecord`, :class:`Publish`).

Both are collective over the given process group (default: every rank): all ranks call them
with the same arguments, and an error on any rank is raised on every rank.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from distckpt._dist import Group, capture, exchange, on_coordinator, raise_if_any
from distckpt.state.shape import numel
from distckpt.errors import IntegrityError, StateMismatchError, UnsafeCheckpointError
from distckpt.load.phases import read
from distckpt.tools.safetensors_io import INDEX_NAME, NAMES, SafetensorsIndex, SafetensorsReader, check_tensor_name
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
    A checkpoint holding both keys is read into buffers of their own and compared first.
    Floating-point tensors are cast to the model's dtype.

    Returns:
        A :class:`PretrainedReport`.

    Raises:
        StateMismatchError: keys or shapes differ (``strict=True``).
        ValueError: the checkpoint stores a tied pair under both keys with different values
            (naming both; the model is left untouched).
        IntegrityError: a malformed file or index, or a folder holding both ``model.safetensors``
            and an index naming other files (:class:`~distckpt.tools.safetensors_io.SafetensorsIndex`).
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
        # Both keys of a tied pair stored: one tensor of the model, two in the checkpoint.
        both = sorted((k, aliases[k]) for k in request if k in aliases and aliases[k] in request)
        view = (sorted(missing), sorted(unexpected), mismatched, tied, both)
        return (request, rename, index, tied), view

    (request, rename, index, _), views = exchange(group, f"load_pretrained from {where}", plan)
    pairs = sorted({p for v in views for p in v[4]})
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
    aside: dict[str, Any] = {}
    if pairs:
        aside, report.bytes_read = _read_tied_pairs(group, where, index, rename, request, pairs, thread_count)
    reader = SafetensorsReader(index, {k: rename[k] for k in request if rename[k] != k}, thread_count=thread_count)
    read(group, where, request, reader, DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(module, {**request, **aside}, options=StateDictOptions(strict=False))
    report.bytes_read += reader.bytes_read
    return report


def _read_tied_pairs(
    group: Group,
    where: str,
    index: SafetensorsIndex,
    rename: dict[str, str],
    request: dict[str, Any],
    pairs: list[tuple[str, str]],
    thread_count: int,
) -> tuple[dict[str, Any], int]:
    """(all ranks) Tied weights the checkpoint stores under both keys (``pairs``: duplicate, key
    it is tied to). Read into buffers of their own and compared before anything is loaded:
    read into the model's one tensor, whichever came last in the files would win unreported.

    Removes both keys of every pair from ``request``; returns the tensors to load for them (the
    values of the key tied to) and the bytes read.

    Raises:
        ValueError: on every rank, naming both keys and their files, if any rank's block of a
            pair differs (a difference may lie in one rank's shard only).
    """
    keys = sorted({k for pair in pairs for k in pair})
    aside = {k: torch.empty_like(request[k]) for k in keys}
    reader = SafetensorsReader(index, {k: rename[k] for k in keys if rename[k] != k}, thread_count=thread_count)
    read(group, where, aside, reader, DefaultLoadPlanner(allow_partial_load=True))

    def local(t: Any) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    differ = [(a, b) for a, b in pairs if not torch.equal(local(aside[a]), local(aside[b]))]
    differ = sorted({p for found in group.all_gather(differ) for p in found})
    if differ:
        shown = "; ".join(
            f"{rename[a]!r} (in {index.spans[rename[a]].file}) and {rename[b]!r} (in {index.spans[rename[b]].file}) "
            f"fill the model's tied {a!r} / {b!r}"
            for a, b in differ
        )
        raise ValueError(
            f"{where}: tensors stored with different values for one tied tensor: {shown}. Loading would keep "
            "whichever is read last; remove one of them from the checkpoint, or skip one with key_map (returning "
            "None for it) and strict=False"
        )
    for key in keys:
        request.pop(key, None)
    return {b: aside[b] for _, b in pairs}, reader.bytes_read


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
    replace: str | Iterable[str] = (),
    process_group: Any = None,
) -> dict[str, Any]:
    """(all ranks, collective) Write ``module``'s weights as a Hugging Face checkpoint directory.

    The directory may hold other files (a tokenizer, a README, sub-folders): they are never
    touched. distckpt records the files it writes in ``.distckpt-publish.json`` and replaces
    only those (see :class:`PublishRecord`).

    Args:
        module: plain, DDP or FSDP2 model (the same on every rank).
        out: the directory to publish into (local path, or fsspec URL). Local directories must
            be on a filesystem every writer rank sees (one node, or a shared filesystem).
        dtype: cast floating-point tensors (a floating-point dtype, e.g. ``torch.bfloat16``).
        max_shard_size: largest file, ``"5GB"`` by default (Hugging Face's default).
        config: optional object with ``to_json_string()`` (a ``transformers`` config): written
            as ``config.json`` so that ``from_pretrained(out)`` needs nothing else.
        strip_prefix: remove this prefix from every key (keys without it are skipped).
        overwrite: replace distckpt's own previous publish at ``out`` (the files its record
            names and that are unchanged since), else ``FileExistsError``.
        replace: files at ``out`` that distckpt did not write but this publish may replace or
            remove: names or patterns (``"*.safetensors"``) of Hugging Face weight files
            (``model.safetensors``, ``model-*-of-*.safetensors``, the index), or ``config.json``
            when ``config`` is given. Such files not named here are a ``FileExistsError``
            naming them. Naming any other file changes nothing: it is kept.
        process_group: the ranks that publish together (default: all).

    Tied weights are written once (under the first key), as Hugging Face's own ``save_pretrained``
    does. Returns a summary (files, tensors, bytes) on every rank.

    Raises:
        FileExistsError: see ``overwrite`` and ``replace``.
        TypeError: ``dtype`` is not a floating-point dtype (it would truncate a weight, named).
        ValueError: a tensor named ``__metadata__`` (reserved by safetensors), or a bad ``replace``.
    """
    from distckpt.tools.convert import cast_dtype

    group = _group(process_group)
    opts = dict(storage_options or {})
    storage = _folder(out, opts)
    where = storage.display()
    limit = parse_size(max_shard_size)
    patterns = replace_patterns(replace)

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
            check_tensor_name(name, f"{where} (model key {key!r})")
            odt = cast_dtype(key, value.dtype, dtype)
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

    (tensors, files), digests = exchange(group, f"save_pretrained to {where}", prepare)
    if len(set(digests)) > 1:
        raise ValueError("ranks disagree on the model's keys, shapes or dtypes; every rank must publish the same model")
    layout = _Layout(files, None if config is None else config.to_json_string().encode())
    # Largest files first, each to the least-loaded rank: the same assignment on every rank.
    load = [0] * group.world_size
    owner: dict[int, int] = {}
    for i in sorted(range(len(files)), key=lambda i: -sum(t.nbytes for t in files[i])):
        r = min(range(group.world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sum(t.nbytes for t in files[i])

    publish = on_coordinator(group, f"save_pretrained to {where}", lambda: Publish.begin(storage, layout, overwrite, patterns, out))
    target = Storage(publish.staged, opts) if publish.staged != storage.url else storage
    try:
        _write_shards(group, where, target, layout, owner, tensors)
        on_coordinator(group, f"commit of {where}", lambda: publish.commit(storage, layout))
    except BaseException:
        if group.is_coordinator:
            publish.abandon(storage)
        raise
    return {"output": where, "files": layout.names, "tensors": sum(len(e) for e in files), "bytes": layout.total}


def _write_shards(group: Group, where: str, target: Storage, layout: _Layout, owner: dict[int, int], tensors: dict[str, Any]) -> None:
    """(all ranks) Write each rank's shard files into ``target`` (durably: synced before closed)."""
    # Every rank walks the same tensors in the same order, since gathering a DTensor is
    # collective. An I/O error on an owner must not leave the others inside a gather: it is
    # recorded, the rank stops writing but keeps gathering, and errors are exchanged at the end.
    error: BaseException | None = None
    for i, entries in enumerate(layout.files):
        mine = owner[i] == group.rank and error is None
        cm: Any = None
        f: Any = None
        if mine:
            try:
                cm = target.open(layout.names[i], "wb")
                f = cm.__enter__()
                f.write(layout.headers[i])
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
                if mine:
                    target.sync_file(f)  # a publish killed after its commit must not lose shard bytes
                cm.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 - see above
                error = error or exc
    outcome = capture(error) if error is not None else None
    raise_if_any(group.all_gather(outcome), f"save_pretrained to {where}")


# --------------------------------------------------------------------------------------------------
# what distckpt wrote into a folder, and the protocol that replaces only that
RECORD_NAME = ".distckpt-publish.json"
CONFIG_NAME = "config.json"
_RECORD_FORMAT = "distckpt-hf-publish"
_MAX_RECORD = 16 * 2**20  # bytes; also the largest file whose content a record pins by sha256
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def _folder(out: str, storage_options: dict[str, Any]) -> Storage:
    """The storage of a folder to publish into. A local folder reached through a symbolic link
    is published at its target: the shards are staged beside the folder itself (same
    filesystem, so they can be renamed into it), and a new folder replaces no link."""
    storage = Storage(out, storage_options)
    return Storage(os.path.realpath(storage.path), storage_options) if storage.is_local else storage


def _writable_name(name: str) -> bool:
    """Whether distckpt ever writes a file of this name: a record can claim only these, so no
    record (crafted, copied or corrupted) can make a publish replace a tokenizer or a README."""
    return name in (INDEX_NAME, CONFIG_NAME) or bool(_SHARD_NAME.match(name))


def _hf_weights(name: str) -> bool:
    """A Hugging Face weight file a new publish must replace or remove: left beside the new one
    it would be stale, or make the folder ambiguous (``model.safetensors`` beside an index)."""
    return name == INDEX_NAME or bool(_SHARD_NAME.match(name))


def replace_patterns(replace: str | Iterable[str] | None) -> list[str]:
    """``replace`` as a list of file-name patterns (a single string is one name).

    Raises:
        TypeError: not a string or an iterable of strings.
        ValueError: an entry that is empty or a path (names are of files directly in the folder).
    """
    if replace is None:
        return []
    items: Any = [replace] if isinstance(replace, str) else replace
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"replace must be a file name or a list of file names, got {type(replace).__name__}") from None
    for p in items:
        if not isinstance(p, str):
            raise TypeError(f"replace entries must be file names (str), got {p!r:.60} ({type(p).__name__})")
        if not p or "/" in p or "\\" in p or p in (".", "..") or "\x00" in p:
            raise ValueError(f"replace entry {p!r:.100} is not a file name: name files directly in the folder (or a pattern such as '*.safetensors')")
    return items


@dataclass(frozen=True)
class OwnedFile:
    """One file a publish wrote: its name in the folder, its size and, for the small JSON files
    (index, config), the sha256 of its content."""

    name: str
    size: int
    sha256: str | None = None


@dataclass
class PublishRecord:
    """``.distckpt-publish.json``: the files distckpt wrote into a Hugging Face folder.

    A publish replaces (with ``overwrite=True``) only files its record names *and* that are
    unchanged since (same size; same sha256 for the index and config): a file the user rewrote,
    replaced by a link, or that a record claims under a name distckpt never writes is theirs.
    Written atomically; before any file of a publish is written it names them too
    (``complete: false``), so a publish killed half-way leaves nothing unclaimed (a shard of an
    unfinished publish is claimed by name, whatever its size: it may be cut short).
    """

    files: list[OwnedFile]
    complete: bool

    def to_bytes(self) -> bytes:
        from distckpt._version import __version__

        files = [{"name": f.name, "size": f.size, **({"sha256": f.sha256} if f.sha256 else {})} for f in self.files]
        body = {"format": _RECORD_FORMAT, "version": 1, "complete": self.complete, "written_by": f"distckpt {__version__}", "files": files}
        return json.dumps(body, indent=1).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> PublishRecord:
        """Validate a record. Raises ``IntegrityError`` (malformed, or claiming a file distckpt
        never writes) or ``UnsafeCheckpointError`` (a path leaving the folder), naming it."""
        fix = f"delete {where} to treat every file there as not written by distckpt"
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise IntegrityError(f"{where}: not a distckpt publish record ({type(exc).__name__}); {fix}") from None
        if not isinstance(body, dict) or body.get("format") != _RECORD_FORMAT or body.get("version") != 1:
            raise IntegrityError(f"{where}: not a distckpt publish record (format/version); {fix}")
        entries, complete = body.get("files"), body.get("complete")
        if not isinstance(entries, list) or not isinstance(complete, bool):
            raise IntegrityError(f"{where}: 'files' must be a list and 'complete' a bool; {fix}")
        files = []
        for e in entries:
            name, size, digest = (e.get("name"), e.get("size"), e.get("sha256")) if isinstance(e, dict) else (None, None, None)
            if not isinstance(name, str) or type(size) is not int or size < 0 or not (
                digest is None or (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest))
            ):
                raise IntegrityError(f"{where}: entry {e!r:.100} is not a name, a size and an optional sha256; {fix}")
            if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
                raise UnsafeCheckpointError(f"{where}: names {name!r:.100}, which is not a file inside the folder; {fix}")
            if not _writable_name(name):
                raise IntegrityError(f"{where}: claims {name!r:.100}, which distckpt never writes; {fix}")
            files.append(OwnedFile(name, size, digest))
        return cls(files, complete)


def read_record(storage: Storage, files: Mapping[str, int]) -> PublishRecord | None:
    """The record of the folder ``storage`` (whose files are ``files``: name -> size), or None.

    Raises:
        IntegrityError / UnsafeCheckpointError: see :meth:`PublishRecord.parse`; also a record
            that is a symbolic link (local disks never read through one) or not a file.
    """
    where = storage.display(RECORD_NAME)
    if RECORD_NAME not in files:
        if storage.exists(RECORD_NAME):
            raise UnsafeCheckpointError(f"{where} is not a regular file; remove it")
        return None
    if files[RECORD_NAME] > _MAX_RECORD:
        raise IntegrityError(f"{where}: {files[RECORD_NAME]} bytes, larger than a publish record can be; delete it")
    return PublishRecord.parse(storage.read_bytes(RECORD_NAME), where)


@dataclass
class _Layout:
    """What a publish writes: shard files (tensors, names, headers), the index, an optional config."""

    files: list[list[_Planned]]
    config: bytes | None = None
    names: list[str] = field(init=False)
    headers: list[bytes] = field(init=False)
    index: bytes = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.names = _file_names(len(self.files))
        self.headers = [_header(entries) for entries in self.files]
        self.total = sum(t.nbytes for entries in self.files for t in entries)
        weight_map = {t.key: self.names[i] for i, entries in enumerate(self.files) for t in entries}
        self.index = json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2, sort_keys=True).encode()

    def owned(self) -> list[OwnedFile]:
        """Every file this publish writes, as its record names them."""
        shards = [OwnedFile(n, len(h) + sum(t.nbytes for t in e)) for n, h, e in zip(self.names, self.headers, self.files)]
        small = [(CONFIG_NAME, self.config)] if self.config is not None else []
        small.append((INDEX_NAME, self.index))
        return shards + [OwnedFile(n, len(data), hashlib.sha256(data).hexdigest()) for n, data in small]

    def small_files(self) -> list[tuple[str, bytes]]:
        """The files the coordinator writes at the commit, the index (the commit itself) last."""
        return ([(CONFIG_NAME, self.config)] if self.config is not None else []) + [(INDEX_NAME, self.index)]


@dataclass
class Publish:
    """One publish into a folder, planned by the coordinator (picklable: every rank learns where
    to write). The call order, all on the coordinator except the writing of the shards:

    1. :meth:`begin`: refuse what must not be replaced; choose ``staged``, where the shards are
       written: a new temporary sibling directory (local disks), or the folder itself (object
       stores: no rename; the record then claims the files and the old index goes first);
    2. the shard files are written into ``staged`` (by their owner ranks);
    3. :meth:`commit`: a folder that did not exist (or was empty) is renamed into place whole;
       otherwise the record claims the new files, the old index goes, the shards are moved in
       (local), files this publish replaces are removed, then the config and the index (the
       commit) are written, and the record names exactly this publish's files;
    on failure before the commit: :meth:`abandon` removes what this publish wrote.
    """

    staged: str
    in_place: bool
    fresh: bool
    writes: list[OwnedFile]
    shards: list[str]
    previous: list[OwnedFile]
    stale: list[str]
    uncommit: bool
    committed: bool = False

    @classmethod
    def begin(cls, storage: Storage, layout: _Layout, overwrite: bool, patterns: list[str], out: str) -> Publish:
        """(coordinator) Plan the publish of ``layout`` into ``storage``'s folder (``out``, as
        the caller gave it).

        Raises:
            FileExistsError: distckpt's previous publish is there and ``overwrite`` is False, or
                files it did not write would be replaced or removed and ``patterns`` do not name them.
            ValueError: the folder lies inside a checkpoint step.
        """
        from distckpt.tools.convert import check_output

        check_output(out, storage.storage_options)
        where = storage.display()
        files = storage.list_files()
        record = read_record(storage, files)
        writes = layout.owned()
        write_names = {w.name for w in writes}
        for name in sorted(write_names) if storage.is_local else []:  # object stores: a key is never a folder
            if name not in files and os.path.lexists(storage.join(name)):
                raise FileExistsError(f"{storage.display(name)} exists and is not a regular file; a publish cannot replace it")
        owned = _still_owned(storage, record, files)
        if owned and not overwrite:
            what = "an unfinished publish" if record is not None and not record.complete else "a Hugging Face checkpoint"
            raise FileExistsError(
                f"{where} holds {what} written by distckpt ({_shown(sorted(owned))}); pass overwrite=True to replace it "
                "(files distckpt did not write are kept)"
            )
        foreign = sorted(n for n in files if n != RECORD_NAME and n not in owned)
        conflicts = [n for n in foreign if n in write_names or _hf_weights(n)]
        allowed = [n for n in conflicts if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        refused = [n for n in conflicts if n not in allowed]
        if refused:
            kept = [n for n in foreign if n not in conflicts]
            it, was = ("it", "was") if len(refused) == 1 else ("them", "were")
            raise FileExistsError(
                f"{where}: {_shown(refused)} {was} not written by distckpt (its record {RECORD_NAME} does not name {it} "
                f"as written and unchanged since), and this publish would replace or remove {it}: pass "
                f"replace={refused!r} to allow that, or move {it} away"
                + (f"; the other files ({_shown(kept)}) are never touched" if kept else "")
            )
        _, entries = storage.last_change()
        staged = storage.stage_directory()  # local: a new temporary sibling; object stores: the folder itself
        plan = cls(
            staged=staged,
            in_place=staged == storage.url,
            fresh=entries == 0,
            writes=writes,
            shards=list(layout.names),
            previous=list(owned.values()),
            stale=sorted((set(owned) | set(allowed)) - write_names),
            uncommit=INDEX_NAME in files,
        )
        if not plan.in_place and not plan.fresh and os.stat(staged).st_dev != os.stat(storage.path).st_dev:
            storage.abandon_directory(staged, [])
            raise OSError(
                errno.EXDEV,
                f"{where} is on another filesystem than the folder around it (a mount point): the new files could "
                "not be renamed into it; publish into a folder inside it",
            )
        if plan.in_place:
            plan._claim(storage)
        return plan

    def _claim(self, storage: Storage) -> None:
        """Name every file of the previous and this publish in the record before one is written
        in place, then remove the old index: no reader sees it over a mix of old and new shards."""
        storage.write_bytes(PublishRecord(self.previous + self.writes, complete=False).to_bytes(), RECORD_NAME)
        if self.uncommit:
            storage.remove(INDEX_NAME)

    def commit(self, storage: Storage, layout: _Layout) -> None:
        """(coordinator) Make the written shards the folder's checkpoint (see the class doc)."""
        record = PublishRecord(self.writes, complete=True).to_bytes()
        if self.fresh and not self.in_place:
            target = Storage(self.staged)
            for name, data in layout.small_files():
                target.write_bytes(data, name)
            target.write_bytes(record, RECORD_NAME)
            storage.commit_directory(self.staged, overwrite=False)
            self.committed = True
            return
        if not self.in_place:
            self._claim(storage)
            for name in self.shards:
                # Same filesystem (a sibling directory): an atomic rename per file. A link
                # standing at the name is replaced itself, never written through.
                os.replace(os.path.join(self.staged, name), storage.join(name))
        for name in self.stale:
            storage.remove(name)
        for name, data in layout.small_files():
            storage.write_bytes(data, name)
        self.committed = True  # the index is written: from here on nothing may be removed
        try:
            storage.write_bytes(record, RECORD_NAME)
        except Exception as exc:  # noqa: BLE001 - the unfinished record still names these files
            warnings.warn(f"distckpt: {storage.display(RECORD_NAME)}: could not record the published files: {exc}", stacklevel=3)
        if not self.in_place:
            storage.abandon_directory(self.staged, [])  # the emptied temporary directory

    def abandon(self, storage: Storage) -> None:
        """(coordinator) After a failure before the commit, remove what this publish wrote, best
        effort: the temporary directory (local), or its shards in place (object stores); the
        record then names only what is left of the previous publish."""
        if self.committed:
            return
        if not self.in_place:
            storage.abandon_directory(self.staged, [])
            return
        storage.abandon_directory(self.staged, self.shards)
        try:
            left = [f for f in self.previous if storage.exists(f.name)]
            if left:
                storage.write_bytes(PublishRecord(left, complete=False).to_bytes(), RECORD_NAME)
            else:
                storage.remove(RECORD_NAME)
        except Exception:  # noqa: BLE001 - best effort: the publish's own error is what counts
            pass


def _still_owned(storage: Storage, record: PublishRecord | None, files: Mapping[str, int]) -> dict[str, OwnedFile]:
    """The files of ``record`` that are still what distckpt wrote: name -> entry."""
    owned: dict[str, OwnedFile] = {}
    for entry in record.files if record is not None else []:
        name = entry.name
        if name in owned or name not in files or (storage.is_local and os.path.islink(storage.join(name))):
            continue  # a link is never distckpt's: it writes none
        if (record.complete or entry.sha256 is not None) and files[name] != entry.size:
            continue
        if entry.sha256 is not None and (
            entry.size > _MAX_RECORD or hashlib.sha256(storage.read_bytes(name)).hexdigest() != entry.sha256
        ):
            continue
        owned[name] = entry
    return owned


def _shown(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


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

    Raises:
        ValueError: ``out_root`` is ``src`` or inside a checkpoint step
            (:func:`distckpt.tools.convert.check_output`).
    """
    import mmap
    import tempfile

    from distckpt.checkpointer import Checkpointer
    from distckpt.tools.convert import check_output

    opts = dict(storage_options or {})
    check_output(out_root, opts, inputs=(src,))  # never into a checkpoint step, never over src
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
    output is committed, by the protocol of :func:`save_pretrained` (:class:`Publish`): a new
    directory renamed into place, or the files moved into an existing one, the index last; a
    failed export removes what it wrote. Not collective.

    Args:
        found: a located checkpoint (:func:`distckpt.tools.catalog.locate`).
        out: the directory to publish into: it must not hold a checkpoint (distckpt's or other
            Hugging Face weights) yet; other files there are kept. Never inside a checkpoint step.
        key, dtype, max_shard_size: what to export, cast (floating-point dtypes) and how to split it.
        storage_options: fsspec options for ``out``.
        progress: ``progress(bytes done, bytes total)``.

    Returns:
        A summary: output, files, tensors, bytes.
    """
    from distckpt.tools.convert import CheckpointSource, cast_dtype, check_output, select_tensors

    opts = dict(storage_options or {})
    check_output(out, opts)  # before anything is read
    source = CheckpointSource(found)
    picked = select_tensors(found, source, model_only=key is None, key=key)
    # Tensors in the order their bytes lie in the checkpoint's data files (as the other exports
    # read them): writing the shard files one after another then reads each data file once,
    # front to back, hashed as it goes. Shards are cut from this order; the index maps names.
    planned: list[_Planned] = []
    for name, k in sorted(picked, key=lambda p: source.position(p[1])):
        info = source.tensors[k]
        check_tensor_name(name, f"export of checkpoint key {k!r}")
        odt = cast_dtype(k, info.dtype, dtype)
        if odt not in NAMES:
            raise TypeError(f"tensor {k} has dtype {odt}, which safetensors cannot store")
        planned.append(_Planned(name, tuple(info.shape), odt, info.nbytes(odt)))
    by_name = dict(picked)
    layout = _Layout(_plan_files(planned, parse_size(max_shard_size)))
    storage = _folder(out, opts)
    publish = Publish.begin(storage, layout, overwrite=False, patterns=[], out=out)
    target = Storage(publish.staged, opts) if publish.staged != storage.url else storage
    done = 0
    try:
        for i, entries in enumerate(layout.files):
            with target.open(layout.names[i], "wb") as f:
                f.write(layout.headers[i])
                for t in entries:
                    written = 0
                    for block in source.iter_bytes(by_name[t.key], t.dtype):
                        f.write(block)
                        written += len(block)
                    if written != t.nbytes:
                        raise RuntimeError(f"tensor {by_name[t.key]}: wrote {written} bytes, expected {t.nbytes}")
                    done += t.nbytes
                    if progress:
                        progress(done, layout.total)
                if i == len(layout.files) - 1:
                    # Every data file read is checked whole before the last shard closes (an
                    # object store publishes a file when it closes).
                    source.finish()
                target.sync_file(f)
        publish.commit(storage, layout)
    except BaseException:
        publish.abandon(storage)  # nothing unverified or partial stays behind
        raise
    return {"output": storage.display(), "format": "hf", "files": layout.names, "tensors": len(planned), "bytes": layout.total}
