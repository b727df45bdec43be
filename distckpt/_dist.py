"""Thin collective helpers that also work without an initialized process group.

The rule these helpers enforce: a failure on any rank becomes the same exception on every rank.
Each rank runs its part, catches what it raises, and the outcomes are exchanged in one collective,
so no rank waits forever on a peer that gave up.
"""

from __future__ import annotations

import pickle
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from distckpt._compat import object_collective_device
from distckpt.errors import CheckpointError, Interrupted, one_line

T = TypeVar("T")
S = TypeVar("S")


@dataclass
class Group:
    """The process group distckpt talks on (``None`` = default group, or no distribution).

    Its rank and size are remembered while ``torch.distributed`` is up: a group that spanned
    several ranks and is gone (``dist.destroy_process_group()`` with an async save in flight, or
    :meth:`GroupHolder.release`) keeps its rank and size, and its collectives raise instead of
    becoming those of a group of one rank (which committed the coordinator's share of a save as
    the whole step). A new save or load gets a new group (:meth:`GroupHolder.get`)."""

    pg: dist.ProcessGroup | None = None
    released: bool = False
    _seen: tuple[int, int] | None = field(default=None, repr=False)  # (rank, size) while it was up

    @property
    def live(self) -> bool:
        """Whether ``torch.distributed`` is up for it now (its rank and size remembered): also
        ``False`` once the caller's own group (``process_group=``) was destroyed while the
        default one stays up (``get_rank`` of it then raised a bare ``ValueError``, "not
        registered", from the middle of a save: after its commit, the step went unreported
        and never to the replica)."""
        if self.released or not (dist.is_available() and dist.is_initialized()):
            return False
        try:
            seen = (dist.get_rank(self.pg), dist.get_world_size(self.pg))
        except (ValueError, RuntimeError):  # a group of the caller's, destroyed
            if self.pg is None:
                raise
            return False
        if self._seen is None:
            self._seen = seen
        return True

    @property
    def gone(self) -> bool:
        """It spanned several ranks and ``torch.distributed`` is no longer up for it."""
        return not self.live and self._seen is not None and self._seen[1] > 1

    @property
    def enabled(self) -> bool:
        """Whether collectives go over ``torch.distributed`` (``False``: one process).

        Raises:
            CheckpointError: the group spanned several ranks and is gone.
        """
        if self.live:
            return True
        if self.gone:
            raise CheckpointError(
                "the process group distckpt was using is gone (torch.distributed.destroy_process_group() ran, or the "
                "checkpointer was closed, while a save or load was still running): it did not complete on this rank "
                "(a save's step is committed only where its coordinator got that far: steps() says); wait() for or "
                "close() the checkpointer before destroy_process_group()"
            )
        return False

    @property
    def rank(self) -> int:
        if self.live:
            return dist.get_rank(self.pg)
        return self._seen[0] if self._seen is not None else 0

    @property
    def world_size(self) -> int:
        if self.live:
            return dist.get_world_size(self.pg)
        return self._seen[1] if self._seen is not None else 1

    @property
    def coordinator_global_rank(self) -> int:
        """Global rank of the group's rank 0 (what ``broadcast_object_list`` wants as ``src``)."""
        if not self.enabled or self.pg is None:
            return 0
        return dist.get_global_rank(self.pg, 0)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: T) -> list[T]:
        """(all ranks) Every rank's ``obj`` (picklable), in rank order.

        One collective where every rank's pickled ``obj`` fits a slot of :func:`_slot` bytes (the
        usual case: outcomes, reports, digests), two otherwise. torch's ``all_gather_object``
        always takes two (the sizes, then the bytes): on a busy node each costs milliseconds, and
        a save or a load makes several of these exchanges."""
        if not self.enabled:
            return [obj]
        with _peer_failures("all_gather"):
            return cast("list[T]", _all_gather_objects(obj, self.pg, self.world_size))

    def broadcast(self, obj: T) -> T:
        """(all ranks) The coordinator's ``obj`` on every rank (one collective where it fits a
        slot of :func:`_slot` bytes, else two)."""
        if not self.enabled:
            return obj
        with _peer_failures("broadcast"):
            return cast(T, _broadcast_object(obj if self.is_coordinator else None, self.pg, self.world_size, self.coordinator_global_rank))

    def gather(self, obj: T) -> list[T] | None:
        """(all ranks) Every rank's ``obj`` in rank order on the coordinator; ``None`` elsewhere.

        Unlike :meth:`all_gather`, only the coordinator receives: the bytes moved grow with the
        sum of the objects, not with the world size times it.
        """
        if not self.enabled:
            return [obj]
        out: list[T | None] | None = [None] * self.world_size if self.is_coordinator else None
        with _peer_failures("gather"):
            dist.gather_object(obj, out, dst=self.coordinator_global_rank, group=self.pg)
        return cast("list[T] | None", out)

    def scatter(self, objs: list[T] | None) -> T:
        """(all ranks) Rank ``r`` receives ``objs[r]`` (``objs`` is read on the coordinator only)."""
        if not self.enabled:
            assert objs is not None
            return objs[0]
        box: list[T | None] = [None]
        with _peer_failures("scatter"):
            dist.scatter_object_list(
                box, objs if self.is_coordinator else None, src=self.coordinator_global_rank, group=self.pg
            )
        return cast(T, box[0])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """(all ranks) ``tensor`` (an int64/uint8 CPU tensor) reduced elementwise over all ranks
        with ``op`` (``"sum"`` or ``"max"``); returns a CPU tensor. Moves it to the current CUDA
        device first when the group's backend is NCCL."""
        if not self.enabled:
            return tensor
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = tensor
        if dist.get_backend(self.pg) == "nccl":
            work = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        with _peer_failures("all_reduce"):
            dist.all_reduce(work, op=reduce_op, group=self.pg)
        return work.cpu()


_HEAD = 8  # bytes of a slot's length header (little-endian)


def _slot(world: int) -> int:
    """Bytes of each rank's slot in an object collective's first round: 4 KiB at small world
    sizes, less at large ones (a rank receives ``world`` slots: 256 KiB in all up to 1,024
    ranks, 256 bytes per rank beyond)."""
    return max(256, min(4096, 262144 // max(1, world)))


def _framed(data: bytes, slot: int) -> bytearray:
    """A slot: ``data``'s length, then as much of ``data`` as fits."""
    out = bytearray(slot)
    out[:_HEAD] = len(data).to_bytes(_HEAD, "little")
    n = min(len(data), slot - _HEAD)
    out[_HEAD : _HEAD + n] = memoryview(data)[:n]
    return out


def _host_view(t: torch.Tensor) -> memoryview:
    """The bytes of a uint8 tensor as a memoryview of host memory (copied off a device)."""
    return memoryview(t.cpu().numpy())


def _all_gather_objects(obj: object, pg: dist.ProcessGroup | None, world: int) -> list[object]:
    """Every rank's ``obj`` (see :meth:`Group.all_gather`)."""
    device = object_collective_device(pg)
    data = pickle.dumps(obj)
    slot = _slot(world)
    send = torch.frombuffer(_framed(data, slot), dtype=torch.uint8).to(device)
    out = torch.empty(world * slot, dtype=torch.uint8, device=device)
    dist.all_gather(list(out.split(slot)), send, group=pg)
    first = _host_view(out)
    sizes = [int.from_bytes(first[r * slot : r * slot + _HEAD], "little") for r in range(world)]
    if max(sizes) <= slot - _HEAD:
        return [pickle.loads(first[r * slot + _HEAD : r * slot + _HEAD + n]) for r, n in enumerate(sizes)]
    # Some rank's object is larger: every rank sends its whole pickle, padded to the largest
    # (every rank saw every size: all take this second round alike).
    width = max(sizes)
    padded = bytearray(width)
    padded[: len(data)] = data
    send = torch.frombuffer(padded, dtype=torch.uint8).to(device)
    del padded, data
    out = torch.empty(world * width, dtype=torch.uint8, device=device)
    dist.all_gather(list(out.split(width)), send, group=pg)
    whole = _host_view(out)
    return [pickle.loads(whole[r * width : r * width + n]) for r, n in enumerate(sizes)]


def _broadcast_object(obj: object, pg: dist.ProcessGroup | None, world: int, src: int) -> object:
    """The ``src`` (global) rank's ``obj`` on every rank (see :meth:`Group.broadcast`); ``src``
    keeps ``obj`` itself, as with torch's ``broadcast_object_list``."""
    device = object_collective_device(pg)
    slot = _slot(world)
    sending = dist.get_rank() == src
    data = pickle.dumps(obj) if sending else b""
    buf = torch.frombuffer(_framed(data, slot), dtype=torch.uint8).to(device)
    dist.broadcast(buf, src=src, group=pg)
    first = _host_view(buf)
    size = int.from_bytes(first[:_HEAD], "little")
    if size > slot - _HEAD:
        # Larger than a slot: the rest in a second round (every rank read the size: all take it).
        tail = bytearray(memoryview(data)[slot - _HEAD :]) if sending else bytearray(size - (slot - _HEAD))
        rest = torch.frombuffer(tail, dtype=torch.uint8).to(device)
        dist.broadcast(rest, src=src, group=pg)
        if sending:
            return obj
        return pickle.loads(b"".join((first[_HEAD:], _host_view(rest))))
    return obj if sending else pickle.loads(first[_HEAD : _HEAD + size])


@contextmanager
def _peer_failures(op: str) -> Iterator[None]:
    """A collective that fails (a peer died, timed out, or the group broke) as a CheckpointError."""
    try:
        yield
    except ValueError as exc:
        # The group destroyed between the check and the call (destroy_process_group() beside a
        # running save): torch's "Group ... is not registered" / "... not initialized".
        if "not registered" not in str(exc) and "not initialized" not in str(exc):
            raise
        raise CheckpointError(
            f"distckpt {op} across ranks failed: its process group is gone (torch.distributed.destroy_process_group() "
            f"ran while a save or load was still running); it did not complete on this rank (a save's step is committed "
            f"only where its coordinator got that far: steps() says): {one_line(exc)}"
        ) from exc
    except RuntimeError as exc:  # gloo/NCCL errors, DistBackendError and timeouts subclass it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"distckpt {op} across ranks failed; a peer rank probably died or timed out: {first}"
        ) from exc


@dataclass
class _Failure:
    """A picklable description of an exception raised on one rank."""

    type_name: str
    message: str
    trace: str
    exc: BaseException | None = None  # kept only when it pickles


def capture(exc: BaseException) -> _Failure:
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    keep: BaseException | None = exc
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        keep = None
    return _Failure(type(exc).__name__, one_line(exc), trace, keep)


def raise_if_any(
    outcomes: Sequence[object], what: str, *, reraise_single_type: bool = True
) -> None:
    """Raise the same exception on every rank if any entry of ``outcomes`` is a failure.

    When the failing ranks all raised the same builtin type carrying the same message (the
    usual case for caller mistakes such as a missing step), that exception is re-raised as is,
    so ``except FileNotFoundError`` works on every rank. Otherwise a :class:`CheckpointError`
    lists each rank's cause.
    """
    failures = {r: o for r, o in enumerate(outcomes) if isinstance(o, _Failure)}
    if not failures:
        return
    first = failures[min(failures)]
    same = len({(f.type_name, f.message) for f in failures.values()}) == 1
    if reraise_single_type and same and first.exc is not None:
        if hasattr(first.exc, "add_note"):  # Python >= 3.11: keep where it happened
            first.exc.add_note(f"(raised on rank {min(failures)}; original traceback:)\n{first.trace}")
        raise first.exc
    raise CheckpointError(
        f"{what} failed on {len(failures)} of {len(outcomes)} rank(s)",
        {r: f.message for r, f in failures.items()},
    ) from (first.exc if first.exc is not None else None)


#: Interrupts a rank may take inside a load (Ctrl-C, a signal handler's ``sys.exit``).
INTERRUPTS = (KeyboardInterrupt, SystemExit)
_loading = threading.local()


@contextmanager
def interrupts_raised() -> Iterator[None]:
    """(each rank, around a public load) Inside it, an interrupt that lands in the work of
    :func:`exchange`, :func:`on_coordinator` or a load's read is exchanged like an error, and is
    a :class:`~distckpt.errors.Interrupted` on every rank (:func:`raise_interrupted`), so
    that all ranks take the same way out (escaping bare on its rank, it left its peers in a
    collective it never joined: a hang, or an emergency save's collectives paired with theirs).
    The load then leaves the interrupted rank as its interrupt (``except KeyboardInterrupt`` and
    a handler's exit status work as without distckpt), its peers as ``Interrupted``."""
    depth = getattr(_loading, "depth", 0)
    _loading.depth = depth + 1
    try:
        yield
    except Interrupted as exc:
        if exc.interrupt is not None:
            exc.interrupt.distckpt_left_alike = True  # type: ignore[attr-defined]  # (see left_alike)
            raise exc.interrupt from None
        raise
    finally:
        _loading.depth = depth


def left_alike(exc: BaseException) -> bool:
    """Whether interrupt ``exc`` left a collective call on every rank alike (raised by
    :func:`interrupts_raised` after exchanging it), not on its rank alone."""
    return bool(getattr(exc, "distckpt_left_alike", False))


def gathers_interrupts() -> bool:
    """Whether this thread is inside :func:`interrupts_raised`."""
    return getattr(_loading, "depth", 0) > 0


def raise_interrupted(outcomes: Sequence[object], what: str, interrupt: BaseException | None) -> None:
    """(all ranks, after exchanging outcomes) :class:`~distckpt.errors.Interrupted` on every
    rank if a rank's outcome is an interrupt (``interrupt``: this rank's own, or ``None``)."""
    stopped = {r: o for r, o in enumerate(outcomes) if isinstance(o, _Failure) and o.type_name in {t.__name__ for t in INTERRUPTS}}
    if stopped or interrupt is not None:
        raise Interrupted(f"{what} was interrupted on rank(s) {sorted(stopped)}", {r: o.message for r, o in stopped.items()}, interrupt)


def all_ranks(group: Group, what: str, fn: Callable[[], T]) -> T:
    """(all ranks) Run ``fn`` on every rank; if it fails anywhere, fail everywhere alike.

    ``fn`` must not run collectives itself: a rank that failed before reaching one would pair
    its error exchange with a peer's unrelated collective.
    """
    return exchange(group, what, lambda: (fn(), None))[0]


def exchange(group: Group, what: str, fn: Callable[[], tuple[T, S]]) -> tuple[T, list[S]]:
    """(all ranks) Like :func:`all_ranks` for ``fn`` returning ``(result, shared)``.

    Returns this rank's result and every rank's ``shared`` part, in rank order, gathered in the
    same single collective that exchanges the outcomes.
    """
    interrupt: BaseException | None = None
    try:
        result, shared = fn()
        outcome: _Failure | None = None
    except Exception as exc:  # noqa: BLE001 - every failure must reach the peers
        result, shared, outcome = None, None, capture(exc)
    except INTERRUPTS as exc:
        if not gathers_interrupts():
            raise
        result, shared, outcome, interrupt = None, None, capture(exc), exc
    try:
        gathered = group.all_gather((outcome, shared))
    except CheckpointError:
        if interrupt is not None:
            raise interrupt from None
        raise
    raise_interrupted([o for o, _ in gathered], what, interrupt)
    raise_if_any([o for o, _ in gathered], what)
    return result, [s for _, s in gathered]  # type: ignore[return-value]


def on_coordinator(group: Group, what: str, fn: Callable[[], T]) -> T:
    """(all ranks) Run ``fn`` on the coordinator only and hand its result or error to every rank."""
    payload: tuple[str, object] | None = None
    interrupt: BaseException | None = None
    if group.is_coordinator:
        try:
            payload = ("ok", fn())
        except Exception as exc:  # noqa: BLE001
            payload = ("err", capture(exc))
        except INTERRUPTS as exc:  # (see interrupts_raised)
            if not gathers_interrupts():
                raise
            payload, interrupt = ("err", capture(exc)), exc
    try:
        payload = group.broadcast(payload)
    except CheckpointError:
        if interrupt is not None:
            raise interrupt from None
        raise
    if payload[0] == "err":
        raise_interrupted([payload[1]], what, interrupt)
        raise_if_any([payload[1]], what)
    return cast(T, payload[1])
