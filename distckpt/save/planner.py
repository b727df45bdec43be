"""DCP's save planner for distckpt: its local plan lists only what this rank writes.

The assignment is :mod:`distckpt.save.assign`'s; the planner also takes, as the writer threads
take each tensor, the fingerprint parts and replica digests of what it writes and the staging
digest of what it serializes (``verify_staging``). Each rank's own object; not collective.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from distckpt.state import fingerprint, statecheck
from distckpt.save.staging import staging_digest
from distckpt.save.assign import PlanInput
from distckpt.state.placements import writes_dtensor
from distckpt.save.metadata import apply_delta, build_global, encode_plan


# The planner (DCP's SavePlanner interface) and the wire form of plans
class DistckptSavePlanner(DefaultSavePlanner):
    """DCP save planner whose local plan lists only what this rank writes (see module docstring).

    Usable with ``dcp.save`` too (``create_global_plan`` then runs :func:`build_global`);
    distckpt drives it through :class:`SaveRun`.
    """

    def __init__(self, plan: PlanInput) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.plan_input = plan
        # Fingerprint parts of the blocks this rank writes, computed by the writer threads as
        # they take each tensor (in parallel, and while its memory is about to be read anyway);
        # None: not collected.
        self.fingerprints: list[Any] | None = None
        # Replica digests (statecheck.copy_digest) of the compared keys among what this rank
        # writes, key -> digest; None: not collected. ``on_device``: keys whose copies were taken
        # from accelerator tensors.
        self.copies: dict[str, Any] | None = None
        self.compared: frozenset[str] = frozenset()
        self.on_device: frozenset[str] = frozenset()
        self._fingerprints_lock = threading.Lock()
        # verify_staging: key -> staging digest of the live tensor at the save call (set by the
        # write phase), and key -> the digest of the tensor serialized for it (see :meth:`serializing`).
        self.staging_expected: Mapping[str, int] = {}
        self.staging_seen: dict[str, int] = {}

    def serializing(self, write_item: Any, tensor: torch.Tensor) -> None:
        """(writer threads) ``tensor`` is about to be serialized for ``write_item``, exactly as
        written: take its staging digest where the save verifies staging (see
        :func:`distckpt.save.phases.check_staging`)."""
        key = write_item.index.fqn
        if key in self.staging_expected:
            value = staging_digest(tensor)
            with self._fingerprints_lock:
                self.staging_seen[key] = int(value)

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        td = write_item.tensor_data
        if self.fingerprints is not None and td is not None and isinstance(data, torch.Tensor):
            chunk = td.chunk
            key = write_item.index.fqn
            part = fingerprint.part_of(key, data, chunk.offsets, td.size)
            copy = None
            if self.copies is not None and key in self.compared:
                copy = statecheck.copy_digest(data, chunk.offsets, key in self.on_device)
            with self._fingerprints_lock:
                if part is not None:
                    self.fingerprints.append(part)
                if copy is not None:
                    self.copies[key] = copy
        return data

    def create_local_plan(self) -> SavePlan:
        writers, rank = self.plan_input.writers, self.plan_input.rank
        kept: dict[str, Any] = {}
        for key, value in self.state_dict.items():
            if isinstance(value, DTensor):
                if not writes_dtensor(value, key):
                    continue
            else:
                writer = writers.get(key)
                if writer is not None and writer != rank:
                    continue
            kept[key] = value
        plan = create_default_local_save_plan(kept, self.is_coordinator)
        mappings = self.mappings
        plan = SavePlan(plan.items, planner_data={k: mappings[k] for k in kept if k in mappings})
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        deltas, metadata = build_global([encode_plan(p) for p in all_plans])
        plans = [apply_delta(p, d) for p, d in zip(all_plans, deltas)]
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan
