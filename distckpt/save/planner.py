"""DCP's save planner for distckpt: its local plan lists only what this rank writes.

The assignment is :mod:`distckpt.save.assign`'s; the planner also takes, as the writer threads
take each tensor, the fingerprint parts and replica digests of what it writes and the staging
digest of what it serializes (``verify_staging``). Each rank's own object; not collective.
"""

from __future__ import annotations

import io
import struct
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
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
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


#: Distinct plain values whose records one save keeps for reuse (each ~1.3 KB).
_RECORDS_KEPT = 4096
_PLAIN_SCALARS = (type(None), bool, int, str, bytes)
_PLAIN_LENGTH = 64  # longest tuple or list, string or bytes, and digits of an int taken
_PLAIN_INT = 10**_PLAIN_LENGTH


def plain_key(value: Any, depth: int = 0) -> tuple[Any, ...] | None:
    """A key that is equal for two values exactly when ``torch.save`` stores the same value for
    both, for plain values only: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` (exact
    types: not subclasses such as ``IntEnum`` or NumPy scalars, whose records differ), tuples of
    them (nested at most twice) and a list of them at the top; short ones. ``None`` for anything
    else. Types are part of the key (``1``, ``1.0`` and ``True`` are equal in Python, not on
    disk), and floats are keyed by their bits (``0.0`` and ``-0.0`` are equal, NaNs never equal
    themselves and carry payloads). Only immutable values sit inside a container: a list holding
    one object twice loads as a list holding one object twice, which an equal list of two
    distinct objects does not."""
    kind = type(value)
    if kind is float:
        return (float, struct.pack("<d", value))
    if kind in _PLAIN_SCALARS:
        if kind is int and not -_PLAIN_INT < value < _PLAIN_INT:
            return None
        if kind in (str, bytes) and len(value) > _PLAIN_LENGTH:
            return None
        return (kind, value)
    if (kind is tuple and depth < 2 or kind is list and depth == 0) and len(value) <= _PLAIN_LENGTH:
        parts = []
        for v in value:
            k = plain_key(v, depth + 1) if type(v) is not list else None
            if k is None:
                return None
            parts.append(k)
        return (kind, *parts)
    return None


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
        self._records: dict[tuple[Any, ...], bytes] = {}  # see transform_object

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """(writer threads) DCP's record of a non-tensor item (``torch.save`` of it into a
        ``BytesIO``), made once per save for equal plain values (:func:`plain_key`) and reused:
        an optimizer's hyper-parameters are flattened per parameter
        (``optim.param_groups.<fqn>.lr``, ...), thousands of equal floats, tuples and flags for
        a model with hundreds of parameters, and each ``torch.save`` costs ~0.1 ms of a writer
        thread's time holding the GIL (benchmarks/README.md). The bytes are the ones DCP's own
        ``transform_object`` makes for the first of them."""
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        key = plain_key(object)
        if key is None:
            return super().transform_object(write_item, object)
        stored = self._records.get(key)
        if stored is None:
            stored = super().transform_object(write_item, object).getvalue()
            if len(self._records) < _RECORDS_KEPT:
                self._records[key] = stored  # one dict store: safe beside other writer threads
        return io.BytesIO(stored)

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
