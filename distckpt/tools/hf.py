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
  ``.distckpt-publish.json``, names the files it wrote (:mod:`distckpt.tools.hf_publish`:
  :class:`~distckpt.tools.hf_publish.PublishRecord`, :class:`~distckpt.tools.hf_publish.Publish`).

Both are collective over the given process group (default: every rank): all ranks call them
with the same arguments, and an error on any rank is raised on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from distckpt._compat import as_byte_viewable
from distckpt._dist import (
    INTERRUPTS,
    Group,
    capture,
    exchange,
    gathers_interrupts,
    interrupts_raised,
    on_coordinator,
    raise_if_any,
    raise_interrupted,
)
from distckpt._process import refuse_different_arguments
from distckpt.errors import CheckpointError, StateMismatchError
from distckpt.load.phases import Mismatches, read, refuse_meta, refuse_overlapping
from distckpt.options import location
from distckpt.state import statecheck
from distckpt.state.casts import beyond_range
from distckpt.state.entries import ModuleEntry, tied_duplicates
from distckpt.storage.base import Storage
from distckpt.tools.convert import warn_beyond_range
from distckpt.tools.hf_publish import (
    DigestingFile,
    Layout,
    PlannedTensor,
    Publish,
    parse_size,
    plan_files,
    plan_tensor,
    publish_folder,
    replace_patterns,
)
from distckpt.tools.safetensors_io import SafetensorsIndex, SafetensorsReader


#: What each rank of :func:`load_pretrained` shares of its plan: missing, unexpected and
#: mismatched keys, tied keys, pairs of keys of one tied tensor the checkpoint stores both of,
#: and what every rank must have alike (arguments, the files' headers, the key mapping).
_PlanView = tuple[list[str], list[str], Mismatches, dict[str, str], list[tuple[str, str]], dict[str, object]]


class HFConfig(Protocol):
    """What :func:`save_pretrained` takes as ``config``: a ``transformers`` config, or anything
    that writes itself as ``config.json``."""

    def to_json_string(self) -> str: ...


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
    mismatched: Mismatches = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    bytes_read: int = 0


def _group(process_group: dist.ProcessGroup | Group | None) -> Group:
    if isinstance(process_group, Group):
        return process_group
    return Group(process_group if dist.is_available() and dist.is_initialized() else None)


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _map_key(name: str, strip_prefix: str | None, add_prefix: str | None, key_map: Callable[[str], str | None] | None) -> str | None:
    if key_map is not None:
        mapped = key_map(name)
        if mapped is not None and not isinstance(mapped, str):  # (a list was "unhashable type: 'list'")
            raise TypeError(f"load_pretrained: key_map({name!r}) returned {type(mapped).__name__}; it must return the model key (str) or None to skip it")
        return mapped
    if strip_prefix:
        if not name.startswith(strip_prefix):
            return None
        name = name[len(strip_prefix) :]
    return f"{add_prefix}{name}" if add_prefix else name


def _index(storage: Storage, given: str) -> SafetensorsIndex:
    """The safetensors files :func:`load_pretrained` reads at ``storage`` (``given``: its path or
    URL as given): a folder (one file, or shards and their index), or one ``.safetensors`` file
    named itself (it was a bare ``NotADirectoryError``, though "a single file" invites passing
    the file).

    Raises:
        NotADirectoryError: a file that is not a ``.safetensors`` file, naming it.
    """
    if not storage.fs.isfile(storage.path):
        return SafetensorsIndex(storage)
    if storage.is_local:
        folder, name = os.path.split(storage.path)
    else:
        folder, _, name = given.rstrip("/").rpartition("/")
        if folder.endswith(":/"):  # a file at the store's root: memory://model.safetensors
            folder += "/"
    if not name.endswith(".safetensors"):
        raise NotADirectoryError(f"{storage.display()} is a file, not a .safetensors file or a folder of them")
    return SafetensorsIndex(Storage(folder, storage.storage_options), only=name)


def _config_json(config: object) -> bytes | None:
    """``config.json``'s bytes for :func:`save_pretrained`'s ``config``: a ``transformers``
    config (``to_json_string()``) or a dict of JSON values (a config read with ``json.load``).

    Raises:
        TypeError: anything else (it failed with a bare ``AttributeError``), or a dict that is
            not JSON (naming why).
    """
    if config is None:
        return None
    if isinstance(config, dict):
        try:
            return (json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
        except (TypeError, ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise TypeError(
                f"save_pretrained(config=...): a dict config must hold JSON values only, under keys of one type (str): {why}"
            ) from None
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        raise TypeError(
            f"save_pretrained(config=...) takes a transformers config (with to_json_string()) or a dict, "
            f"got {type(config).__name__}"
        )
    text = to_json()
    if not isinstance(text, str):
        raise TypeError(f"save_pretrained(config=...): to_json_string() returned {type(text).__name__}, not str")
    return text.encode()


@interrupts_raised()  # Ctrl-C while reading: the interrupt on its rank, Interrupted on its peers
def load_pretrained(
    module: nn.Module,
    path: str,
    *,
    strict: bool = True,
    storage_options: Mapping[str, object] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    key_map: Callable[[str], str | None] | None = None,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 2,
) -> PretrainedReport:
    """(all ranks, collective) Load Hugging Face safetensors weights into ``module`` in place.

    Args:
        module: plain, DDP or FSDP2 model, already wrapped/sharded (FSDP2 parameters an eval
            forward left unsharded are resharded first, as :meth:`Checkpointer.load` does).
        path: directory with ``model.safetensors`` or shards + ``model.safetensors.index.json``
            (or diffusers' ``diffusion_pytorch_model.safetensors.index.json``), or one
            ``.safetensors`` file (local path or fsspec URL).
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
    A checkpoint holding several keys of one tied tensor (T5 ties four) has them read into
    buffers of their own and compared first; a key it lacks is filled through one it holds.
    Floating-point tensors are cast to the model's dtype.

    Returns:
        A :class:`PretrainedReport`.

    Raises:
        StateMismatchError: keys or shapes differ (``strict=True``).
        ValueError: the checkpoint stores keys of one tied tensor with different values
            (naming both; the model is left untouched).
        IntegrityError: a malformed file or index, or a folder holding both ``model.safetensors``
            and an index naming other files (:class:`~distckpt.tools.safetensors_io.SafetensorsIndex`).
    """
    group = _group(process_group)
    if key_map is not None and not callable(key_map):
        # (a dict, as transformers' key_mapping takes regex patterns, failed as "'dict' object
        # is not callable", naming no argument)
        raise TypeError(
            f"load_pretrained: key_map must be a function (checkpoint key -> model key, or None to skip it), got "
            f"{type(key_map).__name__}; for a dict of exact keys pass key_map=mapping.get"
        )
    if key_map is not None and (strip_prefix or add_prefix):
        raise ValueError("load_pretrained: key_map replaces strip_prefix and add_prefix (they would be ignored); fold them into key_map")
    given = location(path, "path", storage_options)
    storage = Storage(given, dict(storage_options or {}))
    where = storage.display()

    def plan() -> tuple[tuple[dict[str, torch.Tensor], dict[str, str], SafetensorsIndex, dict[str, str]], _PlanView]:
        index = _index(storage, given)
        # FSDP2 parameters left unsharded (after a no_grad forward) would keep serving the old
        # values to the next forward: reshard first (local), as Checkpointer.load does.
        ModuleEntry("model", module).settle()
        sd = get_model_state_dict(module)
        aliases = tied_duplicates(sd)
        rename: dict[str, str] = {}  # model key -> checkpoint key
        unexpected: list[str] = []
        mapped = {k: _map_key(k, strip_prefix, add_prefix, key_map) for k in index.spans}
        for ckpt_key, target in mapped.items():
            if target is None or target not in sd:
                unexpected.append(ckpt_key)
            elif target in rename:
                raise ValueError(f"{where}: checkpoint keys {rename[target]!r} and {ckpt_key!r} both map to {target!r}")
            else:
                rename[target] = ckpt_key
        # Tied weights: every key of one tensor (T5 ties four), the model's first key first.
        groups: dict[str, list[str]] = {}
        for dup, first in aliases.items():
            groups.setdefault(first, [first]).append(dup)
        group_of = {k: g for g in groups.values() for k in g}
        missing, tied = [], {}
        mismatched: Mismatches = {}
        request: dict[str, torch.Tensor] = {}
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
        for key in sd:
            if key in rename:
                continue
            # Not stored: filled through a key of its tied tensor that is (one that loads first).
            members = group_of.get(key, ())
            partner = next((m for m in members if m in request), None) or next((m for m in members if m in rename), None)
            if partner is not None:
                tied[key] = partner
            else:
                missing.append(key)
        # Several keys of one tied tensor stored: one tensor of the model, several in the
        # checkpoint; each is compared with the first stored (pairs: key, key it must equal).
        both = []
        for members in groups.values():
            stored = [m for m in members if m in request]
            both += [(m, stored[0]) for m in stored[1:]]
        both.sort()
        # What every rank must share: its arguments, the files it found (a node's own copy at
        # another path may be another revision) and where the checkpoint's keys go (key_map may
        # differ by rank).
        agree = {
            "strict": strict,
            "strip_prefix": strip_prefix,
            "add_prefix": add_prefix,
            "key_map": key_map is not None,
            "files (digest of their headers)": _digest(sorted((n, i.size, i.head.hex()) for n, i in index.files.items())),
            # Of the checkpoint's keys, not the model's: pipeline stages hold other parts of it.
            "key mapping (digest)": _digest(sorted(mapped.items(), key=lambda kv: kv[0])),
        }
        # As Checkpointer.load: a model built on the meta device and not given memory returned
        # "loaded" holding no values; an expand()ed buffer failed half-way naming no key.
        refuse_meta(request, where)
        refuse_overlapping(request, where)
        view = (sorted(missing), sorted(unexpected), mismatched, tied, both, agree)
        return (request, rename, index, tied), view

    (request, rename, index, _), views = exchange(group, f"load_pretrained from {where}", plan)
    # Before anything is read: a rank with strict=False went on into the read while the others
    # raised (a hang until the timeout); other files or mappings loaded a mix silently.
    refuse_different_arguments(f"load_pretrained({where!r})", [v[5] for v in views])
    pairs = sorted({p for v in views for p in v[4]})
    missing = sorted({k for v in views for k in v[0]})
    unexpected = sorted(set(views[0][1]).intersection(*[set(v[1]) for v in views]))
    mismatched: Mismatches = {}
    tied: dict[str, str] = {}
    for v in views:
        mismatched.update(v[2])
        tied.update(v[3])
    report = PretrainedReport(len(request), missing, unexpected, mismatched, tied)
    if strict and (missing or unexpected or mismatched):
        raise StateMismatchError(missing, unexpected, mismatched, f"Hugging Face checkpoint {where}")
    aside: dict[str, torch.Tensor] = {}
    beyond: list[str] = []
    into = {k: v.dtype for k, v in request.items()}  # before the tied pairs leave request
    if pairs:
        aside, report.bytes_read, beyond = _read_tied_pairs(group, where, index, rename, request, pairs, thread_count)
    reader = SafetensorsReader(index, {k: rename[k] for k in request if rename[k] != k}, thread_count=thread_count)
    read(group, where, request, reader, DefaultLoadPlanner(allow_partial_load=True))
    _warn_overflow(where, sorted({*beyond, *reader.beyond_range}), into, index.spans, rename)
    set_model_state_dict(module, {**request, **aside}, options=StateDictOptions(strict=False))
    report.bytes_read += reader.bytes_read
    return report


def _warn_overflow(
    where: str, keys: list[str], into: Mapping[str, torch.dtype], spans: Mapping[str, Any], rename: Mapping[str, str]
) -> None:
    """(each rank, its shards) One warning naming the tensors (``keys``, found by the reader)
    some of whose values lay beyond the range of the model's dtype they were cast into (float32
    into float16: ``inf``; into a float8 type: its largest value, or NaN), silently otherwise."""
    if not keys:
        return
    hit = [f"{k} ({spans[rename[k]].dtype} into {into[k]})" for k in keys]
    shown = ", ".join(hit[:5]) + (f" and {len(hit) - 5} more" if len(hit) > 5 else "")
    warnings.warn(
        f"distckpt: load_pretrained of {where}: {len(hit)} tensor(s) hold values beyond the range of the model's dtype, "
        f"changed by the cast into it (into inf; a float8 type saturates to its largest value or gives NaN): {shown}",
        stacklevel=4,  # (the user's call: load_pretrained's decorator adds a frame)
    )


def _read_tied_pairs(
    group: Group,
    where: str,
    index: SafetensorsIndex,
    rename: dict[str, str],
    request: dict[str, torch.Tensor],
    pairs: list[tuple[str, str]],
    thread_count: int,
) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    """(all ranks) Tied weights the checkpoint stores under both keys (``pairs``: duplicate, key
    it is tied to). Read into buffers of their own and compared before anything is loaded:
    read into the model's one tensor, whichever came last in the files would win unreported.

    Removes both keys of every pair from ``request``; returns the tensors to load for them (the
    values of the key tied to), the bytes read and the keys read with values beyond the model
    dtype's range.

    Raises:
        ValueError: on every rank, naming both keys and their files, if any rank's block of a
            pair differs (a difference may lie in one rank's shard only).
    """
    keys = sorted({k for pair in pairs for k in pair})
    aside = {k: torch.empty_like(request[k]) for k in keys}
    reader = SafetensorsReader(index, {k: rename[k] for k in keys if rename[k] != k}, thread_count=thread_count)
    read(group, where, aside, reader, DefaultLoadPlanner(allow_partial_load=True))

    def local(t: torch.Tensor) -> torch.Tensor:
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
    return {b: aside[b] for _, b in pairs}, reader.bytes_read, reader.beyond_range


@interrupts_raised()  # (see _write_shards)
def save_pretrained(
    module: nn.Module,
    out: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: Mapping[str, object] | None = None,
    config: HFConfig | dict[str, Any] | None = None,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    replace: str | Iterable[str] = (),
    process_group: dist.ProcessGroup | None = None,
    on_replica_drift: str = "warn",
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
        config: optional object with ``to_json_string()`` (a ``transformers`` config), or a
            dict of JSON values: written as ``config.json`` so that ``from_pretrained(out)``
            needs nothing else (anything else is a ``TypeError``, on every rank).
        strip_prefix: remove this prefix from every key (keys without it are skipped).
        overwrite: replace distckpt's own previous publish at ``out`` (the files its record
            names and that are unchanged since), else ``FileExistsError``.
        replace: files at ``out`` that distckpt did not write but this publish may replace or
            remove: names or patterns (``"*.safetensors"``) of Hugging Face weight files
            (``model.safetensors``, ``model-*-of-*.safetensors``, the index), or ``config.json``
            when ``config`` is given. Such files not named here are a ``FileExistsError``
            naming them. Naming any other file changes nothing: it is kept.
        process_group: the ranks that publish together (default: all).
        on_replica_drift: copies of a replicated tensor (a plain parameter or buffer every rank
            holds: DDP, or a buffer FSDP2 leaves unsharded such as BatchNorm's running stats)
            that differ between ranks are named in a warning (``"warn"``), refused before
            anything is written (``"error"``: :class:`~distckpt.ReplicaDriftError`), or not
            compared (``"ignore"``). Only the rank writing a tensor's file publishes its copy.

    Tied weights are written once (under the first key), as Hugging Face's own ``save_pretrained``
    does. Returns a summary (files, tensors, bytes; ``beyond_range``: the tensors whose values
    the cast to ``dtype`` changed beyond its range, also named in one warning) on every rank.

    Raises:
        FileExistsError: see ``overwrite`` and ``replace``.
        TypeError: ``dtype`` is not a floating-point dtype (it would truncate a weight, named).
        ValueError: a tensor named ``__metadata__`` (reserved by safetensors), a bad ``replace``
            or ``on_replica_drift``, or tensors on the meta device (named).
        ReplicaDriftError: see ``on_replica_drift``.
    """
    group = _group(process_group)
    opts = dict(storage_options or {})
    out = location(out, "out", opts)  # (a Path too: the publish checks it as text)
    storage = publish_folder(out, opts)
    where = storage.display()
    limit = parse_size(max_shard_size)
    patterns = replace_patterns(replace)

    def prepare() -> tuple[tuple[dict[str, torch.Tensor], list[list[PlannedTensor]], bytes | None], tuple[str, dict[str, object]]]:
        if on_replica_drift not in statecheck.DRIFT_POLICIES:  # (in the exchange: on one rank, the others waited)
            raise ValueError(f"on_replica_drift must be one of {statecheck.DRIFT_POLICIES}, got {on_replica_drift!r}")
        storage.refuse_unshared(group.world_size, "save_pretrained")
        config_json = _config_json(config)
        sd = get_model_state_dict(module)
        if strip_prefix:
            # Ties among the keys published: a tied tensor whose first key lies outside the
            # prefix (a head registered before the backbone) was skipped under both keys.
            sd = {k: v for k, v in sd.items() if k.startswith(strip_prefix)}
        tied = tied_duplicates(sd)
        planned: list[PlannedTensor] = []
        tensors: dict[str, torch.Tensor] = {}
        for key, value in sd.items():
            if key in tied or not isinstance(value, torch.Tensor):
                continue
            name = key
            if strip_prefix:
                if not key.startswith(strip_prefix):
                    continue
                name = key[len(strip_prefix) :]
            planned.append(plan_tensor(name, key, value.shape, value.dtype, dtype, f"{where} (model key {key!r})"))
            tensors[name] = value
        if not planned:
            raise ValueError("the model has no tensors to publish")
        meta = [k for k, v in tensors.items() if v.device.type == "meta"]
        if meta:  # (it failed in the writes with torch's "Cannot copy out of meta tensor", naming no key)
            shown = ", ".join(repr(k) for k in meta[:5]) + (f" (+{len(meta) - 5} more)" if len(meta) > 5 else "")
            raise ValueError(f"cannot publish tensors on the meta device (no values): {shown}; materialize them first (model.to_empty(device=...), then load or initialise)")
        files = plan_files(planned, limit)
        digest = repr([(t.key, t.shape, str(t.dtype)) for t in planned])
        # What every rank must share besides the model: each rank writes the files its own
        # layout gives it, and the coordinator commits its own. Another max_shard_size on one
        # rank published an index naming shards no rank wrote, with no error.
        agree = {
            "out": where,
            "dtype": str(dtype),
            "max_shard_size": limit,
            "strip_prefix": strip_prefix,
            "overwrite": bool(overwrite),
            "replace": sorted(patterns),
            "config (digest)": None if config_json is None else _digest(config_json),
            "on_replica_drift": on_replica_drift,  # (refused on some ranks only, the others waited)
        }
        # Copies of the plain tensors every rank holds, compared: only the owner of each file
        # publishes its copy, so drifted replicas were published unnamed, several ranks' values
        # mixed across files. (DTensors' replicated dimensions are not compared here.)
        plain = {k: v for k, v in tensors.items() if not isinstance(v, DTensor)}
        copies = statecheck.copy_digests(plain) if group.world_size > 1 and on_replica_drift != "ignore" else {}
        return (tensors, files, config_json, copies), (digest, agree)

    (tensors, files, config_json, copies), views = exchange(group, f"save_pretrained to {where}", prepare)
    refuse_different_arguments(f"save_pretrained({where!r})", [agree for _, agree in views])
    if len({digest for digest, _ in views}) > 1:
        raise ValueError("ranks disagree on the model's keys, shapes or dtypes; every rank must publish the same model")
    if group.world_size > 1 and on_replica_drift != "ignore":
        # As a save compares replicas: slot sums in one all-reduce of O(keys) (the coordinator's
        # copy as the reference), then only the keys that differ gathered, to name the ranks.
        checked = sorted(k for k, v in tensors.items() if not isinstance(v, DTensor))
        mine = statecheck.replica_vector(copies, checked, [], set(checked) if group.is_coordinator else set())
        differ = statecheck.replica_mismatches(group.all_reduce(mine, "sum"), checked, [], group.world_size)
        if differ:  # (the same list on every rank)
            by_rank = group.all_gather({k: copies[k] for k in differ if k in copies})
            statecheck.report_drift(
                f"save_pretrained to {where}", "each file holds its writer rank's copy", statecheck.name_drift(by_rank, differ),
                on_replica_drift, 4,  # (the user's call: the decorator adds a frame)
            )  # fmt: skip
    layout = Layout(files, config_json)
    # Largest files first, each to the least-loaded rank: the same assignment on every rank.
    load = [0] * group.world_size
    owner: dict[int, int] = {}
    for i in sorted(range(len(files)), key=lambda i: -sum(t.nbytes for t in files[i])):
        r = min(range(group.world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sum(t.nbytes for t in files[i])

    publish = on_coordinator(group, f"save_pretrained to {where}", lambda: Publish.begin(storage, layout, overwrite, patterns, out))
    target = publish.target(storage)
    try:
        digests, beyond = _write_shards(group, where, target, layout, owner, tensors)
        on_coordinator(group, f"commit of {where}", lambda: publish.commit(storage, layout, digests))
    except BaseException:
        if group.is_coordinator:
            publish.abandon(storage)
        raise
    warn_beyond_range(f"save_pretrained to {where}", beyond, dtype, stacklevel=4)
    return {"output": where, "files": layout.names, "tensors": sum(len(e) for e in files), "bytes": layout.total, "beyond_range": beyond}


def _write_shards(
    group: Group, where: str, target: Storage, layout: Layout, owner: dict[int, int], tensors: dict[str, torch.Tensor]
) -> dict[str, str]:
    """(all ranks) Write each rank's shard files into ``target`` (durably: synced before closed).
    Returns every shard's CRC-32C (name -> hex) and the keys whose cast changed values beyond
    the written dtype's range (:func:`~distckpt.state.casts.beyond_range`), on every rank."""
    # Every rank walks the same tensors in the same order, since gathering a DTensor is
    # collective. An I/O error on an owner must not leave the others inside a gather: it is
    # recorded, the rank stops writing but keeps gathering, and errors are exchanged at the end.
    # An interrupt (Ctrl-C) in an owner's writes is recorded the same way (inside
    # interrupts_raised): every rank then leaves with Interrupted.
    error: BaseException | None = None
    interrupt: BaseException | None = None
    recorded = (Exception, *INTERRUPTS) if gathers_interrupts() else (Exception,)
    digests: dict[str, str] = {}
    beyond: list[str] = []
    for i, entries in enumerate(layout.files):
        mine = owner[i] == group.rank and error is None
        cm: AbstractContextManager[IO[bytes]] | None = None
        f: DigestingFile | None = None
        if mine:
            try:
                cm = target.open(layout.names[i], "wb")
                f = DigestingFile(cm.__enter__())
                f.write(layout.headers[i])
            except recorded as exc:  # noqa: BLE001 - see above
                error, mine = exc, False
                interrupt = interrupt or (exc if isinstance(exc, INTERRUPTS) else None)
        for t in entries:
            value = tensors[t.key]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if mine:
                try:
                    if full.dtype != t.dtype and beyond_range(full.detach(), t.dtype):
                        beyond.append(t.key)
                    data = as_byte_viewable(full.detach().to(device="cpu", dtype=t.dtype))
                    if data.numel():
                        f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
                except recorded as exc:  # noqa: BLE001 - see above
                    error, mine = exc, False
                    interrupt = interrupt or (exc if isinstance(exc, INTERRUPTS) else None)
            del full
        if cm is not None:
            try:
                if mine:
                    target.sync_file(f.file)  # a publish killed after its commit must not lose shard bytes
                    digests[layout.names[i]] = f.hexdigest()
                cm.__exit__(None, None, None)
            except recorded as exc:  # noqa: BLE001 - see above
                error = error or exc
                interrupt = interrupt or (exc if isinstance(exc, INTERRUPTS) else None)
    outcome = capture(error) if error is not None else None
    try:
        gathered = group.all_gather((outcome, digests, beyond))
    except CheckpointError:
        if interrupt is not None:
            raise interrupt from None
        raise
    raise_interrupted([o for o, _, _ in gathered], f"save_pretrained to {where}", interrupt)
    raise_if_any([o for o, _, _ in gathered], f"save_pretrained to {where}")
    return {name: digest for _, d, _ in gathered for name, digest in d.items()}, sorted(k for _, _, b in gathered for k in b)
