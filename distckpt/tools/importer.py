"""Import a ``torch.save`` checkpoint into a distckpt checkpoint that any world size can load.

The file is read with ``torch.load(weights_only=True, mmap=True)`` (no code runs, tensors stay on
disk until written), the model's state dict is found (a bare state dict, or under ``model``,
``state_dict``, ``model_state_dict``, ...), ``module.``/``_orig_mod.`` prefixes are stripped, and
it is saved as the ``model`` entry with the file's plain top-level values (epoch, step ...).

Not collective: call from one process.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from fsspec.core import url_to_fs

from distckpt.integrations.lightning_pointers import POINTER_MAX_BYTES, pointer_hint
from distckpt.checkpointer import Checkpointer
from distckpt.errors import UnsafeCheckpointError
from distckpt.integrity import deep_stack
from distckpt.integrity.manifest import step_dir
from distckpt.state import values
from distckpt.storage.base import Storage, local_path
from distckpt.tools.outputs import check_output

_STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict", "module", "net")
_PREFIXES = ("module.", "_orig_mod.")


def _is_tensor_dict(obj: object) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(k, str) for k in obj) and any(
        isinstance(v, torch.Tensor) for v in obj.values()
    )


def strip_prefixes(name: str) -> str:
    """``name`` without DDP's leading ``module.`` and ``torch.compile``'s ``_orig_mod.`` (anywhere)."""
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    return name.replace("._orig_mod.", ".")


def import_torch_save(
    src: str,
    out_root: str,
    *,
    step: int | None = None,
    storage_options: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """Import a ``torch.save`` file (a state dict, or a dict holding one) as a distckpt checkpoint.

    The file is read with ``weights_only=True`` (memory-mapped when local). The model's state
    dict (the file itself, or its ``model``/``state_dict``/``model_state_dict`` item) is saved as
    entry ``model`` (keys ``model.<fqn>``, ``module.``/``_orig_mod.`` removed); other top-level
    plain values (``epoch``, ``step``...) are kept; anything else (optimizer state keyed by
    parameter index) is skipped and listed in the summary.

    Returns:
        A summary: output, step, tensors, skipped keys.

    Raises:
        ValueError: ``out_root`` is ``src`` or inside a checkpoint step
            (:func:`distckpt.tools.outputs.check_output`); the file cannot be read with
            ``weights_only=True``.
        UnsafeCheckpointError: the file's pickle asks for work out of proportion to its size
            (:func:`distckpt.integrity.work_scan.refuse_work_bombs`).
    """
    opts = dict(storage_options or {})
    check_output(out_root, opts, inputs=(src,))
    with _local_copy(src, opts) as path:
        try:
            obj = _torch_load(path, str(src))
        except pickle.UnpicklingError as exc:
            raise ValueError(f"cannot read {src} with weights_only=True: {str(exc).splitlines()[0]}") from None
        except UnsafeCheckpointError:
            raise  # (a RuntimeError: named as what it is, not as a file torch cannot read)
        except RuntimeError as exc:
            raise ValueError(f"{src} is not a torch.save file: {str(exc).splitlines()[0]}") from None
        found_key = next((k for k in _STATE_DICT_KEYS if isinstance(obj, Mapping) and _is_tensor_dict(obj.get(k))), None)
        if found_key is not None:
            sd, rest = obj[found_key], {k: v for k, v in obj.items() if k != found_key}
        elif _is_tensor_dict(obj):
            sd, rest = obj, {}
        else:
            raise ValueError(f"{src} holds no model state dict (a dict of tensors, or one under {', '.join(_STATE_DICT_KEYS)})")
        tensors: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        for name, value in sd.items():
            if not isinstance(value, torch.Tensor):
                skipped.append(f"model.{name}")
                continue
            clean = strip_prefixes(name)
            if clean in tensors:
                raise ValueError(f"{src}: keys {name!r} and another both become {clean!r} once prefixes are removed")
            tensors[clean] = value
        state: dict[str, Any] = {"model": tensors}
        for k, v in rest.items():
            v = _count_of(v)
            if isinstance(k, str) and k and "." not in k and not k.startswith("_") and k != "model" and values.is_plain(v):
                state[k] = v
            else:
                skipped.append(str(k))
        if step is None:  # the first of these that is a count (a flag "step": True is none)
            counts = [_count_of(rest.get(k)) for k in ("step", "global_step", "epoch")]
            step = next((int(c) for c in counts if isinstance(c, int) and not isinstance(c, bool) and c >= 0), 0)
        ckpt = Checkpointer(out_root, storage_options=opts, save_rng=False)
        try:
            ckpt.save(step, state, metadata={"imported_from": os.path.basename(src.rstrip("/"))})
        finally:
            ckpt.close()
    out = Storage(out_root, opts)
    return {
        "output": out.display(step_dir(step)),
        "step": step,
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "values": sorted(k for k in state if k != "model"),
        "skipped": skipped,
    }


@contextmanager
def _local_copy(src: str, storage_options: Mapping[str, object]) -> Iterator[str]:
    """A local path of ``src``: itself, or a temporary download of a URL."""
    path = local_path(src)
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist or is not a file")
        yield path
        return
    fs, path = url_to_fs(src, **dict(storage_options))
    with tempfile.TemporaryDirectory(prefix="distckpt-import-") as tmp:
        local = os.path.join(tmp, os.path.basename(path) or "checkpoint.pt")
        fs.get_file(path, local)
        yield local


# What torch's legacy format starts with: its magic number, pickled (protocol 2).
_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)


def _is_tar(f: Any) -> bool:
    """Whether ``f`` starts like a tar archive (torch's format before 0.4): the ``ustar`` magic
    of its first header. (``tarfile.is_tarfile`` also says yes to a file of zeros: an empty
    archive to it, a damaged copy to a user.)"""
    f.seek(257)
    try:
        return f.read(5) == b"ustar"
    finally:
        f.seek(0)


def _count_of(value: object) -> object:
    """A 0-d integer tensor (a step counter kept as ``torch.tensor(7)``) as its int: it was
    skipped, and the step taken from ``epoch``; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (value.is_floating_point() or value.is_complex()):
        if value.dtype != torch.bool and not value.is_quantized:
            return int(value.item())
    return value


def _refuse_unreadable(path: str, where: str) -> None:
    """Refuse, naming them, a file whose pickles need globals ``weights_only=True`` does not
    read (torch's own message was cut to a line that said "two options" and showed none, in
    terminal colour codes). NumPy values are among them, on purpose: NumPy trusts whatever
    array or dtype state a pickle gives it (a forged structured dtype writes out of bounds,
    an array's shape allocates without bound), so a file from anywhere is not read with them."""
    needed = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    if not needed:
        return
    shown = ", ".join(needed[:5]) + (" ..." if len(needed) > 5 else "")
    if all(g.startswith("numpy.") for g in needed):
        raise ValueError(
            f"cannot import {where}: it holds NumPy values ({shown}), which distckpt does not unpickle from a file "
            "(NumPy trusts any array or dtype state a pickle gives it); if you trust the file, re-save it with "
            "them as Python values or tensors (v.tolist(), torch.from_numpy(v)), then import that"
        )
    raise ValueError(
        f"cannot import {where}: it holds objects that are read only by running code they name ({shown}); "
        "distckpt reads tensors and plain values: if you trust the file, re-save it without the others"
    )


def _torch_load(path: str, where: str) -> object:
    """``torch.load(weights_only=True, mmap=True)`` of a file that may come from anywhere: its
    pickles first checked for work bombs (hash or copy amplification), then unpickled on a
    stack deep enough for their nesting (:mod:`distckpt.integrity.deep_stack`)."""
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
        if head[:4] != b"PK\x03\x04":  # (torch's own error here is about mmap)
            if head.startswith(_LEGACY_MAGIC) or _is_tar(f):
                # torch.load reads it, but without mmap, and its pickles follow one another with
                # nothing saying where each starts or how much the storages they declare hold: the
                # checks every other file gets (work bombs, allocations beyond the file's size) do
                # not apply. Such files come from torch before 1.6 (2020); re-saving one is a line.
                raise ValueError(
                    f"{where} is in torch's legacy format (torch.save before torch 1.6, or _use_new_zipfile_serialization=False), "
                    "which distckpt does not import: re-save it under a current torch, if you trust it: "
                    "torch.save(torch.load(OLD, weights_only=True), NEW), then import NEW"
                )
                f.seek(0)
            hint = pointer_hint(f.read(POINTER_MAX_BYTES + 1))
            if hint is not None:  # its step is a DCP checkpoint already: nothing to import
                raise ValueError(f"{where} is not a torch.save file but {hint} (a distckpt step, readable as it is)")
            raise ValueError(f"{where} is not a torch.save file: not a zip archive as torch.save writes (a text file? a damaged copy?)")
        bound = deep_stack.refuse_record_work_bombs(f, None, where)
        if bound is None:
            bound = deep_stack.record_nesting_bound(f)
    _refuse_unreadable(path, where)
    return deep_stack.call_with_stack(bound, lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True))
