"""DCP load planner that never runs code from the checkpoint.

DCP's default planner unpickles non-tensor values with ``torch.load(weights_only=False)``.
distckpt reads them with ``weights_only=True``: a save wrote only what that reader admits (plain
containers, numbers, strings, tensors, and the encoded form of :mod:`distckpt.state.encoded`,
which :func:`~distckpt.state.decoding.decode_loaded` turns back into NumPy values, datetimes,
paths, registered Enums ... here, before any object sees them). A value that would need
arbitrary globals (a checkpoint written by an older distckpt or another tool, or a crafted one)
is refused with an error naming its key and what it needs, instead of being executed. Given the
manifest's ``value_digests``, the bytes of every such value are first compared with the digest
recorded at save (:func:`distckpt.state.values.check_item`).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
from collections.abc import Mapping, Sequence

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from distckpt.state import decoding, safetypes, values
from distckpt.errors import UnsafeCheckpointError
from distckpt.integrity import deep_stack
from distckpt._compat import set_element


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values are read with ``weights_only=True`` and
    decoded (:func:`distckpt.state.decoding.decode_loaded`).

    Args:
        value_digests: the manifest's ``value_digests`` (key -> sha256 of the stored bytes);
            each value's bytes must match before they are unpickled, else
            :class:`~distckpt.errors.IntegrityError` naming the key and file. ``None``: unchecked.
        where: the step directory, as errors name it.
        safe_types: the classes (Enum, dataclass, NamedTuple) encoded values may be rebuilt as
            (``Checkpointer(safe_types=...)``); ``None``: :data:`distckpt.state.safetypes.DEFAULT_SAFE_TYPES`.
        local_plan: the read items DCP's default planning gives for the state dict this planner
            will be set up with, planned before the load (:func:`distckpt.load.run.plan_ahead`):
            returned by :meth:`create_local_plan` instead of planning again. ``None``: planned here.
    """

    def __init__(
        self,
        *args: bool,
        value_digests: Mapping[str, str] | None = None,
        where: str = "",
        safe_types: safetypes.SafeTypesLike = None,
        local_plan: Sequence[ReadItem] | None = None,
        **kwargs: bool,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.local_plan = None if local_plan is None else tuple(local_plan)
        self._seen: set[bytes] = set()  # records read once (their bytes)
        self._twins: dict[bytes, object] = {}  # records read twice or more -> torch.load's output
        self._twin_bytes = 0
        self.value_digests = value_digests
        self.where = where
        self.safe_types = safetypes.SafeTypes.of(safe_types)

    def create_local_plan(self) -> LoadPlan:
        if self.local_plan is not None:
            return LoadPlan(list(self.local_plan))
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        raw = value.getbuffer()
        if self.value_digests is not None:
            values.check_item(raw, read_item.storage_index.fqn, self.value_digests, self._file_of(read_item))
        obj = self._unpickled(raw, value, fqn, read_item)
        obj = decoding.decode_loaded(obj, fqn, self.safe_types)
        if self.flatten_state_dict:

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _unpickled(self, raw: memoryview, value: io.BytesIO, fqn: str, read_item: ReadItem) -> object:
        """What ``torch.load(weights_only=True)`` gives for a record (before decoding).

        Optimizer states repeat their hyperparameters per parameter (``param_groups.<fqn>.lr``
        ...): hundreds of equal small records, each a torch.save archive that costs torch.load a
        fraction of a millisecond. From the second record with the same bytes on, its output is
        kept (plain data: containers, numbers, strings, tensors) and later twins get a copy of
        it; each record is still decoded on its own, so each key gets its own value, decoded as
        if alone. Bounded: records up to 64 KiB, 32 MiB of them per load."""
        key = bytes(raw) if len(raw) <= _TWIN_MAX else None
        kept = self._twins.get(key, _MISSING) if key is not None else _MISSING
        if kept is not _MISSING:
            copied = _copy_plain(kept)
            if copied is not _MISSING:
                return copied
        try:
            # On the host whatever device the saving rank's tensors were on (a tuple's tensors are
            # stored inside it): the apply copies them into the live tensors, on their devices.
            # On a stack deep enough for the record's nesting (deep_stack: its dict keys are hashed).
            obj = deep_stack.torch_load(value, raw, f"checkpoint value {fqn!r} ({self._file_of(read_item)})")
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(refusal(fqn, self._file_of(read_item), exc)) from None
        if key is not None and self._twin_bytes + len(key) <= _TWINS_TOTAL:
            if key in self._seen:
                copied = _copy_plain(obj)
                if copied is not _MISSING:
                    self._twins[key] = copied
            else:
                self._seen.add(key)
            self._twin_bytes += len(key)
        return obj

    def _file_of(self, read_item: ReadItem) -> str:
        """The file the item is read from (its record in the verified ``.metadata``), as errors name it."""
        metadata = getattr(self, "metadata", None)
        info = metadata.storage_data.get(read_item.storage_index) if metadata is not None else None
        name = os.fspath(info.relative_path) if info is not None else "?"
        return f"{self.where}/{name}" if self.where else name


#: Records up to this size are unpickled once per load and copied for equal records; at most
#: this many bytes of them are remembered.
_TWIN_MAX = 64 * 1024
_TWINS_TOTAL = 32 * 2**20
_PLAIN = (int, float, complex, bool, str, bytes, type(None))
_MISSING = object()


def _copy_plain(obj: object) -> object:
    """A copy of what ``torch.load(weights_only=True)`` gave (``obj`` itself where it is a plain
    number or string, or a tuple of them: it cannot change); ``_MISSING`` where it cannot be
    copied (the record is then unpickled again)."""
    if type(obj) in _PLAIN or (type(obj) is tuple and all(type(v) in _PLAIN for v in obj)):
        return obj
    try:
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - e.g. a class the user allowed torch.load, refusing copies
        return _MISSING


def refusal(key: str, where: str, exc: BaseException) -> str:
    """The message for a value ``weights_only`` refused: what it needs, why that is refused, and
    what to do, kept whole (torch's own message starts with advice that does not apply here:
    ``weights_only=False``, which distckpt never uses)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch bolds part of its message for terminals
    found = (
        re.search(r"GLOBAL (\S+) was not an allowed global", text)
        or re.search(r"unsupported GLOBAL (\S+) whose module", text)
        or re.search(r"but got <class '([^']+)'>", text)
    )
    needs = found.group(1) if found else None
    # torch's own diagnosis, without its preamble (weights_only=False) and its link
    detail = text.split("WeightsUnpickler error:", 1)[-1].split("trusted source.", 1)[-1]
    detail = " ".join(line.strip() for line in detail.split("Check the documentation", 1)[0].splitlines() if line.strip())
    first = (
        f"refusing to load checkpoint value {key!r} ({where}): unpickling it needs {needs or 'more than plain data'}, "
        f"which the safe reader does not allow (a crafted checkpoint could run code through it)."
    )
    if "is blocked" in text:
        return (
            f"{first}\ntorch never allows it (its module is blocked): the value was crafted to run code, or damaged; "
            f"do not load this checkpoint. torch: {detail[:300]}"
        )
    return (
        f"{first}\nA save by this distckpt never writes such values (it stores NumPy values, datetimes, paths, "
        f"registered Enums ... in an encoded form, and refuses what a load could not read), so this checkpoint was "
        f"written by an older distckpt or another tool. If you trust it, allow what it needs in the loading process "
        f"before load(), as torch says: {detail[:600]}"
    )
