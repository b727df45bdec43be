"""Global and per-rank state: what is stored once, and what is stored once per rank.

DCP writes each key once: when ranks hold *different* values under the same key, one rank's
copy is kept (even a mix of two ranks' fields, one field from each). distckpt therefore gives
every entry of ``state`` that is not a module or an optimizer (those are replicated or sharded
by construction) a *scope*, decided at save time:

* ``global``: identical on every rank, stored once (e.g. the step, an LR scheduler,
  :class:`~distckpt.GlobalBatchSampler`);
* ``per_rank``: differs on some rank, stored once per rank under ``NAME.rank_<r>`` (e.g.
  torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``, a per-rank counter).

How the scope is decided, first rule that applies:

1. declared by the user: ``state["x"] = distckpt.PerRank(obj)`` or ``distckpt.Global(obj)``;
   a ``Global`` entry that differs between ranks is an error naming the ranks;
2. declared by the object's class: a class attribute ``distckpt_scope = "global"`` or
   ``"per_rank"`` (``GlobalBatchSampler`` declares ``global``);
3. built-in kinds: torchdata's ``StatefulDataLoader`` and ``torch.utils.data.DistributedSampler``
   are ``per_rank`` (their position describes this rank's own slice of the data);
4. otherwise detected: every rank digests what it would save and the digests are exchanged on
   distckpt's group; an entry whose digest differs on any rank is ``per_rank``.

Loading at the same world size gives every rank its own state back. At another world size a
per-rank entry cannot be resharded: ``load(strict=True)`` raises
:class:`~distckpt.StateMismatchError` naming the entry and both world sizes; ``strict=False``
skips it and lists it in ``Checkpointer.last_load_report.skipped``.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from distckpt.state.fingerprint import of_tensor, supported

GLOBAL = "global"
PER_RANK = "per_rank"
SCOPES = (GLOBAL, PER_RANK)
_PER_RANK_KINDS = {
    ("torchdata.stateful_dataloader.stateful_dataloader", "StatefulDataLoader"),
    ("torch.utils.data.distributed", "DistributedSampler"),
}


class Declared:
    """The wrapper a declared scope comes in (:class:`PerRank`, :class:`Global`): ``obj`` is
    the user's object, whatever it is."""

    __slots__ = ("obj",)
    scope = ""

    def __init__(self, obj: Any) -> None:
        if isinstance(obj, Declared):
            raise TypeError(f"{type(self).__name__}({type(obj).__name__}(...)): declare the scope once")
        self.obj = obj

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.obj!r})"


class PerRank(Declared):
    """Declare an entry of ``state`` as per-rank: stored once per rank, loaded back by each rank.

    ``state["loader"] = distckpt.PerRank(loader)``. A plain value inside is replaced in the
    wrapper (``.obj``) on load; objects with ``load_state_dict`` load in place. Any rank may build
    one (not collective).
    """

    scope = PER_RANK


class Global(Declared):
    """Declare an entry of ``state`` as global: it must be identical on every rank (stored once).

    A save where it differs between ranks fails on every rank, naming the entry and the ranks
    on each side. Any rank may build one (not collective).
    """

    scope = GLOBAL


def unwrap(obj: Any) -> tuple[Any, str | None, Declared | None]:
    """``(object, declared scope or None, the wrapper or None)`` of a ``state`` value."""
    if isinstance(obj, Declared):
        return obj.obj, obj.scope, obj
    declared = getattr(type(obj), "distckpt_scope", None)
    if declared is not None:
        if declared not in SCOPES:
            raise ValueError(f"{type(obj).__name__}.distckpt_scope must be one of {SCOPES}, got {declared!r}")
        return obj, declared, None
    for cls in type(obj).__mro__:
        if (cls.__module__, cls.__name__) in _PER_RANK_KINDS:
            return obj, PER_RANK, None
    return obj, None, None


#: Key sets of a per-rank kind's state (torchdata's ``StatefulDataLoader``, without workers and
#: with): a state holding one is per rank, whatever object holds it.
_PER_RANK_STATES = (
    frozenset({"_num_yielded", "_sampler_iter_state"}),
    frozenset({"_snapshot", "_steps_since_snapshot"}),
)
_LOOK_DEPTH = 8
_LOOK_NODES = 4096


def holds_per_rank_state(value: object) -> bool:
    """Whether a state value (what an entry's ``state_dict()`` returned) holds a per-rank kind's
    state, nested in a user's object (``{"epoch": 3, "loader": loader.state_dict()}``): a loader
    over a ``DistributedSampler`` keeps counts only, equal on every rank, so its state looked
    global, was stored once, and a resume at another world size gave every rank that one
    position (samples skipped, silently). Bounded: breadth first (a long history beside the
    loader's state must not hide it), at most :data:`_LOOK_NODES` containers looked at."""
    budget = _LOOK_NODES
    todo: collections.deque[tuple[object, int]] = collections.deque([(value, 0)])
    while todo and budget > 0:
        node, depth = todo.popleft()
        budget -= 1
        if isinstance(node, Mapping):
            if any(all(k in node for k in sig) for sig in _PER_RANK_STATES):
                return True
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth < _LOOK_DEPTH:
            for child in itertools.islice(children, budget):
                if isinstance(child, (Mapping, list, tuple)):
                    todo.append((child, depth + 1))
    return False


def digest(value: object) -> str:
    """A digest of a state value (nested containers, tensors, plain values) that is equal on two
    ranks exactly when their values are equal (tensors compared by dtype, shape and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value)
    return h.hexdigest()


def _feed(h: hashlib.blake2b, value: object) -> None:
    if isinstance(value, torch.Tensor):

        t = value.detach()
        if supported(t):
            h.update(b"T" + f"{t.dtype}{tuple(t.shape)}".encode() + of_tensor(t.cpu() if t.device.type != "cpu" else t).encode())
        else:  # sparse, quantized ...: compare what they print as (never equal by accident)
            h.update(b"t" + repr(t).encode())
    elif isinstance(value, Mapping):
        # Its type too (a Counter on one rank, a dict on another: equal, yet each loads back as
        # its own type): values that differ so are per rank, or one rank's type would be loaded
        # on every rank. Not an OrderedDict's order: one built from a set differs between ranks
        # (hash seeds), and would make the entry per rank, refused at another world size.
        h.update(b"{" + _type(value) + struct.pack("<Q", len(value)))
        for k in sorted(value, key=_text):
            h.update(_text(k).encode() + b":")
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update((b"[" if isinstance(value, list) else b"(") + _type(value) + struct.pack("<Q", len(value)))
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(value, float):
        h.update(b"f" + _type(value) + struct.pack("<d", value))
    else:
        h.update(_type(value) + b"=" + _text(value).encode())


def _type(value: object) -> bytes:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}".encode()


def _text(value: object) -> str:
    """``repr(value)``, for ints in hex: the decimal text of an int of more than 4300 digits is
    refused by Python (``sys.set_int_max_str_digits``), and the save failed with it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{type(value).__name__}:{value:#x}"
    return repr(value)


def classify(name: str, declared: str | None, digests: Sequence[str]) -> str:
    """(every rank, identical result) The scope of entry ``name`` from every rank's digest.

    Raises:
        ValueError: ``name`` was declared global but its value differs between ranks.
    """
    if declared == PER_RANK:
        return PER_RANK
    if len(set(digests)) <= 1:
        return GLOBAL
    if declared == GLOBAL:
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        sides = " vs ".join(str(ranks) for ranks in sorted(groups.values()))
        raise ValueError(
            f"state[{name!r}] is declared distckpt.Global but differs between ranks: ranks {sides} "
            "hold different values (declare it distckpt.PerRank if each rank has its own)"
        )
    return PER_RANK


def rank_key(rank: int) -> str:
    """The key a per-rank entry's state is stored under, inside the entry."""
    return f"rank_{rank}"
