"""Cost of save planning for simulated world sizes (8 .. 4096), without real processes: DCP's
planner and distckpt's, on a first and a repeated save.

Every save plans before writing a byte:

1. on every rank, a local plan: what it writes;
2. a gather of all local plans to the coordinator (pickled);
3. on the coordinator, the global plan: deduplicate, build the global ``Metadata`` (one chunk
   record per written piece) and validate it; then the writer's ``prepare_global_plan``;
4. a scatter of the answers; after the data is written the coordinator adds the write results
   (``storage_data``) and pickles ``.metadata``.

Planners (the ``planner`` field of each row):

* ``dcp``: ``dcp.save``'s ``DefaultSavePlanner``. Every rank lists everything it holds (a DDP
  rank: every tensor) with every flatten mapping; the coordinator deduplicates ``world x items``.
  ``save="repeat"`` uses its ``enable_plan_caching=True``: ranks whose plan did not change send an
  empty "unusable" plan and the coordinator reuses its cached global plan.
* ``distckpt``: :mod:`distckpt.save.assign` / ``.metadata`` / ``.protocol`` exactly as a save runs them (``describe`` and the view
  every rank exchanges in ``prepare``, ``decide`` in ``agree``, ``DistckptSavePlanner``'s local
  plan in its wire form, ``build_global``, the writer's ``prepare_global_plan``). Each rank lists
  only what it writes. ``save="repeat"``: every rank's structure is unchanged, so no plan is
  gathered or scattered; the coordinator reuses its cached ``Metadata``.

Fields (per row): ``coordinator_s`` is everything the coordinator does between holding the local
plans and holding the answers it sends back, plus building and pickling the plan's
``Metadata`` (``global_plan_s + prepare_global_plan_s + metadata_pickle_s``; the repeat of
distckpt: copying the cached ``Metadata`` and pickling it). ``gathered_plans_bytes``: pickled bytes
of what the coordinator receives; ``scattered_bytes``: of what it sends back. Not in
``coordinator_s``, reported beside it: ``receive_s`` (unpickling what was gathered) and
``finish_s`` (``storage_data`` from simulated write results and the pickle of the complete
``.metadata``, done after the data is written, on every save). ``local_plan_s``: the slowest
simulated rank's own planning (distckpt: ``describe`` + ``decide`` + local plan).

Layouts: ``replicated`` (DDP-like: every rank holds every tensor, as meta tensors) and ``sharded``
(FSDP-like: every tensor a ``DTensor`` split along dim 0 over the ranks, built per simulated rank
on a fake process group, so DCP's and distckpt's code see real DTensors). Two layouts on a 2-D
mesh, distckpt's planner only (DCP's is measured on the 1-D ones):

* ``fsdp_tp``: torchtitan's FSDP2 x TP on a ``(dp, tp)`` mesh (``tp = min(8, W)``), as
  ``fully_shard`` over ``parallelize_module`` leaves it: column-wise matrices and their biases
  ``(_StridedShard(0, split_factor=tp), Shard(0))``, row-wise ones (attention out, MLP down)
  ``(Shard(0), Shard(1))``, the other vectors (norms under sequence parallelism, row-wise biases)
  ``(Shard(0), Replicate())``. Every rank writes its own block of every matrix, so the items
  written grow as ``W x tensors``; it runs with ``--tensors-2d`` tensors (default 125, 124 in
  the GPT-like list: at 4,096 ranks 286k written items, against the 512k of the 1-D sharded
  target at 512 ranks and 1,000 tensors; 1,000 tensors at 4,096 ranks, 2.3M items, were not
  simulated on the 2-core VM).
* ``hsdp``: ``fully_shard`` on a ``(replicate, shard)`` mesh (``shard = min(8, W)``): every
  tensor ``(Replicate(), Shard(0))``; only the ``shard`` ranks of replica 0 write, so the items
  written do not grow with ``W`` (as for ``replicated``), ``--tensors`` tensors.

For these two every simulated rank is built and planned once: its view is checked equal to rank
0's (DTensor-only states: no plain leaves, the same replicated keys on every rank) instead of
building every rank twice. torch's chunk helper (``compute_local_shape_and_global_offset``, which
DCP's write items call) costs ~2 ms per ``_StridedShard`` tensor; it is memoized for the bulk of
the ranks (same result per shape, placements and coordinate) and runs unmemoized on the first and
the last rank, whose times give ``local_plan_s``.

``--real N`` checks the simulation against a real save: N gloo processes
(``tests/dist_harness.run_ranks``) save a tiny state of the same layout twice through
``distckpt.Checkpointer``; the measured gathered bytes and coordinator times
(``SaveStats.plan``) are reported next to the simulated rows of the same state at N ranks.

Run ``python benchmarks/plan_scaling.py --help``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json_arg,
    choice_list, layer_shapes, machine_info, nonnegative_int, positive_int, positive_ints, publish, resolve_outputs, resolve_quick,
    save_figure,
)  # fmt: skip

#: Targets of issue 14: (layout, planner, save, world size) -> (max coordinator_s, max gathered bytes).
#: Issue 29 holds the 2-D layouts to the same at 4,096 ranks: HSDP, whose items written do not
#: grow with W, to the replicated ones; FSDP x TP, whose items grow as W x tensors, to the sharded
#: one (first save <= 1 s for ~300-500k items written: 512 ranks x 1,000 tensors there,
#: 4,096 ranks x --tensors-2d 125 here; like the sharded layout, no target for its repeat, whose
#: coordinator time is pickling the cached ``.metadata``).
TARGETS = {
    ("replicated", "distckpt", "first", 4096): (0.5, 10e6),
    ("replicated", "distckpt", "repeat", 4096): (0.05, None),
    ("sharded", "distckpt", "first", 512): (1.0, None),
    ("hsdp", "distckpt", "first", 4096): (0.5, 10e6),
    ("hsdp", "distckpt", "repeat", 4096): (0.05, None),
    ("fsdp_tp", "distckpt", "first", 4096): (1.0, None),
}
#: Layouts on a 2-D mesh (see the module docstring); distckpt's planner only.
MESH_LAYOUTS = ("fsdp_tp", "hsdp")


def model_shapes(n_tensors: int, d: int, vocab: int = 32000) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-like: embeddings, then layers of 4 matrices + 8 vectors until ``n_tensors``."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb", (vocab, d)), ("lm_head", (vocab, d))]
    layer = 0
    while len(shapes) + 12 <= n_tensors - 2:
        shapes += layer_shapes(f"layers.{layer}", d)
        layer += 1
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# -------------------------------------------------------------------------------------------------
# Simulated ranks' states
def replicated_state(shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    import torch

    return {"model": {n: torch.empty(s, device="meta") for n, s in shapes}}


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """Be rank ``rank`` of ``world`` on a fake process group (no communication) in this process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_state(shapes: list[tuple[str, tuple[int, ...]]], world: int, rank: int) -> dict[str, Any]:
    """This rank's FSDP-like state: each tensor a DTensor split along dim 0 (torch.chunk sizes)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shape in shapes:
        rows = shape[0]
        per = -(-rows // world)
        n = max(0, min(per, rows - rank * per))
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        local = torch.empty((n, *shape[1:]), device="meta")
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=tuple(stride))
    return {"model": out}


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)


def mesh_placements(layout: str, name: str, shape: tuple[int, ...], inner: int) -> list[Any]:
    """The placements ``layout`` gives tensor ``name`` on its 2-D mesh (``inner``: the tp/shard size)."""
    from torch.distributed.tensor import Replicate, Shard

    from distckpt._compat import StridedShard

    if layout == "hsdp":
        return [Replicate(), Shard(0)]
    rowwise = any(part in name for part in ("attn.out.", "mlp.down."))
    if len(shape) == 2:
        return [Shard(0), Shard(1)] if rowwise else [StridedShard(0, split_factor=inner), Shard(0)]
    if name.endswith(".bias") and not rowwise and "ln" not in name:  # column-wise biases: split like their matrix
        return [StridedShard(0, split_factor=inner), Shard(0)]
    return [Shard(0), Replicate()]  # norms (sequence parallel), row-wise biases


def mesh_state(layout: str, shapes: list[tuple[str, tuple[int, ...]]], world: int, rank: int, chunk: Any) -> dict[str, Any]:
    """Rank ``rank``'s state in ``layout`` (``fsdp_tp`` or ``hsdp``) on a ``(W / inner, inner)``
    mesh, ``inner = min(8, W)``; ``chunk`` is torch's chunk helper (or a memoized one).

    The mesh creates no process groups (``distckpt._compat.mesh_without_groups``, as distckpt's
    writer process rebuilds meshes: planning needs only shapes, coordinates and placements), and
    DTensors of one shape and placements share the spec ``DTensor.from_local`` built for the first
    (``from_local`` costs ~60 us a tensor, the constructor ~4 us): the same DTensors, built in
    seconds instead of minutes at 4,096 ranks."""
    import torch
    from torch.distributed.tensor import DTensor

    from distckpt._compat import mesh_without_groups

    inner = min(8, world)
    names = ("dp", "tp") if layout == "fsdp_tp" else ("replicate", "shard")
    ranks = torch.arange(world).reshape(world // inner, inner).tolist()
    mesh = mesh_without_groups(ranks, names, rank)
    templates: dict[tuple, Any] = {}
    out = {}
    for name, shape in shapes:
        placements = mesh_placements(layout, name, shape, inner)
        local_shape, _ = chunk(shape, mesh, placements)
        local = torch.empty(local_shape, device="meta")
        key = (shape, tuple(placements))
        template = templates.get(key)
        if template is None:
            template = templates[key] = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=_stride(shape)
            )
            out[name] = template
        else:
            out[name] = DTensor(local, template._spec, requires_grad=False)
    return {"model": out}


@contextlib.contextmanager
def memoized_chunks():
    """torch's ``compute_local_shape_and_global_offset`` memoized by (shape, mesh shape,
    coordinate, placements) where DCP's write items call it; yields the memoized function."""
    from torch.distributed.checkpoint import planner_helpers
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as exact

    memo: dict[tuple, Any] = {}

    def chunk(shape: Any, mesh: Any, placements: Any, skip_offset: bool = False) -> Any:
        key = (tuple(shape), tuple(mesh.shape), tuple(mesh.get_coordinate() or ()), tuple(placements), skip_offset)
        out = memo.get(key)
        if out is None:
            out = memo[key] = exact(shape, mesh, placements, skip_offset)
        return out

    planner_helpers.compute_local_shape_and_global_offset = chunk
    try:
        yield chunk
    finally:
        planner_helpers.compute_local_shape_and_global_offset = exact


# -------------------------------------------------------------------------------------------------
# distckpt's path, per simulated rank
def distckpt_view(state: dict[str, Any], cache: Any = None) -> tuple[Any, Any, list]:
    """What ``_saving.prepare`` computes for the plan: the structure and the exchanged view."""

    from distckpt.save import assign as _assign
    from distckpt._compat import flatten_state_dict
    from distckpt.save.phases import SaveView
    from distckpt.save.staging import replicated_layout

    layout, sizes = replicated_layout({"model": state["model"]})
    structure = _assign.describe(flatten_state_dict(state)[0])
    token = cache.token(structure.own) if cache is not None else None
    view = SaveView(0, ["model"], {}, {}, layout, structure.plain, structure.replicas_digest, token)
    return view, structure, sizes


def distckpt_local(state: dict[str, Any], plan_in: Any, rank: int) -> tuple[Any, bytes]:
    """This rank's local plan and the payload it sends to the coordinator."""

    from distckpt.save import metadata as _metadata
    from distckpt.save import planner as _planner
    from distckpt.save import protocol as _protocol

    planner = _planner.DistckptSavePlanner(plan_in)
    planner.set_up_planner(state, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    return plan, _protocol.dumps((None, _metadata.encode_plan(plan)))


# -------------------------------------------------------------------------------------------------
# The coordinator, and the rows
def _writer() -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter("/nonexistent-plan-scaling", single_file_per_rank=True)


def _write_results(final_plans: list[Any]) -> list[list[Any]]:
    """Simulated write results of the final plans (one file per rank, items back to back)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    out = []
    for r, plan in enumerate(final_plans):
        offset, res = 0, []
        for item in plan.items:
            n = 64
            if item.tensor_data is not None:
                n = item.tensor_data.properties.dtype.itemsize
                for d in item.tensor_data.chunk.sizes:
                    n *= d
            res.append(WriteResult(item.index, n, _StorageInfo(f"__{r}_0.distcp", offset, n)))
            offset += n
        out.append(res)
    return out


def _finish(metadata: Any, results: list[list[Any]]) -> tuple[float, int]:
    """What the writer's ``finish`` does before writing: ``storage_data`` and the pickle."""
    md = dataclasses.replace(metadata)
    t0 = time.perf_counter()
    storage: dict = {}
    for res in results:
        storage.update({wr.index: wr.storage_data for wr in res})
    md.storage_data = storage
    data = dumps(md)
    return time.perf_counter() - t0, len(data)


def _common_fields(local: list[Any], final: list[Any], meta_bytes: bytes, final_bytes: int, finish_s: float) -> dict[str, Any]:
    """Row fields both planners report alike: items planned and written, metadata sizes, finish."""
    return dict(
        local_items_total=sum(len(p.items) for p in local),
        items_written=sum(len(p.items) for p in final),
        ranks_writing=sum(1 for p in final if p.items),
        metadata_bytes=len(meta_bytes),
        metadata_final_bytes=final_bytes,
        finish_s=finish_s,
    )


def _timed(fn: Any, collect: bool = True) -> tuple[Any, float]:
    """``fn()`` and its duration, without the garbage collector running inside it
    (``collect``: run it before; not in per-rank loops, where it would dominate)."""
    if collect:
        gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0
    finally:
        gc.enable()


def _row(layout: str, world: int, shapes: list, planner: str, save: str, **fields: Any) -> dict[str, Any]:
    row = {"layout": layout, "world_size": world, "tensors": len(shapes), "planner": planner, "save": save}
    row.update(fields)
    row["coordinator_s"] = row["global_plan_s"] + row["prepare_global_plan_s"] + row["metadata_pickle_s"]
    target = TARGETS.get((layout, planner, save, world))
    if target is not None:
        max_s, max_bytes = target
        row["target"] = f"coordinator <= {max_s} s" + (f", gathered <= {max_bytes / 1e6:.0f} MB" if max_bytes else "")
        row["met"] = row["coordinator_s"] <= max_s and (max_bytes is None or row["gathered_plans_bytes"] <= max_bytes)
    return row


def measure_dcp(layout: str, shapes: list, world: int, plans: list[Any], local_s: float, repeat_local_s: float, saves: list[str]) -> list[dict[str, Any]]:
    """DCP's coordinator on every rank's ``DefaultSavePlanner`` plan (first save; repeat with its
    plan caching)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    rows = []
    same = layout == "replicated"  # ranks 1.. hold identical plans: pickle one, count it W-1 times
    sizes = [len(dumps(plans[0]))] + ([len(dumps(plans[-1]))] * (world - 1) if same else [len(dumps(p)) for p in plans[1:]])
    blobs = [dumps(plans[0]), dumps(plans[-1])] if same else None
    if same:
        _, t_first = _timed(lambda: pickle.loads(blobs[0]))
        _, t_other = _timed(lambda: pickle.loads(blobs[1]))
        receive_s = t_first + t_other * (world - 1)
    else:
        all_blobs = [dumps(p) for p in plans]
        _, receive_s = _timed(lambda: [pickle.loads(b) for b in all_blobs])
        del all_blobs
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner.set_up_planner({}, is_coordinator=True)
    writer = _writer()
    (global_plan, metadata), t_global = _timed(lambda: planner.create_global_plan(plans))
    global_plan, t_prep = _timed(lambda: writer.prepare_global_plan(global_plan))
    meta_bytes, t_pickle = _timed(lambda: dumps(metadata))
    results = _write_results(global_plan)
    finish_s, final_bytes = _finish(metadata, results)
    common = _common_fields(plans, global_plan, meta_bytes, final_bytes, finish_s)
    if "first" in saves:
        rows.append(_row(
            layout, world, shapes, "dcp", "first", local_plan_s=local_s, global_plan_s=t_global,
            prepare_global_plan_s=t_prep, metadata_pickle_s=t_pickle, receive_s=receive_s,
            gathered_plans_bytes=sum(sizes), scattered_bytes=sum(len(dumps(p)) for p in global_plan), **common,
        ))
    if "repeat" in saves:
        unusable = [SavePlan([], usable=False)] * world  # what each unchanged rank sends
        again = DefaultSavePlanner(enable_plan_caching=True)
        again.set_up_planner({}, is_coordinator=True)
        (delta, metadata2), t_global2 = _timed(lambda: again.create_global_plan(unusable))
        delta, t_prep2 = _timed(lambda: writer.prepare_global_plan(delta))
        meta2, t_pickle2 = _timed(lambda: dumps(metadata2))
        rows.append(_row(
            layout, world, shapes, "dcp", "repeat", local_plan_s=repeat_local_s, global_plan_s=t_global2,
            prepare_global_plan_s=t_prep2, metadata_pickle_s=t_pickle2, receive_s=0.0,
            gathered_plans_bytes=len(dumps(unusable[0])) * world, scattered_bytes=sum(len(dumps(p)) for p in delta), **common,
        ))
    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata,
                  SavePlanner._cached_final_save_plan, SavePlanner._cached_save_plan):
        cache.clear()
    return rows


def measure_distckpt(
    layout: str, shapes: list, world: int, local_plans: list[Any], payloads: list[bytes], local_s: float, repeat_local_s: float, saves: list[str]
) -> list[dict[str, Any]]:
    """distckpt's coordinator, as ``_protocol.SaveRun`` runs it."""
    from torch.distributed.checkpoint.planner import SavePlan

    from distckpt.save import metadata as _metadata

    rows = []
    received, receive_s = _timed(lambda: [pickle.loads(b) for b in payloads])
    writer = _writer()
    (deltas, metadata), t_global = _timed(lambda: _metadata.build_global([w for _, w in received]))

    def prepare() -> list:
        prefixes = writer.prepare_global_plan([SavePlan([]) for _ in range(world)])
        return [(None, (p.storage_data, d[1]), 0, 0.0) for p, d in zip(prefixes, deltas)]

    answers, t_prep = _timed(prepare)
    meta_bytes, t_pickle = _timed(lambda: dumps(metadata))
    finals = [_metadata.apply_delta(p, a[1]) for p, a in zip(local_plans, answers)]
    results = _write_results(finals)
    finish_s, final_bytes = _finish(metadata, results)
    common = _common_fields(local_plans, finals, meta_bytes, final_bytes, finish_s)
    if "first" in saves:
        rows.append(_row(
            layout, world, shapes, "distckpt", "first", local_plan_s=local_s, global_plan_s=t_global,
            prepare_global_plan_s=t_prep, metadata_pickle_s=t_pickle, receive_s=receive_s,
            gathered_plans_bytes=sum(len(b) for b in payloads), scattered_bytes=sum(len(dumps(a)) for a in answers), **common,
        ))
    if "repeat" in saves:
        # Cache hit on every rank: no gather, no scatter; finish() works on a copy of the cached Metadata.
        copy, t_copy = _timed(lambda: dataclasses.replace(metadata))
        meta2, t_pickle2 = _timed(lambda: dumps(copy))
        rows.append(_row(
            layout, world, shapes, "distckpt", "repeat", local_plan_s=repeat_local_s, global_plan_s=t_copy,
            prepare_global_plan_s=0.0, metadata_pickle_s=t_pickle2, receive_s=0.0,
            gathered_plans_bytes=0, scattered_bytes=0, **common,
        ))
    return rows


def measure(layout: str, shapes: list, world: int, planners: list[str], saves: list[str]) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    from torch.distributed.checkpoint.planner import SavePlan

    from distckpt.save import assign as _assign
    from distckpt.save import protocol as _protocol

    rows: list[dict[str, Any]] = []
    dcp_plans: list[Any] = []
    dcp_local = dcp_repeat_local = 0.0
    local_plans: list[Any] = []
    payloads: list[bytes] = []
    local_s = repeat_local_s = 0.0

    def dcp_local_plan(state: dict, rank: int) -> Any:
        nonlocal dcp_local, dcp_repeat_local
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=rank == 0)
        plan, t = _timed(planner.create_local_plan, collect=False)
        dcp_local = max(dcp_local, t)
        if rank == 0 and "repeat" in saves:  # the repeat: plan again, compare with the cached plan
            SavePlanner._cached_save_plan[DefaultSavePlanner.__name__] = plan
            again = DefaultSavePlanner(enable_plan_caching=True)
            again.set_up_planner(state, is_coordinator=True)
            _, t2 = _timed(again.create_local_plan, collect=False)
            dcp_repeat_local = max(dcp_repeat_local, t2)
            SavePlanner._cached_save_plan.clear()
        return plan

    if layout in MESH_LAYOUTS:
        if "distckpt" in planners:
            local_plans, payloads, local_s, repeat_local_s = _mesh_plans(layout, shapes, world)
    elif layout == "replicated":
        state = replicated_state(shapes)
        if "dcp" in planners:
            first = dcp_local_plan(state, 0)
            other = dcp_local_plan(state, min(1, world - 1)) if world > 1 else first
            dcp_plans = [first] + [dataclasses.replace(other, items=list(other.items)) for _ in range(world - 1)]
        if "distckpt" in planners:
            # Every rank holds the same state, so every view (and every decision) is the same:
            # computed once, each rank's own local plan made by its own planner.
            (view, structure, sizes), t_view = _timed(lambda: distckpt_view(state))
            plan_in, t_decide = _timed(lambda: _assign.decide([view] * world, structure, ["model"], {}, sizes, 0))
            cache = _protocol.PlanCache()
            cache.store(plan_in, SavePlan([]), None)
            (view2, structure2, sizes2), t_view2 = _timed(lambda: distckpt_view(state, cache))
            hit, t_decide2 = _timed(lambda: _assign.decide([view2] * world, structure2, ["model"], {}, sizes2, 0))
            assert hit.hit
            repeat_local_s = t_view2 + t_decide2
            slowest = 0.0
            for r in range(world):
                (plan, payload), t = _timed(lambda: distckpt_local(state, dataclasses.replace(plan_in, rank=r), r), collect=False)
                slowest = max(slowest, t)
                local_plans.append(plan)
                payloads.append(payload)
            local_s = t_view + t_decide + slowest
    else:
        views, structures = [], []
        if "distckpt" in planners:
            for r in range(world):  # every rank's view (what prepare exchanges)
                with fake_rank(r, world):
                    st = sharded_state(shapes, world, r)
                    (view, structure, sizes), t = _timed(lambda: distckpt_view(st), collect=False)
                    views.append(view)
                    structures.append((structure, sizes))
                    st = None  # frees it (not del: lambdas in this function close over the name)
        for r in range(world):
            with fake_rank(r, world):
                st = sharded_state(shapes, world, r)
                if "dcp" in planners:
                    dcp_plans.append(dcp_local_plan(st, r))
                if "distckpt" in planners:
                    structure, sizes = structures[r]
                    plan_in, t_decide = _timed(lambda: _assign.decide(views, structure, ["model"], {}, sizes, r), collect=False)
                    (plan, payload), t_local = _timed(lambda: distckpt_local(st, plan_in, r), collect=False)
                    local_plans.append(plan)
                    payloads.append(payload)
                    if r == 0 or r == world - 1:
                        (_, _, _), t_view = _timed(lambda: distckpt_view(st), collect=False)
                        local_s = max(local_s, t_view + t_decide + t_local)
                        repeat_local_s = max(repeat_local_s, t_view + t_decide)
                st = None  # frees it (not del: lambdas in this function close over the name)
    if "dcp" in planners and dcp_plans:  # not for MESH_LAYOUTS
        rows += measure_dcp(layout, shapes, world, dcp_plans, dcp_local, dcp_repeat_local, saves)
        del dcp_plans
        gc.collect()
    if "distckpt" in planners:
        rows += measure_distckpt(layout, shapes, world, local_plans, payloads, local_s, repeat_local_s, saves)
    gc.collect()
    return rows


def _mesh_plans(layout: str, shapes: list, world: int) -> tuple[list[Any], list[bytes], float, float]:
    """Every simulated rank's local plan and payload in a 2-D ``layout`` (one pass per rank: its
    view must equal rank 0's, which every rank's ``decide`` gets); the slowest of the first and
    the last rank's planning (unmemoized), first and repeated save."""
    from torch.distributed.checkpoint import planner_helpers
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as exact

    from distckpt.save import assign as _assign

    plans, payloads = [], []
    local_s = repeat_local_s = 0.0
    views: list[Any] | None = None
    with memoized_chunks() as memo:
        for r in range(world):
            timed = r in (0, world - 1)
            chunk = exact if timed else memo  # timed ranks: torch's own helper, as a real rank runs it
            planner_helpers.compute_local_shape_and_global_offset = chunk  # memoized_chunks restores it
            with fake_rank(r, world):
                st = mesh_state(layout, shapes, world, r, chunk)
                (view, structure, sizes), t_view = _timed(lambda: distckpt_view(st), collect=False)
                if views is None:
                    views = [view] * world
                elif view != views[0]:
                    raise AssertionError(f"{layout}: rank {r}'s view differs from rank 0's; plan every rank twice instead")
                plan_in, t_decide = _timed(lambda: _assign.decide(views, structure, ["model"], {}, sizes, r), collect=False)
                (plan, payload), t_local = _timed(lambda: distckpt_local(st, plan_in, r), collect=False)
                if timed:
                    local_s = max(local_s, t_view + t_decide + t_local)
                    repeat_local_s = max(repeat_local_s, t_view + t_decide)
                plans.append(plan)
                payloads.append(payload)
                st = None  # frees it (not del: lambdas in this function close over the name)
    return plans, payloads, local_s, repeat_local_s


# -------------------------------------------------------------------------------------------------
# The real check
def real_shapes(n_tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """A tiny state with the benchmark's kind of shapes (names without dots: module parameters)."""
    return [(f"p{i}", shape) for i, (_, shape) in enumerate(model_shapes(n_tensors, 16, vocab=64))]


def _real_body(rank: int, world: int, root: str, layout: str, shapes: list) -> list[dict[str, Any]]:
    import torch
    from torch import nn

    import distckpt

    module = nn.Module()
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes:
        module.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    ckpt = distckpt.Checkpointer(root, save_rng=False)
    out = []
    for step in (1, 2):
        t0 = time.perf_counter()
        ckpt.save(step, {"model": module})
        p = ckpt.last_save.plan
        out.append({"cached": p.cached, "plan_bytes": p.plan_bytes, "coordinator_s": p.coordinator_s,
                    "finish_s": p.finish_s, "collectives": p.collectives, "save_s": time.perf_counter() - t0})
    ckpt.close()
    return out


def real_check(layouts: list[str], world: int, n_tensors: int) -> list[dict[str, Any]]:
    """Real saves at ``world`` gloo processes next to the simulation of the same state."""
    import tempfile

    from dist_harness import run_ranks

    shapes = real_shapes(n_tensors)
    rows = []
    for layout in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            measured = run_ranks(_real_body, world, Path(tmp), str(Path(tmp) / "ck"), layout, shapes, timeout=580, pg_timeout=300)
            wall = time.perf_counter() - t0
        simulated = {r["save"]: r for r in measure(layout, shapes, world, ["distckpt"], ["first", "repeat"])}
        for i, save in enumerate(("first", "repeat")):
            m = measured[0][i]
            s = simulated[save]
            rows.append({
                "layout": layout, "world_size": world, "tensors": len(shapes), "save": save,
                "real_cached": m["cached"], "real_gathered_plans_bytes": m["plan_bytes"],
                "simulated_gathered_plans_bytes": s["gathered_plans_bytes"],
                "real_coordinator_s": m["coordinator_s"], "simulated_coordinator_s": s["global_plan_s"] + s["prepare_global_plan_s"],
                "real_finish_s": m["finish_s"], "simulated_finish_s": s["metadata_pickle_s"] + s["finish_s"],
                "real_collectives": m["collectives"], "real_save_s": m["save_s"], "real_wall_s": wall,
                "same_on_every_rank": all(x[i]["plan_bytes"] == m["plan_bytes"] and x[i]["cached"] == m["cached"] for x in measured),
            })
            print(f"[plan_scaling] real {layout} W={world} {save}: gathered {m['plan_bytes']} B (simulated "
                  f"{s['gathered_plans_bytes']} B), coordinator {m['coordinator_s'] * 1e3:.2f} ms (simulated "
                  f"{(s['global_plan_s'] + s['prepare_global_plan_s']) * 1e3:.2f} ms)", flush=True)
    return rows


# -------------------------------------------------------------------------------------------------
# Output
def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | W | planner | save | local items (all ranks) | items written | local plan ms | global plan s | "
        "writer prep s | metadata pickle s | **coordinator s** | gathered plans MB | scattered MB | .metadata MB | receive s | finish s | target |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        target = ""
        if "met" in r:
            target = f"{'met' if r['met'] else 'MISSED'} ({r['target']})"
        lines.append(
            f"| {r['layout']} | {r['world_size']} | {r['planner']} | {r['save']} | {r['local_items_total']:,} | "
            f"{r['items_written']:,} | {r['local_plan_s'] * 1e3:.1f} | {r['global_plan_s']:.4f} | {r['prepare_global_plan_s']:.4f} | "
            f"{r['metadata_pickle_s']:.4f} | **{r['coordinator_s']:.4f}** | {r['gathered_plans_bytes'] / 1e6:.3f} | "
            f"{r['scattered_bytes'] / 1e6:.3f} | {r['metadata_bytes'] / 1e6:.2f} | {r['receive_s']:.3f} | {r['finish_s']:.3f} | {target} |"
        )
    return "\n".join(lines)


def _real_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | W (real processes) | save | cached | gathered B real / simulated | coordinator ms real / simulated | finish ms real / simulated | collectives |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['world_size']} | {r['save']} | {r['real_cached']} | "
            f"{r['real_gathered_plans_bytes']:,} / {r['simulated_gathered_plans_bytes']:,} | "
            f"{r['real_coordinator_s'] * 1e3:.2f} / {r['simulated_coordinator_s'] * 1e3:.2f} | "
            f"{r['real_finish_s'] * 1e3:.2f} / {r['simulated_finish_s'] * 1e3:.2f} | {r['real_collectives']} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], png: Path, info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {("dcp", "first"): "-", ("dcp", "repeat"): ":", ("distckpt", "first"): "--", ("distckpt", "repeat"): "-."}
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2)
    for layout, marker in (("replicated", "o"), ("sharded", "s"), ("hsdp", "^"), ("fsdp_tp", "D")):
        for (planner, save), ls in styles.items():
            rs = [r for r in rows if r["layout"] == layout and r["planner"] == planner and r["save"] == save]
            if not rs:
                continue
            color = next(colors)  # the same line in both panels
            w = [r["world_size"] for r in rs]
            label = f"{layout}, {planner}, {save}"
            a1.loglog(w, [max(r["coordinator_s"], 1e-5) for r in rs], marker=marker, ls=ls, color=color, label=label)
            nonzero = [r for r in rs if r["gathered_plans_bytes"] > 0]  # distckpt's repeats gather nothing
            if nonzero:
                a2.loglog([r["world_size"] for r in nonzero], [r["gathered_plans_bytes"] / 1e6 for r in nonzero],
                          marker=marker, ls=ls, color=color, label=label)
    for (layout, planner, save, world), (max_s, max_bytes) in TARGETS.items():
        a1.plot([world], [max_s], marker="_", ms=20, color="red")
        if max_bytes:
            a2.plot([world], [max_bytes / 1e6], marker="_", ms=20, color="red")
    a1.set_xlabel("simulated world size")
    a1.set_ylabel("coordinator seconds (global plan + .metadata)")
    a2.set_xlabel("simulated world size")
    a2.set_ylabel("MB of local plans gathered by the coordinator")
    a2.text(0.02, 0.02, "distckpt, repeat: 0 bytes (no plan exchange)", transform=a2.transAxes, fontsize=8)
    for a in (a1, a2):
        a.legend(fontsize=7)
        a.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Save planning, {rows[0]['tensors']} tensors (red: issue 14 targets) — {info['cpu']}, torch {info['torch']}", fontsize=10)
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Options --quick changes default to None: it fills only those the user left out. The list
    # options take only known names: a typo would measure nothing (or another layout) and say so nowhere.
    p.add_argument("--world-sizes", type=positive_ints, default=None, help="default 8,32,128,512,1024,2048,4096 (--quick: 8,32)")
    p.add_argument("--tensors", type=positive_int, default=None, help="default 1000 (--quick: 50)")
    p.add_argument("--tensors-2d", type=positive_int, default=None,
                   help="tensors of the fsdp_tp layout (see the module docstring; default 125, --quick: 26)")
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--layouts", type=choice_list(("replicated", "sharded", *MESH_LAYOUTS)), default="replicated,sharded",
                   help="comma-separated: replicated, sharded; also hsdp, fsdp_tp (2-D meshes, distckpt's planner only)")
    p.add_argument("--planners", type=choice_list(("dcp", "distckpt")), default="dcp,distckpt", help="comma-separated: dcp, distckpt")
    p.add_argument("--saves", type=choice_list(("first", "repeat")), default="first,repeat", help="comma-separated: first, repeat")
    p.add_argument("--sharded-max", type=positive_int, default=512, help="largest simulated world size for the sharded layout")
    p.add_argument("--real", type=nonnegative_int, default=0, metavar="N", help="also save a tiny state on N real gloo processes")
    p.add_argument("--real-tensors", type=positive_int, default=100)
    add_json_arg(p, "plan_scaling")
    p.add_argument("--png", default=None, help="the plot (default: beside --json, same name, .png; '' to skip)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args(argv)
    resolve_quick(args, full={"world_sizes": [8, 32, 128, 512, 1024, 2048, 4096], "tensors": 1000, "tensors_2d": 125},
                  quick={"world_sizes": [8, 32], "tensors": 50, "tensors_2d": 26})  # fmt: skip
    if args.planners == ["dcp"] and all(lay in MESH_LAYOUTS for lay in args.layouts):
        p.error(f"--layouts {','.join(args.layouts)} are measured with --planners distckpt only (DCP's planner on the 1-D layouts)")
    resolve_outputs(args, "plan_scaling", png=True)
    shapes = model_shapes(args.tensors, args.hidden)
    shapes_2d = model_shapes(args.tensors_2d, args.hidden)
    planners = args.planners
    saves = args.saves
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for layout in args.layouts:
        for w in args.world_sizes:
            if layout == "sharded" and w > args.sharded_max:
                continue
            for r in measure(layout, shapes_2d if layout == "fsdp_tp" else shapes, w, planners, saves):
                print(
                    f"[plan_scaling] {layout:10s} W={w:5d} {r['planner']:8s} {r['save']:6s}: coordinator "
                    f"{r['coordinator_s']:.4f}s, gathered {r['gathered_plans_bytes'] / 1e6:.3f} MB"
                    + (f"  [{'met' if r['met'] else 'MISSED'}: {r['target']}]" if "met" in r else ""),
                    flush=True,
                )
                rows.append(r)
    info = machine_info()
    result: dict[str, Any] = {"benchmark": "plan_scaling", "machine": info, "tensors": len(shapes), "rows": rows}
    table = _table(rows)
    if args.real:
        one_d = [lay for lay in args.layouts if lay not in MESH_LAYOUTS]  # _real_body builds 1-D layouts
        result["real"] = real_check(one_d, args.real, args.real_tensors)
        table += "\n\nSimulation against real gloo processes (a tiny state, same code path):\n\n" + _real_table(result["real"])
    result["wall_s"] = time.perf_counter() - t_start
    publish(result, table, args.json)
    if args.png and rows:  # (no rows: every sharded world size above --sharded-max)
        _plot(rows, Path(args.png), info)
    return result


if __name__ == "__main__":
    main()
