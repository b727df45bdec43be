"""``ZeroRedundancyOptimizer`` (ZeRO-1) state, saved shard by shard and resharded on load.

ZeRO's own checkpoint path, ``consolidate_state_dict()``, gathers the whole optimizer state on one
rank, and handing the wrapper to ``get_optimizer_state_dict`` runs a real ``step()`` (its wrapper
state is empty). Instead every rank saves the state of the parameters *it owns* from ZeRO's local
optimizer (``zero.optim``), keyed by parameter FQN in DCP's flat optimizer format — the same keys
a plain or FSDP2 optimizer produces — so the checkpoint is interchangeable with those and does not
depend on the world size. On load each rank asks DCP only for the entries of its new partition.

Nothing here calls ``consolidate_state_dict`` or moves state between ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from distckpt.state.entries import (
    _FLAT_OPTIM,
    ModuleEntry,
    OptimizerEntry,
    check_param_groups,
    flat_param_groups,
    _TARGET_STATE,
    load_flat_param_groups,
    made_by_target,
    target_state_dict,
    unread_params,
)

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

#: The module defining ``ZeroRedundancyOptimizer``. Not imported here: ``torch.distributed.optim``
#: scripts its functional optimizers at import, a third of a second of every process that imports
#: distckpt (each background writer too); an instance exists only once a user imported it.
ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def is_zero(obj: object) -> bool:
    """Whether ``obj`` is a ``ZeroRedundancyOptimizer`` (without importing its module)."""
    module = sys.modules.get(ZERO_MODULE)
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)


class ZeroOptimizerEntry(OptimizerEntry):
    """A ``ZeroRedundancyOptimizer``: each rank saves and loads only its own partition.

    Described as the optimizer it wraps (``optim``: ZeRO's local optimizer), with
    ``"parallel": "zero"``.
    """

    def __init__(self, name: str, zero: ZeroRedundancyOptimizer, module: ModuleEntry) -> None:
        super().__init__(name, zero.optim, module)
        self.zero = zero

    @property
    def facing(self) -> ZeroRedundancyOptimizer:
        """The ``ZeroRedundancyOptimizer`` itself (its groups hold every parameter, in the user's
        order; the local optimizer's, this rank's partition, largest first)."""
        return self.zero

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "parallel": "zero"}

    def _sync_wrapper_to_local(self) -> None:
        # ZeRO copies the wrapper's hyper-parameters (where LR schedulers write) into the local
        # optimizer at every step (its private _sync_param_groups); do the same so the saved
        # groups are current. The wrapper and the local optimizer have one group per group.
        wrapper, local = self.zero.param_groups, self.zero.optim.param_groups
        if len(wrapper) != len(local):
            raise RuntimeError(
                f"ZeroRedundancyOptimizer has {len(wrapper)} parameter groups but its local "
                f"optimizer {len(local)}; cannot tell which hyper-parameters belong where"
            )
        for src, dst in zip(wrapper, local):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    def save_state(self) -> dict[str, Any]:
        self._sync_wrapper_to_local()
        local = self.zero.optim
        if not local.state:
            return flat_param_groups(local, self.module.param_fqns())
        return get_optimizer_state_dict(self.module.module, local, options=_FLAT_OPTIM)

    def load_target(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        # The wrapper's hyper-parameters first, as ZeRO's step would copy them: a fresh LR
        # scheduler sets them on the wrapper only (OneCycleLR's momentum), and the local
        # optimizer's zero-gradient step made no momentum buffers for a save that holds them.
        self._sync_wrapper_to_local()
        fqns = self.module.param_fqns()
        # Hyper-parameters of *all* parameters (small values) so that every rank restores the
        # wrapper's groups identically, also for groups with no parameter on this rank.
        target = flat_param_groups(self.zero, fqns)
        if saved.get("initialized", True) and self.zero.optim.param_groups and any(
            g["params"] for g in self.zero.optim.param_groups
        ):
            target.update(target_state_dict(self.module.module, self.zero.optim, fqns, self.held))  # (gradients set aside)
        self.made = made_by_target(self.zero.optim, fqns)
        return target

    def left_alone(self) -> None:
        if self.made:  # (the zero-gradient step's state of the load target)
            self.drop_named(self.zero.optim, self.made)
            self._sync_wrapper_to_local()
        _TARGET_STATE.pop(self.zero.optim, None)

    def check(self, loaded: Any) -> None:
        # The wrapper's groups (every parameter's), not the local optimizer's partition.
        check_param_groups(self.zero, self.module.param_fqns(), loaded, self.name, self.read)

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        fqns = self.module.param_fqns()
        self.check(loaded)
        _TARGET_STATE.pop(self.zero.optim, None)
        load_flat_param_groups(self.zero, fqns, loaded)
        # Per-parameter state of this rank's partition, set directly: DCP's unflattening
        # helper cannot handle the empty param groups a ZeRO partition may have.
        per_param: dict[str, dict[str, Any]] = {}
        # (a fresh optimizer's target state of parameters the load read nothing for is the
        # zero-gradient step's: they get none, as OptimizerEntry.apply)
        unread = unread_params(loaded, self.read) & self.made
        for key, value in loaded.items():
            if key.startswith("state."):
                fqn, name = key[len("state.") :].rsplit(".", 1)
                if fqn not in unread:
                    per_param.setdefault(fqn, {})[name] = value
        local = self.zero.optim
        local.state.clear()
        for group in local.param_groups:
            for p in group["params"]:
                if fqns[id(p)] in per_param:
                    local.state[p] = per_param[fqns[id(p)]]
        self._sync_wrapper_to_local()
