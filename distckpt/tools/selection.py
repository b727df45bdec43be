"""What an export of a checkpoint writes: which stored tensors, under which names, in which dtype.

* :func:`select_tensors`: the tensors of one model (the checkpoint's single module entry), of one
  key prefix, or all of them; distckpt's own entries (RNG states) are never exported.
* :func:`cast_dtype`: the dtype a tensor is written in when an export (or a publish) casts.

Not collective.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from distckpt.errors import IntegrityError
from distckpt.integrations.lightning_layout import read_layout
from distckpt.integrity.shards import CheckpointSource
from distckpt.integrity.stepfiles import StepFiles

INTERNAL = ("_rng",)  # distckpt's own namespaces: never exported


class SelectionError(ValueError):
    """The requested part of the checkpoint (``key``/model-only) does not exist or is ambiguous."""



def _model_names(found: StepFiles, source: CheckpointSource) -> list[str]:
    entries = found.manifest.entries if found.manifest is not None else {}
    modules = sorted(n for n, e in entries.items() if e.get("kind") == "module")
    if modules:
        return modules
    # Imported checkpoints hold the model as a dict of tensors ("tree" entry).
    trees = sorted(n for n, e in entries.items() if e.get("kind") == "tree")
    if "state_dict" in trees and lightning_step(found):
        # A step of the Lightning plugin: its trees are Lightning's checkpoint dict (the
        # optimizer states, callbacks ... beside it); the model is its "state_dict".
        return ["state_dict"]
    return trees


def lightning_step(found: StepFiles) -> bool:
    """Whether ``found`` was saved by Lightning's ``DistckptCheckpointIO``: its manifest holds
    that plugin's layout (not merely a ``"lightning"`` key a user's metadata may hold) whose
    top-level keys include ``state_dict``."""
    try:
        keys, _ = read_layout(found.manifest.extra if found.manifest is not None else {}, found.display())
    except IntegrityError:
        return False
    return "state_dict" in keys


def select_tensors(
    found: StepFiles, source: CheckpointSource, *, model_only: bool, key: str | None
) -> list[tuple[str, str]]:
    """``(output name, checkpoint key)`` of the tensors to export, in checkpoint order.

    ``key`` picks the tensors under one prefix (names relative to it); ``model_only`` picks the
    single model (module entry) of the checkpoint. Otherwise every tensor under its full key.

    The selection is announced to ``source`` (:meth:`CheckpointSource.expect`): each data file
    is then checked whole as soon as the last selected tensor it holds has been read.

    Raises:
        SelectionError: no tensor under ``key``, or no / several models for ``model_only``.
    """
    picked = _select(found, source, model_only=model_only, key=key)
    source.expect([k for _, k in picked])  # each file is checked once the last of these it holds is read
    return picked


def _select(found: StepFiles, source: CheckpointSource, *, model_only: bool, key: str | None) -> list[tuple[str, str]]:
    keys = [k for k in source.tensors if k.split(".", 1)[0] not in INTERNAL]
    prefix = key
    if prefix is None and model_only:
        names = _model_names(found, source)
        if len(names) != 1:
            tops = sorted({k.split(".", 1)[0] for k in keys})
            if not names:
                raise SelectionError(f"{found.display()} records no model; pick tensors with --key PREFIX (top-level names: {', '.join(tops)})")
            raise SelectionError(
                f"{found.display()} holds several models or dicts of tensors ({', '.join(names)}); pick one with --key NAME"
            )
        prefix = names[0]
    if prefix is None:
        return [(k, k) for k in keys]
    prefix = prefix.rstrip(".")
    picked = [(k[len(prefix) + 1:], k) for k in keys if k.startswith(prefix + ".")]
    if prefix in source.tensors:  # --key naming a single tensor
        picked = [(prefix.rsplit(".", 1)[-1], prefix)]
    if not picked:
        tops = sorted({k.split(".", 1)[0] for k in keys})
        raise SelectionError(f"no tensor under key prefix {prefix!r} in {found.display()} (top-level names: {', '.join(tops)})")
    return picked


def cast_dtype(key: str, stored: torch.dtype, dtype: torch.dtype | None, shape: Sequence[int] | None = None) -> torch.dtype:
    """The dtype tensor ``key`` (stored as ``stored``, of ``shape`` where known) is written in
    when exports cast to ``dtype``: floating-point tensors take ``dtype``, others (and packed
    ones such as ``float4_e2m1fn_x2``, which have no cast) keep theirs, as does an optimizer's
    step counter (a 0-d tensor named ``...step``: bf16 rounds 70001 to 70144).

    Raises:
        TypeError: ``dtype`` is not a torch dtype, or a floating-point tensor would be cast to a
            non-floating dtype (``torch.int8``, ``torch.bool``: its values truncated), naming
            the key and both dtypes.
    """
    if dtype is None:
        return stored
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if shape is not None and not len(shape) and key.rpartition(".")[2] == "step":
        return stored
    if not stored.is_floating_point or not _casts(stored, torch.float32):
        return stored  # (a packed dtype, float4_e2m1fn_x2: two values a byte, no cast defined)
    if not dtype.is_floating_point or not _casts(stored, dtype):
        raise TypeError(
            f"tensor {key!r} is {stored}; casting it to {dtype} would truncate its values or is not defined "
            "(dtype= casts floating-point tensors and takes a floating-point dtype, e.g. torch.bfloat16)"
        )
    return dtype


@functools.lru_cache(maxsize=None)
def _casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether torch can copy ``src`` values into a ``dst`` tensor (one element, on the CPU)."""
    try:
        torch.zeros(src.itemsize, dtype=torch.uint8).view(src).to(dst)
    except (RuntimeError, TypeError):
        return False
    return True

