"""Domain errors of distckpt.

Every error raised from a collective call (``save``, ``load``, ``wait``) is raised with the same
message on every rank, so no rank is left waiting in a collective its peers abandoned. Errors
subclass the builtin that fits the caller's mistake, so ``except ValueError`` and friends work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class CheckpointError(RuntimeError):
    """A save or load failed on one or more ranks.

    Unlike DCP's ``CheckpointException`` (a ``BaseException``), this is an ordinary ``Exception``.

    Attributes:
        failures: rank -> one-line description of the cause on that rank (empty when the
            failure was not attributable to single ranks).
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures: dict[int, str] = dict(failures or {})
        self._message = message
        if self.failures:
            lines = [f"  rank {r}: {msg}" for r, msg in sorted(self.failures.items())]
            message = message + "\n" + "\n".join(lines)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        # Errors cross process boundaries (gathered to every rank): keep the per-rank causes.
        return (self.__class__, (self._message, self.failures))


class StepExistsError(ValueError):
    """``save`` was asked to write a step that is already committed under the root."""


class StepDeletedError(FileNotFoundError):
    """A committed step was deleted, or committed anew, while ``load`` read it: most likely by
    the retention (``keep_last``) of a job saving to the same root. ``load(step=None)`` then loads
    the newest committed step instead (a few times at most); with an explicit ``step`` (or
    ``strict=False``) this is raised, on every rank. Like any failed load, the failed read may
    have written part of the state; a strict load that succeeds overwrites all of it."""


class StateMismatchError(KeyError):
    """The checkpoint and the state to load into disagree on keys or shapes (``strict=True``).

    Attributes:
        missing: keys the state expects that the checkpoint does not hold.
        unexpected: keys the checkpoint holds that nothing in the state asked for.
        mismatched: key -> (shape in checkpoint, shape in state).
        per_rank: per-rank entry -> (world size it was saved at, world size now): per-rank state
            (see :mod:`distckpt.state.scope`) cannot be resharded to another world size.
        kinds: entry -> (what the checkpoint holds, what the state holds) where they cannot load
            into each other under one key (a tuple holding tensors saved, a plain value given).
        unread_on: those of ``unexpected`` that other ranks' state asked for -> the ranks whose
            state did not (an entry every rank must hold whole).
    """

    def __init__(
        self,
        missing: Sequence[str],
        unexpected: Sequence[str],
        mismatched: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
        where: str = "",
        per_rank: Mapping[str, tuple[int, int]] | None = None,
        kinds: Mapping[str, tuple[str, str]] | None = None,
        unread_on: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = dict(mismatched)
        self.per_rank = dict(per_rank or {})
        self.kinds = dict(kinds or {})
        self.unread_on = {k: list(v) for k, v in (unread_on or {}).items()}
        self.where = where
        super().__init__(self.describe(where))

    def __reduce__(self) -> tuple:
        return (self.__class__, (self.missing, self.unexpected, self.mismatched, self.where, self.per_rank, self.kinds, self.unread_on))

    def describe(self, where: str = "", skipped: bool = False) -> str:
        """The message; ``skipped``: for a ``strict=False`` load's warning, which skipped the
        per-rank state (no advice to load with ``strict=False``)."""
        parts = [f"state does not match checkpoint{(' ' + where) if where else ''}:"]
        if self.missing:
            parts.append(f"missing keys ({len(self.missing)}): {_clip(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected keys ({len(self.unexpected)}): {_clip(self.unexpected)}")
        if self.unread_on:
            shown = [f"{k} (rank(s) {ranks})" for k, ranks in sorted(self.unread_on.items())]
            parts.append(
                f"of which other ranks' state asks for, not these ranks' ({len(shown)}): {_clip(shown)}; "
                "the state must hold them on every rank (state split between ranks by design, as pipeline stages: "
                "hold it in a module or a stateful object, or load with strict=False)"
            )
        if self.mismatched:
            shown = [
                f"{k}: checkpoint {list(a)} vs state {list(b)}"
                for k, (a, b) in sorted(self.mismatched.items())
            ]
            parts.append(f"shape mismatches ({len(shown)}): {_clip(shown)}")
        if self.per_rank:
            shown = [
                f"{k} (saved by {a} ranks, loading at {b}: each rank's own state cannot be mapped to another world size)"
                for k, (a, b) in sorted(self.per_rank.items())
            ]
            then = "skipped" if skipped else "load with strict=False to skip it"
            parts.append(f"per-rank state ({len(shown)}): {_clip(shown)}; {then}")
        if self.kinds:
            shown = [f"{k}: checkpoint {a} vs state {b}" for k, (a, b) in sorted(self.kinds.items())]
            # (a state side ending in a full stop carries its own advice)
            advice = "" if all(b.endswith(".") for _, b in self.kinds.values()) else "; put an object of the saved structure there"
            parts.append(f"entries of another kind ({len(shown)}): {_clip(shown)}{advice}")
        return " ".join(parts)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class IntegrityError(CheckpointError):
    """A checkpoint file is missing, truncated or its checksum does not match the manifest."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds something that could run code when read, or a path escaping it."""


class Interrupted(CheckpointError):
    """A collective call (``load``, ``load_pretrained``, ``save_pretrained``) was interrupted on
    some rank (Ctrl-C, a signal handler's ``sys.exit``).

    Every rank takes the same way out of the call with it (its layers run collectives on the way
    out); the interrupted rank then raises the interrupt itself from the public call
    (:func:`distckpt._dist.interrupts_raised`), its peers this error naming the rank.

    Attributes:
        interrupt: the ``KeyboardInterrupt`` or ``SystemExit`` on the interrupted rank, else ``None``.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None, interrupt: BaseException | None = None) -> None:
        super().__init__(message, failures)
        self.interrupt = interrupt


class StagingMismatchError(CheckpointError):
    """An async save's writer serialized values other than those the state held at the ``save``
    call (``verify_staging``): the staged copy was wrong, or changed before it was written. The
    save is not committed; the previous step stays the newest. The message names the tensors
    (per rank, in :attr:`failures`)."""

    @classmethod
    def found(cls, step: int, rank: int, differ: Sequence[str], unchecked: Sequence[str] = ()) -> StagingMismatchError:
        """The error one rank raises: ``differ`` written with other values than at the call,
        ``unchecked`` written without being checked (a distckpt bug)."""
        parts = []
        if differ:
            parts.append(f"{len(differ)} tensor(s) written with values other than the state held at the save call: {_clip(differ)}")
        if unchecked:
            parts.append(f"{len(unchecked)} tensor(s) written without being checked: {_clip(unchecked)}")
        return cls(
            f"save of step {step} (rank {rank}): verify_staging: " + "; ".join(parts)
            + "; nothing was committed (the staged host copy is not the live state: please report it with the device and torch version)"
        )


def _clip(items: Sequence[str], limit: int = 20) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


def cause_of(exc: BaseException) -> tuple[type[CheckpointError] | None, str]:
    """A rank's failure as :func:`from_causes` takes it, picklable for any exception: its
    distckpt error type (``None`` for other types, which need not be importable on the peers)
    and its one-line description."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and len(exc.failures) == 1:
        exc = _unwrap(next(iter(exc.failures.values())))  # DCP without collectives: this rank's own
    kind = type(exc) if isinstance(exc, CheckpointError) and type(exc).__module__ == __name__ else None
    return kind, one_line(exc)


def interrupt_in(exc: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt`` or ``SystemExit`` (a signal handler's ``sys.exit``) that
    ``exc`` is, or that DCP wrapped as its one-rank ``CheckpointException``; else ``None``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and len(exc.failures) == 1:
        exc = _unwrap(next(iter(exc.failures.values())))
    return exc if isinstance(exc, (KeyboardInterrupt, SystemExit)) else None


def from_causes(causes: Mapping[int, tuple[type[CheckpointError] | None, str]], what: str, note: str = "") -> CheckpointError:
    """One error for failures on several ranks (rank -> :func:`cause_of`): of their common
    distckpt error type if they share one, else a :class:`CheckpointError`; each rank's cause
    listed (``note``: said after "WHAT failed")."""
    kinds = {kind for kind, _ in causes.values()}
    cls = kinds.pop() if len(kinds) == 1 else None
    return (cls or CheckpointError)(f"{what} failed{note}", {r: line for r, (_, line) in causes.items()})


def _unwrap(err: object) -> BaseException:
    # DCP wraps each rank's cause as a tuple (exception, traceback summary).
    inner = err[0] if isinstance(err, tuple) and err else getattr(err, "exception", err)
    return inner if isinstance(inner, BaseException) else RuntimeError(str(err))


def one_line(exc: BaseException) -> str:
    """``exc`` as one rank's entry of a failure list (``Type: message``, see :func:`from_causes`).

    A foreign exception keeps its first line (what follows is often a traceback, or advice for
    another API). distckpt's own errors keep every line: their further lines are the hint (how to
    register a class, which rank failed how), and cutting them left users with a refusal they
    could not act on. Those lines are indented, so they stay under the rank they belong to.
    """
    text = str(exc).strip()
    if not text:
        return f"{type(exc).__name__}: {exc!r}"
    lines = text.splitlines()
    if not type(exc).__module__.startswith("distckpt"):
        lines = lines[:1]
    return f"{type(exc).__name__}: " + "\n    ".join(line.rstrip() for line in lines)
