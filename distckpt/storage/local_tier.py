"""The fast recovery tier: node-local copies of each step's files, and a peer node's copy of them.

A job that loses a node restarts all its processes; without this tier every restart reads the
whole state back from the checkpoint root (object storage, at scale). With
``Checkpointer(local_dir=...)`` every committed step also lives in ``local_dir`` on each node
(a tmpfs such as ``/dev/shm/JOB``: it survives the restart of the worker processes, not of the
machine), as the same files the root holds:

* each rank's writer writes its files to the root and, byte for byte, to its node's
  ``local_dir/step_<N>/`` (:class:`LocalCopy`, a tee inside the writer: no second pass);
* after the commit the coordinator's ``manifest.json`` and ``.metadata`` go to every node, and
  each rank sends its files to its peer (``local_peers=1``: the rank with the same local rank on
  the next node, ring by node) over distckpt's process group, which keeps them in its own
  ``local_dir``. Two nodes then hold every file of a step; a lost node costs no file;
* each node keeps the newest ``local_keep`` committed steps.

Recovery (:meth:`LocalTier.recover`, from ``load``): every rank reports which files of which
steps its node holds, each file's checksum checked on the node against the manifest; the ranks
agree on the newest step whose every file some node holds intact (never older than the root's
newest step, and never when the manifests of the nodes disagree); files a node lacks are sent
to it by a node that has them: streamed into the load of each rank that reads them
(:mod:`distckpt.storage.stream`: tensors' bytes straight into their destinations, nothing
written to the node's tier) where the manifest has checksums, else (and in a retry after a
failed load) written into the node's tier first; the load reads the node's ``local_dir`` like
any root (same verification, resharding and state check). Nothing is read from the root. A step no longer
complete in the surviving nodes, a damaged copy on every node, or a transfer that fails: the
root, with one warning saying why.

Nodes are told apart by ``LOCAL_WORLD_SIZE`` (``torchrun`` sets it; rank // LOCAL_WORLD_SIZE is
the node), else by host name. Failures of the local tier never fail a save: the step is
committed at the root; a warning names what was skipped (a full tmpfs, for instance).
"""

from __future__ import annotations

import hashlib
import json
import logging
import contextlib
import os
import shutil
import socket
import stat
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distckpt._dist import Group
from distckpt._process import refuse_different_arguments
from distckpt.errors import Interrupted, one_line
from distckpt.integrity.checksums import digest_of_file
from distckpt.integrity.manifest import DATA_FILE, MANIFEST_NAME, TIER_MARK, Manifest, parse_step_dir, step_dir
from distckpt.storage.base import Storage
from distckpt.storage.ownership import foreign_entries, is_step_file, shown_entries
from distckpt.storage.retention import _warn_kept
from distckpt.storage.transfer import PART, create_fresh, global_rank, transfer, transfer_device

log = logging.getLogger("distckpt")

METADATA = ".metadata"
#: Beside each step's manifest in the tier: the root the step was committed to. A tier left by
#: another job (another root) in the same directory is never recovered from, and a root that is
#: this directory never takes the copies for its steps (:func:`~distckpt.integrity.manifest.tier_copy`).
ROOT_MARK = TIER_MARK


def check_local_dir(local_dir: object) -> str | None:
    """``local_dir`` as a path string (``None`` stays), ``ValueError`` for a URL or blank."""
    if local_dir is None:
        return None
    if not isinstance(local_dir, (str, os.PathLike)) or not os.fspath(local_dir).strip():
        raise ValueError(f"local_dir must be a local directory path (a tmpfs such as /dev/shm/JOB), got {local_dir!r}")
    path = os.fspath(local_dir)
    if "://" in path:
        raise ValueError(f"local_dir must be a local directory path on each node, not a URL: {path!r}")
    return os.path.abspath(os.path.expanduser(path))


# -- the tee in the writer -----------------------------------------------------------------------
class LocalCopy:
    """(writer thread) A node-local copy of one file being written: ``write`` what the root
    gets, ``finish`` once it is whole (renamed into place), ``abandon`` otherwise. A failure
    (a full tmpfs) drops the copy and is recorded, never raised: the root's file is what counts.
    """

    def __init__(self, directory: str, name: str, errors: list[str], root: str | None = None) -> None:
        self.path = os.path.join(directory, name)
        self._errors = errors
        self._f: Any = None
        try:
            if root is not None and not same_root(_mark_of(directory), root):
                # The save's open_step found the directory another root's (or a folder of
                # that name appeared since): its files are never replaced.
                self._errors.append(f"{directory} does not carry this root's mark ({_shown(root)}): no local copy written")
                return
            os.makedirs(directory, exist_ok=True)
            self._f = os.fdopen(create_fresh(self.path + PART), "wb")  # closed by finish/abandon
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self._errors.append(f"{self.path}: {one_line(exc)}")
        self.abandon()

    def write(self, data: Any) -> None:
        if self._f is not None:
            try:
                self._f.write(data)
            except OSError as exc:
                self._fail(exc)

    def finish(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
                os.replace(self.path + PART, self.path)
            except OSError as exc:
                self._fail(exc)
            self._f = None

    def abandon(self) -> None:
        f, self._f = self._f, None
        try:
            if f is not None:
                # Closing flushes what the buffer still holds: on a full tmpfs that fails again
                # (ENOSPC), and must not reach the root's writer, whose save it would fail.
                f.close()
        except OSError:
            pass
        finally:
            try:
                os.unlink(self.path + PART)
            except OSError:
                pass


def rename_copy(directory: str, old: str, new: str) -> None:
    """(writer) Mirror a rename of the root's file (DCP writes ``.metadata.tmp``, then renames)."""
    try:
        os.replace(os.path.join(directory, old), os.path.join(directory, new))
    except OSError:
        pass  # no copy (it failed and was recorded): nothing to rename


# -- nodes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Nodes:
    """Which node each rank of the group runs on (node indices in order of first rank)."""

    of: tuple[int, ...]

    @classmethod
    def gather(cls, group: Group) -> Nodes:
        """(all ranks, one collective) ``LOCAL_WORLD_SIZE`` where set, else host names."""
        lws = os.environ.get("LOCAL_WORLD_SIZE", "")
        # torchrun numbers ranks node by node: the node of a *global* rank (a subgroup's own
        # numbering says nothing about nodes).
        me = global_rank(group, group.rank) if group.enabled else 0
        key = f"lws:{me // int(lws)}" if lws.isascii() and lws.isdigit() and int(lws) > 0 else f"host:{socket.gethostname()}"
        keys = group.all_gather(key)
        index: dict[str, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys))

    @property
    def count(self) -> int:
        return max(self.of) + 1

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.of) if n == node]

    def local_rank(self, rank: int) -> int:
        return self.ranks(self.of[rank]).index(rank)

    def peer(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s files: same local rank on the next node (``None``: one node)."""
        if self.count < 2:
            return None
        ranks = self.ranks((self.of[rank] + 1) % self.count)
        return ranks[self.local_rank(rank) % len(ranks)]


# -- recovery plan (pure: every rank computes the same) ------------------------------------------
@dataclass
class Holding:
    """What one rank reports of one step in its node's ``local_dir``."""

    manifest_sha: str
    files: list[str]  # every file the step needs (manifest.json included), from the manifest
    intact: list[str]  # files this rank checked and found intact (its share of the node's)
    job: str | None = None  # the job its manifest records (a named job resumes its own steps)
    created_unix: float = 0.0  # its manifest's (which of two commits of a step is newer)
    root: str | None = None  # the root its manifest records (Manifest.root)


def superseded_by(held: Holding | Manifest, root: str | None, job: str | None, created: float) -> bool:
    """(pure) Whether a replica's commit of a step (the ``root`` and ``job`` its manifest
    records, made at ``created``) is a newer commit of the step the tier's copy ``held`` is:
    the same root saved it again since (a rollback, then retired at the root), whichever job.
    Manifests that record no root (written before they did): the same job. Another root's
    commit on a shared replica never supersedes, nor does an older one (a re-save whose upload
    failed). "Newer" is read from the saving machines' clocks."""
    same = root == held.root if root is not None and held.root is not None else job == held.job
    return same and created > held.created_unix


@dataclass(frozen=True)
class Recovery:
    """What :meth:`LocalTier.recover` made of the tiers."""

    step: int | None  # the step this node's tier now holds whole; None: load from the root
    sources: dict[str, str]  # per file this rank's load uses: "local" or "rank N" (sent, or streamed, by it)
    planned: bool = False  # needs() succeeded on every rank (each rank's plan may be reused)
    # (file, from rank, to rank), every rank alike: files the load receives from the rank that
    # holds them instead of reading them from this node's tier (see :mod:`distckpt.storage.stream`).
    streams: tuple[tuple[str, int, int], ...] = ()
    # Why a step older than the tier's newest is recovered (the root unreachable), else "": said
    # once the load succeeded (a failed attempt is retried, then the root).
    older: str = ""
    # Completing ``tried`` in the tiers failed (step is None): why, said by the caller, which may
    # retry (every rank alike: the failure is gathered).
    failed: str = ""
    tried: int | None = None
    later: bool = False  # older candidates remain (Decision.later): a failed load may turn to them


@dataclass
class Decision:
    """The step to recover and the transfers that complete every node's copy."""

    step: int | None
    reason: str
    transfers: list[tuple[str, int, int]] = field(default_factory=list)  # (file, from rank, to rank)
    later: bool = False  # candidates older than ``step`` remain (see :func:`decide`)


def decide(
    nodes: Nodes,
    reports: list[dict[int, Holding]],
    root_steps: list[int] | None,
    want: int | None,
    root_manifests: Mapping[int, str] | None = None,
    lagging: bool = False,
    replica_manifests: Mapping[int, tuple[str, str | None, str | None, float]] | None = None,
    job: str | None = None,
    failed: Mapping[int, str] | None = None,
) -> Decision:
    """(every rank alike) Which step to recover, and who sends which file to which node.

    ``want``: that step (the tier may serve a step the root no longer keeps). Otherwise, when the
    root could be listed (``root_steps``), its newest step and only that one: a newer step in the
    tier was deleted at the root or is left from an earlier life of the job (a rollback), and an
    older one is not what a resume wants. When it could not (``None``: unreachable), the newest
    step of the tier. ``lagging``: ``root_steps`` are the replica's, the root being unreachable:
    its uploads lag behind the saves, so the tier's newest step not older than the replica's
    newest (a step the replica has not received yet is no rollback's). A step is recoverable when the nodes that hold it agree on its manifest,
    that manifest is the root's where ``root_manifests`` has the step's digest (the number may
    have been saved again at the root since: a rollback, then a new run), and not older than the
    replica's where ``replica_manifests`` has the step's ``(digest, root, job, created_unix)``
    and it supersedes the tier's copy (:func:`superseded_by`). Every file of it must be intact
    on some node. ``job``: a named
    job's (``job=``) resume without ``want`` takes only its own steps and ones that recorded no
    job, as from the root. ``failed``: steps whose recovery or load failed in an earlier attempt
    (step -> why), passed by as unservable. ``Decision.later``: older candidates remain (the
    root unreachable), which an attempt may turn to where loading the chosen step fails."""
    steps = sorted({s for rep in reports for s in rep}, reverse=True)
    if want is None and job is not None:
        steps = [s for s in steps if next(rep[s].job for rep in reports if s in rep) in (job, None)]
    if want is not None:
        candidates = [want] if want in steps else []
        why = f"step {want} is not in the local tier"
    elif root_steps is not None and lagging:
        floor = max(root_steps, default=None)
        candidates = [s for s in steps if floor is None or s >= floor]
        why = (
            "no committed step in the local tier of any node" if floor is None
            else f"no step in the local tier as new as the replica's newest step {floor} (the root is unreachable)"
        )  # fmt: skip
    elif root_steps is not None:
        newest = max(root_steps) if root_steps else None
        candidates = [newest] if newest in steps else []
        why = "the root holds no committed step" if newest is None else f"the root's newest step {newest} is not in the local tier"
    else:
        candidates = steps
        why = "no committed step in the local tier of any node"
    skipped: list[tuple[int, str]] = []  # newer candidates that cannot be served, and why
    for n, step in enumerate(candidates):
        if failed and step in failed:  # its load failed (e.g. the only copy of a file damaged)
            skipped.append((step, failed[step]))
            continue
        held = [(r, rep[step]) for r, rep in enumerate(reports) if step in rep]
        shas = {h.manifest_sha for _, h in held}
        if len(shas) != 1:
            skipped.append((step, f"the nodes hold different manifests of step {step}"))
            continue
        if root_manifests is not None and step in root_manifests and root_manifests[step] not in shas:
            skipped.append((step, (
                f"the local tier's step {step} is not the root's: the root's manifest of it differs (saved again at the "
                "root since the tier kept it, or damaged there)"
            )))  # fmt: skip
            continue
        if replica_manifests is not None and step in replica_manifests:
            sha, root, saved_by, created = replica_manifests[step]
            if sha not in shas and superseded_by(held[0][1], root, saved_by, created):
                skipped.append((step, (
                    f"the local tier's step {step} is older than the replica's commit of it: the step was saved again at "
                    "the root since the tier kept it (a rollback)"
                )))  # fmt: skip
                continue
        needed = held[0][1].files
        holders: dict[str, list[int]] = {f: [] for f in needed}
        for r, h in held:
            for f in h.intact:
                if f in holders:
                    holders[f].append(r)
        lost = [f for f, hs in holders.items() if not hs]
        if lost:
            skipped.append((step, f"step {step}: {len(lost)} file(s) intact on no node (e.g. {lost[0]})"))
            continue
        transfers: list[tuple[str, int, int]] = []
        for node in range(nodes.count):
            on_node = set()
            for r in nodes.ranks(node):
                if step in reports[r]:
                    on_node.update(reports[r][step].intact)
            receivers = nodes.ranks(node)
            missing = [f for f in needed if f not in on_node]
            for i, f in enumerate(missing):
                hs = holders[f]
                transfers.append((f, hs[i % len(hs)], receivers[i % len(receivers)]))
        older = ""  # (why an older step than the tier's newest is taken, where one is)
        if skipped:
            older = f"the tier's newer step(s) {', '.join(str(s) for s, _ in skipped)} cannot be served ({'; '.join(w for _, w in skipped)})"
        return Decision(step, older, transfers, later=n + 1 < len(candidates))
    if len(skipped) == 1:
        why = skipped[0][1]
    elif skipped:  # every candidate's reason (the newest's alone hid why the older ones failed too)
        why = "; ".join(w if w.startswith(f"step {s}") else f"step {s}: {w}" for s, w in skipped)
    return Decision(None, why)


# -- the tier -------------------------------------------------------------------------------------
class LocalTier:
    """One checkpointer's node-local tier (see the module doc). Every method taking a group is
    collective (all ranks, same order).

    Args:
        local_dir: this node's directory (may differ per node; every rank of a node passes the same).
        keep: committed steps each node keeps.
        peers: 1: each rank's files are also kept by its peer on the next node; 0: no peer copies.
        root: the checkpointer's root's mark (:func:`root_mark`), recorded with each step
            (:data:`ROOT_MARK`).
    """

    def __init__(self, local_dir: str, keep: int, peers: int, root: str) -> None:
        self.dir = local_dir
        self.root = root
        self.keep = keep
        self.peers = peers
        self.storage = Storage(local_dir)
        self.storage.tier_copies = True  # its step folders are this tier's (marked) copies
        self.nodes: Nodes | None = None
        self._nodes_for: Group | None = None
        self._warned_one_node = False
        self._open_problems: dict[int, str] = {}  # step -> why this node could not open its folder

    def nodes_of(self, group: Group) -> Nodes:
        """(all ranks, collective the first time for each group) The nodes of the group's ranks
        (gathered again for a group made anew: the job's process group made again, or made
        after a first use without one)."""
        if self.nodes is None or self._nodes_for is not group:
            self.nodes = Nodes.gather(group)
            self._nodes_for = group
        return self.nodes

    def step_path(self, step: int) -> str:
        return os.path.join(self.dir, step_dir(step))

    # -- save side ----------------------------------------------------------------------------
    def _owned(self, step: int) -> bool | None:
        """Whether this node's ``step`` directory is this root's (``None``: there is none)."""
        path = self.step_path(step)
        if not os.path.lexists(path):
            return None
        return same_root(_mark_of(path), self.root)

    def usable_for(self, step: int) -> bool:
        """(each rank, no collectives: call it inside the save's exchange) Whether this node's
        tier can take ``step``: no directory of that name, or one of this root's (a re-save).
        Another root's, or something else by that name, is never touched: the save then keeps
        no local copy (one warning)."""
        return self._owned(step) is not False

    def open_step(self, group: Group, step: int) -> None:
        """(all ranks, one collective; after the step was claimed at the root, before any write)
        One rank per node replaces an earlier life's copy of ``step`` with an empty directory
        holding this root's mark; the rest wait for it."""
        nodes = self.nodes_of(group)
        problem = None
        self._open_problems.pop(step, None)  # (an earlier save of this number that failed at the root)
        if nodes.local_rank(group.rank) == 0:
            try:
                owned = self._owned(step)
                if owned is False:
                    # Another root's step appeared since usable_for (a root or tier sharing this
                    # folder saved it meanwhile): untouched; the tee and after_commit check the
                    # mark, so nothing of this save lands there.
                    problem = f"{self.step_path(step)} is not this root's"
                else:
                    if owned and not self._kept_for_foreign(step):
                        _remove_tree(self.step_path(step))
                    os.makedirs(self.step_path(step), exist_ok=True)
                    try:
                        _write_atomic(self.step_path(step), ROOT_MARK, self.root.encode())
                    except OSError:
                        # A full tmpfs: the unmarked folder, no step of this root's, would stay
                        # for good (retention leaves folders without this root's mark).
                        with contextlib.suppress(OSError):
                            os.rmdir(self.step_path(step))
                        raise
            except OSError as exc:  # the tee records its own failures; this is only a note
                problem = f"{self.step_path(step)}: {one_line(exc)}"
                # The cause the commit's warning names first (a full tmpfs: the tee then only
                # finds the folder unmarked). Another root's folder is said by the tee itself.
                self._open_problems[step] = problem
        group.all_gather(problem)

    def after_commit(
        self, group: Group, step: int, manifest_json: bytes, local_errors: list[str], settled: Callable[[], None] = lambda: None
    ) -> None:
        """(all ranks) Complete the committed ``step`` in every node's tier: the coordinator's
        manifest and ``.metadata`` to every node, each rank's files to its peer, then retention.
        Never raises for a failure of the tier: one warning on every rank (the root holds the
        step). ``settled`` runs right after its last collective (retention and warnings are this
        rank's alone)."""
        nodes = self.nodes_of(group)
        opened = self._open_problems.pop(step, None)
        problems = ([opened] if opened is not None else []) + list(local_errors)
        manifest = Manifest.from_json(manifest_json)
        # 1. manifest and .metadata to every node (the coordinator's copy of .metadata).
        meta: bytes | None = None
        if group.is_coordinator:
            try:
                with open(os.path.join(self.step_path(step), METADATA), "rb") as f:
                    meta = f.read()
            except OSError as exc:
                problems.append(f"{METADATA}: {one_line(exc)}")
        # Whether each node's directory of the step is still this root's: nothing is sent to,
        # or written in, one that is not (another root's step of that number appeared there).
        # (.metadata by broadcast: gathered, every rank's share would be padded to its size)
        meta = group.broadcast(meta)
        ours = group.all_gather(self._owned(step) is True)
        if not ours[group.rank]:
            problems.append(
                f"{self.step_path(step)} does not carry this root's mark (another root's step, or the tier could not open it): "
                f"this node keeps no copy of step {step}"
            )
        # 2. each rank's files to its peer.
        sends: list[tuple[str, int, int]] = []
        if self.peers and nodes.count > 1:
            for name in sorted(manifest.files):
                m = DATA_FILE.fullmatch(name)
                if m and int(m.group(1)) < len(nodes.of):
                    src = int(m.group(1))
                    dst = nodes.peer(src)
                    if dst is not None and nodes.of[dst] != nodes.of[src] and ours[dst]:
                        sends.append((name, src, dst))
        failures = transfer(group, self.step_path(step), sends, manifest)
        problems += failures
        # 3. the node's manifest last: the step is committed in this node's tier once it is there.
        if nodes.local_rank(group.rank) == 0 and ours[group.rank]:
            try:
                if meta is None:
                    raise OSError(f"no {METADATA} from the coordinator")
                _write_atomic(self.step_path(step), METADATA, meta)
                _write_atomic(self.step_path(step), ROOT_MARK, self.root.encode())
                _write_atomic(self.step_path(step), MANIFEST_NAME, manifest_json)
            except OSError as exc:
                problems.append(f"{self.step_path(step)}: {one_line(exc)}")
        everyone = group.all_gather(problems)
        # After that gather every rank of the node has finished writing what it received: each
        # node's leader says which steps it holds whole, and a step counts as whole where every
        # node does (with local_peers=0 a node's own copy is all there is of its ranks' files).
        leader = nodes.local_rank(group.rank) == 0 and ours[group.rank]
        whole_here = self._whole_steps(step, nodes, nodes.of[group.rank]) if leader else None
        wholes = [w for w in group.all_gather(whole_here) if w is not None]
        settled()
        whole = set.intersection(*map(set, wholes)) if len(wholes) == nodes.count else set()
        if leader:
            self.retain(step, whole)
        # Warnings after the last collective, on every rank: one turned into an error by the
        # caller's filters then fails every rank alike instead of stranding the others.
        if self.peers and nodes.count < 2 and not self._warned_one_node:
            self._warned_one_node = True
            warnings.warn(
                "distckpt: local_peers=1 but every rank runs on one node: the local tier keeps no peer copies "
                "(nodes are told apart by LOCAL_WORLD_SIZE or the host name)",
                stacklevel=4,
            )
        if any(everyone):
            first = next(p for ps in everyone for p in ps)
            count = sum(len(ps) for ps in everyone)
            warnings.warn(
                f"distckpt: step {step} is committed at the root, but its local-tier copy is incomplete "
                f"({count} problem(s); first: {first}); recovery falls back to the root where a file is missing",
                stacklevel=4,
            )

    def skipped(self, step: int) -> None:
        """(every rank) The warning of a save that kept no local copy: the tier's directory of
        ``step`` is another root's, or not a directory."""
        warnings.warn(
            f"distckpt: step {step} keeps no local-tier copy: {self.step_path(step)} exists and is not this root's "
            f"({_shown(self.root)}); the local tier never touches what it did not write",
            stacklevel=4,
        )

    def retain(self, newest: int, whole: frozenset[int] | set[int] = frozenset()) -> None:
        """(one rank per node) Keep the newest ``keep`` committed steps of this root in this
        node's tier, up to ``newest`` (the step just committed). A step of this root newer than
        ``newest`` is an earlier life's (the job went back to an older step) and goes; so do this
        root's leftovers (no manifest). Another root's steps, and anything without this root's
        mark, are never touched.

        ``whole``: the steps every node holds whole (every rank alike). Where none of the kept
        ones is (a full tmpfs left copies without files: the saves warned), the newest whole
        step stays too (``keep`` + 1 at most), on every node alike: else two such saves retired
        the last recoverable step, and with the root unreachable nothing could be recovered.
        One step, not ``keep`` more: a tier filled by a passing episode must free enough room
        for the next step to be whole again."""
        mine = [s for s in self._steps() if self._owned(s)]
        committed = sorted(s for s in mine if s <= newest and self._has_manifest(s))
        keep = set(committed[-self.keep :])
        if not keep & whole:
            last_whole = next((s for s in reversed(committed) if s in whole), None)
            if last_whole is not None:
                keep.add(last_whole)
        for s in mine:
            if s not in keep and not self._kept_for_foreign(s):
                _remove_tree(self.step_path(s))

    def _whole_steps(self, newest: int, nodes: Nodes, node: int) -> list[int]:
        """(one rank per node) This root's committed steps up to ``newest`` whose copy on this
        node is whole (:meth:`_whole_here`); ``[]`` where the tier cannot be read."""
        try:
            steps = [s for s in self._steps() if s <= newest and self._owned(s) and self._has_manifest(s)]
            return [s for s in steps if self._whole_here(s, nodes, node)]
        except OSError:
            return []

    def _whole_here(self, step: int, nodes: Nodes, node: int) -> bool:
        """Whether this node's copy of committed ``step`` holds every file it keeps, by size: its
        ranks' files, its predecessor node's (peer copies) and the shared ones. A step saved at
        another world size (an earlier run's) counts as whole: what this node keeps of it cannot
        be told."""
        path = self.step_path(step)
        try:
            manifest = Manifest.from_json(_read_regular(os.path.join(path, MANIFEST_NAME)))
        except (OSError, ValueError):
            return False
        if manifest.world_size != len(nodes.of):
            return True
        for name in manifest.files:
            m = DATA_FILE.fullmatch(name)
            if m is not None:
                src = int(m.group(1))
                if src >= len(nodes.of):
                    continue
                peer = nodes.peer(src) if self.peers else None
                if nodes.of[src] != node and (peer is None or nodes.of[peer] != node):
                    continue  # another node's file, not kept here
            if not _intact(os.path.join(path, name), manifest, name, check=False):
                return False
        return True

    def committed(self) -> list[int]:
        """(any rank, not collective) This root's steps committed in this node's tier, ascending
        (the node's own view: a lost node's tier holds none, its peer's the copies)."""
        return [s for s in self._steps() if self._owned(s) and self._has_manifest(s)]

    def _has_manifest(self, step: int) -> bool:
        return os.path.isfile(os.path.join(self.step_path(step), MANIFEST_NAME))

    def _kept_for_foreign(self, step: int) -> bool:
        """Whether this node's ``step`` directory holds anything the tier does not write (a
        sub-folder, a file of the user's, another root put inside it): then it is never removed
        (warned once); the tier deletes only what it wrote."""
        foreign = foreign_entries(self.storage, step_dir(step), ours=_tier_file)
        if foreign:
            path = self.step_path(step)
            why = f"holds files the tier does not write ({shown_entries(foreign)})"
            _warn_kept(path, f"the local tier would delete {path}, but it {why}; kept (delete it by hand)")
        return bool(foreign)

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return sorted(s for s in (parse_step_dir(n) for n in names) if s is not None)

    # -- load side ----------------------------------------------------------------------------
    def recover(
        self,
        group: Group,
        want: int | None,
        root_steps: Callable[[], tuple[list[int], bool] | None],
        check: bool,
        needs: Callable[[Manifest], set[str]] | None = None,
        agree: Mapping[str, object] | None = None,
        root_manifest: Callable[[int], tuple[bytes, bool] | None] | None = None,
        job: str | None = None,
        failed: Mapping[int, str] | None = None,
    ) -> Recovery:
        """(all ranks) Make this node's tier hold the step to load, if the tiers can serve it.

        Returns a :class:`Recovery`: the step (``None``: load from the root; a warning on every
        rank said why, where the tier should have served it), where each file of this node's
        copy came from, and whether ``needs`` succeeded on every rank. ``root_steps`` runs on the
        coordinator only: the root's committed steps and whether they are only its replica's (the
        root unreachable: its uploads lag), ``None`` where neither can be listed (see
        :func:`decide`); ``check``: verify every copy's checksum (else sizes only).
        ``needs(manifest)`` (every rank alike, once every node holds the step's ``.metadata``;
        it may run collectives): the files this rank's load will read; a node is then sent only
        what its ranks read (``None``, or a rank that cannot tell: every file of the step).
        ``agree``: the load's arguments that every rank must pass alike, compared in the
        inventory's gather (``ValueError`` on every rank, naming them, where they differ). ``root_manifest(step)`` (coordinator): the bytes
        of the root's manifest of ``step``, else the replica's, and whether they are the
        replica's (``None``: neither holds it), compared with the tier's copy (see
        :func:`decide`; a replica's only where it records this root, :attr:`Manifest.root`:
        a shared replica holds other roots' steps of the same numbers). ``job``: a named
        job's (see :func:`decide`). ``failed``: steps an earlier attempt could not load, and why
        (see :func:`decide`); a failure to complete the chosen step is returned
        (:attr:`Recovery.failed`), not warned of: the caller says what it does next.

        Collectives: as few as the case allows, since each costs milliseconds on a busy node. When
        every node holds the step (a restart of the worker processes), two: the inventory and
        whether ``needs`` succeeded everywhere. A node that lacks files adds the transfers.
        """
        nodes = self.nodes_of(group)
        report: dict[int, Holding] | None = None
        raw: dict[int, bytes] = {}
        listed: list[int] | None = None
        lagging = False
        try:
            report, raw = self._inventory(nodes, group.rank, check)
        except Exception as exc:  # noqa: BLE001 - a damaged tier must not stop the load
            log.warning("distckpt: rank %d could not read its local tier %s: %s", group.rank, self.dir, one_line(exc))
        at_root: dict[int, str] = {}
        at_replica: dict[int, tuple[str, str | None, str | None, float]] = {}
        if group.is_coordinator:
            try:
                found = root_steps()
                if found is not None:
                    listed, lagging = found
            except Exception as exc:  # noqa: BLE001 - an unreachable root: the local tier decides
                log.warning("distckpt: could not list the root (%s); recovering from the local tier", one_line(exc))
            target = want if want is not None else max(listed, default=None) if listed is not None else None
            # Also for a step=N the listing leaves out (another job's step N, with job=): the
            # tier's copy must be the commit the root holds of that number, whoever saved it.
            if target is not None and listed is not None and root_manifest is not None:
                try:
                    got = root_manifest(target)
                    if got is not None and not got[1]:
                        at_root[target] = hashlib.sha256(got[0]).hexdigest()
                    elif got is not None:
                        theirs = Manifest.from_json(got[0])
                        at_replica[target] = (hashlib.sha256(got[0]).hexdigest(), theirs.root, theirs.job, theirs.created_unix)
                except Exception as exc:  # noqa: BLE001 - unreadable there: the tier's copy is judged alone
                    log.warning("distckpt: could not read the root's manifest of step %d (%s)", target, one_line(exc))
        gathered = group.all_gather((report or {}, (listed, lagging), dict(agree or {}), (at_root, at_replica)))
        refuse_different_arguments("load()", [a for _, _, a, _ in gathered])
        reports = [r for r, _, _, _ in gathered]
        decision = decide(
            nodes, reports, gathered[0][1][0], want, gathered[0][3][0], lagging=gathered[0][1][1],
            replica_manifests=gathered[0][3][1], job=job, failed=failed,
        )
        if decision.step is None:
            if any(reports) and want is None:  # a step the tier should have served
                _warn_root(decision.reason)
            else:
                log.info("distckpt: loading from the root: %s", decision.reason)
            return Recovery(None, {})
        step = decision.step
        if all(step in rep for rep in reports):
            # Every rank read the step's manifest, the same one (decide() compared their digests).
            manifest_json = raw[step]
        else:
            # The chosen manifest, as a rank that holds it read it, for the nodes that lack it.
            holder = min(r for r, rep in enumerate(reports) if step in rep)
            manifest_json = _from(group, holder, raw.get(step))
        manifest = Manifest.from_json(manifest_json)
        if not decision.transfers:
            # Every node holds every file: nothing to send, nothing to write, nothing that can fail.
            planned = _plan(needs, manifest, group.rank) is not None if needs is not None else False
            log.info("distckpt: recovering step %d from the local tier (every node holds it)", step)
            sources = {f: "local" for f in list(manifest.files) + [MANIFEST_NAME]}
            return Recovery(step, sources, all(group.all_gather(planned)), older=decision.reason, tried=step, later=decision.later)
        return self._complete(group, nodes, decision, reports, manifest, manifest_json, check, needs)

    def _complete(
        self,
        group: Group,
        nodes: Nodes,
        decision: Decision,
        reports: list[dict[int, Holding]],
        manifest: Manifest,
        manifest_json: bytes,
        check: bool,
        needs: Callable[[Manifest], set[str]] | None,
    ) -> Recovery:
        """(all ranks) :meth:`recover` of a step some node lacks files of: the transfers."""
        step = decision.step
        assert step is not None
        here = nodes.of[group.rank]
        holds = any(step in reports[r] for r in nodes.ranks(here))  # this node's directory exists, this root's
        gets_manifest = any(f == MANIFEST_NAME and nodes.of[dst] == here for f, _, dst in decision.transfers)
        # A node that lacks the step gets its directory, with this root's mark, before any file.
        failures: list[str] = []
        if nodes.local_rank(group.rank) == 0 and not holds:
            try:
                if self._owned(step) is False:  # another root's directory of that name: never touched
                    raise OSError(f"{self.step_path(step)} is not this root's")
                os.makedirs(self.step_path(step), exist_ok=True)
                _write_atomic(self.step_path(step), ROOT_MARK, self.root.encode())
            except OSError as exc:
                failures.append(f"{self.step_path(step)}: {one_line(exc)}")
        moves: list[tuple[str, int, int]] = []
        streams: list[tuple[str, int, int]] = []
        per_rank: list[set[str] | None] = []
        planned = False
        if not any(group.all_gather(failures)):
            moves = [t for t in decision.transfers if t[0] != MANIFEST_NAME]
            if needs is not None:
                # .metadata first (every node needs it to plan), then only what a node's ranks read.
                first = [t for t in moves if t[0] == METADATA]
                failures = transfer(group, self.step_path(step), first, manifest, verify=True)
                # Its own collective, not merged into the next one: a receiver renames the file
                # into place after transfer()'s last collective, and needs() reads it (on the
                # coordinator, which may be a receiver) only once every receiver is done.
                if any(group.all_gather(failures)) and not failures:  # decided alike on every rank
                    failures = ["sending .metadata failed on another rank"]
                wanted = None if failures else _plan(needs, manifest, group.rank)
                per_rank = group.all_gather(wanted)
                planned = all(w is not None for w in per_rank)
                per_node: dict[int, set[str] | None] = {}
                for r, w in enumerate(per_rank):
                    n = nodes.of[r]
                    w = None if w is None else w | {METADATA}
                    per_node[n] = None if w is None or per_node.get(n, set()) is None else per_node.get(n, set()) | w
                moves = first + [
                    t for t in moves if t[0] != METADATA and (per_node[nodes.of[t[2]]] is None or t[0] in per_node[nodes.of[t[2]]])
                ]
            if not failures:
                rest = [t for t in moves if t[0] != METADATA] if needs is not None else moves
                if planned and not check and _streamable(group, manifest):
                    # Sent straight into the load of each rank that reads them (not written to
                    # this node's tier, nor read back from it): the node's tier stays without
                    # this step (no manifest; the next save brings one), the peer keeps its copy.
                    streams = _streams(nodes, rest, per_rank)
                    rest = []
                # Unchecked on the way in where the load checks what it reads (the first
                # attempt); a damaged copy then fails the load and the second attempt checks all.
                failures = transfer(group, self.step_path(step), rest, manifest, verify=check)
            if nodes.local_rank(group.rank) == 0 and not failures and gets_manifest and not streams:
                try:
                    _write_atomic(self.step_path(step), MANIFEST_NAME, manifest_json)
                except OSError as exc:
                    failures.append(f"{self.step_path(step)}: {one_line(exc)}")
        everyone = group.all_gather(failures)
        if any(everyone):
            first_problem = next(p for ps in everyone for p in ps)
            return Recovery(None, {}, failed=f"completing it in the local tier failed ({first_problem})", tried=step, later=decision.later)
        # Streamed files went to a rank, not into this node's tier: .metadata alone came by move.
        came = {f: f"rank {src}" for f, src, dst in moves if nodes.of[dst] == here and (not streams or f == METADATA)}
        came.update({f: f"rank {src}" for f, src, dst in streams if dst == group.rank})
        if gets_manifest:
            holder = min(r for r, rep in enumerate(reports) if step in rep)
            came[MANIFEST_NAME] = f"rank {holder}"  # it came with the manifest's exchange from ``holder``
        # Files this node neither had nor needed (its ranks do not read them) are left out.
        have = set(os.listdir(self.step_path(step)))
        sources = {f: came.get(f, "local") for f in list(manifest.files) + [MANIFEST_NAME] if f in came or f in have}
        log.info("distckpt: recovering step %d from the local tier (%d file(s) from peers)", step, len(decision.transfers))
        return Recovery(step, sources, planned, tuple(streams), older=decision.reason, tried=step, later=decision.later)

    def _inventory(self, nodes: Nodes, rank: int, check: bool) -> tuple[dict[int, Holding], dict[int, bytes]]:
        """(each rank) The committed steps of this root in this node's tier, each with the files
        this rank checked (its share of the node's files: one pass over them per node), and
        each step's manifest as read."""
        ranks = nodes.ranks(nodes.of[rank])
        mine = ranks.index(rank)
        out: dict[int, Holding] = {}
        raws: dict[int, bytes] = {}
        for step in self._steps():
            if not self._owned(step):
                continue  # another root's step (a tier left by another job), or not a directory
            path = self.step_path(step)
            try:
                raw = _read_regular(os.path.join(path, MANIFEST_NAME))
                manifest = Manifest.from_json(raw, where=os.path.join(path, MANIFEST_NAME))
            except (OSError, ValueError):
                continue  # not committed here (or damaged): this node does not hold the step
            if manifest.step != step:
                continue
            names = sorted(manifest.files)
            intact = [MANIFEST_NAME] if mine == 0 else []
            for i, name in enumerate(names):
                if i % len(ranks) == mine and _intact(os.path.join(path, name), manifest, name, check):
                    intact.append(name)
            out[step] = Holding(
                hashlib.sha256(raw).hexdigest(), names + [MANIFEST_NAME], intact, manifest.job, manifest.created_unix, manifest.root
            )
            raws[step] = raw
        return out, raws


def _streamable(group: Group, manifest: Manifest) -> bool:
    """Whether the files a node lacks can be streamed into its ranks' load: only where every file
    has a checksum (a sender that cannot read its copy sends zeros, which the checksum refuses)
    and over a host backend (gloo: received into host memory, the reader's destinations)."""
    if manifest.checksum_algorithm is None or any(r.checksum is None for r in manifest.files.values()):
        return False
    return transfer_device(group).type == "cpu"


def _streams(nodes: Nodes, moves: list[tuple[str, int, int]], per_rank: list[set[str] | None]) -> list[tuple[str, int, int]]:
    """(every rank alike) A stream ``(file, from rank, to rank)`` for each file a node's
    ``moves`` would have brought it and each rank of that node that reads the file (``per_rank``:
    every rank's files, all known), from the rank the move would have taken it from."""
    source = {(f, nodes.of[dst]): src for f, src, dst in moves}
    out = []
    for rank, files in enumerate(per_rank):
        assert files is not None
        for f in sorted(files):
            src = source.get((f, nodes.of[rank]))
            if src is not None:
                out.append((f, src, rank))
    return out


def _plan(needs: Callable[[Manifest], set[str]], manifest: Manifest, rank: int) -> set[str] | None:
    """``needs(manifest)``, or ``None`` (logged) where this rank cannot tell what it reads."""
    try:
        return set(needs(manifest))
    except Interrupted:  # Ctrl-C on some rank (every rank has it): the load stops, not "every file"
        raise
    except Exception as exc:  # noqa: BLE001 - this rank then takes every file
        log.info("distckpt: rank %d could not plan its load (%s): every file", rank, one_line(exc))
        return None


def _from(group: Group, holder: int, value: Any) -> Any:
    """(all ranks) ``value`` of rank ``holder`` on every rank."""
    return group.all_gather(value if group.rank == holder else None)[holder]


def _read_regular(path: str) -> bytes:
    """A regular file's bytes (``OSError`` for a symbolic link or anything else)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a regular file")
    with open(path, "rb") as f:
        return f.read()


_CHUNK = 8 * 2**20


def _intact(path: str, manifest: Manifest, name: str, check: bool) -> bool:
    """Whether ``path`` is a regular file (not a link) of the manifest's size and checksum."""
    record = manifest.files[name]
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != record.size:
            return False
        if not check or record.checksum is None or manifest.checksum_algorithm is None:
            return True
        with open(path, "rb") as f:
            return digest_of_file(f, manifest.checksum_algorithm, _CHUNK) == record.checksum
    except OSError:
        return False


def _write_atomic(directory: str, name: str, data: bytes | memoryview) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, name + PART)
    try:
        with os.fdopen(create_fresh(tmp), "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        # (a full tmpfs: the temporary file must not stay, where nothing retires it)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _tier_file(name: str) -> bool:
    """Whether ``name`` is a file the tier writes into its step directory (or one being written)."""
    name = name.removesuffix(PART)
    return name == ROOT_MARK or is_step_file(name)


def _mark_of(path: str) -> str | None:
    """The root recorded in tier directory ``path`` (:data:`ROOT_MARK`); ``None``: no mark, or
    not a directory (a link included)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, ROOT_MARK), "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _shown(mark: str) -> str:
    """A mark's root as messages name it (its identity)."""
    names = _mark_names(mark)
    return names[0] if names is not None else mark


def root_mark(storage: Storage) -> str:
    """The text of the tier's mark for root ``storage``: a JSON list of its identity (links
    resolved, as manifests record it: one folder named through a link or ``//`` is one root) and
    the root as spelt. The identity decides; the spelt name only where this root's identity
    cannot be told (see :func:`same_root`)."""
    return json.dumps([storage.identity(), storage.url])


def _mark_names(mark: str) -> tuple[str, str] | None:
    """``(identity, spelt)`` of a mark of :func:`root_mark`'s form, else ``None``."""
    try:
        names = json.loads(mark)
    except ValueError:
        return None
    if isinstance(names, list) and len(names) == 2 and all(isinstance(n, str) for n in names):
        return names[0], names[1]
    return None


def same_root(mark: str | None, root: str) -> bool:
    """Whether a tier directory's ``mark`` names this root (``root``: its :func:`root_mark`).

    By identity. The root as spelt decides only where this root's identity cannot be told: a
    local root that is not there, nor the folder the mark resolved it to (a link to it stored on
    its own filesystem, which is down: the tier must serve then). Not otherwise: a link re-pointed between runs (``ckpt -> runs/7``,
    then ``runs/8``) names another root by the same spelling, whose steps must never be loaded
    or retired. A mark of one line was written before marks held both (the root's identity, or
    earlier the root as spelt): it counts by the same rules, or where it resolves to this root's
    identity. Garbage (a NUL byte, a zero-filled mark after a crash) is no root's."""
    ours = _mark_names(root)
    if mark is None or ours is None:
        return False
    identity, spelt = ours
    theirs = _mark_names(mark)
    if theirs is not None:
        # The name decides only where both this root and the mark's own location are not there
        # (one filesystem down). A fresh root by a name whose earlier folder is still there
        # (the link removed, not re-pointed) is another root.
        return theirs[0] == identity or (theirs[1] == spelt and _cannot_resolve(spelt) and _cannot_resolve(theirs[0]))
    if mark == identity or (mark == spelt and _cannot_resolve(spelt)):
        return True
    if not os.path.isabs(mark) or "\0" in mark or len(mark) > 4096:
        return False
    try:
        return os.path.realpath(mark) == identity
    except (OSError, ValueError):
        return False


def _cannot_resolve(spelt: str) -> bool:
    """Whether local root ``spelt`` is not there to resolve (no entry by that name, not even a
    dangling link): its identity is then its name, which cannot tell it from another root."""
    return "://" not in spelt and not os.path.lexists(spelt)


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _warn_root(reason: str) -> None:
    """(every rank, after the tier's last collective) Why the load reads the root."""
    warnings.warn(f"distckpt: loading from the root, not the local tier: {reason}", stacklevel=4)
