"""Calls on torch's ``weights_only`` allow-list whose cost a record's arguments choose, refused
before ``torch.load`` runs them (:func:`refuse_argument_bombs`)."""

from __future__ import annotations

import pickletools

from distckpt.errors import UnsafeCheckpointError

#: Callables torch's ``weights_only`` unpickler admits that ``torch.save`` never writes for
#: host or CUDA tensors and plain values, and whose cost a record chooses: a device tensor
#: rebuilt from a stride-0 view of one element took 800 MB from a 1.7 KB record.
REFUSED_CALLS = frozenset({
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    "torch._utils._rebuild_device_tensor_from_numpy",
})  # fmt: skip
_BYTEARRAY = frozenset({"builtins.bytearray", "__builtin__.bytearray"})
_ENCODE = "_codecs.encode"
_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
_TENSOR_REBUILDS = "torch._utils._rebuild_"
_BYTES = object()  # what ``_codecs.encode(text, "latin1")`` returned (torch.save's bytes)
_OTHER = object()


class _Callable(str):
    """A GLOBAL's ``module.name`` on the walk's stack."""


def refuse_argument_bombs(data: bytes, where: str) -> None:
    """Raise :class:`UnsafeCheckpointError` where a ``torch.save`` record's pickle ``data`` calls
    what torch's ``weights_only`` unpickler admits with arguments ``torch.save`` never writes,
    whose cost their values choose: ``bytearray(800_000_000)`` is 30 bytes for 800 MB, and
    ``_codecs.encode(text, "punycode")`` is quadratic in the text (13 KB: 5 s). ``torch.save``
    writes ``bytes`` as ``_codecs.encode(text, "latin1")`` and a ``bytearray`` as
    ``bytearray()`` or ``bytearray(<such bytes>)``; the callables in :data:`REFUSED_CALLS`
    never. A walk of the opcodes torch's unpickler knows, with the values it needs (pure)."""
    if not any(name in data for name in (b"bytearray", b"_codecs", b"_rebuild_device_tensor", b"_rebuild_from_type_v2")):
        return  # (a substring gate: a GLOBAL names its callable in plain text)
    stack: list = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == "GLOBAL":
                full = str(arg).replace(" ", ".", 1)
                if full in REFUSED_CALLS:
                    _refuse_call(where, full, "a call torch.save never writes")
                stack.append(_Callable(full))
            elif name in ("BINUNICODE", "SHORT_BINSTRING", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT"):
                stack.append(arg)
            elif name in ("NONE", "NEWTRUE", "NEWFALSE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
                stack.append(_OTHER)
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                if len(items) != n:
                    return
                del stack[-n:]
                stack.append(items)
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("TUPLE", "APPENDS", "SETITEMS"):
                at = marks.pop()
                items = tuple(stack[at:])
                del stack[at:]
                if name == "TUPLE":
                    stack.append(items)
            elif name == "APPEND":
                stack.pop()
            elif name == "SETITEM":
                del stack[-2:]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "BINPERSID":
                stack[-1] = _OTHER
            elif name in ("REDUCE", "NEWOBJ"):
                args = stack.pop()
                fn = stack[-1]
                stack[-1] = _checked_call(fn, args, where) if name == "REDUCE" else _OTHER
            elif name == "BUILD":
                stack.pop()
            elif name == "STOP":
                return
            elif name != "PROTO":
                return  # an opcode torch's unpickler refuses
    except (IndexError, KeyError, ValueError, TypeError):
        return  # truncated or impossible: torch's unpickler fails there too


def _checked_call(fn: object, args: object, where: str) -> object:
    if type(fn) is not _Callable:
        return _OTHER
    if fn == _FROM_TYPE:
        # _rebuild_from_type_v2(func, new_type, args, state) runs func(*args): torch.save writes
        # it for tensor subclasses, with one of torch's tensor rebuilds as func. Any other func
        # would be a call this scan and the work walk do not see as one (set(l), bytearray(n)).
        func = args[0] if type(args) is tuple and args else None
        if not (type(func) is _Callable and func.startswith(_TENSOR_REBUILDS) and func not in REFUSED_CALLS):
            _refuse_call(where, fn, f"with {_args(args)}, where torch.save gives it one of torch's tensor rebuilds")
    if fn == _ENCODE:
        if not (type(args) is tuple and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1")):
            _refuse_call(where, fn, f"with {_args(args)}, where torch.save writes (text, 'latin1')")
        return _BYTES
    if fn in _BYTEARRAY:
        if not (args == () or (type(args) is tuple and len(args) == 1 and args[0] is _BYTES)):
            _refuse_call(where, fn, f"with {_args(args)}, where torch.save writes () or (bytes,)")
    return _OTHER


def _args(args: object) -> str:
    if type(args) is not tuple:
        return "arguments that are no tuple"
    kinds = ["bytes" if a is _BYTES else "?" if a is _OTHER else type(a).__name__ for a in args[:4]]
    return "(" + ", ".join(kinds) + (", ..." if len(args) > 4 else "") + ")"


def _refuse_call(where: str, fn: str, what: str) -> None:
    raise UnsafeCheckpointError(
        f"refusing to read {where}: its pickle calls {fn} {what} (a crafted record: the call's cost would be the "
        "record's to choose)"
    )
