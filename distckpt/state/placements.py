"""Which ranks hold the same block of a DTensor, from its placements: what a save writes once and
a load's state check counts once.

Along a mesh dimension placed ``Replicate`` every rank holds the same block; along one placed
``Shard`` or ``_StridedShard`` (or a subclass) the ranks hold different blocks. The copy at
coordinate 0 of the replicating dimensions writes each block (:func:`writes_dtensor`), and the
load's state check designates the same copy (:mod:`distckpt.load.verify`). A placement that is
neither (``Partial``, or one distckpt does not know) is refused, naming key and placement.

Pure and local: every rank computes it from its own DTensors.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from distckpt._compat import StridedShard, compute_local_shape_and_global_offset


class PlacementError(ValueError):
    """A DTensor placement a checkpoint cannot hold correctly (``Partial``, or one distckpt does
    not know); the message names the key, the placement and its mesh dimension."""


#: Placements that shard a tensor along the mesh dimension they sit on: exactly those torch's
#: chunk helper (``compute_local_shape_and_global_offset``, by which DCP writes a DTensor) shards
#: by, subclasses included. ``_StridedShard`` (FSDP2 over TP) is not a ``Shard`` in torch 2.13 and
#: its ``is_shard()`` is False, so ``is_shard()`` is not the test.
_SHARDING = (Shard, StridedShard)


def _dim_name(value: DTensor, dim: int) -> str:
    names = value.device_mesh.mesh_dim_names
    return f"mesh dimension {dim}" + (f" ({names[dim]!r})" if names else "")


def replica_dims(value: DTensor, key: str) -> tuple[int, ...]:
    """(each rank, pure) The mesh dimensions of ``value``'s mesh along which ranks hold the same
    block of it: those whose placement is ``Replicate``. Every other dimension must shard it.

    Args:
        value: a DTensor of the state.
        key: its flattened key, named in errors.

    Raises:
        PlacementError: a ``Partial`` placement (each rank holds an unreduced partial value: any
            one copy would be wrong, and DCP refuses it too), or a placement that is neither
            sharding (:data:`_SHARDING`) nor replicating: distckpt cannot tell which ranks hold
            the same block, and torch's chunk helper would silently treat it as a replica.
    """
    dims = []
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, _SHARDING):
            continue
        if isinstance(placement, Replicate):
            dims.append(dim)
        elif isinstance(placement, Partial):
            raise PlacementError(
                f"cannot checkpoint DTensor {key!r}: its placement {placement!r} on {_dim_name(value, dim)} "
                "holds unreduced partial values (no rank's copy is the tensor, and DCP refuses it too); "
                "reduce it first, e.g. with value.redistribute(placements=...) to Replicate() or Shard(d)"
            )
        else:
            raise PlacementError(
                f"cannot checkpoint DTensor {key!r}: unknown placement {placement!r} "
                f"({type(placement).__module__}.{type(placement).__qualname__}) on {_dim_name(value, dim)}; "
                "distckpt knows Shard, _StridedShard and Replicate (and their subclasses) and cannot "
                "tell which ranks hold the same block under another placement"
            )
    return tuple(dims)


def replication(value: DTensor, key: str) -> tuple[int, tuple[int, ...] | None]:
    """(each rank, pure) ``(replication factor, mesh coordinate)`` of a DTensor: how many ranks of
    its mesh hold each of its blocks (the product of the sizes of its :func:`replica_dims`).

    Raises:
        PlacementError: see :func:`replica_dims` (``key``, the flattened key, names the tensor).
    """
    mesh = value.device_mesh
    factor = 1
    for dim in replica_dims(value, key):
        factor *= mesh.size(dim)
    coord = mesh.get_coordinate()
    return factor, (tuple(coord) if coord is not None else None)


def writes_dtensor(value: DTensor, key: str) -> bool:
    """(each rank, pure) Whether this rank writes its block of ``value``: it is in the mesh and at
    coordinate 0 on every :func:`replica_dims` dimension, so that of the ranks of the mesh
    holding one block exactly one writes it. The load's state check designates the same copy
    (:mod:`distckpt.load.verify`). Copies held on other meshes are left to the coordinator
    (:func:`build_global`).

    Raises:
        PlacementError: see :func:`replica_dims`.
    """
    coord = value.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(coord[dim] == 0 for dim in replica_dims(value, key))


def check_block(value: DTensor, key: str) -> None:
    """(each rank, pure) Refuse a DTensor whose local tensor is not the block its placements give
    this rank (one made by ``DTensor.from_local(..., run_check=False)`` with shards split other
    than ``torch.chunk`` splits): DCP would record the block its placements give and write the
    local tensor under it, a committed step that no load can read.

    Raises:
        PlacementError: naming the key, both shapes and the rank's mesh coordinate.
    """
    coord = value.device_mesh.get_coordinate()
    if coord is None or value.numel() == 0:
        return  # (no elements: nothing to write under any block; FSDP2 holds (0, 0) of a (4, 0))
    shape = _block_shape(tuple(value.shape), value.device_mesh, tuple(value.placements))
    local = value.to_local().shape
    if tuple(shape) != tuple(local):
        raise PlacementError(
            f"cannot checkpoint DTensor {key!r}: this rank (mesh coordinate {tuple(coord)}) holds a block of shape "
            f"{tuple(local)}, but its placements {tuple(value.placements)} over shape {tuple(value.shape)} give it "
            f"{tuple(shape)} (torch.chunk's split, by which checkpoints record blocks); make it with "
            "distribute_tensor, or with DTensor.from_local from shards split as torch.chunk splits"
        )


@functools.lru_cache(maxsize=4096)
def _block_shape(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """The block a rank of ``mesh`` holds of a DTensor (~40 us a call: once per parameter
    layout, not per parameter and save)."""
    return tuple(compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)[0])
