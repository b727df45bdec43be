"""What a pickle's keys will hash to, known before it is unpickled: hash floods refused.

A dict or set stores each key at a slot chosen by its hash; keys whose hashes are equal (not
merely their slots) are compared one by one, so ``n`` distinct keys sharing one hash cost
``n**2 / 2`` comparisons to insert, in C, holding the GIL. Strings and bytes hash with a key
drawn per process (SipHash): nobody can choose them to collide. Numbers cannot hide theirs:
``hash(n)`` is ``n mod (2**61 - 1)`` (with ``hash(-1) == hash(-2)``), and a tuple's hash is a
public function of its members' hashes, so integers and tuples of integers are easily crafted
to collide: 400 KB of ``.metadata`` took 27 s, a few MB would take hours.

:mod:`distckpt.integrity.work_scan` therefore gives every immutable object on its stack a
*model hash* beside its weight: the real hash for numbers, strings, bytes and tuples of them
(computed in this process, so with this process's string hashes), and for what a call returned
the hash of the call (``torch.Size(t)`` exactly ``hash(t)``; ``complex`` one value for all, as
its hash mixes its two parts). It is *craftable* where a number is involved. Where a dict or set
gets keys, :class:`Collisions` counts the craftable ones per container and model hash and
charges each key the comparisons its insertion costs; equal keys count too (a pickle of a real
dict never repeats a key). A legitimate pickle's keys never collide, so it is charged nothing.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter

#: CPython's tuple hash (xxHash's lanes, ``Objects/tupleobject.c``), on 64-bit builds.
P1, P2, P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
MASK = (1 << 64) - 1
#: Hashes strictly inside (-KEPT, KEPT) are kept as they are when hashed again (except -1,
#: which no hash is).
KEPT = (1 << 61) - 1

#: One model hash for all values whose real hash this model does not compute (``complex``,
#: frozensets, protocol 0's text numbers): craftable, so they are counted as colliding.
WILD = 0x5D1C_C4E7_0000_0001

_EXACT = sys.hash_info.width == 64 and sys.implementation.name == "cpython"


def tuple_hash(hashes: tuple[int, ...] | list[int]) -> int:
    """``hash(t)`` for a tuple ``t`` whose members hash to ``hashes`` (any values a ``__hash__``
    can return), as CPython computes it: ``hash(tuple(hashes))`` where every member hash is kept
    when hashed again (numbers', always), this Python loop where one is not (a string's or a
    tuple's may be any 64-bit value)."""
    if not _EXACT:
        return hash(tuple(hashes))  # (another interpreter: equal members still hash equal)
    for h in hashes:
        if not -KEPT < h < KEPT or h == -1:
            break
    else:
        return hash(tuple(hashes))
    acc = P5
    for h in hashes:
        acc = (acc + (h & MASK) * P2) & MASK
        acc = ((acc << 31) | (acc >> 33)) & MASK
        acc = (acc * P1) & MASK
    acc = (acc + (len(hashes) ^ (P5 ^ 3527539))) & MASK
    if acc == MASK:
        return 1546275796
    return acc - (1 << 64) if acc >> 63 else acc


def global_hash(module: str, name: str) -> int:
    """The model hash of the object ``module.name``, as ``GLOBAL`` or ``STACK_GLOBAL`` names it
    (a class or function: hashed by identity, so never craftable; only equal names must hash
    equal)."""
    return hash((hash(module), hash(name)))


#: Calls whose result hashes as the one member of their arguments does (``torch.Size(dims)``).
SAME_HASH_CALLS = frozenset({global_hash("torch", "Size")})
#: Calls whose result's hash this model does not compute: their results are :data:`WILD`.
WILD_CALLS = frozenset({global_hash("builtins", "complex"), global_hash("__builtin__", "complex")})
#: Calls that hash what their argument holds into a new set or Counter (torch's ``weights_only``
#: allow-list admits ``set`` and ``Counter``; ``frozenset`` for pickles that admit it) ...
MEMBER_CALLS = frozenset(
    global_hash(m, n)
    for m, n in (
        ("builtins", "set"), ("__builtin__", "set"), ("builtins", "frozenset"), ("__builtin__", "frozenset"),
        ("collections", "Counter"),
    )
)  # fmt: skip
#: ... and the first members of the pairs it holds into a new dict (``OrderedDict(pairs)``).
PAIR_CALLS = frozenset(
    global_hash(m, n) for m, n in (("builtins", "dict"), ("__builtin__", "dict"), ("collections", "OrderedDict"))
)
HASHING_CALLS = MEMBER_CALLS | PAIR_CALLS


class Collisions:
    """Per dict or set (by identity: the walk's record of it), how many craftable keys of each
    model hash it was given, and what re-hashing its keys would cost (``pending``: a call such as
    ``OrderedDict(d)`` or a ``BUILD`` with it as state inserts them all again). Per list, the
    model hashes of the craftable items it was given (:meth:`remember`): nothing hashes them
    unless the list is handed to a call that does (``set(l)``), where they are counted."""

    __slots__ = ("seen", "pending", "alive", "items")

    def __init__(self) -> None:
        self.seen: dict[int, dict[int, int]] = {}
        self.pending: dict[int, int] = {}
        self.alive: dict[int, object] = {}  # (holds each container counted: its id is not reused meanwhile)
        self.items: dict[int, list] = {}  # a list's id: [its items' model hashes, its pairs' keys', heaviest weight]

    def add(self, target: object, keys: list) -> int:
        """Count ``keys`` (walk items) into the dict or set ``target``; return the comparisons
        their insertion costs (each key: the craftable keys of its model hash already there,
        times its weight)."""
        pairs = craftable_pairs(keys)
        if not pairs:
            return 0
        t = id(target)
        counts = self.seen.get(t)
        if counts is None:
            self.seen[t] = counts = {}
            self.alive[t] = target
        hashes = [h for h, _ in pairs]
        if len(set(hashes)) == len(hashes) and counts.keys().isdisjoint(hashes):
            counts.update(dict.fromkeys(hashes, 1))  # (no two alike: the common case, at C speed)
            return 0
        work = local_collisions(pairs, counts)
        if work:
            self.pending[t] = self.pending.get(t, 0) + work
        return work

    def of(self, target: object) -> int:
        """What re-hashing ``target``'s keys or members would cost (0 for most)."""
        return self.pending.get(id(target), 0) if self.pending else 0

    def remember(self, target: object, items: list) -> None:
        """``items`` appended to the list ``target``: the model hashes of the craftable ones, and
        of the craftable first members of pairs (``OrderedDict(pairs)`` hashes those), 8 bytes
        each, with the heaviest weight among them."""
        members = craftable_pairs(items)
        keys = pair_keys(items)
        if not members and not keys:
            return
        held = self.items.get(id(target))
        if held is None:
            self.items[id(target)] = held = [array("q"), array("q"), 0]
            self.alive[id(target)] = target
        held[0].extend([h for h, _ in members])
        held[1].extend([h for h, _ in keys])
        held[2] = max(held[2], max(w for _, w in members + keys))

    def remembered(self, target: object, pairs: bool) -> int:
        """The comparisons inserting what the list ``target`` was given would cost (0 if it is
        no list): its items, or (``pairs``) the first members of its pairs."""
        held = self.items.get(id(target)) if self.items else None
        if not held:
            return 0
        return held[2] * sum(c * (c - 1) // 2 for c in Counter(held[1 if pairs else 0]).values() if c > 1)


def craftable_pairs(items: list) -> list[tuple[int, int]]:
    """``(model hash, weight)`` of the walk items a pickle can choose the hash of (numbers in them)."""
    try:  # (all immutable, the common case: one comprehension)
        return [(x[1], x[0]) for x in items if x[2]]
    except (IndexError, TypeError):
        pass
    out = []
    for x in items:
        if x.__class__ is tuple:
            if x[2]:
                out.append((x[1], x[0]))
        elif getattr(x, "cr", False):  # what a call returned (the walk's _Called)
            out.append((x.h, x[0]))  # type: ignore[attr-defined,index]
    return out


def pair_keys(items: list) -> list[tuple[int, int]]:
    """:func:`craftable_pairs` of the first members of the tuples among ``items`` (the keys
    ``OrderedDict(pairs)`` or ``__dict__.update(pairs)`` inserts)."""
    return craftable_pairs([x[4] for x in items if x.__class__ is tuple and x[4] is not None])


def local_collisions(pairs: list[tuple[int, int]], counts: dict[int, int] | None = None) -> int:
    """The comparisons inserting items of these ``(model hash, weight)`` into one container
    costs: a new one (``DICT``, ``FROZENSET``, a tuple or a list handed to a hashing call), or
    one already holding ``counts`` (model hash -> keys of it; updated)."""
    if counts is None:
        counts = {}
    work = 0
    for h, w in pairs:
        n = counts.get(h, 0)
        counts[h] = n + 1
        work += n * w
    return work
