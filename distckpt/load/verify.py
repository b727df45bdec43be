"""The state check after a load (verified resume), with O(keys) bytes per rank at any world size.

Every rank fingerprints what its objects hold (:func:`distckpt.state.fingerprint.local_parts`),
and the loaded state must give back every fingerprint the manifest recorded. Gathering every
rank's parts would cost each rank O(world x keys) bytes (at 4,096 FSDP ranks and 1,000 tensors,
hundreds of MB per rank on every resharded resume). Instead:

* A tensor a rank holds whole (a plain or DDP tensor, a ZeRO partition's state, a per-rank value,
  a fully replicated DTensor) is judged by that rank alone: its digest against the manifest's.
  Every copy is checked, so a replica that differs is caught where it lives.
* A sharded DTensor's blocks add up across ranks. Per key, one all-reduce sums slots of 32-bit
  halves (no overflow at any world size): over the copies the designated holder of each block
  writes (the rank at coordinate 0 of the mesh dimensions that replicate it, as a save picks
  its writer: :func:`distckpt.state.placements.writes_dtensor`): the partial fingerprint sums, the
  elements covered and a hash of each partial sum (:func:`~distckpt.state.fingerprint.mix_value`);
  over all copies: the same hash, the number of copies and the number of meshes holding the
  key (their ranks at coordinate 0). The holders then judge: the designated blocks cover the
  tensor exactly, their sum gives the saved fingerprint, there are ``R x M`` copies of each
  (``R``: the replication factor within a mesh, ``M``: the meshes) and the hash over all copies
  is ``R x M`` times the designated copies' (the hash is not linear, so copies that differ
  cannot cancel out, except by a 2**-64 accident). Empty blocks (uneven sharding) hold nothing
  and take no part.
* Keys that several meshes hold (``M > 1``: a DTensor on a sub-mesh, replicated along the job's
  other mesh dimensions, as FSDP-only parameters of an FSDP x TP job) have a designated copy of
  each block on every one of them. Two more all-reduces, run only then (every rank sees the
  same ``M``), keep one mesh's: the lowest rank of each holding mesh (a max over negated ranks),
  then the designated slots again over that mesh alone.
* A second all-reduce (a byte per key) hands every rank the same verdict. A key that nobody
  holds in a form that can be fingerprinted counts as diverged, as does one no rank can cover.

The verdict equals :func:`distckpt.state.statecheck.diverged` over gathered parts (pinned by tests).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from distckpt._caller import outside
from distckpt._compat import flatten_state_dict
from distckpt._dist import Group, all_ranks
from distckpt.errors import CheckpointError
from distckpt.integrity.manifest import Manifest
from distckpt.load.phases import LoadPlan, entries_read
from distckpt.state import rng, scope
from distckpt.state.entries import Entry
from distckpt.state import fingerprint, fpkernels
from distckpt.state.casts import cast_back, exact_cast
from distckpt.state.placements import replication, writes_dtensor
from distckpt.state.shape import numel
from distckpt.state.statecheck import StateDivergedError

_LOW32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
# Slots per key of the summed vector, in this order.
_COPIES, _DESIGNATED, _COVERED, _BAD, _ALL_HI, _ALL_LO, _MINE_HI, _MINE_LO, _SUM_HI, _SUM_LO, _MESHES, _UNPROVEN, _LOSSY = range(13)
_SLOTS = 13
# The designated-copy slots, recomputed over one mesh for keys that several meshes hold.
_PER_MESH = (_DESIGNATED, _COVERED, _MINE_HI, _MINE_LO, _SUM_HI, _SUM_LO)


def diverged_keys(
    group: Group,
    extract: Callable[[], Mapping[str, Any]],
    saved: Mapping[str, str],
    keys: Sequence[str],
    what: str,
    threads: int = 1,
    version: int = fingerprint.VERSION,
    saved_dtypes: Mapping[str, torch.dtype] | None = None,
    unproven: list[str] | None = None,
    lossy: list[str] | None = None,
) -> list[str]:
    """(all ranks, collective) The keys among ``keys`` whose loaded values differ from the
    saved ones, sorted, identical on every rank.

    Args:
        extract: gives this rank's state, flattened (DCP's keys), re-extracted from the live
            objects (called once, inside the check's error agreement).
        saved: the manifest's fingerprints; keys without one are not judged.
        keys: the keys to judge, the same list on every rank.
        what: names the check in errors (a failure on one rank fails every rank alike).
        threads: fingerprinting threads.
        version: the fingerprint construction of ``saved`` (the manifest's ``fingerprint_version``).
        saved_dtypes: key -> the dtype the checkpoint holds. A tensor loaded into another dtype
            is fingerprinted cast back to it (a bf16 checkpoint in an fp32 model); one holding
            NaN cannot be proven (no cast keeps a NaN's bits): never judged, its key appended
            to ``unproven`` (the same list on every rank).
            Where the cast may lose values, the loaded values are judged cast back too: proven
            if the saved values fit the new dtype; otherwise the key goes to ``unproven`` and
            ``lossy`` (the cast lost values; a NaN-holding tensor goes to ``unproven`` only),
            never to the result. A cast neither way exact (int64 into uint64) is never proven:
            ``unproven`` and ``lossy``.
    """
    judged = sorted(k for k in keys if k in saved)
    index = {k: i for i, k in enumerate(judged)}
    sharded: dict[int, tuple[int, tuple[int, ...], str]] = {}  # key index -> (replicas, global shape, dtype)
    # key index -> (lowest rank of the block's mesh, elements, hash, partial sum) of the blocks
    # this rank is the designated holder of.
    blocks: dict[int, tuple[int, int, int, int]] = {}

    def local() -> torch.Tensor:
        slots = [[0] * len(judged) for _ in range(_SLOTS)]
        flat = extract()
        mine = {k: v for k, v in flat.items() if k in index}
        back: dict[str, torch.dtype] = {}  # key -> the saved dtype its loaded values are cast back to
        for key, value in list(mine.items()):
            was = (saved_dtypes or {}).get(key)
            if was is None or not isinstance(value, torch.Tensor) or value.dtype == was:
                continue
            exact = exact_cast(was, value.dtype)
            if exact or not value.numel():
                holds = _holds_only(value, was)
            elif exact_cast(value.dtype, was):
                # Into a dtype that cannot hold every saved value, but whose values all cast back
                # exactly (fp32 into bf16): the saved values fit it where the cast back matches
                # their fingerprints (proven); where not, the cast lost values, no divergence.
                holds = None if _holds_nan(value) else True
            else:
                # Neither way exact (int64 into uint64: -1 loads as 2**64 - 1 and casts back to
                # -1): a cast back matching proves nothing.
                holds = None
            # (The same on every rank: ranks hold one dtype per key.)
            slots[_LOSSY][index[key]] |= not exact and bool(value.numel())
            if holds is not None:
                back[key] = was
                # Cast back, a value the saved dtype cannot hold would round to a saved one:
                # every loaded value must be one of the saved dtype's (bit for bit).
                if not holds:
                    slots[_BAD][index[key]] = 1
            else:  # NaNs (a cast keeps no NaN's bits), or a cast no cast back can judge: unprovable
                slots[_UNPROVEN][index[key]] += 1
                del mine[key]
        lowest: dict[int, int] = {}  # id(mesh) -> its lowest global rank
        for key, offsets, shape, global_shape, dtype, total in fingerprint.local_parts(mine, threads=threads, version=version, as_dtype=back):
            i = index[key]
            if (tuple(shape) == tuple(global_shape) and not any(offsets)) or not numel(global_shape):
                # A whole copy; or a block of an empty tensor (shape (0, 6) split in dim 1: every
                # rank's block is empty and none whole), which has nothing to add up.
                slots[_COPIES][i] += 1
                slots[_BAD][i] |= fingerprint.digest(total, global_shape, dtype, version) != saved[key]
                continue
            if not numel(shape):
                continue  # an empty block of uneven sharding: nothing to count or sum
            # Plain tensors come whole from local_parts: only a DTensor's block is partial.
            value = flat[key]
            replicas, coord = replication(value, key)
            sharded[i] = (replicas, tuple(global_shape), dtype)
            h = fingerprint.mix_value(total)
            slots[_COPIES][i] += 1
            slots[_MESHES][i] += coord is not None and not any(coord)
            _add64(slots, _ALL_HI, i, h)
            if writes_dtensor(value, key):
                mesh = value.device_mesh
                if id(mesh) not in lowest:
                    lowest[id(mesh)] = int(mesh.mesh.min())
                blocks[i] = (lowest[id(mesh)], numel(shape), h, total)
                slots[_DESIGNATED][i] += 1
                slots[_COVERED][i] += numel(shape)
                _add64(slots, _MINE_HI, i, h)
                _add64(slots, _SUM_HI, i, total)
        return torch.tensor(slots, dtype=torch.int64).reshape(-1)

    summed = group.all_reduce(all_ranks(group, what, local), "sum").reshape(_SLOTS, len(judged)).tolist()
    skipped = {i for i in range(len(judged)) if summed[_UNPROVEN][i]}
    bad = [1 if (summed[_BAD][i] or not summed[_COPIES][i]) and i not in skipped else 0 for i in range(len(judged))]
    several = [i for i in range(len(judged)) if summed[_MESHES][i] > 1]  # the same list on every rank
    if several:
        _one_mesh(group, several, blocks, summed)
    if any(summed[_DESIGNATED]):  # every rank sees the same sums, so all take part or none
        for i, (replicas, global_shape, dtype) in sharded.items():
            if i in skipped:
                continue
            s = [row[i] for row in summed]
            copies = replicas * max(1, s[_MESHES])  # of each block, over every mesh holding the key
            total = ((s[_SUM_HI] << 32) + s[_SUM_LO]) & _MASK64
            every = ((s[_ALL_HI] << 32) + s[_ALL_LO]) & _MASK64
            designated = ((s[_MINE_HI] << 32) + s[_MINE_LO]) & _MASK64
            if (
                s[_COVERED] != numel(global_shape)
                or s[_COPIES] != copies * s[_DESIGNATED]
                or every != (copies * designated) & _MASK64
                or fingerprint.digest(total, global_shape, dtype, version) != saved[judged[i]]
            ):
                bad[i] = 1
        bad = group.all_reduce(torch.tensor(bad, dtype=torch.uint8), "max").tolist()
    # (bad and the slots are the same on every rank: so are these lists.)
    lost = [i for i in range(len(judged)) if bad[i] and summed[_LOSSY][i]]
    for i in lost:
        bad[i] = 0
    if unproven is not None:
        unproven.extend(judged[i] for i in sorted(skipped | set(lost)))
    if lossy is not None:
        lossy.extend(judged[i] for i in sorted(skipped | set(lost)) if summed[_LOSSY][i])
    return [k for k, b in zip(judged, bad) if b]


def _holds_nan(value: torch.Tensor) -> bool:
    """Whether this rank's block of ``value`` holds a NaN."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    return bool(local.numel()) and (local.dtype.is_floating_point or local.dtype.is_complex) and bool(torch.isnan(local).any())


def _holds_only(value: torch.Tensor, dtype: torch.dtype) -> bool | None:
    """Whether every element of ``value`` (this rank's block) is a value of ``dtype``: cast there
    and back, the same bits. ``None`` where it holds a NaN: casts do not keep a NaN's bits (an
    fp32 NaN becomes bf16 ``0xFFFF`` whatever the bf16 one was), so its fingerprint cast back
    cannot match the saved one."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    if not local.numel():
        return True
    if _holds_nan(local):
        return None
    # (A complex tensor cast back into a real dtype: its imaginary parts must be zero.)
    return torch.equal(fpkernels.bits(cast_back(local, dtype).to(local.dtype)), fpkernels.bits(local))


def _one_mesh(
    group: Group, several: list[int], blocks: Mapping[int, tuple[int, int, int, int]], summed: list[list[int]]
) -> None:
    """(all ranks, collective: two all-reduces) For the keys ``several`` (indices) that several
    meshes hold, replace the designated-copy slots of ``summed`` by those of one mesh: the one
    holding the lowest rank (a max over negated ranks; a rank holding no designated block of a
    key offers the lowest possible value)."""
    none = -(1 << 62)
    offered = [-blocks[i][0] if i in blocks else none for i in several]
    first = group.all_reduce(torch.tensor(offered, dtype=torch.int64), "max").tolist()
    slots = [[0] * len(several) for _ in range(_SLOTS)]
    for j, i in enumerate(several):
        block = blocks.get(i)
        if block is None or -block[0] != first[j]:
            continue
        _, elements, h, total = block
        slots[_DESIGNATED][j] += 1
        slots[_COVERED][j] += elements
        _add64(slots, _MINE_HI, j, h)
        _add64(slots, _SUM_HI, j, total)
    redone = group.all_reduce(torch.tensor([slots[row] for row in _PER_MESH], dtype=torch.int64), "sum").tolist()
    for row, values in zip(_PER_MESH, redone):
        for j, i in enumerate(several):
            summed[row][i] = values[j]


def _add64(slots: list[list[int]], hi: int, i: int, value: int) -> None:
    """Add a 64-bit value to the 32-bit halves at rows ``hi`` and ``hi + 1``."""
    slots[hi][i] += value >> 32
    slots[hi + 1][i] += value & _LOW32


# -- the rules: when a load is checked, and what it must be able to prove -------------------------
def due(explicit: bool | None, manifest: Manifest, world_size: int, entries: Sequence[Entry], where: str) -> bool:
    """(every rank, pure) Whether a load is checked: as asked (``verify_state=True/False``), else
    where the risk is highest: the world size or an entry's parallelism changed since the save,
    or nothing else proved the bytes (a checkpoint saved with ``checksum=None``: its fingerprints
    are its only proof). A check that is due but has no fingerprints to compare warns once and
    is skipped."""
    if explicit is not None:
        return explicit
    relaid = manifest.world_size != world_size or parallelism_changed(manifest, entries)
    if not (relaid or manifest.checksum_algorithm is None):
        return False
    if not manifest.fingerprints:
        _warn_unverifiable(manifest.step, where, relaid)
        return False
    return True


def parallelism_changed(manifest: Manifest, entries: Sequence[Entry]) -> bool:
    """Whether any entry is laid out otherwise than at the save: its kind of parallelism (plain,
    DDP, FSDP2; ZeRO vs a plain optimizer, which records no ``parallel``) or, where the save
    recorded one, its DTensor layout (a digest of mesh shapes and placements; manifests written
    before ``layout`` was recorded compare kinds only)."""

    def kind(described: Mapping[str, Any]) -> Any:
        if described.get("kind") == "optimizer":
            return described.get("parallel", "plain")
        return described.get("parallel")

    for e in entries:
        saved = manifest.entries.get(e.name)
        if not isinstance(saved, Mapping):
            continue
        now = e.describe()
        if kind(saved) is not None and kind(now) is not None and kind(saved) != kind(now):
            return True
        if saved.get("layout") is not None and saved.get("layout") != now.get("layout"):
            return True
    return False


def require_fingerprints(manifest: Manifest, index: Mapping[str, Any], requested: Sequence[str], where: str) -> None:
    """(every rank, pure: the same error everywhere) For ``verify_state=True``: every requested
    tensor must have a recorded fingerprint, else the load is refused before anything is read.
    Plain values are not fingerprinted (``kind: value`` entries are checked by digest); RNG
    states need none (judged where recorded: at the same world size, where they are restored).

    Raises:
        CheckpointError: naming the step and the tensors without a fingerprint.
    """
    how = "load with verify_state=False to load it without that proof (or None: verify only where fingerprints exist)"
    if not manifest.fingerprints:
        raise CheckpointError(
            f"load(verify_state=True) of step {manifest.step} at {where}: the checkpoint records no state "
            f"fingerprints (saved with fingerprint=False or by an older distckpt), so the loaded state cannot "
            f"be proven equal to the saved one; {how}"
        )
    lacking = [
        k
        for k in requested
        if index.get(k) is not None and k not in manifest.fingerprints and not k.startswith(rng.NAMESPACE + ".")
    ]
    if lacking:
        shown = ", ".join(lacking[:20]) + (f", ... (+{len(lacking) - 20} more)" if len(lacking) > 20 else "")
        raise CheckpointError(
            f"load(verify_state=True) of step {manifest.step} at {where}: {len(lacking)} requested tensor(s) have "
            f"no recorded fingerprint (replicas that drifted at save, or layouts that were not fingerprinted), "
            f"so they cannot be verified: {shown}; {how}"
        )


def check_loaded(
    group: Group,
    manifest: Manifest,
    plan: LoadPlan,
    requested: Sequence[str],
    where: str,
    threads: int,
    saved_dtypes: Mapping[str, torch.dtype] | None = None,
    explicit: bool = False,
) -> None:
    """(all ranks) Fingerprints of what the objects hold now against the saved ones
    (``saved_dtypes``: key -> the checkpoint's dtype, for tensors loaded into another; see
    :func:`diverged_keys`). Tensors whose load lost values in a cast are not judged: one warning
    names them.

    Raises:
        StateDivergedError: on every rank, naming the tensors that differ.
        CheckpointError: on every rank, with ``explicit`` (``verify_state=True``), where an
            object's own ``load_state_dict`` cast loaded tensors into a dtype that lost saved
            values (torch's optimizers cast a floating-point parameter's state to the
            parameter's dtype; without ``explicit``: a warning naming them).
    """

    read = entries_read([e.name for e in plan.entries], requested)

    def current() -> dict[str, Any]:
        # Re-extracted through the same functions a save uses, so a wrong mapping between what
        # DCP read and what the objects hold shows up too.
        out: dict[str, Any] = {}
        # The generators as the load left them, put back after the entries' state_dict()s ran:
        # some draw from them (a torchdata loader's starts an iterator, which takes a seed), so a
        # checked resume continued another random stream than an unchecked one.
        generators = rng.capture()
        try:
            out.update(entries_now())
        finally:
            rng.restore(generators)
        if restored:
            # As the generators hold them now (restored from what was read): a damaged or
            # misplaced state (a checkpoint saved with checksum=None has no other proof) seeded
            # them silently otherwise.
            out[rng.NAMESPACE] = {plan.rng_key: generators}
        return flatten_state_dict(out)[0]

    def entries_now() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in plan.entries:
            if e.name in plan.per_rank or e.name not in read:
                # Skipped, or nothing of it read (left alone): nothing to judge, and its state
                # is not taken (a torchdata loader's state_dict() starts an iterator its next
                # epoch would replay, with the sampler's order from before the load).
                continue
            value = e.peek_state()
            if manifest.entries.get(e.name, {}).get("scope") == scope.PER_RANK:
                value = {scope.rank_key(group.rank): value}
            out[e.name] = value
        return out

    # RNG states are restored at the same world size (each rank its own, in ``requested`` as
    # every rank's requests are), but reseeded at another: then they are not judged.
    restored = plan.rng_key is not None and manifest.world_size == group.world_size
    judged = [k for k in requested if restored or not k.startswith(rng.NAMESPACE + ".")]
    unproven: list[str] = []
    lossy: list[str] = []
    bad = diverged_keys(
        group, current, manifest.fingerprints, judged, f"state check of {where}", threads=threads,
        version=manifest.fingerprint_version, saved_dtypes=saved_dtypes, unproven=unproven, lossy=lossy,
    )  # fmt: skip
    if bad:
        raise StateDivergedError(bad, f"step {manifest.step} at {where}")
    # Casts the load made that lose values were named when it was planned (warn_lossy). Ones an
    # object made after (the state its load_state_dict was handed held the saved dtype) were
    # taken for NaNs and skipped: fp32 moments of a bf16 parameter came back bf16, unreported.
    planned = set(lossy_casts(plan.request, saved_dtypes or {}))
    by_object = [k for k in lossy if k not in planned]
    if by_object:
        shown = _listed([f"{k} ({(saved_dtypes or {}).get(k)} saved)" for k in by_object])
        what = (
            f"the state check of step {manifest.step} at {where}: {len(by_object)} tensor(s) were cast by their "
            f"object's own load_state_dict into a dtype that did not keep their saved values (or, holding NaN or "
            f"cast between signed and unsigned integers, cannot be shown to have; torch's optimizers cast a "
            f"floating-point parameter's state to the parameter's dtype): {shown}"
        )
        if explicit:
            raise CheckpointError(
                f"load(verify_state=True): {what}; the loaded state is not the saved one (load with "
                "verify_state=None to load it with a warning)"
            )
        warnings.warn(f"distckpt: {what}", stacklevel=outside())
    # What is left holds NaNs, whose bits no cast keeps (planned lossy casts were named).
    nans = [k for k in unproven if k not in lossy and k not in planned]
    if nans:
        warnings.warn(
            f"distckpt: the state check of step {manifest.step} at {where} could not verify {len(nans)} tensor(s) "
            f"holding NaN, loaded into another dtype (a cast keeps no NaN's bits): {_listed(nans)}",
            stacklevel=outside(),
        )


def check_shared(
    group: Group,
    manifest: Manifest,
    plan: LoadPlan,
    keys: Sequence[str],
    where: str,
    threads: int,
    saved_dtypes: Mapping[str, torch.dtype] | None = None,
) -> None:
    """(all ranks; ``keys`` the same on every rank) :func:`check_loaded` of just ``keys``, the
    tensors some rank loaded into memory that another of its keys shares (a flat buffer and a
    view of it, :func:`~distckpt.load.phases.sharing_memory`), where no full check was due: the
    key read last kept the shared elements, so where the checkpoint's values disagree there one
    of them holds other values than were saved. One warning names those without a recorded
    fingerprint (nothing proves them).

    Raises:
        StateDivergedError: on every rank, naming the keys that came back with other values.
    """
    unproven = [k for k in keys if k not in manifest.fingerprints]
    if unproven:
        warnings.warn(
            f"distckpt: loading step {manifest.step} at {where}: {len(unproven)} tensor(s) were loaded into memory "
            f"another loaded tensor shares (or may: a layout too large to tell), and have no recorded fingerprint to "
            f"prove them (the one read last kept the shared values): {_listed(unproven)}",
            stacklevel=outside(),
        )
    if len(unproven) < len(keys):
        why = f"{where} (loaded into memory another loaded tensor shares: the one read last kept the shared values)"
        check_loaded(group, manifest, plan, keys, why, threads, saved_dtypes)


def _listed(items: Sequence[str], most: int = 10) -> str:
    return ", ".join(items[:most]) + (f", ... (+{len(items) - most} more)" if len(items) > most else "")


def lossy_casts(request: Mapping[str, Any], saved_dtypes: Mapping[str, torch.dtype]) -> dict[str, str]:
    """Key -> ``"key (saved dtype into loaded dtype)"`` for each tensor of ``request`` whose
    destination cannot hold its saved values exactly (:func:`~distckpt.state.casts.exact_cast`),
    in order."""
    lossy = {}
    for key, value in request.items():
        was = saved_dtypes.get(key)
        if isinstance(value, torch.Tensor) and was is not None and value.numel() and not exact_cast(was, value.dtype):
            lossy[key] = f"{key} ({str(was).replace('torch.', '')} into {str(value.dtype).replace('torch.', '')})"
    return lossy


def warn_lossy(request: Mapping[str, Any], saved_dtypes: Mapping[str, torch.dtype], step: int, where: str) -> None:
    """(each rank, not collective) One warning naming the tensors a load casts into a dtype that
    cannot hold their saved values (a float64 checkpoint into float32, int64 into float64):
    DCP casts them silently."""
    lossy = list(lossy_casts(request, saved_dtypes).values())
    if lossy:
        warnings.warn(
            f"distckpt: loading step {step} at {where} casts {len(lossy)} tensor(s) into a dtype that cannot hold "
            f"their saved values exactly: {_listed(lossy)}",
            stacklevel=outside(),
        )


def refuse_unprovable(request: Mapping[str, Any], saved_dtypes: Mapping[str, torch.dtype], step: int, where: str) -> None:
    """(each rank, inside the load's plan exchange: every rank fails alike) For
    ``verify_state=True``: a tensor whose destination's dtype cannot hold its saved values
    exactly (an fp32 checkpoint into a bf16 model) cannot be proven equal to the saved one, so
    the load is refused before anything is read.

    Raises:
        CheckpointError: naming the tensors and both dtypes.
    """
    lossy = list(lossy_casts(request, saved_dtypes).values())
    if lossy:
        shown = _listed(lossy)
        raise CheckpointError(
            f"load(verify_state=True) of step {step} at {where}: {len(lossy)} tensor(s) would be loaded into a dtype "
            f"that cannot hold their saved values exactly, so the load cannot be proven equal to the save: {shown}; "
            "load with verify_state=False (or None: verify what can be proven)"
        )


_warned_unverifiable: set[str] = set()


def _warn_unverifiable(step: int, where: str, relaid: bool) -> None:
    """Once per checkpoint root and process: the default check was due but has nothing to compare."""
    root = where.rsplit("/", 1)[0]
    if root in _warned_unverifiable:
        return
    _warned_unverifiable.add(root)
    why = "was loaded at another world size or parallelism" if relaid else "records no file checksums (saved with checksum=None)"
    warnings.warn(
        f"distckpt: step {step} at {where} {why}, and it records no state fingerprints (saved with "
        "fingerprint=False), so the loaded state was not verified",
        stacklevel=5,
    )
