"""The manifest: the small JSON document whose presence commits a step.

Layout of a root::

    ROOT/step_000000100/            one directory per step
        __0_0.distcp ...            DCP data files, written in parallel by the ranks
        .metadata                   DCP metadata, written by the coordinator after all data
        manifest.json               written last by the coordinator: the commit

A step directory without ``manifest.json`` is invisible to ``steps()``/``load()`` and is removed
by a later save.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(step: int) -> str:
    """Directory name of ``step`` (zero-padded so names sort like numbers)."""
    return f"step_{step:09d}"


def committed_steps(storage: Any) -> list[int]:
    """Committed steps (directories holding a manifest) under a :class:`~distckpt.Storage`."""
    return sorted(
        s for d in storage.list_dirs() if (s := parse_step_dir(d)) is not None and storage.exists(d, MANIFEST_NAME)
    )


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name made by :func:`step_dir`, else ``None``."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass
class FileRecord:
    """One file of a checkpoint: its size and checksum as written."""

    size: int
    checksum: str | None = None


@dataclass
class Manifest:
    """What a committed step holds and how it was written.

    Attributes:
        step: the training step.
        world_size: ranks that saved it.
        entries: top-level state name -> {"kind": module|optimizer|stateful|tensor|value, ...}
            with how it was parallelized (``"parallel": ddp|fsdp2|plain|zero``).
        files: file name inside the step directory -> size and checksum.
        checksum_algorithm: algorithm of ``files[...].checksum``.
        torch_version, distckpt_version, created_unix: provenance.
        extra: free-form user metadata (JSON values).
    """

    step: int
    world_size: int
    entries: dict[str, dict[str, Any]]
    files: dict[str, FileRecord]
    checksum_algorithm: str | None
    torch_version: str
    distckpt_version: str
    created_unix: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "manifest") -> Manifest:
        """Parse a manifest, raising ``ValueError`` that names ``where`` if it is malformed."""
        try:
            raw = json.loads(data)
            files = {str(k): FileRecord(**v) for k, v in raw.pop("files").items()}
            version = raw.get("format_version", 1)
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version} is newer than this distckpt understands "
                    f"({FORMAT_VERSION}); upgrade distckpt"
                )
            known = {f for f in cls.__dataclass_fields__}
            manifest = cls(files=files, **{k: v for k, v in raw.items() if k in known})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed manifest {where}: {exc}") from exc
        from .safe_pickle import check_relative_name

        for name in manifest.files:
            check_relative_name(name, where)
        return manifest


def digest_of(data: bytes, algorithm: str | None) -> str | None:
    """Checksum of ``data`` with ``algorithm`` (None: no checksum)."""
    if not algorithm:
        return None
    from .integrity import new_hasher

    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def read_metadata(storage: Any, manifest: Manifest, verify: bool = True) -> Any:
    """DCP metadata of a committed step, unpickled safely and (``verify``) checked against the manifest."""
    from .errors import IntegrityError
    from .safe_pickle import load_metadata

    directory = step_dir(manifest.step)
    where = storage.display(directory, ".metadata")
    try:
        data = storage.read_bytes(directory, ".metadata")
    except FileNotFoundError:
        raise IntegrityError(f"{where}: missing") from None
    record = manifest.files.get(".metadata")
    if verify and record is not None:
        if len(data) != record.size:
            raise IntegrityError(f"{where}: {len(data)} bytes, manifest says {record.size} (truncated or overwritten)")
        digest = digest_of(data, manifest.checksum_algorithm)
        if record.checksum and digest != record.checksum:
            raise IntegrityError(f"{where}: checksum {digest} does not match the manifest's {record.checksum} (corrupted)")
    return load_metadata(data, where)


def read_manifest(storage: Any, step: int) -> Manifest:
    """The manifest of a committed ``step`` under ``storage``."""
    path = storage.display(step_dir(step), MANIFEST_NAME)
    try:
        data = storage.read_bytes(step_dir(step), MANIFEST_NAME)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint step {step} is not committed: {path} does not exist") from None
    return Manifest.from_json(data, path)
