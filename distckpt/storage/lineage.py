"""Which committed steps of a root are this job's: what ``keep_last`` counts and deletes.

Several jobs may save into one root (two runs of a sweep, a restarted run beside an older one).
Retention must never delete another job's committed steps, so every manifest records the job
that saved it (``Manifest.job``) and retention counts only steps of its own job.

A job is a *lineage* of runs, not a process: a run restarted after preemption resumes with
``load()`` and must go on retiring the steps its earlier runs saved. So by default the identity
is inherited: a full ``load`` (not ``only``/``exclude``, which start something new from part of
a checkpoint) adopts the job of the step it loaded; a checkpointer that saves without having
loaded starts a new job (an id drawn at its first save). ``Checkpointer(job="name")`` fixes it
instead (e.g. the scheduler's job name), for runs that do not resume through ``load``.

Steps saved before manifests recorded a job belong to no job, except to a run that resumed from
one of them: that lineage owns them too, so upgrading distckpt in the middle of a run keeps its
retention working.

Not collective: only the coordinator commits and applies retention; every rank keeps the same
state (they all load the same step).
"""

from __future__ import annotations

import uuid
import warnings

from distckpt._caller import outside
from distckpt.errors import CheckpointError, one_line
from distckpt.integrity.manifest import MANIFEST_NAME, NewerFormatError, read_manifest, step_dir
from distckpt.storage.base import Storage


def check_job(job: str | None) -> None:
    """``ValueError`` unless ``job`` is ``None`` or a string of at most 200 characters with a
    visible one and no control characters (a name shown in ``distckpt ls`` and errors: a
    blank or a newline would read as no job, or split a line)."""
    if job is not None and (
        not isinstance(job, str)
        or not job.strip()
        or len(job) > 200
        or any(ord(c) < 32 or ord(c) == 127 for c in job)
    ):
        raise ValueError(
            f"job must be None or a string of at most 200 characters, not blank and without control characters, got {job!r}"
        )


_UNREADABLE = object()  # (Lineage._job_of: no manifest to read the job from)
_WARNED: set[tuple[str, int, str]] = set()  # (root, step, job) whose unreadable manifest was named


class Lineage:
    """This job's identity and the test of which committed steps are its own.

    Args:
        job: a fixed job name (``Checkpointer(job=...)``); ``None``: inherited from the step a
            full load resumes from, else drawn at the first save.
    """

    def __init__(self, job: str | None = None) -> None:
        check_job(job)
        self.fixed = job is not None
        self._job = job
        self._legacy = False  # resumed from a step that recorded no job: such steps are ours too
        self._jobs: dict[tuple[int, int], str | None] = {}  # (id(storage), step) -> recorded job

    def adopt(self, recorded: str | None) -> None:
        """A full load resumed from a step saved by job ``recorded`` (``None``: saved before
        jobs were recorded): continue that job, unless this one has a fixed name."""
        if self.fixed:
            return
        self._job = recorded
        self._legacy = recorded is None

    @property
    def job(self) -> str:
        """The job new manifests record (drawn on first use if none was given or adopted)."""
        if self._job is None:
            self._job = uuid.uuid4().hex[:16]
        return self._job

    def owns(self, storage: Storage, step: int) -> bool:
        """Whether committed ``step`` under ``storage`` is this job's (its manifest is read once
        and remembered until :meth:`forget`: a committed manifest never changes, but its step
        may be deleted and the number saved again, by another job: retention forgets a step
        before deleting it and after). A step whose manifest cannot be read is not ours:
        retention leaves what it cannot attribute."""
        recorded = self._job_of(storage, step)
        if recorded is _UNREADABLE:
            return False
        if recorded is None:
            return self._legacy
        return recorded == self.job

    def may_resume(self, storage: Storage, step: int) -> bool:
        """Whether ``load(step=None)`` may resume committed ``step``: any step, unless this job
        has a fixed name; then its own, and steps that recorded no job (saved before jobs were
        recorded), never another named job's (two runs of a sweep on one root: each resumes
        its own). Read from the manifest as it is now (not remembered)."""
        if not self.fixed:
            return True
        self.forget(storage, step)
        recorded = self._job_of(storage, step)
        return recorded is not _UNREADABLE and (recorded is None or recorded == self.job)

    def _job_of(self, storage: Storage, step: int) -> object:
        """The job recorded by ``step``'s manifest (``None``: saved before jobs were recorded),
        remembered (see :meth:`owns`); ``_UNREADABLE`` where the manifest cannot be read."""
        key = (id(storage), step)
        if key not in self._jobs:
            try:
                self._jobs[key] = read_manifest(storage, step).job
            except NewerFormatError:
                raise  # intact, written by a newer distckpt: upgrade (never passed by as damaged)
            except (OSError, ValueError, CheckpointError) as exc:
                # (IntegrityError: another writer's commit cut short, or a planted manifest.json
                # on a shared root, which failed every named job's resume and every retention.)
                self._unreadable(storage, step, exc)
                return _UNREADABLE
        return self._jobs[key]

    def _unreadable(self, storage: Storage, step: int, exc: BaseException) -> None:
        """One warning per step and process: what cannot be attributed is left alone."""
        key = (storage.display(), step, self.job)
        if self.fixed and key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(
                f"distckpt: {storage.display(step_dir(step), MANIFEST_NAME)} cannot be read ("
                f"{one_line(exc)[:300]}): job {self.job!r} neither resumes nor retires that step (it cannot tell whose "
                "it is); if it is this job's own, its commit is damaged: a resume takes the job's newest readable step, "
                "and saving that step number again is refused until the folder is repaired or removed",
                stacklevel=outside(),
            )

    def forget(self, storage: Storage, step: int) -> None:
        """Drop what is remembered of ``step`` (deleted, so its number may be saved again)."""
        self._jobs.pop((id(storage), step), None)
