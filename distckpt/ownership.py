"""Who is writing a step directory: exclusive creation, a lease, and an exclusive commit.

Several writers may share a root (two jobs started by mistake, a restarted job whose old
incarnation still runs). Rules, all enforced by the coordinator of each job:

* **Creating a step is exclusive.** Local disks: ``mkdir`` without ``exist_ok``; object stores:
  a conditional put of the step's owner record (S3's ``If-None-Match``). A second writer of the
  same step gets :class:`~distckpt.StepExistsError`, never a mixed checkpoint.
* **A lease protects an incomplete step.** The owner record (``.owner`` in the step directory:
  writer id, host, pid, time) is refreshed every ``lease_s / 4`` seconds while the save runs.
  Cleanup of incomplete directories removes one only when its lease is *stale*: its writer is a
  dead process on this host, or its record is older than ``lease_s`` (default 10 minutes), or it
  was released by a failed save. A directory with no record yet is given ``lease_s`` from its
  creation time, so a writer between ``mkdir`` and its first record is safe.
* **The commit is exclusive.** Right before writing ``manifest.json`` the writer checks that the
  owner record is still its own, and writes the manifest with a no-replace primitive (local:
  ``link``; object stores: a conditional put). A save that returned is therefore never deleted
  or overwritten by another writer; only retention (``keep_last``) deletes committed steps.

Object stores: the guarantees hold where the store implements conditional puts (AWS S3 does,
through s3fs). Elsewhere fsspec falls back to check-then-write, which narrows but does not close
the race between two writers of the *same* step; writers of different steps never interfere.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

OWNER_NAME = ".owner"
DEFAULT_LEASE_S = 600.0


def _record(writer: str, released: bool = False) -> bytes:
    return json.dumps(
        {"writer": writer, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "released": released}
    ).encode()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """(coordinator) Exclusive ownership of one step directory while a save writes it.

    Args:
        storage: the root.
        dirname: the step directory's name.
        lease_s: how long a record stays valid without a refresh.
    """

    def __init__(self, storage: Any, dirname: str, lease_s: float = DEFAULT_LEASE_S) -> None:
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
        self.storage.create_exclusive(self.dirname, OWNER_NAME, _record(self.writer))
        self._thread = threading.Thread(target=self._refresh, name=f"distckpt-lease-{self.dirname}", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                if self.still_mine():
                    self.storage.write_bytes(_record(self.writer), self.dirname, OWNER_NAME)
            except Exception:  # noqa: BLE001 - a missed refresh only shortens the lease
                pass

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
        that the next save's cleanup removes it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if committed:
                self.storage.remove(self.dirname, OWNER_NAME)
            elif self.still_mine():
                try:
                    self.storage.remove_tree(self.dirname)
                except Exception:  # noqa: BLE001 - fall back to marking it for cleanup
                    self.storage.write_bytes(_record(self.writer, released=True), self.dirname, OWNER_NAME)
        except Exception:  # noqa: BLE001 - best effort: a stale lease expires anyway
            pass


def is_stale(storage: Any, dirname: str, lease_s: float = DEFAULT_LEASE_S, now: float | None = None) -> bool:
    """(coordinator) Whether an incomplete step directory may be removed (see the module doc)."""
    now = time.time() if now is None else now
    try:
        record = json.loads(storage.read_bytes(dirname, OWNER_NAME))
        if not isinstance(record, dict):
            raise ValueError("not a record")
    except FileNotFoundError:
        # Step directories appear with their record already inside (built under a temporary
        # name, then renamed): one without a record was left by an older version or another tool.
        return True
    except Exception:  # noqa: BLE001 - a garbled record is no claim
        return True
    if record.get("released"):
        return True
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        if not _pid_alive(record["pid"]):
            return True
    stamp = record.get("time")
    return not isinstance(stamp, (int, float)) or now - stamp > lease_s
