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

from distckpt.errors import UnsafeCheckpointError

_TWO_LINES = frozenset(b"ci")  # GLOBAL and INST: module and name, a line each

#: The work a pickle may ask of an unpickler, per byte of it and in all: far above what any
#: pickle of plain data asks (each object it builds is hashed or copied a few times at most:
#: DCP's 18 MB ``.metadata`` asks ~1 unit a byte) and far below what sharing makes possible
#: (:func:`refuse_work_bombs`).
WORK_PER_BYTE = 16
WORK_BASE = 1 << 16
_CAP = 1 << 62  # weights saturate here: a doubling chain never builds huge integers


def refuse_work_bombs(data: bytes | bytearray | memoryview, where: str, start: int = 0, *, strict: bool = False) -> int:
    """Raise :class:`UnsafeCheckpointError` where unpickling ``data`` (from ``start``) would hash
    or copy more than :data:`WORK_PER_BYTE` per byte of it (plus :data:`WORK_BASE`); else return
    that work (pure; any thread).

    A pickle names each object once and then refers to it (memo ``GET``): a tuple holding the
    same tuple twice, forty levels deep, is a few hundred bytes, but hashing it (as a dictionary key or a
    set member) visits 2**40 tuples: the unpickler never returns, holding the GIL. One large
    dict or string given by reference to a thousand constructors (``BUILD`` onto an
    ``OrderedDict``, ``OrderedDict(d)``, ``set(l)``, ``_codecs.encode(s)``) is copied a thousand
    times. This walk gives every object a weight (what hashing or copying it visits: one per
    atom, per 64 bytes of a string, plus its members') and adds the weight of every key,
    set member, constructor argument and ``BUILD`` state to the work: sharing multiplies it
    exactly as it multiplies the unpickler's.

    ``strict`` (``.metadata``): a ``BUILD`` may only give attributes to an object ``NEWOBJ``
    made, as DCP's pickles do: not to what a call returned, which may be a shared singleton (an
    enum member given a heavy ``_name_`` once, then hashed as a key again and again).

    An upper bound, not a prediction: a container's weight counts what it holds (a list inside a
    key makes hashing fail at once); a tuple's is fixed when it is built. Like
    :func:`refuse_memory_bombs`, an opcode it does not know, a truncation or an impossible stack
    ends the walk quietly where the unpickler stops with its own error.
    """
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    n = len(raw)
    budget = WORK_PER_BYTE * (n - start) + WORK_BASE
    work = 0
    stack: list = []  # an int: an immutable object's weight; [int]: a mutable one's (shared with the memo)
    push = stack.append
    unpack_from = _U32.unpack_from
    marks: list[int] = []
    memo: dict[int, object] = {}
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
                push(1)
                i += 2
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                i += 1
            elif op == 0x29 or op == 0x4E:  # EMPTY_TUPLE, NONE
                push(1)
                i += 1
            elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE: a new object from a callable and arguments
                x = stack.pop()
                w = x if x.__class__ is int else x[0]
                stack[-1] = x = [1 + w] if op == 0x81 else _Called((1 + w,))
                work += w
                i += 1
                if raw[i] == 0x94:  # (memoized, as pickle.dump memoizes every new object)
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x85:  # TUPLE1
                x = stack[-1]
                if x.__class__ is not int:
                    if len(x) == 1:
                        x.append(0)  # captured (see _grow)
                    x = x[0]
                stack[-1] = x = 1 + x
                i += 1
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x62:  # BUILD
                x = stack.pop()
                w = x if x.__class__ is int else x[0]
                target = stack[-1]
                if strict and target.__class__ is not list:
                    _refuse_build(where, target)
                if target.__class__ is not int:
                    _grow(target, w, where)
                work += w
                i += 1
            elif op == 0x75:  # SETITEMS
                at = marks.pop()
                items = stack[at:]
                del stack[at:]
                target = stack[-1]
                if target.__class__ is int:
                    return work  # not a container: the unpickler fails here
                keys = sum([x if x.__class__ is int else x[0] for x in items[0::2]])
                work += keys
                _grow(target, keys + sum([x if x.__class__ is int else x[0] for x in items[1::2]]), where)
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
                if x.__class__ is not int or y.__class__ is not int:
                    x, y = _captured((x, y))
                stack[-1] = x = min(_CAP, 1 + x + y)
                i += 1
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            elif op == 0x4D:  # BININT2
                push(1)
                i += 3
            elif op == 0x4A:  # BININT
                push(1)
                i += 5
            elif op == 0x94:  # MEMOIZE (most come right after what they memoize, taken there)
                memo[len(memo)] = stack[-1]
                i += 1
            elif op == 0x8C:  # SHORT_BINUNICODE
                length = raw[i + 1]
                push(x := 1 + (length >> 6))
                i += 2 + length
                if raw[i] == 0x94:
                    memo[len(memo)] = x
                    i += 1
            else:
                i, work = _step(raw, i, n, stack, marks, memo, work, where, strict)
                if i < 0:
                    _check(work, budget, where, n - start)
                    return work
            if work > budget:  # (TUPLE*, BUILD, ...: hashing their weight is what tuples cost)
                _check(work, budget, where, n - start)
    except (IndexError, KeyError, ValueError, struct.error):
        return work  # an empty stack, a missing mark or memo slot, a bad index: the unpickler fails here too
    return work


def _step(
    raw: bytes | bytearray, i: int, n: int, stack: list, marks: list[int], memo: dict[int, object], work: int, where: str,
    strict: bool,
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
        stack.append(1 + (length >> 6))
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
        stack.append(min(_CAP, 1 + sum(_captured(items))))
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
            if strict and type(target) is not list:
                _refuse_build(where, target)
            if type(target) is not int:
                _grow(target, w, where)
        else:
            stack.append([1 + w] if op in (0x81, 0x92) else _Called((1 + w,)))  # NEWOBJ(_EX): new objects
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
        if type(target) is int:
            return -i, work  # not a container: the unpickler fails here
        if op in _HASHES_EVERY:  # set members
            work += _weight(items)
        elif op in _HASHES_KEYS:
            work += _weight(items[0::2])
        _grow(target, _weight(items), where)
    elif kind == _K_BUILT:  # LIST, DICT, FROZENSET: a new one from the items above the mark
        items = _pop_mark(stack, marks)
        w = min(_CAP, 1 + _weight(items))
        if op == _DICT:
            work += _weight(items[0::2])
        elif op == _FROZENSET:
            work += w
        stack.append(w if op == _FROZENSET else [w])
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
        del stack[-2:]
        stack.append(1)
    elif kind == _K_PID:  # BINPERSID: the id for one object
        stack[-1] = 1
    elif kind == _K_STOP:
        return -i, work
    # _K_NONE (PROTO, FRAME, READONLY_BUFFER): nothing on the stack changes
    return i, work


#: How much an object may grow after a tuple took it (a tuple's weight is fixed when it is
#: built): an object's attributes or a container's items given after a tuple holding it was
#: built, which only a structure that holds itself needs (and DCP's pickles never do).
GROWTH_AFTER_CAPTURE = 64


class _Called(list):
    """The ``[weight]`` of what a call (``REDUCE``, ``OBJ``, ``INST``) returned: maybe an object
    shared beyond this pickle (an enum member), which a strict walk gives no ``BUILD``."""


def _refuse_build(where: str, target: object) -> None:
    what = "what a call returned" if type(target) is _Called else "an object no NEWOBJ made"
    raise UnsafeCheckpointError(
        f"refusing to read {where}: its pickle gives attributes (BUILD) to {what}, which DCP metadata never does (a "
        "crafted file: a shared object, such as an enum member, could be made costly to hash everywhere it is used)"
    )


def _captured(items: tuple | list) -> list[int]:
    """The weights of ``items`` as a new tuple takes them; the mutable ones are marked captured."""
    out = []
    for x in items:
        if x.__class__ is not int:
            if len(x) == 1:
                x.append(0)
            x = x[0]
        out.append(x)
    return out


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
    return sum([x if x.__class__ is int else x[0] for x in items])


def _pop_mark(stack: list, marks: list[int]) -> list:
    at = marks.pop()
    items = stack[at:]
    del stack[at:]
    return items


def _check(work: int, budget: int, where: str, size: int) -> None:
    if work > budget:
        raise UnsafeCheckpointError(
            f"refusing to read {where}: unpickling its {size:,}-byte pickle would hash or copy more than "
            f"{budget:,} objects (a crafted file: objects it refers to again and again, each reference "
            "hashed or copied in full, such as a tuple holding one tuple twice, forty levels deep)"
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
_LINES = -100  # an argument up to a newline
_U32 = struct.Struct("<I")
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
