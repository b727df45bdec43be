"""A module's state dict under DCP's world-size independent keys, with the key mapping cached.

:func:`state_dict` returns exactly what torch's ``get_model_state_dict(module)`` returns (the
same keys, in the same order, the same tensors), and :func:`load` does what
``set_model_state_dict(module, sd, options=StateDictOptions(strict=False))`` does. torch's helpers
recompute every key's FQN on every call by walking the module tree from the root for each key
(``_verify_options`` and ``_get_fqns``: about 1,000 walks for a 200-tensor model, a cost paid on
every save and load; measured: benchmarks/README.md), although the mapping depends only on the
module tree's names and wrapper types. Here it is computed once (with torch's own rule,
:func:`distckpt._compat.model_key_fqns`) and reused while the module tree keeps the same names
and types; any change recomputes it.

Modules wrapped in FSDP1 (``FullyShardedDataParallel``), whose state dicts need torch's
state-dict-type context, go through torch's helpers unchanged.

Not collective: any rank, any time.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from distckpt._compat import model_key_fqns

# module -> (its structure, raw state-dict key -> FQN)
_cache: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict[str, str]]] = weakref.WeakKeyDictionary()


def _structure(module: nn.Module) -> tuple:
    """What the key mapping depends on: every submodule's path and type."""
    return tuple((name, type(m)) for name, m in module.named_modules(remove_duplicate=False))


def _uses_fsdp1(structure: tuple) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return any(issubclass(t, FullyShardedDataParallel) for _, t in structure)


def state_dict(module: nn.Module) -> tuple[dict[str, Any], dict[str, str] | None]:
    """``get_model_state_dict(module)``, and FQN -> the module's own state-dict key (for
    :func:`load`; ``None`` where torch's helpers were used)."""
    structure = _structure(module)
    if _uses_fsdp1(structure):
        return get_model_state_dict(module), None
    cached = _cache.get(module)
    if cached is None or cached[0] != structure:
        cached = (structure, {})
        _cache[module] = cached
    fqns = cached[1]
    with torch.no_grad():
        sd = module.state_dict()
    if not sd:
        return get_model_state_dict(module), None  # torch's error for a module without state
    raw_of: dict[str, str] = {}
    for key in list(sd):
        fqn = fqns.get(key)
        if fqn is None:
            fqn = fqns[key] = model_key_fqns(module, key)
        raw_of[fqn] = key
        if fqn != key:
            sd[fqn] = sd.pop(key)  # torch's order: renamed keys move to the end
    return sd, raw_of


def load(module: nn.Module, loaded: Mapping[str, Any], raw_of: Mapping[str, str] | None) -> None:
    """``set_model_state_dict(module, loaded, strict=False)``: ``loaded`` keyed by FQN, with
    ``raw_of`` from the :func:`state_dict` call that produced the load's targets."""
    if raw_of is None:
        set_model_state_dict(module, dict(loaded), options=StateDictOptions(strict=False))
        return
    with torch.no_grad():
        sd = OrderedDict((raw_of.get(k, k), v) for k, v in loaded.items())
        # The modules' versions, as a state_dict carries them: without them each module takes the
        # dict for its oldest format (torch.ao's quantized Linear then looked for 'weight' and
        # raised a bare KeyError: a quantized model saved, and never loaded).
        sd._metadata = getattr(module.state_dict(), "_metadata", OrderedDict())  # type: ignore[attr-defined]
        module.load_state_dict(sd, strict=False)
