"""DCP's save planner for distckpt: its local plan lists only what this rank writes.

The assignment is :mod:`distckpt.save.assign`'s; the planner also takes, as the writer threads
take each tensor, the fingerprint parts and replica digests of what it writes and the staging
digest of what it serializes (``verify_staging``). Each rank's own object; not collective.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.tensor import DTensor

from distckpt.state import fingerprint, statecheck
from distckpt.save import d2h
from distckpt.save.staging import staging_digest
from distckpt.save.assign import PlanInput
from distckpt.state.placements import writes_dtensor
from distckpt.save.metadata import apply_delta, build_global, encode_plan


@dataclass(frozen=True)
class Observe:
    """What the writer threads take of each tensor as they write it (fixed before the write).

    Attributes:
        fingerprints: the fingerprint part of every block written (:func:`fingerprint.part_of`;
            an accelerator block's sum stays a device tensor until :func:`fingerprint.settled`).
        compared: keys whose copies the replica check compares: their replica digests
            (:func:`statecheck.copy_digest`); ``on_device``: those taken from accelerator tensors.
        staging: (``verify_staging``) key -> the staging digest of the live tensor at the save
            call; the digest of the tensor serialized for it is taken to compare.
    """

    fingerprints: bool = False
    compared: frozenset[str] = frozenset()
    on_device: frozenset[str] = frozenset()
    staging: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Observed:
    """What the writer threads took (see :class:`Observe`), filled while they write."""

    parts: list[fingerprint.Part] = field(default_factory=list)
    copies: dict[str, statecheck.Copy] = field(default_factory=dict)
    staging: dict[str, int] = field(default_factory=dict)


class DistckptSavePlanner(DefaultSavePlanner):
    """DCP save planner whose local plan lists only what this rank writes (see module docstring).

    Usable with ``dcp.save`` too (``create_global_plan`` then runs :func:`build_global`);
    distckpt drives it through :class:`~distckpt.save.protocol.SaveRun`. The writer threads hand
    it every item they take (:meth:`resolve_data`) and every tensor they serialize
    (:meth:`serializing`): what :meth:`watch` asked for is taken then, in parallel and while the
    memory is about to be read anyway, into :attr:`observed`.
    """

    def __init__(self, plan: PlanInput) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.plan_input = plan
        self.observe = Observe()
        self.observed = Observed()
        self._lock = threading.Lock()

    def watch(self, observe: Observe) -> None:
        """What the writer threads take of each tensor: set after planning (the plan settles
        which replicas are compared) and before writing."""
        self.observe = observe
        self.observed = Observed()

    def serializing(self, write_item: WriteItem, tensor: torch.Tensor) -> None:
        """(writer threads) ``tensor`` is about to be serialized for ``write_item``, exactly as
        written: take its staging digest where the save verifies staging (see
        :func:`distckpt.save.phases.check_staging`)."""
        key = write_item.index.fqn
        if key in self.observe.staging:
            # In calls of d2h.PROOF_CHUNK elements, as a sync save's copy proof: smaller calls
            # queue for the GIL behind the other writer threads after each one.
            value = int(staging_digest(tensor, d2h.PROOF_CHUNK))
            with self._lock:
                self.observed.staging[key] = value

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        td = write_item.tensor_data
        if self.observe.fingerprints and td is not None and isinstance(data, torch.Tensor):
            key = write_item.index.fqn
            # Lazy: an accelerator tensor's sums stay on its device until the write is done (see
            # distckpt.save.phases.write), so this writer thread does not wait for each one.
            part = fingerprint.part_of(key, data, td.chunk.offsets, td.size, lazy=True)
            copy = None
            if key in self.observe.compared:
                copy = statecheck.copy_digest(data, td.chunk.offsets, key in self.observe.on_device, lazy=True)
            with self._lock:
                if part is not None:
                    self.observed.parts.append(part)
                if copy is not None:
                    self.observed.copies[key] = copy
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
