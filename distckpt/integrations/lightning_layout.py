"""Lightning's checkpoint dict as distckpt state, and back, for
:class:`~distckpt.integrations.lightning.DistckptCheckpointIO`.

Every top-level item of Lightning's checkpoint dict is an entry of the distckpt state (names
escaped by :func:`entry_name`: distckpt reserves ``.`` and a leading ``_``): tensors as DCP
tensors, nested dicts and lists as distckpt trees, everything else as values. The structure
(containers, key types, tensor shapes and dtypes) is the *layout*, recorded in the manifest
(``extra[LAYOUT_KEY]``, :func:`prepare`), so that a load rebuilds the dict to load into without
a live model (:func:`read_layout`, :func:`template`).

Imports no Lightning. Not collective: every rank calls these on its own.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from distckpt._caller import outside
from distckpt.errors import IntegrityError
from distckpt.state.containers import (
    dcp_leaf,  # DCP's rule for which lists it enters (one rule, not a copy)
)
from distckpt.state.encoded import FACTORIES, factory_name
from distckpt.state.entries import contains

__all__ = ["LAYOUT_KEY", "entry_name", "node_texts", "prepare", "rank_layouts", "read_layout", "template", "with_rank_nodes"]

#: Where the structure of Lightning's dict is recorded in the manifest (``Manifest.extra``).
LAYOUT_KEY = "lightning"
_LAYOUT_VERSION = 1
_MAX_DEPTH = 64
_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


#: A layout node (JSON): ``["v"]`` a value, ``["t", shape, dtype]`` a tensor, ``["d" | "o", [[tag,
#: key, node], ...]]`` a dict or OrderedDict, ``["D", factory name | None, [[tag, key, node], ...]]``
#: a defaultdict, ``["C", [[tag, key, node], ...]]`` a Counter, ``["l", [node, ...]]`` a list DCP enters, ``["T",
#: [node, ...]]`` a tuple holding tensors (distckpt stores it as a tree: a callback's ``(mean,
#: var)`` pair of tensors; a tuple of plain values is one value).
Node = list[object]


def entry_name(key: str) -> str:
    """The distckpt entry name of a top-level key of Lightning's dict (``.``, ``%`` and a leading
    ``_`` escaped, as distckpt reserves them; injective, so keys never collide)."""
    if not key:
        return "%"
    name = key.replace("%", "%25").replace(".", "%2E")
    return "%5F" + name[1:] if name.startswith("_") else name


def prepare(checkpoint: Mapping[str, Any], copy_values: bool) -> tuple[list[str], dict[str, Any], dict[str, object]]:
    """(each rank) Lightning's top-level keys, the distckpt state and the layout for the manifest.

    Containers are rebuilt (tensors are not copied: distckpt stages them), and with
    ``copy_values`` the other values are deep-copied: an async save must write the values of the
    call, and Lightning's dict holds live objects (``ModelCheckpoint``'s ``best_k_models``)."""
    keys = list(checkpoint)
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"Lightning checkpoint key {k!r} is a {type(k).__name__}; top-level keys must be strings")
    nodes: list[Node] = []
    state: dict[str, Any] = {}
    for k in keys:
        value = checkpoint[k]
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or (
            not isinstance(value, torch.Tensor)
            and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None))
        ):
            raise TypeError(
                f"checkpoint[{k!r}] is a {type(value).__qualname__} object; put its state_dict() into the checkpoint instead"
            )
        if isinstance(value, torch.Tensor) or contains(value):
            node, state[entry_name(k)] = _walk(value, k, 0, copy_values)
        else:
            node, state[entry_name(k)] = ["v"], _copied(value, copy_values)
        nodes.append(node)
    layout = {"version": _LAYOUT_VERSION, "keys": keys, "nodes": json.dumps(nodes, separators=(",", ":"))}
    return keys, state, layout


def _walk(value: Any, where: str, depth: int, copy_values: bool) -> tuple[Node, Any]:
    """Layout node and rebuilt value of a part of a tree entry, down to DCP's items: mappings and
    the lists DCP enters are containers, everything else one item (a tensor, or a value)."""
    if depth > _MAX_DEPTH:
        raise TypeError(f"checkpoint value {where!r} is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"checkpoint tensor {where!r} is a {type(value).__qualname__}: tensor subclasses (DTensor from FSDP or "
                "ModelParallel strategies) are not supported by DistckptCheckpointIO; use DDP or a single device"
            )
        return ["t", list(value.shape), str(value.dtype)], value
    if isinstance(value, Mapping):
        # DCP enters every mapping; the load rebuilds it from its node, of the saved type (a
        # defaultdict keeps its factory: code appending to a missing key works after a resume
        # as before; each came back a plain dict, silently). Other mappings come back as
        # dicts, with a warning at the save.
        kind = _MAPPING_NODES.get(type(value))
        factory = factory_name(value) if kind == "D" else None
        if kind is None or factory == "":
            # (Lightning's own AttributeDict in hyper-parameters or a callback's state: refusing
            # it would stop training at its first checkpoint.)
            what = (
                f"a defaultdict whose default_factory {value.default_factory!r:.60} is not a built-in type"  # type: ignore[attr-defined]
                if factory == ""
                else f"a {type(value).__qualname__} (not a dict, OrderedDict, defaultdict or Counter)"
            )
            _warn_plain(where, what, "dict")
            kind, factory = "d", None
        head: list[object] = ["D", factory] if kind == "D" else [kind]
        out = _mapping(kind, factory)
        items = []
        for k, v in value.items():
            tag = _key_tag(k, where)
            node, out[k] = _walk(v, f"{where}.{k}", depth + 1, copy_values)
            items.append([tag, k, node])
        return [*head, items], out
    if isinstance(value, list) and (not dcp_leaf(value) or contains(value)):  # (a list of tuples holding tensors too)
        if type(value) is not list:
            _warn_plain(where, f"a {type(value).__qualname__} (a list subclass)", "list")
        nodes, out_list = [], []
        for i, v in enumerate(value):
            node, c = _walk(v, f"{where}.{i}", depth + 1, copy_values)
            nodes.append(node)
            out_list.append(c)
        return ["l", nodes], out_list
    if isinstance(value, tuple) and type(value) is not tuple and contains(value):
        raise TypeError(
            f"checkpoint value {where!r} is a {type(value).__qualname__} (a tuple subclass) holding tensors: "
            "DistckptCheckpointIO rebuilds plain tuples, dicts and lists only; store it as a dict (its _asdict()) or a tuple"
        )
    if type(value) is tuple and contains(value):
        # (a tuple of values only is one value, as before; a tuple holding tensors was one value
        # here but a tree in distckpt's state: saved, then never loadable)
        pairs = [_walk(v, f"{where}.{i}", depth + 1, copy_values) for i, v in enumerate(value)]
        return ["T", [n for n, _ in pairs]], tuple(c for _, c in pairs)
    return ["v"], _copied(value, copy_values)


#: The layout node kind of each mapping type a load rebuilds.
_MAPPING_NODES: dict[type, str] = {dict: "d", OrderedDict: "o", defaultdict: "D", Counter: "C"}


def _mapping(kind: str, factory: str | None) -> dict[Any, Any]:
    """An empty mapping of node kind ``kind`` (``factory``: a ``"D"`` node's)."""
    if kind == "D":
        return defaultdict(None if factory is None else FACTORIES[factory])
    return {"o": OrderedDict, "C": Counter}.get(kind, dict)()


_WARNED_PLAIN: set[tuple[str, str]] = set()


def _warn_plain(where: str, what: str, plain: str) -> None:
    """Warn (once per key and type) that checkpoint value ``where``, ``what``, inside a part of
    the checkpoint that holds tensors or containers DCP enters, is saved as a plain ``plain``
    and comes back as one."""
    if (where, what) in _WARNED_PLAIN:
        return
    _WARNED_PLAIN.add((where, what))
    message = (
        f"distckpt: checkpoint value {where!r} is {what}; DistckptCheckpointIO saves it as a plain {plain}, and a "
        f"load gives back a {plain} (store it as one, or as a value of its own top-level key)"
    )
    warnings.warn(message, stacklevel=outside())  # (the caller of distckpt, however deep the value)


def _copied(value: Any, copy_values: bool) -> Any:
    if not copy_values:
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - not copyable: distckpt's save refuses it or stores it as is
        return value


_KEY_TAGS: dict[type, str] = {str: "s", int: "i", bool: "b", float: "f", type(None): "n"}


def _key_tag(key: Any, where: str) -> str:
    tag = _KEY_TAGS.get(type(key))
    if tag is None or (tag == "f" and not math.isfinite(key)):
        raise TypeError(
            f"checkpoint value {where!r} has the key {key!r} ({type(key).__name__}); keys inside Lightning's checkpoint "
            "must be str, int, bool, finite float or None"
        )
    return tag


def read_layout(extra: Mapping[str, object], where: str) -> tuple[list[str], str]:
    """The layout :func:`prepare` recorded in a manifest's ``extra``: Lightning's top-level keys
    and the nodes (JSON) for :func:`template`. ``where`` names the step in errors.

    Raises:
        IntegrityError: no layout (the step was not saved by ``DistckptCheckpointIO``), or a
            malformed one.
    """
    layout = extra.get(LAYOUT_KEY)
    if not isinstance(layout, Mapping) or layout.get("version") != _LAYOUT_VERSION:
        raise IntegrityError(
            f"{where} has no Lightning layout in its manifest (extra[{LAYOUT_KEY!r}]): "
            "it was not saved by DistckptCheckpointIO"
        )
    all_keys, nodes = layout.get("keys"), layout.get("nodes")
    if not isinstance(all_keys, list) or not all(isinstance(k, str) for k in all_keys) or not isinstance(nodes, str):
        raise IntegrityError(f"{where}: malformed Lightning layout in its manifest")
    return all_keys, nodes


def rank_layouts(extra: Mapping[str, object], where: str) -> list[dict[str, str]] | None:
    """The per-rank nodes a layout records (:func:`with_rank_nodes`): per saving rank, the JSON
    node of each top-level key whose structure differed between ranks; ``None`` where none did.

    Raises:
        IntegrityError: a malformed record.
    """
    layout = extra.get(LAYOUT_KEY)
    ranks = layout.get("ranks") if isinstance(layout, Mapping) else None
    if ranks is None:
        return None
    keys = layout.get("keys") if isinstance(layout, Mapping) else None
    if not isinstance(ranks, list) or not ranks or not isinstance(keys, list) or not all(
        isinstance(r, dict) and all(isinstance(k, str) and k in keys and isinstance(v, str) for k, v in r.items())
        for r in ranks
    ):
        raise IntegrityError(f"{where}: malformed per-rank Lightning layout in its manifest")
    return ranks


def with_rank_nodes(keys_of: list[str], nodes_json: str, mine: Mapping[str, str], where: str) -> str:
    """``nodes_json`` with the nodes of ``mine`` (top-level key -> this rank's JSON node) in place
    of the recorded ones: the structure this rank saved where ranks differed (a callback's
    ``best_k_models`` keyed by file names holding each rank's own metric).

    Raises:
        IntegrityError: a node that is not JSON, or a layout that does not match its keys.
    """
    if not mine:
        return nodes_json
    try:
        nodes = json.loads(nodes_json)
        replaced = {k: json.loads(v) for k, v in mine.items()}
    except (ValueError, RecursionError):
        raise IntegrityError(f"{where}: the manifest's Lightning layout is not valid JSON") from None
    if not isinstance(nodes, list) or len(nodes) != len(keys_of):
        raise IntegrityError(f"{where}: the manifest's Lightning layout does not match its keys")
    for i, k in enumerate(keys_of):
        if k in replaced:
            nodes[i] = replaced[k]
    return json.dumps(nodes, separators=(",", ":"))


def node_texts(layout: Mapping[str, object]) -> list[str]:
    """(each rank) The JSON node of each top-level key of a layout :func:`prepare` made (what
    ranks compare to find the entries whose structure differs between them)."""
    return [json.dumps(n, separators=(",", ":")) for n in json.loads(str(layout["nodes"]))]


def template(keys_of: list[str], nodes_json: str, budget: int, where: str) -> dict[str, Any]:
    """(each rank) The state to load into, rebuilt from the manifest's layout: CPU tensors of the
    saved shapes and dtypes, the saved containers and keys, ``None`` where values go.

    Raises:
        IntegrityError: the layout is malformed, or claims more tensor bytes than ``budget``.
    """
    try:
        nodes = json.loads(nodes_json)
    except (ValueError, RecursionError):
        raise IntegrityError(f"{where}: the manifest's Lightning layout is not valid JSON") from None
    if not isinstance(nodes, list) or len(nodes) != len(keys_of):
        raise IntegrityError(f"{where}: the manifest's Lightning layout does not match its keys")
    left = [budget]
    try:
        return {entry_name(k): _build(node, left, 0) for k, node in zip(keys_of, nodes)}
    except _BadLayout as exc:
        raise IntegrityError(f"{where}: malformed Lightning layout in the manifest ({exc})") from None


class _BadLayout(Exception):
    pass


def _build(node: object, left: list[int], depth: int) -> Any:
    if depth > _MAX_DEPTH or not isinstance(node, list) or not node:
        raise _BadLayout("a node that is not a non-empty list, or nested too deeply")
    kind = node[0]
    if kind == "v" and len(node) == 1:
        return None
    if kind == "t" and len(node) == 3:
        shape, dtype = node[1], _DTYPES.get(node[2]) if isinstance(node[2], str) else None
        if dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise _BadLayout(f"a tensor of shape {shape!r:.60} and dtype {node[2]!r:.40}")
        left[0] -= math.prod(shape) * dtype.itemsize
        if left[0] < 0:
            raise _BadLayout("its tensors hold more bytes than the step's files")
        return torch.empty(shape, dtype=dtype)
    if (kind in ("d", "o", "C") and len(node) == 2 and isinstance(node[1], list)) or (
        kind == "D" and len(node) == 3 and (node[1] is None or (type(node[1]) is str and node[1] in FACTORIES)) and isinstance(node[2], list)
    ):
        out = _mapping(kind, node[1] if kind == "D" else None)  # type: ignore[arg-type]
        for item in node[-1]:
            if not isinstance(item, list) or len(item) != 3:
                raise _BadLayout("a mapping item that is not [tag, key, node]")
            out[_key(item[0], item[1])] = _build(item[2], left, depth + 1)
        return out
    if kind == "l" and len(node) == 2 and isinstance(node[1], list):
        return [_build(child, left, depth + 1) for child in node[1]]
    if kind == "T" and len(node) == 2 and isinstance(node[1], list):
        return tuple(_build(child, left, depth + 1) for child in node[1])
    raise _BadLayout(f"unknown node {kind!r:.20}: damaged, or written by a newer distckpt")


def _key(tag: object, key: Any) -> Any:
    if type(tag) is not str:
        raise _BadLayout(f"a key tagged {tag!r:.40}")
    ok = {
        "s": type(key) is str,
        "i": type(key) is int,
        "b": type(key) is bool,
        "f": type(key) in (int, float) and type(key) is not bool,
        "n": key is None,
    }.get(tag)
    if not ok:
        raise _BadLayout(f"a key {key!r:.40} tagged {tag!r:.10}")
    return float(key) if tag == "f" else key
