"""What a later save at one global step holds differently (an *overlay*), kept in its pointer, for
:class:`~distckpt.integrations.lightning.DistckptCheckpointIO`.

Lightning may save twice at one global step: a top-k save and then ``save_last`` at an epoch's
end, a save in the epoch's last batch and then one at the epoch's end. distckpt keeps one step
per global step, written by the first save. What a later save there holds differently, beyond
the model's and optimizers' tensors (which must be the same: the plugin refuses otherwise), is
the optimizers' ``param_groups`` (a scheduler stepped between them), callbacks' and loops' bookkeeping (ModelCheckpoint's ``last_model_path``, EarlyStopping's
``wait_count``, the loops' counters) and keys set in ``on_save_checkpoint``. Dropped, a resume
from ``last.ckpt`` made ModelCheckpoint write ``last-v1.ckpt`` beside it (and keep every step),
and EarlyStopping resumed one epoch behind.

Those top-level values are stored in the later save's pointer file: encoded as distckpt stores
non-tensor values (:func:`~distckpt.state.encoded.encode_for_save`, then ``torch.save``; tensors
on the CPU), base64 in the pointer's JSON, and read back as distckpt reads them
(``torch.load(weights_only=True)`` once the record's pickles are known to ask no more work than
their size allows, then :func:`~distckpt.state.decoding.decode_loaded`): nothing runs code. A
value that differed between ranks is kept per rank, and loads at that world size only.

Imports no Lightning. Not collective: every rank calls these on its own.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from distckpt._compat import as_byte_viewable
from distckpt.errors import IntegrityError, UnsafeCheckpointError
from distckpt.integrity import deep_stack
from distckpt.state.decoding import decode_loaded
from distckpt.state.encoded import TopLevel, encode_for_save
from distckpt.state.safetypes import SafeTypesLike

__all__ = ["MAX_OVERLAY_CHARS", "MODEL_KEYS", "OPTIMIZERS", "Overlay", "apply", "as_text", "check", "decode", "digest", "encoded", "model_values", "record", "snapshot"]

#: Lightning's top-level keys of the model's and optimizers' state: a later save at one step must
#: hold the same tensors. The model's are never in an overlay; of the optimizers' state only the
#: ``param_groups`` are (a scheduler stepped between the saves changed their ``lr``), kept under
#: :data:`OPTIMIZERS` as the list of every optimizer's groups.
MODEL_KEYS = ("state_dict", "optimizer_states")
OPTIMIZERS = "optimizer_states"
#: The most an overlay may hold (base64 characters, every rank's together): callbacks' and loops'
#: bookkeeping is a few kilobytes.
MAX_OVERLAY_CHARS = 4 << 20

#: A pointer's overlay: per top-level key, the value's record (base64) on every rank alike, or one per rank.
Overlay = dict[str, "str | list[str]"]


def encoded(value: Any, key: str, safe_types: SafeTypesLike = None) -> Any:
    """(each rank) The encoded form of one top-level value, as distckpt stores a value entry
    (``defaultdict``, ``torch.Size`` ... kept), tensors on the CPU and owning their data (a
    view of a large buffer is stored as itself, not with the buffer).

    Raises:
        TypeError: naming ``key``, a value distckpt cannot store safely.
    """
    form = encode_for_save({key: TopLevel(value)}, safe_types)[key]
    # On the CPU, as loads give tensors back (Lightning moves them): the same value on another
    # device is the same record.
    return _tensors_mapped(form, _own, 0)


def _tensors_mapped(x: Any, fn: Callable[[torch.Tensor], Any], depth: int) -> Any:
    """``x`` with every tensor in its plain containers replaced by ``fn(tensor)`` (other
    containers, such as ``torch.Size``, left as they are: pytree's ``tree_map`` made that one a
    tuple)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if depth > 1000:
        return x
    if type(x) in (dict, OrderedDict):
        return type(x)((k, _tensors_mapped(v, fn, depth + 1)) for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x)(_tensors_mapped(v, fn, depth + 1) for v in x)
    return x


def _own(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes or not t.is_contiguous() else t


def record(form: Any) -> bytes:
    """The bytes an overlay keeps of an :func:`encoded` value (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save(form, buffer)
    return buffer.getvalue()


def digest(form: Any) -> str:
    """A digest of an :func:`encoded` value that equal values share whatever the order their
    dicts were filled in (a dict built from a set differs in order between processes; an
    ``OrderedDict``'s order counts): what a later save's values and every rank's are compared
    by. Bottom-up: each node hashes its type and its children's digests."""
    return _digest(form, 0).hex()


def _digest(x: Any, depth: int) -> bytes:
    if depth > 1000:
        raise TypeError("value nested too deeply")
    h = hashlib.sha256(type(x).__name__.encode() + b"\0")
    if isinstance(x, torch.Tensor):
        t = as_byte_viewable(x.detach().cpu().resolve_conj().resolve_neg())
        h.update(f"{t.dtype}{tuple(x.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, Mapping):
        pairs = [_digest(k, depth + 1) + _digest(v, depth + 1) for k, v in x.items()]
        for pair in pairs if isinstance(x, OrderedDict) else sorted(pairs):
            h.update(pair)
    elif isinstance(x, (list, tuple)):
        for v in x:
            h.update(_digest(v, depth + 1))
    else:
        h.update(repr(x).encode())
    return h.digest()


def snapshot(checkpoint: Mapping[str, Any], safe_types: SafeTypesLike = None) -> dict[str, Any]:
    """(each rank) The encoded form of every top-level value of Lightning's dict but the model's
    and optimizers' state (:data:`MODEL_KEYS`), by key; of the optimizers', their ``param_groups``."""
    out = {}
    for k, v in checkpoint.items():
        if k == OPTIMIZERS:
            v = _param_groups(v)
            if v is None:
                continue
        elif k in MODEL_KEYS:
            continue
        out[k] = encoded(v, k, safe_types)
    return out


def model_values(checkpoint: Mapping[str, Any], safe_types: SafeTypesLike = None) -> dict[str, str]:
    """(each rank) Digests of the values of the model's and optimizers' state that are not
    tensors, by where they are (``state_dict.<key>``: a module's ``get_extra_state()``;
    ``optimizer_states.<i>.state.<param>``, ``optimizer_states.<i>.<key>``), their tensors
    replaced by a mark (the tensors are compared by themselves). ``param_groups`` are left out:
    an overlay keeps them. What a later save at one step must hold alike, as its tensors: the
    step keeps the first save's, and a pointer to it would load them.

    Raises:
        TypeError: a value distckpt cannot store safely (the save refuses it too).
    """
    out: dict[str, str] = {}

    def add(where: str, value: Any) -> None:
        out[where] = digest(encoded(_tensors_mapped(value, lambda t: _TENSOR_MARK, 0), where, safe_types))

    model = checkpoint.get("state_dict")
    if isinstance(model, Mapping):
        for k, v in model.items():
            if not isinstance(v, torch.Tensor):
                add(f"state_dict.{k}", v)
    states = checkpoint.get(OPTIMIZERS)
    if isinstance(states, list):
        for i, s in enumerate(states):
            if not isinstance(s, Mapping):
                continue
            for k, v in s.items():
                if k == "param_groups" or isinstance(v, torch.Tensor):
                    continue
                if k == "state" and isinstance(v, Mapping):
                    for param, per in v.items():
                        add(f"{OPTIMIZERS}.{i}.state.{param}", per)
                else:
                    add(f"{OPTIMIZERS}.{i}.{k}", v)
    return out


_TENSOR_MARK = "<a tensor: compared by itself>"


def _param_groups(states: object) -> list[Any] | None:
    """Every optimizer's ``param_groups`` of Lightning's ``optimizer_states`` (a list of
    optimizers' state dicts); ``None`` for anything else."""
    if not isinstance(states, list) or not all(isinstance(s, Mapping) and "param_groups" in s for s in states):
        return None
    return [s["param_groups"] for s in states]


def apply(loaded: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Put a value an overlay keeps into the loaded dict: the top-level value, or (under
    :data:`OPTIMIZERS`) every optimizer's ``param_groups``.

    Raises:
        IntegrityError: optimizers' groups that do not match the step's optimizers.
    """
    if key != OPTIMIZERS:
        loaded[key] = value
        return
    states = loaded.get(key)
    if not (
        isinstance(value, list) and isinstance(states, list) and len(value) == len(states)
        and all(isinstance(s, dict) for s in states)
    ):
        raise IntegrityError(f"{where}: the optimizers' param_groups kept in it do not match the step's optimizers")
    for state, groups in zip(states, value):
        state["param_groups"] = groups


def as_text(record: bytes) -> str:
    return base64.b64encode(record).decode("ascii")


def decode(text: str, key: str, where: str, safe_types: SafeTypesLike = None) -> Any:
    """(each rank) The value of an overlay's record (base64 ``text``) of top-level ``key``.

    Raises:
        IntegrityError: naming ``where`` and ``key``, the record is not one (damaged or altered).
        UnsafeCheckpointError: the record needs code to be read, or names a class not in
            ``safe_types``.
    """
    what = f"{where}: the value of {key!r} kept in it"
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise IntegrityError(f"{what} is not base64 (the file was damaged or altered)") from None
    try:
        obj = deep_stack.torch_load(io.BytesIO(raw), raw, what)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{what} needs code to be read, which distckpt never runs: {str(exc)[:300]}") from None
    value = decode_loaded(obj, key, safe_types)
    if not isinstance(value, TopLevel):
        raise IntegrityError(f"{what} is not a value record (the file was damaged or altered)")
    return value.value


def check(overlay: object) -> bool:
    """Whether ``overlay`` (from a pointer's JSON) has an overlay's shape."""
    if not isinstance(overlay, dict):
        return False
    for key, value in overlay.items():
        if not isinstance(key, str) or (key in MODEL_KEYS and key != OPTIMIZERS):
            return False
        if not (isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))):
            return False
    return True
