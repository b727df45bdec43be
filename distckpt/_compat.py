"""Every private torch API distckpt relies on, in one place.

torch has no public equivalent for these in 2.11-2.15. Each may change in a torch release without
notice; this module is what to check (and ``tests/test_compat.py``, which imports and exercises
each of them, is what fails) when pyproject's torch range moves. Small helpers that torch keeps
private but that are trivial (narrowing a tensor by offsets, copying ZeRO's hyper-parameters) are
written out in distckpt instead of imported.

Checked against torch 2.11.0, 2.12.1, 2.13.0 and 2.14.1 (2026-11-25, their installed sources read
side by side, and ``tests/compat.sh VERSION`` run for each): every API below has the same
signature and behaviour in all four, so no branch by version is needed yet. A difference found
later goes here as a branch on ``TORCH_VERSION`` with the releases it covers named.

torch 2.15.0 (2026-11-28: its sources compared with 2.13.0's, ``tests/compat.sh 2.15.0`` run) has
two differences distckpt depends on, each a branch here:

* ``torch.distributed.checkpoint._fsspec_filesystem`` became a shim that warns on import
  (DeprecationWarning); the class moved to ``fsspec_filesystem._FileSystem``.
* DCP's ``TensorProperties`` gained a field, ``strides``, pickled as a sixth item of its state,
  which 2.11-2.14 cannot unpickle: :data:`TENSOR_PROPERTIES_READER`. (distckpt's plan encoding
  shares one properties object per kind: the strides are part of the kind,
  :func:`distckpt.save.metadata.encode_plan`.)

Unchanged in 2.15 for what distckpt uses: ``_nested_dict``, ``_traverse.set_element``,
``serialization._save``, ``_utils._rebuild_tensor_v2``, ``state_dict._get_fqns``,
``state_dict_loader._load_state_dict``, ``Stateful``, ``_get_object_coll_device``,
``_world.pg_map``, ``DeviceMesh``'s ``_init_backend``/``_rank`` keywords, ``_split_by_size_and_type``,
``_StorageInfo``; ``_StridedShard`` gained padding helpers and is still not a ``Shard``. Nearby,
not depended on: DCP's planners learned a ``CheckpointableTensor`` protocol; the weights-only
unpickler defers ``NEWOBJ`` of pybind11 classes to their ``BUILD`` and no longer admits
``_rebuild_nested_tensor``; a new dtype, ``torch.bcomplex32``.

Differences seen nearby that distckpt does not depend on, among 2.11-2.14:

* 2.11: ``FileSystemWriter.finish`` stamps ``metadata.version`` on a copy (``dataclasses.replace``),
  2.12+ on the object passed in; distckpt passes its own copy either way (its save run's finish).
* 2.11: ``dcp.load``'s error when no ``.metadata`` can be read is a bare "metadata is None"
  (2.12+ add the causes); distckpt reads and verifies ``.metadata`` itself before DCP does.
* 2.11: ``DefaultSavePlanner(enable_plan_caching=True)`` caches the local plan before the global
  plan is validated (2.12+ after); distckpt's planner does not use DCP's plan cache.
* 2.14: ``FileSystemWriter`` warns instead of calling ``os.sync()`` when a stream has no
  ``fileno()``; distckpt writes files through its own writer (``CheckpointWriter.write_data``).
* ``DeviceMesh.__init__`` was restructured between 2.11 and 2.13 (layout checks), keeping the
  ``_init_backend`` and ``_rank`` keywords :func:`mesh_without_groups` uses.
* CUDA builds (PyPI's default for 2.11, 2.12 and 2.14) hold ~260 MB more resident memory after
  ``import torch`` than the 2.13 CPU build; nothing here depends on the build.
"""

from __future__ import annotations

import io
import re

# DCP's flattening of nested state dicts into dotted keys, and its inverse. DCP's planners do the
# same internally (flatten_state_dict=True); distckpt needs the key mapping itself to stage async
# saves in DCP's layout and to hand loaded values back to nested objects.
from torch.distributed.checkpoint._nested_dict import (  # noqa: F401
    flatten_state_dict,
    unflatten_state_dict,
)

# Sets one value inside a nested state dict by its flattened path (the load planner's
# load_bytes override puts safely-unpickled values where DCP's own planner would).
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401

import torch

#: The running torch's release as a tuple, e.g. (2, 11, 0), for branches by version.
#: "2.14.0a0+git..." (a source build) gives (2, 14, 0).
TORCH_VERSION: tuple[int, ...] = tuple(int(x) for x in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])

# DCP's fsspec-backed FileSystem (its public FsspecWriter/FsspecReader wrap it but create their
# own fsspec instance from a URL, losing the caller's storage_options; see GUIDE: "passing a
# configured writer and checkpoint_id silently drops the storage options"). torch 2.15 moved it to
# the public module ``fsspec_filesystem`` as ``_FileSystem``; the old module still re-exports it
# but warns (DeprecationWarning) on import.
if TORCH_VERSION >= (2, 15):
    from torch.distributed.checkpoint.fsspec_filesystem import _FileSystem as FsspecDcpFileSystem  # noqa: F401
else:  # 2.11-2.14
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecDcpFileSystem  # noqa: F401

# DCP's protocol for a plain local tensor that holds shards of a global one (torch 2.15+: a
# runtime-checkable Protocol, ``CheckpointableTensor``): the attributes DCP's planners read. None
# before 2.15, whose DCP saves such a tensor as the plain tensor it is.
if TORCH_VERSION >= (2, 15):
    from torch.distributed.checkpoint import CheckpointableTensor as _CheckpointableTensor

    CHECKPOINTABLE_TENSOR_FIELDS: tuple[str, ...] = tuple(_CheckpointableTensor.__annotations__)
else:
    CHECKPOINTABLE_TENSOR_FIELDS = ()

# The zip container torch.save writes. Readers find a tensor's raw bytes inside a DCP record
# (to read it straight into its destination); the torch-format export writes records one
# tensor at a time, which torch.save cannot do without holding everything in memory.

PyTorchFileReader = torch._C.PyTorchFileReader
PyTorchFileWriter = torch._C.PyTorchFileWriter


def storage_alignment() -> int:
    """torch.save's storage alignment for new files (every torch of pyproject's range has one)."""
    import torch.serialization as ser

    return ser._get_storage_alignment()


def dtype_from_storage_name(name: str) -> torch.dtype:
    """The dtype of a ``torch.<X>Storage`` name as torch.save pickles it."""
    return torch.storage._get_dtype_from_pickle_storage_type(name)


def storage_name_of_dtype(dtype: torch.dtype) -> str:
    """The ``<X>Storage`` class name torch.save pickles for ``dtype``."""
    from torch.storage import _dtype_to_storage_type_map

    return _dtype_to_storage_type_map()[dtype]


# The function torch.save pickles to rebuild a tensor (its reference by name is part of the file
# format, so exports must use exactly this one).
rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2
# ... and the one it pickles for the dtypes that have no ``<X>Storage`` class (uint16/32/64, the
# float8 family...): an ``UntypedStorage`` of bytes and the dtype as an argument.
rebuild_tensor_v3 = torch._utils._rebuild_tensor_v3


def untyped_storage_dtypes() -> frozenset[torch.dtype]:
    """The dtypes torch.save pickles through :data:`rebuild_tensor_v3` (no ``<X>Storage`` class)."""
    return frozenset(torch.storage._new_dtypes())


# The enum DCP pickles a tensor's memory format as (the allow-list unpickler admits it, and
# Python 3.11.0-3.11.2 pickle its members as getattr(enum, name)).
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as MEM_FORMAT_ENCODING  # noqa: E402,F401


def _tensor_properties_reader() -> type:
    """The class ``.metadata``'s ``TensorProperties`` are unpickled as.

    torch 2.15 added the field ``strides`` (the tensor's strides, or ``None``): its DCP pickles a
    sixth item in the state, which the ``__setstate__`` of 2.11-2.14 cannot unpack ("too many
    values to unpack (expected 5)"), so plain ``dcp.load`` there cannot read a checkpoint written
    under 2.15. Under those releases this subclass takes the five fields they know, keeps the
    sixth as the attribute ``strides`` (nothing in their DCP reads it) and becomes a plain
    ``TensorProperties``; 2.15 and later read both forms themselves."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import TensorProperties

    if any(f.name == "strides" for f in dataclasses.fields(TensorProperties)):
        return TensorProperties

    def __setstate__(self: TensorProperties, state: object) -> None:
        strides, newer = None, type(state) is tuple and len(state) == 6
        if newer:
            state, strides = state[:5], state[5]
        TensorProperties.__setstate__(self, state)
        if newer:
            self.strides = strides  # checked as a field by distckpt.integrity.metadata_check
        object.__setattr__(self, "__class__", TensorProperties)

    name = "TensorProperties without its fields"
    return type(name, (TensorProperties,), {"__slots__": (), "__setstate__": __setstate__, "__qualname__": name})


#: See :func:`_tensor_properties_reader`.
TENSOR_PROPERTIES_READER: type = _tensor_properties_reader()


def object_collective_device(pg: object) -> str:
    """The device type torch's object collectives use on ``pg`` (``"cpu"`` where a CPU backend
    serves the group, e.g. gloo or ``cpu:gloo,cuda:nccl``; ``"cuda"`` for NCCL alone)."""
    import torch.distributed.distributed_c10d as c10d

    pick = getattr(c10d, "_get_object_coll_device", None)
    if pick is not None:
        return pick(pg)
    return "cuda" if torch.distributed.get_backend(pg) == "nccl" else "cpu"


def group_is_registered(pg: object) -> bool:
    """Whether ``pg`` is still one of torch.distributed's live groups (destroy_process_group()
    of the default group unregisters every group)."""
    from torch.distributed import distributed_c10d

    return pg in distributed_c10d._world.pg_map


def mesh_without_groups(mesh: list, dim_names: tuple[str, ...] | None, rank: int) -> object:
    """A CPU ``DeviceMesh`` of the given global ranks, seen from global ``rank``, that creates no
    process groups (``_init_backend=False``, ``_rank``: private keywords of torch 2.11-2.15).

    distckpt's background writer process rebuilds the DTensors a rank staged with it: DCP needs
    only each DTensor's mesh shape, coordinate and placements to write a shard, and the writer
    process has no groups of the training job."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", mesh, mesh_dim_names=dim_names, _init_backend=False, _rank=rank)


def model_key_fqns(model: torch.nn.Module, key: str) -> str:
    """The FQN ``get_model_state_dict`` gives state-dict key ``key`` of ``model`` (DDP's
    ``module.`` and ``torch.compile``'s ``_orig_mod.`` removed), by torch's own rule
    (``_get_fqns``) and with its check that only such wrapper parts were removed.
    :mod:`distckpt.state.module_keys` caches the result per module structure."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    fqns = _get_fqns(model, key)
    if len(fqns) != 1:
        raise AssertionError(f"Expected 1 FQN for key '{key}', got {len(fqns)}: {fqns}")
    fqn = next(iter(fqns))
    if fqn != key:
        fqn_split, fqn_idx = fqn.split("."), 0
        ok = len(fqn) < len(key)
        if ok:
            for key_idx, key_name in enumerate(key.split(".")):
                if key_name == fqn_split[fqn_idx]:
                    fqn_idx += 1
                    if fqn_idx == len(fqn_split):
                        ok = key_idx == len(key.split(".")) - 1
                        break
                elif key_name not in ("module", "_orig_mod"):
                    ok = False
                    break
        if not ok:
            raise RuntimeError(f"An unexpected key, {key}, exists. FQN is {fqn}")
    return fqn


# DCP's rule for splitting one rank's items into its data files, and the record of where an
# item landed: distckpt.save.records writes DCP's files with torch.save's per-record CRC chosen
# per call, and must split, name and describe them exactly as DCP's FileSystemWriter does.
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type as split_by_size_and_type  # noqa: E402,F401
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # noqa: E402,F401


def write_torch_record(obj: object, stream: object, crc: bool) -> None:
    """``torch.save(obj, stream)`` (new zipfile format, default pickle protocol), byte for byte,
    with the per-record CRC-32 computed or not for this call only.

    torch.save reads that choice from a process-wide setting (``set_crc32_options``); this is its
    body (``_open_zipfile_writer`` + ``_save``) with the choice passed to the zip writer."""
    import pickle

    import torch.serialization as ser

    writer = torch._C.PyTorchFileWriter(stream, crc, ser._get_storage_alignment())
    ser._save(obj, writer, pickle, ser.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    stream.flush()


# DTensor's strided placement: FSDP2 applied over tensor parallelism shards the TP-sharded
# dimension again with it (``_StridedShard`` on the FSDP mesh dimension). In torch 2.13 it is not
# a ``Shard`` subclass and its ``is_shard()`` is False, yet it shards the tensor, and torch's
# chunk helper (``compute_local_shape_and_global_offset``, the block DCP writes) shards by it:
# the save planner must count it as sharding (distckpt.state.placements.replica_dims).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: E402,F401

# The block of a DTensor that each rank holds by its placements (torch.chunk's split): what DCP
# writes for its local tensor (distckpt.state.placements.check_block).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402,F401


# DCP's load without the public wrapper's per-value ``isinstance(value, Stateful)`` (twice per
# value). ``Stateful`` is a runtime-checkable Protocol: each check inspects the value's class
# statically, ~10 us; distckpt hands DCP a flat state dict, where a model with an optimizer has
# thousands of values (9544 for 636 parameters with AdamW: 0.2 s of a ~1 s load, measured).
# Added 2026-11-27 (third session) and run against 2.13.0 and 2.11.0 (the CI's compat run) only:
# 2.12 and 2.14 were not reinstalled for it (2.11's ``_load_state_dict`` takes the same keywords).
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

_NEVER_STATEFUL = frozenset({type(None), bool, int, float, complex, str, bytes, tuple, list, dict, io.BytesIO})


def load_flat(state_dict: dict, storage_reader: object, planner: object) -> None:
    """``dcp.load(state_dict, storage_reader=..., planner=..., no_dist=True)``, the same calls in
    the same order, for a flat state dict: values that are tensors (of classes without
    ``state_dict``/``load_state_dict``) or plain built-in values skip the ``Stateful`` check; a
    state dict holding any other value goes through ``dcp.load`` itself."""
    import torch.distributed.checkpoint as dcp

    for value in state_dict.values():
        kind = type(value)
        if kind in _NEVER_STATEFUL:
            continue
        if isinstance(value, torch.Tensor) and not (hasattr(kind, "state_dict") or hasattr(kind, "load_state_dict")):
            continue
        if isinstance(value, Stateful):  # DCP loads it in place through its own methods
            dcp.load(state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)
            return
    ordered = {key: state_dict[key] for key in sorted(state_dict)}  # dcp.load's order
    _load_state_dict(state_dict=ordered, storage_reader=storage_reader, planner=planner, no_dist=True)
    state_dict.update(ordered)  # what dcp.load does for values that are not Stateful


def byte_viewable(t: torch.Tensor) -> bool:
    """Whether ``t.reshape(-1).view(torch.uint8)`` sees ``t``'s own memory: contiguous, with a unit
    stride once flattened. One element counts as contiguous whatever its stride
    (``scores[1:, 2]``), yet no byte view of it can be made."""
    return t.is_contiguous() and t.reshape(-1).stride(0) == 1


def as_byte_viewable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where :func:`byte_viewable`, else a contiguous copy."""
    return t if byte_viewable(t) else t.clone(memory_format=torch.contiguous_format)
