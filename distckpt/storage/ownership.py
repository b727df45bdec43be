"""Who is writing a step directory: exclusive creation, a lease, an exclusive commit, and a
cleanup that can never remove a committed step.

Several writers may share a root (two jobs started by mistake, a restarted job whose old
incarnation still runs, two jobs replicating to one remote root). Rules, all enforced by the
coordinator of each job (and by the replica's uploader, :mod:`distckpt.storage.replica`):

* **Creating a step is exclusive.** Local disks: a directory prepared under a temporary name
  with its owner record inside, then renamed into place (``rename`` fails if the step exists);
  object stores: a conditional put of the step's owner record (S3's ``If-None-Match``). A second
  writer of the same step gets :class:`~distckpt.StepExistsError`, never a mixed checkpoint.
  So does a save (or an upload) of a step whose folder is another tool's (:func:`not_distckpts`),
  checked first: an object store's conditional put creates only the record, beside its files.
* **A lease protects an incomplete step.** The owner record (``.owner`` in the step directory:
  writer id, host, pid, time, the writer's ``lease_s``) is refreshed every ``lease_s / 4``
  seconds while the save runs; a refresh rewrites the record inside the existing directory and
  never re-creates a directory that is gone. Cleanup of incomplete directories removes one only
  when its lease is *stale*: its writer is a dead process on this host, or its record is older
  than ``lease_s`` (default 10 minutes; the cleaner's, or the writer's where longer, up to
  :data:`MAX_LEASE_S`), or it was released (a failed save, or retention deleting the step). A directory
  with **no record** gets ``lease_s`` of grace from its last change (the newest time of the
  directory and the files directly inside it): on fsspec stores with real directories the
  directory exists before its record is put, and a committed step's record is removed after its
  commit. So does a directory whose record is dated more than ``lease_s`` ahead of the cleaner's
  clock (its writer's clock is ahead): that time cannot tell when the record was last
  refreshed; the store's times can.
* **The commit is exclusive.** Right before writing ``manifest.json`` the writer checks that the
  owner record is still its own, and writes the manifest with a no-replace primitive (local:
  ``link`` into the existing directory, which never creates it; object stores: a conditional
  put). A save that returned is therefore never overwritten by another writer; only retention
  (``keep_last``) deletes committed steps.
* **Cleanup removes only what distckpt writes.** An incomplete step directory (or a temporary
  one) is removed only if every entry in it is a file distckpt or DCP writes there
  (:func:`foreign_entries`): a folder named like a step that holds anything else (a user's
  ``model.pt``, a sub-folder) is left alone and warned about once, whatever its lease says. So
  is a plain DCP checkpoint saved under a step's name: ``.metadata`` with neither a manifest nor
  an owner record, which no save or removal of distckpt's leaves (:func:`unowned_dcp_checkpoint`).
* **Cleanup never removes a committed step** (:func:`remove_uncommitted`). The staleness verdict
  and the removal are not atomic, so a writer may commit after cleanup listed its directory or
  judged its lease. Cleanup therefore re-checks the manifest right before removing, and on local
  disks removes in two steps: it first renames the directory to a unique tombstone
  (``.distckpt-removing-<dir>-<id>``), then checks the *tombstone* for a manifest. A rename is
  atomic, and a commit links the manifest into the directory by its path: either the link
  happened before the rename (the tombstone holds the manifest, so it is renamed back, never
  deleted) or after it (the path no longer exists, so the commit fails and the writer's save
  raises instead of returning). A tombstone without a manifest is garbage whoever made it, so a
  removal interrupted by a crash is finished by the next cleanup; one with a manifest is kept
  and warned about. This holds whatever the timing of the two processes.

Object stores have no rename: cleanup re-checks the manifest immediately before its recursive
delete, which leaves one narrow window: a writer whose lease *looks* stale (it stalled longer
than ``lease_s``, or its clock is off by that much) commits in the milliseconds between that
check and the delete. A live writer refreshing its lease is never at risk. Exclusive creation
and commit hold where the store implements conditional puts (AWS S3 does, through s3fs);
elsewhere fsspec falls back to check-then-write, which narrows but does not close the race
between two writers of the *same* step; writers of different steps never interfere.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Collection, Mapping

from distckpt._process import process_exists
from distckpt.integrity.manifest import DATA_FILE, MANIFEST_NAME, parse_step_dir
from distckpt.integrity.stepfiles import METADATA_NAME
from distckpt.storage.base import NEW_DIR_PREFIX, Storage, new_dir_creator

log = logging.getLogger("distckpt")

OWNER_NAME = ".owner"
DEFAULT_LEASE_S = 600.0
# Directories being removed (local roots): renamed to this prefix first, see the module doc.
TOMBSTONE_PREFIX = ".distckpt-removing-"


#: Writers (owner record ids) of this process whose save failed: their leases were released,
#: even where the store could not be told so (an object store down at that moment), so their
#: records are stale to this process's cleanup at once. Without it, retrying the failed step in
#: the same process was refused as "another writer's" for ``lease_s``.
_RELEASED_HERE: set[str] = set()

#: The longest lease a record's own ``lease_s`` makes a cleaner honour (a record claiming more,
#: forged or garbled, would hold its step for as long): also the largest ``lease_s`` option.
MAX_LEASE_S = 7 * 24 * 3600.0


def _record(writer: str, released: bool = False, lease_s: float | None = None) -> bytes:
    record: dict[str, object] = {
        "writer": writer, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "released": released
    }  # fmt: skip
    if lease_s is not None:
        # The writer's own lease: a cleaner with a shorter one judges the record by this one
        # (a job with lease_s=5 removed another job's step while it was written, refreshed
        # every 600 / 4 s).
        record["lease_s"] = lease_s
    return json.dumps(record).encode()


def held_lease(record: Mapping[str, object], lease_s: float) -> float:
    """The lease a cleaner judges ``record`` by: its own ``lease_s``, or the writer's recorded
    in it where longer (at most :data:`MAX_LEASE_S`)."""
    held = record.get("lease_s")
    if isinstance(held, (int, float)) and not isinstance(held, bool) and math.isfinite(held) and held > lease_s:
        return min(float(held), max(lease_s, MAX_LEASE_S))
    return lease_s


def _write_record(storage: Storage, dirname: str, data: bytes) -> None:
    """Replace the owner record of ``dirname`` without ever creating the directory (a directory
    moved away by cleanup must stay gone): :meth:`~distckpt.storage.base.Storage.rewrite_bytes`."""
    storage.rewrite_bytes(data, dirname, OWNER_NAME)


def mark_released(storage: Storage, dirname: str) -> None:
    """Write a released owner record into ``dirname`` (retention does before uncommitting a
    step, so that a crash half-way leaves a directory the next cleanup removes at once)."""
    _write_record(storage, dirname, _record("released", released=True))


class Lease:
    """(coordinator) Exclusive ownership of one step directory while a save writes it.

    Args:
        storage: the root.
        dirname: the step directory's name.
        lease_s: how long a record stays valid without a refresh.
    """

    def __init__(self, storage: Storage, dirname: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.storage = storage
        self.dirname = dirname
        self.lease_s = lease_s
        self.writer = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Create the step directory and its owner record, exclusively.

        Raises:
            FileExistsError: the directory (or, on object stores, its owner record) exists.
        """
        self.storage.create_exclusive(self.dirname, OWNER_NAME, _record(self.writer, lease_s=self.lease_s))
        self._thread = threading.Thread(target=self._refresh, name=f"distckpt-lease-{self.dirname}", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.renew()
            except Exception:  # noqa: BLE001 - a missed refresh only shortens the lease
                pass

    def renew(self) -> None:
        """Refresh the record if it is still this writer's; never re-creates the directory."""
        if self.still_mine():
            _write_record(self.storage, self.dirname, _record(self.writer, lease_s=self.lease_s))

    def still_mine(self) -> bool:
        """Whether the owner record is still this writer's (checked right before committing)."""
        try:
            return json.loads(self.storage.read_bytes(self.dirname, OWNER_NAME)).get("writer") == self.writer
        except Exception:  # noqa: BLE001 - unreadable or gone: not ours any more
            return False

    def release(self, committed: bool) -> None:
        """Stop refreshing. After a commit the record goes. After a failure (every rank has
        stopped writing by then) the owner removes the directory it still owns, so a failed save
        on a full disk gives its space back; if that fails, the record is marked released so
        that the next save's cleanup removes it. A directory that holds a manifest (another
        writer committed it) is never removed: only this writer's record goes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not committed:
            _RELEASED_HERE.add(self.writer)
        try:
            if committed:
                self.storage.remove(self.dirname, OWNER_NAME)
            elif self.still_mine():
                if self.storage.exists(self.dirname, MANIFEST_NAME):
                    self.storage.remove(self.dirname, OWNER_NAME)
                    return
                try:
                    remove_uncommitted(self.storage, self.dirname)
                except Exception:  # noqa: BLE001 - fall back to marking it for cleanup
                    _write_record(self.storage, self.dirname, _record(self.writer, released=True))
        except Exception:  # noqa: BLE001 - best effort: a stale lease expires anyway
            pass


def is_stale(storage: Storage, dirname: str, lease_s: float = DEFAULT_LEASE_S, now: float | None = None) -> bool:
    """(coordinator) Whether an incomplete step directory may be removed (see the module doc).

    A directory without a record is stale only ``lease_s`` after its last change (or at once if
    it is empty and its store reports no times, or if it is a temporary directory whose name
    says a process of this host made it that is gone: killed before its record was written). So
    is one whose record is dated more than ``lease_s`` ahead of this clock (a writer whose clock
    is ahead). A record of a writer of this process whose save failed is stale at once (its
    release may not have reached the store). A record that cannot be read for another reason than its absence (an I/O error)
    leaves the directory alone.
    """
    now = time.time() if now is None else now
    try:
        raw = storage.read_bytes(dirname, OWNER_NAME)
    except FileNotFoundError:
        creator = new_dir_creator(dirname)
        if creator is not None and not process_exists(creator):
            return True
        changed, count = storage.last_change(dirname)
        if changed is None:
            return count == 0
        return now - changed > lease_s
    except OSError:
        return False
    except Exception:  # noqa: BLE001 - e.g. a record that is a symbolic link: no claim
        return True
    try:
        record = json.loads(raw)
        if not isinstance(record, dict):
            raise ValueError("not a record")
    except Exception:  # noqa: BLE001 - a garbled record is no claim
        return True
    writer = record.get("writer")
    if record.get("released") or (isinstance(writer, str) and writer in _RELEASED_HERE):
        return True
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        if not process_exists(record["pid"]):
            return True
    lease_s = held_lease(record, lease_s)
    stamp = record.get("time")
    # NaN or infinity (json reads both) would never expire: a garbled record, no claim.
    if not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
        return True
    if stamp - now > lease_s:
        # Dated more than a lease ahead: the writer's clock is ahead of this one (or the record
        # lies), so its time cannot say when it was last refreshed, and would hold the step until
        # this clock caught up (a dead writer's step unsavable for as long as its clock was off).
        # The store's times can: a live writer rewrites its record every lease_s / 4.
        changed, _ = storage.last_change(dirname)
        return changed is not None and now - changed > lease_s
    return now - stamp > lease_s


def _tombstone(storage: Storage, dirname: str) -> str | None:
    """Atomically move ``dirname`` to a unique tombstone name and return that name; ``dirname``
    itself where the storage has no atomic rename (object stores: nothing moves); ``None`` if
    it is gone."""
    tomb = f"{TOMBSTONE_PREFIX}{dirname}-{uuid.uuid4().hex[:12]}"
    try:
        moved = storage.move_dir(dirname, tomb)
    except FileNotFoundError:
        return None
    return tomb if moved else dirname


def _restore(storage: Storage, tomb: str, dirname: str) -> None:
    """Move a tombstone that turned out to hold a commit back to its name (or keep it, warned)."""
    try:
        storage.move_dir(tomb, dirname)
    except OSError as exc:
        warnings.warn(
            f"distckpt: {storage.display(dirname)} was committed while it was being cleaned up and "
            f"could not be moved back ({exc}); its checkpoint is kept at {storage.display(tomb)}",
            stacklevel=3,
        )
        return
    warnings.warn(
        f"distckpt: {storage.display(dirname)} was committed while it was being cleaned up; kept",
        stacklevel=3,
    )


def remove_uncommitted(storage: Storage, dirname: str, dispose: Callable[[str], None] | None = None) -> bool:
    """(one process) Remove ``dirname`` unless it holds a manifest, even one written meanwhile.

    Where the storage can rename atomically (local roots): re-check, move to a tombstone, check
    the tombstone, then delete it (or move it back if a commit landed first). Object stores:
    re-check, then delete (see the module doc for the window this leaves). Returns whether the
    directory was removed (or, with ``dispose``, handed over for removal).

    Args:
        dispose: takes a tombstone, once it is known to hold no manifest, and deletes it later
            (:class:`distckpt.storage.retention.Reaper`): from then on it is garbage, whoever
            deletes it and whenever (a tombstone left by a crash is removed by the next
            cleanup). Directories that could not be moved aside are always deleted here.
    """
    if storage.exists(dirname, MANIFEST_NAME):
        return False
    where = _tombstone(storage, dirname)
    if where is None:
        return False
    if where != dirname and storage.exists(where, MANIFEST_NAME):
        _restore(storage, where, dirname)
        return False
    if dispose is not None and where != dirname:
        dispose(where)
    else:
        if where == dirname:
            # No rename: a removal interrupted half-way (a crash, a failed batch of deletes) leaves
            # some of the files under the step's own name. .metadata goes first, so what is left
            # never looks like a DCP checkpoint another tool wrote (kept forever: unowned_dcp_checkpoint).
            storage.remove(where, METADATA_NAME)
        storage.remove_tree(where)
    return True


#: Files distckpt and DCP write into a step directory, and the temporary names they are written
#: under (``<name>.tmp-<8 hex>``: :class:`~distckpt.storage.local.LocalStorage`; ``.tmp``: DCP's
#: ``.metadata``).
_STEP_FILE = re.compile(
    "(?:" + "|".join([*map(re.escape, (OWNER_NAME, METADATA_NAME, MANIFEST_NAME)), DATA_FILE.pattern]) + r")(?:\.tmp|\.tmp-[0-9a-f]{8})?"
)
_WARNED_FOREIGN: set[str] = set()


def is_step_file(name: str) -> bool:
    """Whether ``name`` is a file distckpt or DCP writes into a step directory (or one being
    written under a temporary name)."""
    return _STEP_FILE.fullmatch(name) is not None


def foreign_entries(
    storage: Storage,
    dirname: str,
    listing: tuple[Mapping[str, int], list[str]] | None = None,
    ours: Callable[[str], bool] = is_step_file,
) -> list[str]:
    """(one process) The entries of ``dirname`` that are not files distckpt writes into a step
    directory (sorted, files first; an entry that is not a file, such as a sub-folder or a link
    that leads nowhere, ends with ``/``); [] for a directory that holds only distckpt's files, or
    is gone. Cleanup never removes a directory for which this is not empty: it is someone
    else's, whatever its name. ``listing``:
    :meth:`~distckpt.storage.base.Storage.list_entries` of it, if listed already. ``ours``: the
    names of the files that are distckpt's there (a step of a root: :func:`is_step_file`)."""
    files, others = storage.list_entries(dirname) if listing is None else listing
    return sorted(n for n in files if not ours(n)) + [f"{n}/" for n in others]


def shown_entries(foreign: list[str]) -> str:
    """:func:`foreign_entries` for a message: the first three, quoted, and how many more."""
    return ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")


def unowned_dcp_checkpoint(storage: Storage, dirname: str, files: Mapping[str, int] | None = None) -> bool:
    """(one process) Whether ``dirname`` holds a DCP checkpoint (its ``.metadata``) but neither a
    manifest nor an owner record: a plain ``dcp.save`` (or a copy without ``manifest.json``), not
    a save distckpt left. distckpt creates a step with its owner record inside and keeps one there
    until the commit, and an uncommit (retention) writes a released one first; a removal without
    a rename deletes ``.metadata`` first (:func:`remove_uncommitted`), so no interrupted save or
    removal of distckpt's leaves this state. ``files``: as for :func:`foreign_entries`."""
    files = storage.list_files(dirname) if files is None else files
    return METADATA_NAME in files and OWNER_NAME not in files and MANIFEST_NAME not in files


def not_distckpts(storage: Storage, dirname: str) -> str | None:
    """(one process) Why ``dirname``, named like a step, is not distckpt's to remove or to write
    into (a phrase: "holds files distckpt does not write ('model.pt')", or one for
    :func:`unowned_dcp_checkpoint`); ``None`` if nothing says so."""
    listing = storage.list_entries(dirname)  # (one request on object stores)
    foreign = foreign_entries(storage, dirname, listing)
    files = listing[0]
    if foreign:
        return f"holds files distckpt does not write ({shown_entries(foreign)})"
    if unowned_dcp_checkpoint(storage, dirname, files):
        return "holds a DCP checkpoint (.metadata) that no distckpt save wrote: no manifest.json and no owner record"
    return None


def _kept_as_foreign(storage: Storage, name: str) -> bool:
    """Whether ``name`` is not distckpt's (:func:`not_distckpts`); warned once per directory."""
    why = not_distckpts(storage, name)
    if why is None:
        return False
    where = storage.display(name)
    if where not in _WARNED_FOREIGN:
        _WARNED_FOREIGN.add(where)
        warnings.warn(
            f"distckpt: {where} is named like an incomplete checkpoint step but {why}; cleanup leaves it alone "
            "(move it out of the checkpoint root)",
            stacklevel=3,
        )
    return True


def remove_stale_leftovers(storage: Storage, lease_s: float = DEFAULT_LEASE_S, busy: Collection[str] = ()) -> None:
    """(coordinator, or the replica's uploader) Remove what interrupted saves left under the
    root: step directories without a manifest whose lease is stale, temporary directories of a
    step being created once stale, and tombstones of interrupted removals. Never a committed
    step or a live writer's directory; a failed removal is logged, never raised.

    ``busy``: tombstones this process is deleting already (its :class:`~distckpt.storage.retention.Reaper`), left to it."""
    names = storage.list_dirs()
    # Which step and temporary directories hold a manifest, asked all at once (one request each
    # on object stores); a commit landing after this is caught by remove_uncommitted's re-check.
    candidates = [n for n in names if n.startswith(NEW_DIR_PREFIX) or parse_step_dir(n) is not None]
    try:
        committed: set[str] | None = {n for n, yes in zip(candidates, storage.exists_each((n, MANIFEST_NAME) for n in candidates)) if yes}
    except OSError:
        committed = None  # asked again one by one below, where a failure is logged for its directory alone
    for name in names:
        try:
            if name in busy:
                continue
            if name.startswith(TOMBSTONE_PREFIX):
                if storage.exists(name, MANIFEST_NAME):
                    warnings.warn(
                        f"distckpt: {storage.display(name)} holds a committed checkpoint that cleanup "
                        "could not move back to its step directory; kept (move it back by hand)",
                        stacklevel=2,
                    )
                else:
                    storage.remove_tree(name)  # a removal decided before, interrupted
                continue
            if not name.startswith(NEW_DIR_PREFIX) and parse_step_dir(name) is None:
                continue
            if name in committed if committed is not None else storage.exists(name, MANIFEST_NAME):
                continue
            if not is_stale(storage, name, lease_s):
                log.info("leaving incomplete checkpoint %s: another writer holds its lease", storage.display(name))
                continue
            if _kept_as_foreign(storage, name):
                continue
            if remove_uncommitted(storage, name):
                log.info("removed incomplete checkpoint %s", storage.display(name))
        except OSError as exc:
            log.warning("could not remove incomplete checkpoint %s: %s", storage.display(name), exc)
