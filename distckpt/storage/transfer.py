"""Files of a step directory sent between ranks over the process group: the local tier's peer
copies (:mod:`distckpt.storage.local_tier`), after a save and during a recovery.

One call moves a list of ``(file, from rank, to rank)``; every rank passes the same list.
Files travel as pieces of at most :data:`PIECE` bytes, in waves of at most :data:`WAVE` bytes
per rank, two waves in flight: while one wave is on the wire the receivers write the previous
one's pieces to their disk (senders send from a read-only mapping of each file, else read the
next wave's pieces meanwhile). So a transfer costs about what its slowest stage costs, not the
sum of reading, sending and writing, and each rank holds at most two waves of buffers (reused)
whatever the files' sizes. Measured on gloo over loopback
(2 cores, benchmarks/README.md): one 256 MiB message takes about twice as long as the same
bytes in 16 MiB pieces.

Safety: a sender opens each file it sends before anything moves (a regular file, no symbolic
link followed, of the manifest's size); a file one cannot open is skipped by both ends. A file
that fails later (a read error on the sender, a write error on the receiver, a checksum that
does not match) is never renamed into place: the receiver writes ``name.part`` and renames it
only once every piece arrived, the senders reported none failed and (``verify``) its checksum
matches the manifest. Never bytes standing in for a file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distckpt._dist import Group
from distckpt.errors import one_line
from distckpt.integrity.checksums import new_hasher
from distckpt.integrity.manifest import Manifest
from distckpt.storage.base import open_regular_file

#: Bytes per message: gloo moves a large message in small pieces about twice as fast as whole.
PIECE = 16 * 2**20
#: Bytes one rank sends plus receives per wave; two waves are in flight (read, wire, write).
WAVE = 64 * 2**20
PART = ".part"  # suffix of a file being written; renamed once whole (a crash leaves only these)


@dataclass(frozen=True)
class _Piece:
    move: int  # index into the moves
    offset: int
    length: int


@dataclass
class _Incoming:
    """A file being received: its ``.part`` descriptor, running hash and first problem."""

    fd: int | None
    hasher: Any
    problem: str | None = None


@dataclass
class _Wave:
    pieces: list[_Piece]
    works: list[Any] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    received: list[tuple[_Piece, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # piece, wire buffer, host view


def transfer(
    group: Group, directory: str, moves: Iterable[tuple[str, int, int]], manifest: Manifest, verify: bool = True
) -> list[str]:
    """(all ranks, every rank the same ``moves``) Send each ``(file, from rank, to rank)`` of the
    step in ``directory`` (each rank's own directory: the node's) over the group. The receiver
    checks it against ``manifest`` (``verify``; else its size only, for a caller whose load
    checks every byte it reads) and renames it into its ``directory`` once whole. Returns this
    rank's problems (empty: every file it sent or received arrived)."""
    # One move per (file, receiver): two would share the receiver's ``.part`` (the first to
    # finish would rename the other's bytes into place). Every rank drops the same ones.
    unique: dict[tuple[str, int], tuple[str, int, int]] = {}
    for name, src, dst in moves:
        unique.setdefault((name, dst), (name, src, dst))
    moves = list(unique.values())
    problems: list[str] = []
    if not moves or not group.enabled:
        return problems
    me = group.rank
    device = transfer_device(group)
    sizes = [manifest.files[name].size for name, _, _ in moves]
    # 1. Senders open their files first; one that cannot be opened is skipped by both ends.
    sources: dict[int, int] = {}
    unopened: list[int] = []
    for i, (name, src, dst) in enumerate(moves):
        if src == me:
            try:
                sources[i] = open_regular(os.path.join(directory, name), sizes[i])
            except OSError as exc:
                problems.append(f"sending {name} to rank {dst}: {one_line(exc)}")
                unopened.append(i)
    skip = {i for part in group.all_gather(unopened) for i in part}
    incoming: dict[int, _Incoming] = {}
    failed_sends: list[int] = []
    try:
        for i, (name, src, dst) in enumerate(moves):
            if dst == me and i not in skip:
                incoming[i] = _open_part(directory, name, manifest if verify else None)
        try:
            broken = _run_waves(group, moves, sizes, [p for p in _pieces(sizes) if p.move not in skip], sources, incoming, failed_sends, device)
        except Exception as exc:  # noqa: BLE001 - e.g. no memory for a buffer: reported on every rank below
            broken = f"rank {me}: {one_line(exc)}"
        for i in failed_sends:
            problems.append(f"sending {moves[i][0]} to rank {moves[i][2]}: reading it failed")
        # 2. Every rank's failures (a dead peer fails this exchange too), then the receivers
        #    keep only the files that arrived whole.
        try:
            everyone = group.all_gather((failed_sends, broken))
        except Exception as exc:  # noqa: BLE001 - a peer died
            everyone = [([], broken or one_line(exc))]
        wire = "; ".join(dict.fromkeys(b for _, b in everyone if b))  # every rank's reason, once
        if wire:
            problems.append(f"transfer with a peer failed: {wire}")
            return problems
        bad_sends = {i for sent, _ in everyone for i in sent}
        for i, inc in incoming.items():
            name, src, _ = moves[i]
            problem = inc.problem or ("the sender could not read it" if i in bad_sends else None)
            if problem is None and inc.hasher is not None and inc.hasher.hexdigest() != manifest.files[name].checksum:
                problem = "it does not match its checksum"
            problem = _close_part(directory, name, inc, keep=problem is None) or problem
            if problem:
                problems.append(f"receiving {name} from rank {src}: {problem}")
        return problems
    finally:
        for fd in sources.values():
            os.close(fd)
        for i, inc in incoming.items():
            if inc.fd is not None:  # left open by a failure above: never renamed
                _close_part(directory, moves[i][0], inc, keep=False)


def _run_waves(
    group: Group,
    moves: list[tuple[str, int, int]],
    sizes: list[int],
    pieces: list[_Piece],
    sources: dict[int, int],
    incoming: dict[int, _Incoming],
    failed_sends: list[int],
    device: torch.device,
) -> str | None:
    """Post each wave's sends and receives, then finish the wave before it (two in flight).
    Pieces this rank cannot read are still sent (the receiver is waiting for them) and listed in
    ``failed_sends``. Returns why the wire failed (``None``: every piece moved)."""
    me = group.rank
    pools = _Pools(device)
    maps = {i: m for i, fd in sources.items() if (m := map_file(fd, sizes[i])) is not None}
    pending: _Wave | None = None
    for k, wave in enumerate(_waves(pieces, moves)):
        ops: list[Any] = []
        used = 0
        for piece in wave.pieces:
            _, src, dst = moves[piece.move]
            if me not in (src, dst):
                continue
            if src == me:
                mapped = maps.get(piece.move)
                if mapped is not None:  # sent from the page cache: no copy in this process
                    host = mapped[piece.offset : piece.offset + piece.length]
                else:
                    host = pools.host(k % 2, used, piece.length)
                    used += piece.length
                    if not _read_piece(sources[piece.move], piece, host) and piece.move not in failed_sends:
                        failed_sends.append(piece.move)
                wire = pools.wire(host)
                ops.append(dist.P2POp(dist.isend, wire, global_rank(group, dst), group.pg))
            else:
                host = pools.host(k % 2, used, piece.length)
                used += piece.length
                wire = pools.wire_empty(host)
                wave.received.append((piece, wire, host))
                ops.append(dist.P2POp(dist.irecv, wire, global_rank(group, src), group.pg))
            wave.keep.append(wire)  # alive until the wave is finished (an accelerator's copy)
        try:
            wave.works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as exc:  # noqa: BLE001 - a peer died: reported, the root stays
            return one_line(exc)
        if pending is not None:
            broken = _finish(pending, incoming)
            if broken:
                return broken
        pending = wave
    return _finish(pending, incoming) if pending is not None else None


def _pieces(sizes: list[int]) -> list[_Piece]:
    out = []
    for i, size in enumerate(sizes):
        out += [_Piece(i, off, min(PIECE, size - off)) for off in range(0, size, PIECE)]
        if size == 0:
            out.append(_Piece(i, 0, 0))
    return out


def _waves(pieces: list[_Piece], moves: list[tuple[str, int, int]]) -> list[_Wave]:
    """(pure: every rank alike) Consecutive pieces grouped so that no rank sends plus receives
    more than :data:`WAVE` bytes in one wave."""
    waves: list[_Wave] = []
    load: dict[int, int] = {}
    for piece in pieces:
        ends = moves[piece.move][1:]
        adds = {r: piece.length * ends.count(r) for r in ends}
        if not waves or any(load.get(r, 0) + n > WAVE for r, n in adds.items()):
            waves.append(_Wave([]))
            load = {}
        waves[-1].pieces.append(piece)
        for r, n in adds.items():
            load[r] = load.get(r, 0) + n
    return waves


class _Pools:
    """Two reused host buffers of :data:`WAVE` bytes (one per wave in flight), allocated on first
    use; on an accelerator backend the wire buffers are device copies of them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[torch.Tensor | None] = [None, None]

    def host(self, slot: int, start: int, length: int) -> torch.Tensor:
        if self._host[slot] is None:
            self._host[slot] = torch.empty(WAVE, dtype=torch.uint8)
        buf = self._host[slot]
        assert buf is not None
        return buf[start : start + length]

    def wire(self, host: torch.Tensor) -> torch.Tensor:
        return host if self.device.type == "cpu" else host.to(self.device)

    def wire_empty(self, host: torch.Tensor) -> torch.Tensor:
        return host if self.device.type == "cpu" else torch.empty(host.numel(), dtype=torch.uint8, device=self.device)


def _finish(wave: _Wave, incoming: dict[int, _Incoming]) -> str | None:
    """Wait for a wave; write what it brought (in order: pieces of a file arrive in order).
    Returns why the wire failed (``None``: it did not)."""
    try:
        for work in wave.works:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - a peer died
        return one_line(exc)
    for piece, wire, host in wave.received:
        inc = incoming[piece.move]
        if inc.problem is not None or inc.fd is None:
            continue
        if wire is not host:
            host.copy_(wire)
        view = memoryview(host.numpy()).cast("B")
        try:
            if inc.hasher is not None:
                inc.hasher.update(view)
            _write_all(inc.fd, view, piece.offset)
        except OSError as exc:
            inc.problem = one_line(exc)
    return None


def open_regular(path: str, size: int) -> int:
    """A descriptor of ``path``, a regular file (not a link) of ``size`` bytes, else ``OSError``."""
    fd, st = open_regular_file(path)
    if st.st_size != size:
        os.close(fd)
        raise OSError(f"{path} is {st.st_size} bytes, the manifest says {size}")
    return fd


def map_file(fd: int, size: int) -> torch.Tensor | None:
    """The whole file of ``fd`` as a read-only mapping, if it still holds the ``size`` bytes it was
    opened with (``None``: empty, changed, or it cannot be mapped; the pieces are then read with
    ``preadv``, which reports a short read). Reading a tmpfs file through a mapping costs half
    what ``read`` costs on the machines measured (the kernel's copy to user memory is the slow
    part), and gloo sends straight from it. A mapping turns a file truncated under it into
    SIGBUS: these are the tier's own files (written once, renamed into place, never truncated by
    distckpt), in the job's own ``local_dir``."""
    try:
        if size == 0 or os.fstat(fd).st_size != size:
            return None
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    with warnings.catch_warnings():  # not writable: only ever read (sent) from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=torch.uint8)


def _read_piece(fd: int, piece: _Piece, into: torch.Tensor) -> bool:
    view = memoryview(into.numpy()).cast("B")
    done = 0
    try:
        while done < piece.length:
            n = os.preadv(fd, [view[done:]], piece.offset + done)
            if n <= 0:
                return False
            done += n
    except OSError:
        return False
    return True


def _open_part(directory: str, name: str, manifest: Manifest | None) -> _Incoming:
    hasher = None
    if manifest is not None and manifest.checksum_algorithm and manifest.files[name].checksum is not None:
        hasher = new_hasher(manifest.checksum_algorithm)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = create_fresh(os.path.join(directory, name + PART))
    except OSError as exc:
        return _Incoming(None, hasher, one_line(exc))
    return _Incoming(fd, hasher)


def create_fresh(path: str) -> int:
    """A descriptor of a new, empty file at ``path`` for writing. Whatever is there (a leftover of
    a crash, a symbolic or hard link to another file) is unlinked first, never written through."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _close_part(directory: str, name: str, inc: _Incoming, keep: bool) -> str | None:
    """Close a received file; rename it into place (``keep``) or remove it. Returns a problem."""
    part = os.path.join(directory, name + PART)
    fd, inc.fd = inc.fd, None
    problem = None
    try:
        if fd is not None:
            os.close(fd)
            if keep:
                os.replace(part, os.path.join(directory, name))
                return None
    except OSError as exc:
        problem = one_line(exc)
    with contextlib.suppress(OSError):
        os.unlink(part)
    return problem


def transfer_device(group: Group) -> torch.device:
    """Where the group's backend takes tensors from: NCCL needs them on the current GPU."""
    backend = dist.get_backend(group.pg)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group: Group, rank: int) -> int:
    """The default group's number of ``group``'s rank ``rank`` (what point-to-point ops take)."""
    return dist.get_global_rank(group.pg, rank) if group.pg is not None else rank
