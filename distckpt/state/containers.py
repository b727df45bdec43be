"""Nested containers in a state as DCP's flattening stores them, and how deep they may nest.

DCP flattens a state dict into dotted keys: it enters mappings, and lists only when they hold
tensors, mappings or such lists (:func:`dcp_leaf`); everything else is stored as one item. At
load it rebuilds plain dicts with string keys and nothing for an empty dict;
:func:`restore_containers` gives an object's state back in the containers and keys it had.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import torch

from distckpt._compat import unflatten_state_dict

SAVE_DEPTH = 100  # nesting a save accepts (deeper: refused, naming the key)
LOAD_DEPTH = 200  # nesting a load walks (checkpoints from before SAVE_DEPTH may nest deeper)


def dcp_leaf(value: object, depth: int = 0) -> bool:
    """Whether DCP's flattening stores ``value`` as one item (mirrors ``traverse_state_dict``:
    mappings are entered, lists only when they hold tensors, mappings or such lists). Lists
    nested beyond :data:`SAVE_DEPTH` count as items, which the save then refuses, naming them."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list) or depth > SAVE_DEPTH:
        return True
    for v in value:
        if isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not dcp_leaf(v, depth + 1)):
            return False
    return True


def unflatten_for_dcp(flat: dict[str, Any], mappings: dict[str, tuple[str | int, ...]]) -> dict[str, Any]:
    """The nested state of a flattened one (``flatten_state_dict``), such that DCP flattens it
    into the same keys again.

    Flattening stores nothing for a mapping without items (``{}``, ``{"b": {}}``); torch's
    unflattening pads the list positions they held with ``None``, and DCP does not enter a list
    of plain values: ``[{}, 3]`` (items ``a.1``) came back as ``[None, 3]`` (one item ``a``), so
    an async save (which stages flattened) wrote other keys than a sync save of the same state,
    and could not be loaded into it. Positions no key reaches are filled with ``{}`` instead;
    a ``None`` that was saved has a key and stays.
    """
    nested = unflatten_state_dict(flat, mappings)
    reached: set[tuple[tuple[str | int, ...], int]] = set()
    for path in mappings.values():
        for i, part in enumerate(path):
            if isinstance(part, int):
                reached.add((tuple(path[:i]), part))
    if not reached:
        return nested
    entered = {path for path, _ in reached}  # lists DCP entered (a list stored whole is a value)

    def fill(value: Any, path: tuple[str | int, ...]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                fill(v, (*path, k))
        elif isinstance(value, list) and path in entered:
            for i, v in enumerate(value):
                if v is None and (path, i) not in reached:
                    value[i] = {}
                else:
                    fill(v, (*path, i))
            # Every list here was entered (its items have keys); if what is left of it reads as
            # plain values (``[None, {}]`` lost its trailing ``{}``), one ``{}`` more makes DCP
            # enter it again, and stores nothing.
            if dcp_leaf(value):
                value.append({})

    fill(nested, ())
    return nested


def restore_containers(loaded: Any, like: Any, depth: int = 0) -> Any:
    """``loaded``, as a load hands an object's state back, in the containers and keys of ``like``
    (the object's own state, of the same structure: DCP's targets had its keys).

    DCP flattens the dicts of a state into string keys, stores nothing for an empty dict, and
    rebuilds plain dicts: without this a ``{0: seed}`` came back as ``{"0": seed}``, a
    ``defaultdict`` as a ``dict``, and ``{"seen": {}}`` as ``{}``, silently. The values are
    ``loaded``'s; keys ``like`` does not have stay as loaded. Lists are matched item by item;
    everything else (stored items, decoded exactly) is left as it is.
    """
    if depth > LOAD_DEPTH:
        return loaded
    if type(loaded) is dict and isinstance(like, Mapping):
        keys = {str(k): k for k in like}
        got: dict[Any, Any] = {}
        for k, v in loaded.items():
            key = keys.get(k, k) if type(k) is str else k
            got[key] = restore_containers(v, like[key], depth + 1) if key in like else v
        pairs = []
        for k in like:  # like's order: the order the object keeps its state in
            if k in got:
                pairs.append((k, got.pop(k)))
            elif not _stores_items(like[k]):  # an empty container: DCP stored nothing for it
                pairs.append((k, _bare(like[k])))
        pairs.extend(got.items())
        return _mapping_like(like, pairs)
    if type(loaded) is list and isinstance(like, list):
        out = []
        for i in range(max(len(loaded), len(like))):
            here = loaded[i] if i < len(loaded) else None
            if i < len(like) and here is None and not _stores_items(like[i]):
                out.append(_bare(like[i]))  # DCP padded with None (or stopped) where it stored nothing
            elif i < len(loaded):
                out.append(restore_containers(here, like[i], depth + 1) if i < len(like) else here)
            else:
                break
        return out
    return loaded


def _stores_items(value: object, depth: int = 0) -> bool:
    """Whether DCP's flattening of ``value`` yields any item (an empty dict yields none)."""
    if depth > LOAD_DEPTH:
        return True
    if isinstance(value, Mapping):
        return any(_stores_items(v, depth + 1) for v in value.values())
    if isinstance(value, list) and not dcp_leaf(value):
        return any(_stores_items(v, depth + 1) for v in value)
    return True


def _bare(like: Any) -> Any:
    """A copy of a container that holds no items (dicts of empty dicts ...), of ``like``'s types."""
    if isinstance(like, Mapping):
        return _mapping_like(like, [(k, _bare(v)) for k, v in like.items()])
    return [_bare(v) for v in like] if isinstance(like, list) else like


def _mapping_like(like: Mapping[Any, Any], pairs: list[tuple[Any, Any]]) -> Mapping[Any, Any]:
    """A mapping of ``like``'s type holding ``pairs`` (a plain dict for types it cannot build)."""
    t = type(like)
    if t is collections.defaultdict:
        return collections.defaultdict(like.default_factory, pairs)  # type: ignore[attr-defined]
    if t is collections.Counter:
        return collections.Counter(dict(pairs))
    return t(pairs) if t in (dict, collections.OrderedDict) else dict(pairs)
