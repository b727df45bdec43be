"""Scans of a pickle's opcodes before an unpickler runs them: memory bombs and work bombs refused.

The C unpickler trusts the sizes a pickle declares. ``LONG_BINPUT`` (or ``PUT``) with memo index
``n`` makes it grow its memo to ``2n`` slots and fill them, before anything else happens: eleven
bytes with ``n`` = 500,000,000 cost 8 GiB and seconds, ``n`` = 1,000,000,000 16 GiB (an OOM kill
on many hosts), ``n`` larger a ``MemoryError``. A length prefix (``BINBYTES8`` ...) beyond the end
of the data is an allocation of that size. No legitimate pickle needs either: a memo index is
below the number of objects memoized, so below the pickle's length, and every declared length
lies within the data.

:func:`refuse_memory_bombs` walks the opcodes as the unpickler will read them. Runs of
fixed-size opcodes (most of DCP's metadata: ``MEMOIZE``, ``BINGET``, small ints, tuples) are
consumed by one regular expression at C speed; Python only looks at the opcodes that carry a
length or a line, and at the memo writes with an index of more than one byte. An opcode it does
not know, or a length that runs past the data, ends the scan: the unpickler stops at the same
place, with its own error, before running anything after it.

:func:`refuse_work_bombs` (:mod:`distckpt.integrity.work_scan`) follows the unpickler's stack
and memo to weigh what it will hash and copy; :func:`refuse_argument_bombs`
(:mod:`distckpt.integrity.call_scan`) checks the arguments of the calls whose cost they choose.
Both are re-exported here, where every reader imports its scans from.
"""

from __future__ import annotations

import pickletools
import re

from distckpt.errors import UnsafeCheckpointError

_LONG_BINPUT, _PUT, _STOP = 0x72, 0x70, 0x2E
_TWO_LINES = frozenset(b"ci")  # GLOBAL and INST: module and name, a line each


def _tables() -> tuple[re.Pattern[bytes], dict[int, tuple[int, bool]]]:
    """The fast pattern (a run of opcodes with a fixed-size argument), and for the others:
    opcode -> (bytes of the length prefix, or 0 for a newline-terminated argument; signed)."""
    fixed: dict[int, list[int]] = {}
    counted: dict[int, tuple[int, bool]] = {}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        n = 0 if op.arg is None else op.arg.n
        if code == _STOP:
            continue  # ends the scan
        if code == _LONG_BINPUT:  # fixed-size, but its slot is checked: never in the fast run
            counted[code] = (4, False)
        elif n >= 0:
            fixed.setdefault(n, []).append(code)
        elif n == pickletools.UP_TO_NEWLINE:
            counted[code] = (0, False)
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            counted[code] = (1, False)
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            counted[code] = (4, n == pickletools.TAKEN_FROM_ARGUMENT4)
        elif n == pickletools.TAKEN_FROM_ARGUMENT8U:
            counted[code] = (8, False)
        else:  # a kind of argument this scan does not know: refuse to guess its size
            raise AssertionError(f"pickletools: unknown argument kind of {op.name}")
    def one_of(codes: list[int]) -> bytes:
        return b"[" + b"".join(b"\\x%02x" % c for c in sorted(codes)) + b"]"

    bare = one_of(fixed.pop(0))
    with_argument = b"|".join(one_of(codes) + b".{%d}" % n for n, codes in sorted(fixed.items()))
    # Each iteration takes a run of opcodes without an argument, then one with: half the
    # iterations of one alternation per opcode (an opcode's first byte decides its size, so the
    # possessive match is the unpickler's own reading).
    return re.compile(b"(?:" + bare + b"*+(?:" + with_argument + b"))*+" + bare + b"*+", re.DOTALL), counted


_FAST, _COUNTED = _tables()


def refuse_memory_bombs(data: bytes, where: str) -> None:
    """Raise :class:`UnsafeCheckpointError` where the pickle ``data`` declares a memo index of at
    least its own length, or a length that runs past its end (pure; any thread).

    Not a validation of the pickle: anything else, including an unknown opcode, is left to the
    unpickler, which stops at the same opcode."""
    n = len(data)
    fast = _FAST.match
    counted = _COUNTED
    find = data.find
    i = 0
    while True:
        i = fast(data, i).end()
        if i >= n:
            return  # truncated: the unpickler says so
        op = data[i]
        kind = counted.get(op)
        if kind is None:
            return  # STOP, or an opcode the unpickler refuses
        i += 1
        size, signed = kind
        if size:
            if i + size > n:
                return
            length = int.from_bytes(data[i : i + size], "little", signed=signed)
            i += size
            if op == _LONG_BINPUT:
                if length >= n:
                    _refuse(where, f"LONG_BINPUT writes memo slot {length:,}", n)
                continue
            if length < 0:
                return  # the unpickler refuses a negative count
            if length > n - i:
                _refuse(where, f"{pickletools.code2op[chr(op)].name} declares {length:,} bytes", n)
            i += length
        else:
            end = find(b"\n", i)
            if end < 0:
                return
            if op == _PUT:
                # As the unpickler reads the line: up to a NUL (C string), then int()'s syntax
                # (" +5_000"). Stopping at a line int() refused let "p0\x00\n" hide what followed.
                try:
                    slot = int(data[i:end].split(b"\0", 1)[0])
                except ValueError:
                    return
                if slot >= n:
                    _refuse(where, f"PUT writes memo slot {slot:,}", n)
            if op in _TWO_LINES:
                end = find(b"\n", end + 1)
                if end < 0:
                    return
            i = end + 1


def _refuse(where: str, what: str, length: int) -> None:
    raise UnsafeCheckpointError(
        f"refusing to read {where}: its pickle {what}, more than its {length:,} bytes can hold "
        "(a crafted file: unpickling it would allocate memory in proportion)"
    )


# (re-exported: every reader imports its scans from here)
from distckpt.integrity.call_scan import REFUSED_CALLS, refuse_argument_bombs  # noqa: E402
from distckpt.integrity.work_scan import GROWTH_AFTER_CAPTURE, WORK_BASE, WORK_PER_BYTE, refuse_work_bombs  # noqa: E402

__all__ = [
    "GROWTH_AFTER_CAPTURE", "REFUSED_CALLS", "WORK_BASE", "WORK_PER_BYTE",
    "refuse_argument_bombs", "refuse_memory_bombs", "refuse_work_bombs",
]  # fmt: skip
