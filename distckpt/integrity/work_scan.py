"""The work a pickle asks of an unpickler, weighed before it runs: work bombs refused.

A pickle names each object once and then refers to it (memo ``GET``): hashing or copying what it
refers to again and again costs the unpickler far more than the pickle's size. This walk follows
the unpickler's stack and memo to weigh it (:func:`refuse_work_bombs`). The companion scans:
:mod:`distckpt.integrity.pickle_scan` (memory bombs: declared sizes) and
:mod:`distckpt.integrity.call_scan` (calls whose cost their arguments choose).
"""

from __future__ import annotations

import pickletools
import struct

from distckpt._process import gc_paused
from distckpt.errors import UnsafeCheckpointError
from distckpt.integrity.hash_model import (
    HASHING_CALLS,
    PAIR_CALLS,
    SAME_HASH_CALLS,
    WILD,
    WILD_CALLS,
    Collisions,
    craftable_pairs,
    global_hash,
    local_collisions,
    pair_keys,
    tuple_hash,
)
_TWO_LINES = frozenset(b"ci")  # GLOBAL and INST: module and name, a line each

#: The work a pickle may ask of an unpickler, per byte of it and in all: far above what any
#: pickle of plain data asks (each object it builds is hashed or copied a few times at most:
#: DCP's 18 MB ``.metadata`` asks ~1 unit a byte) and far below what sharing makes possible
#: (:func:`refuse_work_bombs`).
WORK_PER_BYTE = 16
WORK_BASE = 1 << 16
_CAP = 1 << 62  # weights saturate here: a doubling chain never builds huge integers


def refuse_work_bombs(data: bytes | bytearray | memoryview, where: str, start: int = 0, *, strict: bool = False) -> int:
    """Raise :class:`UnsafeCheckpointError` where unpickling ``data`` (from ``start``) would hash,
    compare or copy more than :data:`WORK_PER_BYTE` per byte of it (plus :data:`WORK_BASE`); else
    return that work (pure; any thread).

    A pickle names each object once and then refers to it (memo ``GET``): a tuple holding the
    same tuple twice, forty levels deep, is a few hundred bytes, but hashing it (as a dictionary key or a
    set member) visits 2**40 tuples: the unpickler never returns, holding the GIL. One large
    dict or string given by reference to a thousand constructors (``BUILD`` onto an
    ``OrderedDict``, ``OrderedDict(d)``, ``set(l)``, ``_codecs.encode(s)``) is copied a thousand
    times. This walk gives every object a weight (what hashing or copying it visits: one per
    atom, per 64 bytes of a string, plus its members') and adds the weight of every key,
    set member, constructor argument and ``BUILD`` state to the work: sharing multiplies it
    exactly as it multiplies the unpickler's.

    Distinct keys whose hashes are equal are compared with each other as they are inserted
    (``n`` of them: ``n**2 / 2`` comparisons): integers that differ by a multiple of
    ``2**61 - 1``, tuples of integers crafted to collide. Every immutable object also gets its
    hash, as this process will compute it (:mod:`distckpt.integrity.hash_model`), and each key
    is charged the comparisons its insertion costs.

    ``strict`` (``.metadata``): a ``BUILD`` may only give attributes to an object ``NEWOBJ``
    made, as DCP's pickles do: not to what a call returned, which may be a shared singleton (an
    enum member given a heavy ``_name_`` once, then hashed as a key again and again).

    An upper bound, not a prediction: a container's weight counts what it holds (a list inside a
    key makes hashing fail at once); a tuple's is fixed when it is built. Like
    :func:`~distckpt.integrity.pickle_scan.refuse_memory_bombs`, an opcode it does not know, a
    truncation or an impossible stack ends the walk quietly where the unpickler stops with its
    own error.
    """
    # The walk makes millions of small tuples and lists, none of them in a cycle: the cyclic
    # collector's passes over them (a third of the walk's time for an 18 MB .metadata) find nothing.
    with gc_paused():
        return _walk(data, where, start, _Strict(where) if strict else None)


def _walk(data: bytes | bytearray | memoryview, where: str, start: int, strict: _Strict | None) -> int:
    """:func:`refuse_work_bombs`'s walk."""
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    n = len(raw)
    budget = WORK_PER_BYTE * (n - start) + WORK_BASE
    work = 0
    # On the stack and in the memo, an immutable object is a tuple (weight, model hash,
    # craftable, collisions among what it holds, its first member); a mutable one is a
    # [weight] list (shared with the memo; _Called for what a call returned, with its hash).
    stack: list = []
    push = stack.append
    unpack_from = _U32.unpack_from
    int32 = _I32.unpack_from
    float64 = _F64.unpack_from
    marks: list[int] = []
    memo: dict[int, object] = {}
    col = Collisions()
    small = _SMALL_INTS
    i = start
    # Only where the unpickler goes on must this walk follow it exactly: where it fails (a
    # mark it lacks, an item below the mark), nothing after runs, whatever this walk assumes.
    try:
        while i < n:
            op = raw[i]
            # The opcodes DCP's pickles are made of, most frequent first, inline; the rest below.
            if op == 0x6A:  # LONG_BINGET
                push(memo[unpack_from(raw, i + 1)[0]])
                i += 5
            elif op == 0x68:  # BINGET
                push(memo[raw[i + 1]])
                i += 2
            elif op == 0x4B:  # BININT1
                push(small[raw[i + 1]])
                i += 2
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                i += 1
            elif op == 0x29:  # EMPTY_TUPLE
                push(_EMPTY_TUPLE)
                i += 1
            elif op == 0x4E:  # NONE
                push(_NONE)
                i += 1
            elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE: a new object from a callable and arguments
                x = stack.pop()
                w = x[0]
                fn = stack[-1]
                if op == 0x81 and not (fn.__class__ is tuple and fn[1] in _VALUE_HASHED):
                    stack[-1] = x = [1 + w]
                elif fn.__class__ is tuple and fn[1] in SAME_HASH_CALLS and x.__class__ is tuple and x[4].__class__ is tuple:
                    m = x[4]  # torch.Size(dims): hashed as dims are
                    stack[-1] = x = _Called((1 + w,))
                    x.h = m[1]
                    x.cr = m[2]
                else:
                    x, more = _call(fn, x, col)
                    stack[-1] = x
                    work += more
                work += w
                i += 1
                if raw[i] == 0x94:  # (memoized, as pickle.dump memoizes every new object)
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x85:  # TUPLE1
                x = stack[-1]
                if x.__class__ is tuple:
                    h = x[1]
                    if not x[2]:
                        h = hash((h,))
                    elif h != WILD:  # (a tuple holding what the model does not know: not known either)
                        h = tuple_hash((h,))
                    stack[-1] = x = (1 + x[0], h, x[2], x[3], x)
                else:
                    stack[-1] = x = _tuple([x], col)
                i += 1
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x62:  # BUILD
                x = stack.pop()
                w = x[0]
                target = stack[-1]
                if strict is not None:
                    strict.build(target, x)
                if target.__class__ is not tuple:
                    _grow(target, w, where)
                work += w
                if col.pending or col.items or x.__class__ is tuple and x[3]:  # its keys, inserted again
                    work += _rebuilt(x, col)
                i += 1
            elif op == 0x75:  # SETITEMS
                at = marks.pop()
                items = stack[at:]
                del stack[at:]
                target = stack[-1]
                if target.__class__ is tuple:
                    return work  # not a container: the unpickler fails here
                if strict is not None and strict.frozen:
                    strict.fill(target)
                keys = items[0::2]
                w = sum([x[0] for x in keys])
                work += w
                if not all([x.__class__ is tuple and not x[2] for x in keys]):
                    work += col.add(target, keys)
                _grow(target, w + sum([x[0] for x in items[1::2]]), where)
                i += 1
            elif op == 0x7D or op == 0x5D:  # EMPTY_DICT, EMPTY_LIST
                push(x := [1])
                i += 1
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x86:  # TUPLE2
                x = stack.pop()
                y = stack[-1]
                if x.__class__ is tuple and y.__class__ is tuple:
                    hx, hy = x[1], y[1]
                    cr = x[2] or y[2]
                    if not cr:
                        h = hash((hy, hx))
                    else:
                        h = WILD if hx == WILD or hy == WILD else tuple_hash((hy, hx))
                    d = x[3] + y[3]
                    if hx == hy and x[2] and y[2]:
                        d += x[0]
                    stack[-1] = x = (min(_CAP, 1 + x[0] + y[0]), h, cr, d, y)
                else:
                    stack[-1] = x = _tuple([y, x], col)
                i += 1
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x4D:  # BININT2
                push((1, raw[i + 1] | raw[i + 2] << 8, True, 0, None))
                i += 3
            elif op == 0x4A:  # BININT
                push((1, hash(int32(raw, i + 1)[0]), True, 0, None))
                i += 5
            elif op == 0x94:  # MEMOIZE (most come right after what they memoize, taken there)
                memo[len(memo)] = stack[-1]
                i += 1
            elif op == 0x47:  # BINFLOAT
                push((1, hash(float64(raw, i + 1)[0]), True, 0, None))
                i += 9
            elif op == 0x8A:  # LONG1
                length = raw[i + 1]
                push((1 + (length >> 6), hash(int.from_bytes(raw[i + 2 : i + 2 + length], "little", signed=True)), True, 0, None))
                i += 2 + length
            elif op == 0x8C:  # SHORT_BINUNICODE
                length = raw[i + 1]
                push(x := (1 + (length >> 6), hash(raw[i + 2 : i + 2 + length].decode("utf-8", "surrogatepass")), False, 0, None))
                i += 2 + length
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            else:
                i, work = _step(raw, i, n, stack, marks, memo, work, where, strict, col)
                if i < 0:
                    _check(work, budget, where, n - start)
                    return work
            if work > budget:  # (TUPLE*, BUILD, ...: hashing their weight is what tuples cost)
                _check(work, budget, where, n - start)
    except (IndexError, KeyError, ValueError, struct.error):
        # An empty stack, a missing mark or memo slot, a bad index, text that does not decode
        # (UnicodeDecodeError is a ValueError): the unpickler fails here too.
        return work
    return work


def _step(
    raw: bytes | bytearray, i: int, n: int, stack: list, marks: list[int], memo: dict[int, object], work: int, where: str,
    strict: _Strict | None, col: Collisions,
) -> tuple[int, int]:
    """One opcode at ``i`` of :func:`refuse_work_bombs`'s walk (any opcode; the walk inlines the
    frequent ones): where the next one starts and the work so far; ``(-end, work)`` where the
    walk ends (``STOP``, or the unpickler stops here)."""
    op = raw[i]
    i += 1
    size = _ARGUMENT.get(op)
    if size is None:
        return -i, work  # an opcode the unpickler refuses
    # The argument: a fixed size, a length prefix (its payload's length), or lines.
    length = 0
    if size >= 0:
        arg = i
        i += size
    elif size == _LINES:  # up to a newline (two lines for GLOBAL and INST)
        arg = i
        end = raw.find(b"\n", i)
        if op in _TWO_LINES and end >= 0:
            end = raw.find(b"\n", end + 1)
        if end < 0:
            return -n, work
        length = end - i
        i = end + 1
    else:  # a length prefix of -size bytes
        arg = i - size
        if arg > n:
            return -n, work
        length = int.from_bytes(raw[i:arg], "little", signed=op in _SIGNED)
        if length < 0:
            return -n, work
        i = arg + length
    if i > n:
        return -n, work
    kind = _KIND[op]
    if kind == _K_PUSH:
        stack.append(_atom(op, raw, arg, i if size != _LINES else arg + length))
    elif kind == _K_MEMOIZE:
        memo[len(memo)] = stack[-1]
    elif kind == _K_GET:
        stack.append(memo[_slot(op, raw, arg, length)])
    elif kind == _K_PUT:
        memo[_slot(op, raw, arg, length)] = stack[-1]
    elif kind == _K_MARK:
        marks.append(len(stack))
    elif kind == _K_TUPLE:
        take = _TUPLE_SIZE[op]
        if take < 0:
            items = _pop_mark(stack, marks)
        elif take:
            if len(stack) < take:
                return -i, work
            items = stack[-take:]
            del stack[-take:]
        else:
            items = []
        stack.append(_tuple(items, col))
    elif kind == _K_CALL:  # REDUCE, NEWOBJ, BUILD, ...: the arguments (or state) are visited
        take = _CALL_SIZE[op]
        if take < 0:  # OBJ, INST: down to the mark
            items = _pop_mark(stack, marks)
        else:
            if len(stack) < take:
                return -i, work
            items = stack[-take:]
            del stack[-take:]
        w = min(_CAP, _weight(items))
        work += w
        if op == _BUILD:
            target = stack[-1]
            x = items[0]
            if strict is not None:
                strict.build(target, x)
            if type(target) is not tuple:
                _grow(target, w, where)
            work += _rebuilt(x, col)
        elif op == _REDUCE or op == 0x81 and _model(items[0]) in _VALUE_HASHED:
            # (the walk inlines both; NEWOBJ of torch.Size or complex is cls.__new__(cls, *args),
            # hashed by value)
            x, more = _call(items[0], items[1], col)
            stack.append(x)
            work += more
        elif op in (0x81, 0x92):  # NEWOBJ(_EX): new objects
            stack.append([1 + w])
        else:  # OBJ, INST: a call of protocol 0 and 1 (never in DCP's or torch's pickles)
            x = _Called((1 + w,))
            x.h, x.cr = WILD, True
            stack.append(x)
    elif kind == _K_CONTAINER:
        stack.append([1])
    elif kind == _K_FILL:  # APPEND(S), SETITEM(S), ADDITEMS: into the container below
        take = _ONE_ITEM.get(op)
        if take is not None:
            if len(stack) <= take:
                return -i, work
            items = stack[-take:]
            del stack[-take:]
        else:
            items = _pop_mark(stack, marks)
        target = stack[-1]
        if type(target) is tuple:
            return -i, work  # not a container: the unpickler fails here
        if strict is not None and strict.frozen:
            strict.fill(target)
        if op in _HASHES_EVERY:  # set members
            work += _weight(items) + col.add(target, items)
        elif op in _HASHES_KEYS:
            work += _weight(items[0::2]) + col.add(target, items[0::2])
        else:  # list items: hashed only if the list is handed to a call that hashes them
            col.remember(target, items)
        _grow(target, _weight(items), where)
    elif kind == _K_BUILT:  # LIST, DICT, FROZENSET: a new one from the items above the mark
        items = _pop_mark(stack, marks)
        w = min(_CAP, 1 + _weight(items))
        x = [w]
        if op == _DICT:
            work += _weight(items[0::2]) + col.add(x, items[0::2])
        elif op == _FROZENSET:
            d = local_collisions(craftable_pairs(items))
            work += w + d
            x = (w, WILD, True, d, items[0] if items else None)
        else:
            col.remember(x, items)
        stack.append(x)
    elif kind == _K_POP:
        if stack and (not marks or len(stack) > marks[-1]):
            stack.pop()
        elif marks:
            marks.pop()  # POP of a mark
        else:
            return -i, work
    elif kind == _K_POP_MARK:
        _pop_mark(stack, marks)
    elif kind == _K_DUP:
        stack.append(stack[-1])
    elif kind == _K_GLOBAL2:  # STACK_GLOBAL: two strings for one class
        if len(stack) < 2:
            return -i, work
        name = stack.pop()
        stack[-1] = (1, hash((_model(stack[-1]), _model(name))), False, 0, None)
    elif kind == _K_PID:  # BINPERSID: the id for one object (torch: a storage, hashed by identity)
        stack[-1] = (1, hash((_PID, _model(stack[-1]))), False, 0, None)
    elif kind == _K_STOP:
        return -i, work
    # _K_NONE (PROTO, FRAME, READONLY_BUFFER): nothing on the stack changes
    return i, work


def _model(x: object) -> int:
    """The model hash of a walk item (a mutable object's: its identity, never equal to another's)."""
    if x.__class__ is tuple:
        return x[1]  # type: ignore[index]
    if x.__class__ is _Called:
        return x.h  # type: ignore[attr-defined]
    return id(x)


def _tuple(items: list, col: Collisions) -> tuple:
    """The walk item of a tuple of ``items`` (the mutable ones are marked captured, see :func:`_grow`)."""
    w = 1
    hashes = []
    cr = False
    d = 0
    for x in items:
        if x.__class__ is tuple:
            w += x[0]
            hashes.append(x[1])
            cr = cr or x[2]
            d += x[3]
        else:
            if len(x) == 1:
                x.append(0)  # captured
            w += x[0]
            if x.__class__ is _Called:
                hashes.append(x.h)
                cr = cr or x.cr
            else:
                hashes.append(id(x))
            d += col.of(x)
    if cr:
        # Handed to a call that hashes what it holds (frozenset(t), OrderedDict(t), a BUILD
        # onto an OrderedDict): its items, or the first members of its pairs. Both are counted.
        d += local_collisions(craftable_pairs(items)) + local_collisions(pair_keys(items))
        # (a tuple holding what the model does not know is not known either)
        h = WILD if WILD in hashes else tuple_hash(hashes)
    else:
        h = hash(tuple(hashes))
    return (min(_CAP, w), h, cr, d, items[0] if items else None)


def _rebuilt(state: object, col: Collisions) -> int:
    """What a ``BUILD`` of ``state`` costs beyond its weight: torch's loader updates an object's
    ``__dict__`` with a dict, a list of pairs, or the first of a ``(state, slotstate)`` pair,
    inserting their keys again."""
    if state.__class__ is not tuple:
        return col.of(state) + col.remembered(state, pairs=True)
    first = state[4]  # type: ignore[index]
    more = state[3]  # type: ignore[index]
    if first is not None and first.__class__ is not tuple:
        more += col.remembered(first, pairs=True)
    return more


def _call(fn: object, args: object, col: Collisions) -> tuple[_Called, int]:
    """What ``REDUCE`` of ``fn`` on ``args`` makes (its weight and model hash), and the work
    of a call that hashes what its argument holds (``set(l)``, ``OrderedDict(d)``)."""
    x = _Called((1 + args[0],))  # type: ignore[index]
    fh = _model(fn)
    if args.__class__ is tuple:
        ah, acr, first = args[1], args[2], args[4]  # type: ignore[index]
    else:
        ah, acr, first = _model(args), False, None
    if fh in SAME_HASH_CALLS and first.__class__ is tuple:
        x.h, x.cr = first[1], first[2]  # type: ignore[index]
    elif fh in WILD_CALLS or fh in SAME_HASH_CALLS:  # (torch.Size of a list: its items are not known here)
        x.h, x.cr = WILD, True
    else:
        x.h, x.cr = hash((fh, ah)), acr
    more = 0
    if fh in HASHING_CALLS:  # what its argument holds is inserted: keys again, or a list's items
        more = args[3] if args.__class__ is tuple else col.of(args)  # type: ignore[index]
        more += col.remembered(first, pairs=fh in PAIR_CALLS)  # set(l), Counter(l): the items; OrderedDict(pairs): their keys
    return x, more


def _atom(op: int, raw: bytes | bytearray, arg: int, stop: int) -> object:
    """The walk item of what an opcode pushes (its argument: ``raw[arg:stop]``)."""
    name = _NAMES[op]
    length = stop - arg
    if name in ("BINUNICODE", "BINUNICODE8", "SHORT_BINUNICODE"):
        return (1 + (length >> 6), hash(raw[arg : arg + length].decode("utf-8", "surrogatepass")), False, 0, None)
    if name in ("SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "SHORT_BINSTRING", "BINSTRING"):
        # (a str8 is read as ASCII text: hashed as those bytes are)
        return (1 + (length >> 6), hash(bytes(raw[arg : arg + length])), False, 0, None)
    if name in ("LONG1", "LONG4"):
        v = int.from_bytes(raw[arg : arg + length], "little", signed=True)
        return (1 + (length >> 6), hash(v), True, 0, None)
    if name == "BINFLOAT":
        return (1, hash(_F64.unpack_from(raw, arg)[0]), True, 0, None)
    if name in ("BININT", "BININT1", "BININT2"):
        v = int.from_bytes(raw[arg:stop], "little", signed=name == "BININT")
        return (1, hash(v), True, 0, None)
    if name == "NEWTRUE":
        return _TRUE
    if name == "NEWFALSE":
        return _FALSE
    if name == "NONE":
        return _NONE
    if name == "UNICODE":
        return (1 + (length >> 6), hash(bytes(raw[arg : arg + length]).decode("raw-unicode-escape")), False, 0, None)
    if name in ("INT", "LONG", "FLOAT", "STRING"):
        # Protocol 0's text (never in DCP's or torch's pickles): read as the unpickler reads it
        # (C's strtol, escapes), which this model does not follow: counted as colliding.
        return (1 + (length >> 6), WILD, True, 0, None)
    if name == "GLOBAL":
        module, _, qual = bytes(raw[arg : arg + length]).partition(b"\n")
        return (1, global_hash(module.decode("utf-8"), qual.decode("utf-8")), False, 0, None)
    if name == "BYTEARRAY8":
        return [1 + (length >> 6)]  # mutable
    # EXT*, PERSID, NEXT_BUFFER: objects hashed by identity; equal arguments, the same object.
    return (1, hash((op, bytes(raw[arg:stop]))), False, 0, None)


#: How much an object may grow after a tuple took it (a tuple's weight is fixed when it is
#: built): an object's attributes or a container's items given after a tuple holding it was
#: built, which only a structure that holds itself needs (and DCP's pickles never do).
GROWTH_AFTER_CAPTURE = 64


class _Called(list):
    """The ``[weight]`` of what a call (``REDUCE``, ``OBJ``, ``INST``) returned: maybe an object
    shared beyond this pickle (an enum member), which a strict walk gives no ``BUILD``; with its
    model hash ``h`` and whether a pickle can choose it (``cr``)."""

    __slots__ = ("h", "cr")


class _Strict:
    """What a strict walk (``.metadata``) remembers: the objects ``BUILD`` gave attributes and
    the dicts it gave them. DCP's pickles give each object one ``BUILD``, of a dict complete by
    then. A dict changed after it became an object's attributes changes that object after it
    was counted (``MetadataIndex`` keys are counted, by their hash, as ``BUILD`` gives them
    their fields), and so would a second ``BUILD``."""

    __slots__ = ("where", "built", "frozen", "keep")

    def __init__(self, where: str) -> None:
        self.where = where
        self.built: set[int] = set()
        self.frozen: set[int] = set()
        self.keep: list[object] = []  # (their ids are not reused while remembered)

    def build(self, target: object, state: object) -> None:
        if target.__class__ is not list or id(target) in self.built:
            _refuse_build(self.where, target)
        self.built.add(id(target))
        self.keep.append(target)
        if state.__class__ is not tuple:
            self.frozen.add(id(state))
            self.keep.append(state)

    def fill(self, target: object) -> None:
        if id(target) in self.frozen:
            raise UnsafeCheckpointError(
                f"refusing to read {self.where}: its pickle changes a dict after BUILD made it an object's attributes, "
                "which DCP metadata never does (a crafted file: the object was counted as it was built)"
            )


def _refuse_build(where: str, target: object) -> None:
    what = (
        "what a call returned" if type(target) is _Called
        else "an object a BUILD already gave attributes" if type(target) is list
        else "an object no NEWOBJ made"
    )  # fmt: skip
    raise UnsafeCheckpointError(
        f"refusing to read {where}: its pickle gives attributes (BUILD) to {what}, which DCP metadata never does (a "
        "crafted file: a shared object, such as an enum member, could be made costly to hash everywhere it is used)"
    )


def _grow(target: list, w: int, where: str) -> None:
    """``target`` (a mutable object's ``[weight]``, or ``[weight, growth]`` once a tuple took
    it) gets ``w`` more: its items, or its attributes."""
    target[0] = min(_CAP, target[0] + w)
    if len(target) > 1:
        target[1] += w
        if target[1] > GROWTH_AFTER_CAPTURE:
            raise UnsafeCheckpointError(
                f"refusing to read {where}: its pickle adds {target[1]:,} objects (items, attributes and what they "
                "hold) to an object after a tuple took it (a crafted file: hashing or copying that tuple would visit "
                "them all, each time, while it looked small)"
            )


def _weight(items: list) -> int:
    return sum([x[0] for x in items])


def _pop_mark(stack: list, marks: list[int]) -> list:
    at = marks.pop()
    items = stack[at:]
    del stack[at:]
    return items


def _check(work: int, budget: int, where: str, size: int) -> None:
    if work > budget:
        raise UnsafeCheckpointError(
            f"refusing to read {where}: unpickling its {size:,}-byte pickle would hash, compare or copy more than "
            f"{budget:,} objects (a crafted file: objects it refers to again and again, each reference "
            "hashed or copied in full, such as a tuple holding one tuple twice, forty levels deep; or many "
            "distinct keys whose hashes collide, such as integers that differ by multiples of 2**61 - 1)"
        )


def _slot(op: int, raw: bytes | bytearray, arg: int, length: int) -> int:
    """The memo index of a GET or PUT (BIN*: binary, else a decimal line)."""
    if op in (_BINGET, _BINPUT):
        return raw[arg]
    if op in (_LONG_BINGET, _LONG_BINPUT):
        return int.from_bytes(raw[arg : arg + 4], "little")
    return int(bytes(raw[arg : arg + length]).split(b"\0", 1)[0])


(_K_NONE, _K_PUSH, _K_MEMOIZE, _K_GET, _K_PUT, _K_MARK, _K_TUPLE, _K_CALL, _K_CONTAINER, _K_FILL, _K_BUILT,
 _K_POP, _K_POP_MARK, _K_DUP, _K_GLOBAL2, _K_PID, _K_STOP) = range(17)  # fmt: skip
_BUILD, _DICT, _FROZENSET = 0x62, 0x64, 0x91
_BINGET, _BINPUT, _LONG_BINGET, _LONG_BINPUT = 0x68, 0x71, 0x6A, 0x72
_REDUCE = 0x52
#: Classes whose instances ``NEWOBJ`` makes hashed by value, as ``REDUCE`` makes them.
_VALUE_HASHED = SAME_HASH_CALLS | WILD_CALLS
_LINES = -100  # an argument up to a newline
_U32, _I32, _F64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct(">d")
_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
# The walk items of the most frequent atoms (see refuse_work_bombs): built once.
_SMALL_INTS = [(1, v, True, 0, None) for v in range(256)]
_EMPTY_TUPLE = (1, hash(()), False, 0, None)
_NONE = (1, hash(None), False, 0, None)
_TRUE, _FALSE = (1, hash(True), True, 0, None), (1, hash(False), True, 0, None)
_PID = hash("persistent id")
_SIGNED = frozenset(op.code.encode("latin-1")[0] for op in pickletools.opcodes if op.arg is not None and op.arg.n == pickletools.TAKEN_FROM_ARGUMENT4)


def _work_tables() -> tuple[dict[int, int], dict[int, int]]:
    """opcode -> its argument (bytes of a fixed size, :data:`_LINES`: lines, else a length
    prefix of -n bytes) and opcode -> what it does to the stack (``_K_*``)."""
    names = {
        "MEMOIZE": _K_MEMOIZE, "GET": _K_GET, "BINGET": _K_GET, "LONG_BINGET": _K_GET,
        "PUT": _K_PUT, "BINPUT": _K_PUT, "LONG_BINPUT": _K_PUT, "MARK": _K_MARK,
        "EMPTY_TUPLE": _K_TUPLE, "TUPLE": _K_TUPLE, "TUPLE1": _K_TUPLE, "TUPLE2": _K_TUPLE, "TUPLE3": _K_TUPLE,
        "REDUCE": _K_CALL, "NEWOBJ": _K_CALL, "NEWOBJ_EX": _K_CALL, "BUILD": _K_CALL, "OBJ": _K_CALL, "INST": _K_CALL,
        "EMPTY_LIST": _K_CONTAINER, "EMPTY_DICT": _K_CONTAINER, "EMPTY_SET": _K_CONTAINER,
        "APPEND": _K_FILL, "APPENDS": _K_FILL, "SETITEM": _K_FILL, "SETITEMS": _K_FILL, "ADDITEMS": _K_FILL,
        "LIST": _K_BUILT, "DICT": _K_BUILT, "FROZENSET": _K_BUILT,
        "POP": _K_POP, "POP_MARK": _K_POP_MARK, "DUP": _K_DUP, "STACK_GLOBAL": _K_GLOBAL2,
        "BINPERSID": _K_PID, "STOP": _K_STOP, "PROTO": _K_NONE, "FRAME": _K_NONE, "READONLY_BUFFER": _K_NONE,
    }  # fmt: skip
    argument: dict[int, int] = {}
    kind: dict[int, int] = {}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        n = 0 if op.arg is None else op.arg.n
        if n == pickletools.UP_TO_NEWLINE:
            argument[code] = _LINES
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            argument[code] = -1
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            argument[code] = -4
        elif n == pickletools.TAKEN_FROM_ARGUMENT8U:
            argument[code] = -8
        elif n >= 0:
            argument[code] = n
        else:
            raise AssertionError(f"pickletools: unknown argument kind of {op.name}")
        # Everything else pushes one new object (atoms, strings, GLOBAL, EXT*, PERSID, NEXT_BUFFER).
        kind[code] = names.get(op.name, _K_PUSH)
    return argument, kind


_ARGUMENT, _KIND = _work_tables()
_TUPLE_SIZE = {0x29: 0, 0x74: -1, 0x85: 1, 0x86: 2, 0x87: 3}  # EMPTY_TUPLE, TUPLE, TUPLE1-3
_CALL_SIZE = {0x52: 2, 0x81: 2, 0x92: 3, 0x62: 1, 0x6F: -1, 0x69: -1}  # REDUCE, NEWOBJ, NEWOBJ_EX, BUILD, OBJ, INST
_ONE_ITEM = {0x61: 1, 0x73: 2}  # APPEND, SETITEM
_HASHES_KEYS = frozenset({0x73, 0x75})  # SETITEM, SETITEMS
_HASHES_EVERY = frozenset({0x90})  # ADDITEMS
