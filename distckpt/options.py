"""The options of a :class:`~distckpt.Checkpointer`, validated once.

:class:`CheckpointerOptions` holds every option the checkpointer takes (its docstring says what
each does); ``__post_init__`` normalizes them (a path root to a string, seconds to a
``timedelta``, ``safe_types`` to a :class:`~distckpt.state.safetypes.SafeTypes`) and raises
``ValueError`` naming the field, the value and the reason. The save and load drivers read them
from there; :meth:`CheckpointerOptions.save_options` is what the save phases (and a writer
process) take.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from distckpt.integrity.checksums import ALGORITHMS
from distckpt.integrity.checksums import DEFAULT as DEFAULT_CHECKSUM
from distckpt.save.phases import SaveOptions
from distckpt.state import statecheck
from distckpt.state.safetypes import SafeTypes
from distckpt.storage import ownership
from distckpt.storage.base import Storage, _redact, is_local_location, overlaps
from distckpt.storage.lineage import check_job
from distckpt.storage.local_tier import check_local_dir
from distckpt._ints import plain_int
from distckpt.storage.retention import check_keep_last

ASYNC_MODES = ("process", "thread")
MAX_THREADS = 256
MIN_LEASE_S = 1.0
MAX_TIMEOUT = timedelta(days=365)


def flag(value: object, name: str, what: str = "True or False") -> bool:
    """``value`` as a bool where it is one (NumPy's too); ``ValueError`` naming ``name``
    otherwise: a string from a config file ('False') was taken by its truth, as True."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name} must be {what}, got {value!r}")


def _known_backend(name: str) -> bool:
    """Whether torch knows backend ``name`` (``gloo``, or per device: ``cpu:gloo,cuda:nccl``);
    backends registered by extensions (``Backend.register_backend``) are in its list too."""
    # As torch parses it: lower-cased, not stripped (" gloo" passed here and failed the first
    # save on every rank, blaming a dead peer).
    parts = [p.split(":", 1)[-1] for p in name.lower().split(",")] if ":" in name else [name.lower()]
    return all(p in _backends() for p in parts)


def _backends() -> list[str]:
    return [b for b in dist.Backend.backend_list if b != dist.Backend.UNDEFINED]


def seconds(value: object) -> float | None:
    """A real number of seconds (NumPy's too) as a float; ``None`` for anything else (a bool,
    text from a config file)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


MIN_TIMEOUT_S = 0.001


def _timeout(value: object) -> timedelta:
    """``timeout`` as a positive timedelta of at most :data:`MAX_TIMEOUT` (seconds given as a
    number): 0 or a negative one failed every collective with a message about dead peers, and
    gloo hangs or overflows on ones of some hundred years."""
    given = value.total_seconds() if isinstance(value, timedelta) else seconds(value)
    # At least a millisecond: gloo counts in them, and a shorter one became 0 ms (every
    # collective then timed out at once, blaming peers).
    if given is None or not MIN_TIMEOUT_S <= given <= MAX_TIMEOUT.total_seconds():
        raise ValueError(
            f"timeout must be a positive timedelta or number of seconds, at least 1 ms and at most {MAX_TIMEOUT.days} "
            f"days, got {value!r}"
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=given)


@dataclass
class CheckpointerOptions:
    """Every option of a checkpointer (see :class:`~distckpt.Checkpointer` for what each means).

    Raises:
        ValueError: a field's value is not one it takes (the message names field, value and why).
    """

    root: str | os.PathLike
    keep_last: int | None = None
    storage_options: Mapping[str, Any] | None = None
    process_group: dist.ProcessGroup | None = None
    backend: str | None = "gloo"
    timeout: timedelta | float = timedelta(minutes=10)
    thread_count: int = 2
    sync_files: bool = True
    checksum: str | None = DEFAULT_CHECKSUM
    save_rng: bool = True
    verify: bool = True
    background_nice: int = 10
    replicate_to: str | None = None
    replicate_storage_options: Mapping[str, Any] | None = None
    fingerprint: bool = True
    on_replica_drift: str = "warn"
    verify_state: bool | None = None
    lease_s: float = ownership.DEFAULT_LEASE_S
    skip_torch_record_crc: bool = True
    async_mode: str = "process"
    verify_staging: bool | str = "auto"
    job: str | None = None
    safe_types: Sequence[type] | SafeTypes = field(default_factory=tuple)
    local_dir: str | os.PathLike | None = None
    local_keep: int = 2
    local_peers: int = 1
    replicate_keep_last: int | None | str = "same"

    def __post_init__(self) -> None:
        # NumPy's integers (and other __index__ types) as the plain ints the manifest records.
        for name in ("keep_last", "replicate_keep_last", "thread_count", "local_keep", "local_peers", "background_nice"):
            setattr(self, name, plain_int(getattr(self, name)))
        check_keep_last(self.keep_last)
        if self.replicate_to is None and self.replicate_storage_options:
            raise ValueError(
                "replicate_storage_options configure the filesystem of the replica, and there is none (replicate_to "
                "is not set): they would be ignored"
            )
        if self.replicate_to is None and self.replicate_keep_last != "same":
            raise ValueError(
                f"replicate_keep_last={self.replicate_keep_last!r} is the retention of the replica, and there is none "
                "(replicate_to is not set): it would be ignored"
            )
        if isinstance(self.replicate_keep_last, str):
            if self.replicate_keep_last != "same":
                raise ValueError(
                    f'replicate_keep_last must be "same" (as keep_last), None (keep every step) or an int >= 1, '
                    f"got {self.replicate_keep_last!r}"
                )
            self.replicate_keep_last = self.keep_last
        else:
            check_keep_last(self.replicate_keep_last, "replicate_keep_last")
        self.root = location(self.root, "root", self.storage_options)
        if self.replicate_to is not None:
            self.replicate_to = location(self.replicate_to, "replicate_to", self.replicate_storage_options, "replicate_storage_options")
            # The replica keeps its own retention (replicate_keep_last): in the root, or holding
            # it, it would delete the root's steps, and it would be no second copy.
            if overlaps(self.root, self.storage_options, self.replicate_to, self.replicate_storage_options or self.storage_options):
                raise ValueError(
                    f"replicate_to {_redact(self.replicate_to)} and root {_redact(self.root)} overlap: the replica needs "
                    "a place of its own (it is the second copy, with its own retention)"
                )
        self.storage_options = dict(self.storage_options or {})
        if not (isinstance(self.verify_staging, bool) or self.verify_staging == "auto"):
            raise ValueError(f'verify_staging must be "auto", True or False, got {self.verify_staging!r}')
        if self.async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be one of {ASYNC_MODES}, got {self.async_mode!r}")
        if self.checksum is not None and self.checksum not in ALGORITHMS:
            raise ValueError(f"checksum must be one of {ALGORITHMS} or None, got {self.checksum!r}")
        if isinstance(self.thread_count, bool) or not isinstance(self.thread_count, int) or not 1 <= self.thread_count <= MAX_THREADS:
            # (each writes a file of every save: 10**6 exhausted the process's threads)
            raise ValueError(f"thread_count must be an int from 1 to {MAX_THREADS}, got {self.thread_count!r}")
        if isinstance(self.background_nice, bool) or not isinstance(self.background_nice, int) or not 0 <= self.background_nice <= 39:
            # (a str from a config file failed in the async save's thread, which then never ended)
            raise ValueError(f"background_nice must be an int from 0 to 39 (niceness added), got {self.background_nice!r}")
        for name in ("sync_files", "save_rng", "verify", "fingerprint", "skip_torch_record_crc"):
            setattr(self, name, flag(getattr(self, name), name))
        if self.verify_state is not None:
            self.verify_state = flag(self.verify_state, "verify_state", "None, True or False")
        if self.on_replica_drift not in statecheck.DRIFT_POLICIES:
            raise ValueError(f"on_replica_drift must be one of {statecheck.DRIFT_POLICIES}, got {self.on_replica_drift!r}")
        lease = seconds(self.lease_s)
        if lease is None or not MIN_LEASE_S <= lease <= ownership.MAX_LEASE_S:
            # (a tiny lease rewrote the owner record without pause; infinity crashed its refresh)
            raise ValueError(f"lease_s must be a number of seconds from {MIN_LEASE_S:g} to {ownership.MAX_LEASE_S:g}, got {self.lease_s!r}")
        self.lease_s = lease
        if self.backend is not None and not (isinstance(self.backend, str) and _known_backend(self.backend)):
            # (a typo failed the first save on every rank, blaming a dead peer)
            raise ValueError(
                f"backend must be None or a torch.distributed backend ({', '.join(_backends())}, or "
                f"'cpu:gloo,cuda:nccl'), got {self.backend!r}"
            )
        if self.process_group is not None and not isinstance(self.process_group, dist.ProcessGroup):
            raise ValueError(f"process_group must be None or a torch.distributed.ProcessGroup, got {self.process_group!r}")
        self.timeout = _timeout(self.timeout)
        if self.process_group is not None:
            # Both shape distckpt's own group only: beside a group of yours they were ignored
            # (a timeout=10 wiring mistake then hung for the group's 30 minutes).
            ignored = [f"{n}={v!r}" for n, v, default in (
                ("backend", self.backend, "gloo"), ("timeout", self.timeout, timedelta(minutes=10))) if v != default]  # fmt: skip
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} apply to distckpt's own process group, not to process_group=: distckpt's "
                    "collectives run on your group, bounded by its timeout (new_group(..., timeout=...)); leave them out"
                )
        check_job(self.job)
        # Validated once (ValueError naming the bad entry). Not part of save_options(): those are
        # pickled into a writer process's job, where classes defined in __main__ cannot be
        # unpickled; the writer needs none of them (values are encoded before staging).
        self.safe_types = SafeTypes.of(self.safe_types)
        self.local_dir = check_local_dir(self.local_dir)
        # The tier deletes its old steps: it must not be (in) the root or the replica, nor hold
        # them. Resolved as the storage resolves them (~, symbolic links, the local target of a
        # chain of caches): one directory by two names overlaps.
        for name, where in (("root", self.root), ("replicate_to", self.replicate_to)):
            if self.local_dir is not None and where is not None and overlaps(where, None, self.local_dir, None):
                raise ValueError(
                    f"local_dir {self.local_dir!r} and {name} {_redact(where)} overlap: the local tier needs a directory "
                    "of its own (it keeps only its newest steps)"
                )
        if isinstance(self.local_keep, bool) or not isinstance(self.local_keep, int) or self.local_keep < 1:
            raise ValueError(f"local_keep must be an int >= 1, got {self.local_keep!r}")
        if isinstance(self.local_peers, bool) or self.local_peers not in (0, 1):
            raise ValueError(f"local_peers must be 0 or 1 (one peer node keeps each rank's files), got {self.local_peers!r}")

    def must_agree(self) -> dict[str, object]:
        """The options every rank must pass alike, checked when distckpt's group is created
        (:class:`~distckpt._process.GroupHolder`): the local tier, its peer copies and the
        writer process change which collectives a save or a load takes (ranks that differ
        would wait for each other forever), and the checksum is recorded once per step (a rank
        hashing with another algorithm commits a step that no load can verify); ``verify_state``
        decides whether a load takes the state check's collectives. ``local_dir`` itself may
        differ between nodes; only whether it is set must agree."""
        tier = self.local_dir is not None
        return {
            "local_dir": "set" if tier else None,
            "local_peers": self.local_peers if tier else None,
            "async_mode": self.async_mode,
            "checksum": self.checksum,
            "verify_state": self.verify_state,
            # Only the coordinator uploads and retires replica steps: a rank passing another
            # value would read back one that is not in effect.
            "replicate_keep_last": self.replicate_keep_last if self.replicate_to is not None else None,
        }

    def save_options(self, storage: Storage) -> SaveOptions:
        """What the save phases take, for a save to ``storage``."""
        return SaveOptions(
            storage=storage,
            keep_last=self.keep_last,
            thread_count=self.thread_count,
            sync_files=self.sync_files,
            checksum=self.checksum,
            skip_record_crc=self.skip_torch_record_crc,
            save_rng=self.save_rng,
            fingerprint=self.fingerprint,
            on_replica_drift=self.on_replica_drift,
            lease_s=self.lease_s,
            verify_staging=self.verify_staging,
            local_dir=self.local_dir,
        )


def location(
    value: object, name: str, storage_options: Mapping[str, object] | None = None, options_name: str = "storage_options"
) -> str:
    """``value`` (``root``, ``replicate_to``, a Hugging Face folder) as the text of a path or URL;
    ``ValueError`` naming ``name`` for anything else (bytes from ``__fspath__``, blank text: an
    unset variable would name the working directory), and for ``storage_options`` (called
    ``options_name``) given with a local path (they would be ignored)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name} must be a local path or an fsspec URL (as text), got {value!r}")
    if storage_options and is_local_location(text):
        raise ValueError(
            f"{options_name} configure the filesystem of a URL (s3://..., memory://...); {name} {text!r} is a "
            "local path, where they would be ignored"
        )
    return text
