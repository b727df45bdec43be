"""The entries of a state: which kind of object each item of ``state`` is, and who owns what.

:func:`build_entries` classifies every item of the mapping a user passes to ``save``/``load``
(modules first, so that optimizers find the module owning their parameters) into the entry kinds
of :mod:`distckpt.state.entries` and :mod:`distckpt.state.zero`. Pure and local: no collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distckpt.state.entries import (
    Entry,
    ModuleEntry,
    OptimizerEntry,
    StatefulEntry,
    TensorEntry,
    TreeEntry,
    ValueEntry,
    contains,
    optimizer_params,
)
from distckpt.state.scope import Declared, unwrap
from distckpt.state.zero import ZeroOptimizerEntry, is_zero

RESERVED_PREFIX = "_"


def build_entries(state: Mapping[str, Any]) -> list[Entry]:
    """Classify every item of ``state``; ``TypeError``/``ValueError`` naming the key on bad input.

    Modules come first so that optimizers can find the module that owns their parameters.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to objects, got {type(state).__name__}")
    modules: list[ModuleEntry] = []
    others: list[tuple[str, Any]] = []
    declared: dict[str, tuple[str | None, Declared | None]] = {}
    for name, obj in state.items():
        if not isinstance(name, str) or not name or "." in name or name.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"state key {name!r} is invalid: use non-empty strings without '.' that do not "
                f"start with {RESERVED_PREFIX!r} (reserved for distckpt)"
            )
        obj, scope, holder = unwrap(obj)
        declared[name] = (scope, holder)
        if isinstance(obj, nn.Module):
            if holder is not None:
                raise TypeError(f"state[{name!r}]: modules are replicated or sharded; they take no PerRank/Global")
            entry = ModuleEntry(name, obj)
            entry.settle()
            modules.append(entry)
        else:
            others.append((name, obj))

    entries: list[Entry] = list(modules)
    for name, obj in others:
        if isinstance(obj, torch.optim.Optimizer) and declared[name][1] is not None:
            raise TypeError(f"state[{name!r}]: optimizers follow their module; they take no PerRank/Global")
        if isinstance(obj, torch.optim.Optimizer):
            owner = _owner_of(name, obj, modules)
            if is_zero(obj):
                entries.append(ZeroOptimizerEntry(name, obj, owner))
            else:
                entries.append(OptimizerEntry(name, obj, owner))
        elif isinstance(obj, torch.Tensor):
            entries.append(TensorEntry(name, obj))
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            entries.append(StatefulEntry(name, obj))
        elif contains(obj):
            entries.append(TreeEntry(name, obj))
        else:  # a value that load could not read is refused by the save (encoded.encode_for_save)
            entries.append(ValueEntry(name, obj))
    for entry in entries:
        entry.declared, entry.holder = declared[entry.name]
    return entries


def _owner_of(name: str, optim: torch.optim.Optimizer, modules: list[ModuleEntry]) -> ModuleEntry:
    wanted = {id(p) for p in optimizer_params(optim)}
    owners = [m for m in modules if wanted and wanted <= m.param_ids()]
    if len(owners) == 1:
        return owners[0]
    if not owners:
        raise ValueError(
            f"optimizer state[{name!r}] optimizes parameters that no single module in state owns "
            f"(modules: {[m.name for m in modules] or 'none'}); put its model in the same state"
        )
    # Several candidates (e.g. a module and a sub-module both listed): take the smallest.
    return min(owners, key=lambda m: len(m.param_ids()))
