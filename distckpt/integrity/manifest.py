"""The manifest: the small JSON document whose presence commits a step.

Layout of a root::

    ROOT/step_000000100/            one directory per step
        __0_0.distcp ...            DCP data files, written in parallel by the ranks
        .metadata                   DCP metadata, written by the coordinator after all data
        manifest.json               written last by the coordinator: the commit

A step directory without ``manifest.json`` is invisible to ``steps()``/``load()`` and is removed
by a later save once its lease is stale, if it holds nothing but these files
(:func:`distckpt.storage.ownership.foreign_entries`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from typing import Any

from distckpt.errors import IntegrityError
from distckpt.integrity.checksums import ALGORITHMS, new_hasher
from distckpt.integrity.safe_pickle import check_relative_name
from distckpt.storage.base import Storage

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_([0-9]{9,})")
#: DCP's data files, ``__<rank>_<n>.distcp`` (``fullmatch``; group 1: the rank).
DATA_FILE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")


def step_dir(step: int) -> str:
    """Directory name of ``step`` (zero-padded so names sort like numbers)."""
    return f"step_{step:09d}"


#: The file the local tier writes into each step folder it makes (the root the copy belongs to):
#: such a folder is a tier's copy of a step, not a step of the root it lies in. A root on the
#: local disk that is also another job's ``local_dir`` never lists, loads or retires it
#: (:func:`tier_copy`); only the tier's own storage (``Storage.tier_copies``) reads it.
TIER_MARK = ".distckpt-root"
#: What such a folder is, for messages.
TIER_COPY = f"a local tier's copy of another root's step (it holds {TIER_MARK}: this root is also another job's local_dir)"


def committed_steps(storage: Storage) -> list[int]:
    """Committed steps (directories holding a manifest) under ``storage``; not a local tier's
    copies of another root's steps (:func:`tier_copy`)."""
    steps = {d: s for d in storage.list_dirs() if (s := parse_step_dir(d)) is not None}
    held = storage.exists_each((d, MANIFEST_NAME) for d in steps)
    found = [(d, s) for (d, s), yes in zip(steps.items(), held) if yes]
    if found and _tier_copies_possible(storage):
        marked = storage.exists_each((d, TIER_MARK) for d, _ in found)
        found = [ds for ds, yes in zip(found, marked) if not yes]
    return sorted(s for _, s in found)


def tier_copy(storage: Storage, step: int) -> bool:
    """Whether ``step``'s folder under root ``storage`` is a local tier's copy of another root's
    step (it holds :data:`TIER_MARK`: ``storage`` is also some job's ``local_dir``), which this
    root must never take for its own step. Always ``False`` for the tier's own storage, and
    off the local disk (a tier is node-local)."""
    return _tier_copies_possible(storage) and storage.exists(step_dir(step), TIER_MARK)


def _tier_copies_possible(storage: Storage) -> bool:
    """Whether root ``storage`` may hold another job's tier copies (one request per step to
    tell; none where it cannot: a tier lives on the local disk)."""
    return storage.is_local and not storage.tier_copies


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name made by :func:`step_dir`, else ``None``: exactly that name,
    so that ``step_100``, ``step_0000000007``, ``step_\u0663`` (an Arabic-Indic 3, which
    ``\\d`` matches) or a name ending in a newline (which ``$`` lets through) are not a step
    (two names for one step; folders of other tools that cleanup would take for incomplete steps)."""
    m = _STEP_DIR.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == name else None


@dataclass
class FileRecord:
    """One file of a checkpoint: its size and checksum as written."""

    size: int
    checksum: str | None = None


class _NewerFormat(ValueError):
    """(Manifest.from_json) A manifest of a format newer than this distckpt's."""


class NewerFormatError(IntegrityError):
    """A manifest written by a newer distckpt (its ``format_version`` beyond this one's): intact,
    but not readable here; upgrade distckpt. (An ``IntegrityError``, as before it had a class.)"""


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
        fingerprints: tensor key -> sharding-independent fingerprint of the saved values
            (:mod:`distckpt.state.fingerprint`), checked after loads (:mod:`distckpt.state.statecheck`).
        fingerprint_version: the fingerprint construction ``fingerprints`` were computed with
            (:mod:`distckpt.state.fpkernels`; 1 in manifests written before it was recorded).
        job: the job (lineage of runs) that saved it: retention counts and deletes only its own
            job's steps (:mod:`distckpt.storage.lineage`; ``None`` in manifests written before).
        value_digests: flattened key -> sha256 of the bytes stored for every non-tensor item
            written (optimizer hyper-parameters, scheduler/GradScaler fields, plain values...:
            DCP's BYTE_IO records, see :mod:`distckpt.state.values`), checked by every load, export and
            ``verify --state`` before the item is unpickled. ``None`` in manifests written before
            distckpt recorded them: those items are then read unverified (a ``.metadata``
            re-pointed at another record goes unnoticed), except top-level plain values, whose
            entries carry their own ``sha256``.
        root: the URL of the root it was committed to (credentials left out), also in a
            replica's copy: a replica several roots share tells their steps of one number apart
            (:mod:`distckpt.storage.local_tier`). ``None`` in manifests written before.
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
    fingerprints: dict[str, str] = field(default_factory=dict)
    value_digests: dict[str, str] | None = None
    fingerprint_version: int = 1
    job: str | None = None
    root: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "manifest") -> Manifest:
        """Parse a manifest, raising ``ValueError`` that names ``where`` and the bad field."""
        raw = json_object(data, f"malformed manifest {where}")
        _check_fields(raw, where)
        version = raw.get("format_version", 1)
        if version > FORMAT_VERSION:
            raise _NewerFormat(
                f"{where}: format_version {version} is newer than this distckpt understands "
                f"({FORMAT_VERSION}); upgrade distckpt"
            )
        files = {k: FileRecord(v["size"], v.get("checksum")) for k, v in raw["files"].items()}
        known = {f for f in cls.__dataclass_fields__} - {"files"}
        manifest = cls(files=files, **{k: v for k, v in raw.items() if k in known})

        for name in manifest.files:
            check_relative_name(name, where)
        return manifest


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def json_object(data: bytes | str, what: str, error: type[Exception] = ValueError, *, strict: bool = False) -> dict[str, Any]:
    """``data`` parsed as a JSON object (its values: any JSON), else ``error`` saying that
    ``what`` (the document and where it is, for the message) is not one. ``strict``: refuse
    ``NaN`` and ``Infinity``, which Python's json reads and other readers (safetensors) refuse."""
    try:
        raw = json.loads(data, parse_constant=_no_constant) if strict else json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise error(f"{what} is a {type(raw).__name__}, not a JSON object")
    return raw


def _check_fields(raw: dict[str, Any], where: str) -> None:
    """Every field of a manifest has the type it must have, or ``ValueError`` naming it."""

    def bad(field: str, want: str) -> ValueError:
        value = raw.get(field)
        return ValueError(f"malformed manifest {where}: field {field!r} must be {want}, got {type(value).__name__} {value!r:.60}")

    def is_int(v: object, low: int) -> bool:
        return type(v) is int and v >= low

    for required in ("step", "world_size", "entries", "files", "checksum_algorithm", "torch_version", "distckpt_version"):
        if required not in raw:
            raise ValueError(f"malformed manifest {where}: field {required!r} is missing")
    if not is_int(raw["step"], 0):
        raise bad("step", "a non-negative int")
    if not is_int(raw["world_size"], 1):
        raise bad("world_size", "a positive int")
    if "format_version" in raw and not is_int(raw["format_version"], 1):
        raise bad("format_version", "a positive int")
    if not isinstance(raw["entries"], dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in raw["entries"].items()):
        raise bad("entries", "an object of objects")
    for name, described in raw["entries"].items():
        for field_name in ("kind", "parallel"):
            value = described.get(field_name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"malformed manifest {where}: entries[{name!r}].{field_name} must be a string, "
                    f"got {type(value).__name__} {value!r:.60}"
                )
    files = raw["files"]
    if not isinstance(files, dict):
        raise bad("files", "an object")
    for name, record in files.items():
        if not isinstance(record, dict) or not is_int(record.get("size"), 0):
            raise ValueError(f"malformed manifest {where}: files[{name!r}].size must be a non-negative int, got {record!r:.60}")
        if record.get("checksum") is not None and not isinstance(record["checksum"], str):
            raise ValueError(f"malformed manifest {where}: files[{name!r}].checksum must be a string or null")

    if raw["checksum_algorithm"] is not None and raw["checksum_algorithm"] not in ALGORITHMS:
        raise bad("checksum_algorithm", f"one of {ALGORITHMS} or null")
    for name in ("torch_version", "distckpt_version"):
        if not isinstance(raw[name], str):
            raise bad(name, "a string")
    created = raw.get("created_unix", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or created != created or abs(created) > 1e12:
        raise bad("created_unix", "a number of seconds")
    if not isinstance(raw.get("extra", {}), dict):
        raise bad("extra", "an object")
    if _depth(raw.get("extra", {})) > _EXTRA_DEPTH + 1:
        # A save refuses deeper metadata (check_extra): only a crafted manifest gets here, and
        # every tool that walks or prints it would run out of recursion on it.
        raise bad("extra", f"nested at most {_EXTRA_DEPTH} levels deep")
    prints = raw.get("fingerprints", {})
    if not isinstance(prints, dict) or not all(isinstance(v, str) for v in prints.values()):
        raise bad("fingerprints", "an object of strings")
    if "fingerprint_version" in raw and not is_int(raw["fingerprint_version"], 1):
        raise bad("fingerprint_version", "a positive int")
    if raw.get("job") is not None and not isinstance(raw["job"], str):
        raise bad("job", "a string or null")
    if raw.get("root") is not None and not isinstance(raw["root"], str):
        raise bad("root", "a string or null")
    digests = raw.get("value_digests")
    if digests is not None and (not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values())):
        raise bad("value_digests", "an object of strings or null")


_EXTRA_DEPTH = 32


def _depth(value: object) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and objects (a scalar: 0), without
    recursion (a crafted document can nest ~1000 levels)."""
    deepest = 0
    todo: list[tuple[object, int]] = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            todo.extend((v, depth + 1) for v in item)
        else:
            continue
        deepest = max(deepest, depth + 1)
    return deepest


def check_extra(extra: object) -> dict[str, Any]:
    """``save(metadata=...)`` as the manifest records it: a dict that JSON holds exactly, so
    that it reads back equal (``Manifest.extra``). ``None`` is an empty dict.

    Raises:
        TypeError: not a dict; a key that is not a string (JSON would turn ``1`` into ``"1"``); a
            tuple (it would come back a list) or any value that is not None, bool, int, float,
            str, list or dict; nested deeper than 32 levels. The message names the path.
        ValueError: a float that is NaN or infinite (not JSON).
    """
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"save(metadata=...) must be a dict of JSON values, got {type(extra).__name__}")

    def walk(value: object, path: str, depth: int) -> Any:
        if depth > _EXTRA_DEPTH:
            raise TypeError(f"save(metadata=...): {path} is nested deeper than {_EXTRA_DEPTH} levels")
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return str.__str__(value)  # a str subclass (a (str, Enum), a tag class) as the plain str JSON keeps: its text, not its __str__
        if isinstance(value, int):
            return int(value)  # an int subclass (IntEnum, NumPy-free bool-likes) as the plain int JSON keeps
        if isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"save(metadata=...): {path} is {value!r}, which JSON cannot hold (store it as a string)")
            return float(value)
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"save(metadata=...): {path} has the key {k!r} ({type(k).__name__}); JSON keys are strings, "
                        "so it would read back as another key"
                    )
                out[str.__str__(k)] = walk(v, f"{path}[{k!r}]", depth + 1)  # (a str subclass key as a str)
            return out
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            raise TypeError(f"save(metadata=...): {path} is a tuple, which would read back as a list; pass a list")
        raise TypeError(
            f"save(metadata=...): {path} is a {type(value).__module__}.{type(value).__qualname__}; metadata holds "
            "JSON values only (None, bool, int, float, str, lists and dicts of them)"
        )

    return walk(extra, "metadata", 0)


def digest_of(data: bytes, algorithm: str | None) -> str | None:
    """Checksum of ``data`` with ``algorithm`` (None: no checksum)."""
    if not algorithm:
        return None

    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def load_manifest(storage: Storage, dirname: str) -> Manifest:
    """The manifest in directory ``dirname`` under ``storage``, bound to that directory.

    A directory named ``step_N`` must hold step N's manifest (a manifest copied into another
    step's directory would otherwise load that neighbour's data); a directory under any other
    name (copied or renamed, e.g. ``best``) takes its step from the manifest.

    Raises:
        FileNotFoundError: the directory holds no manifest (not committed).
        IntegrityError: malformed, or written for another step than the directory's name says.
    """

    parts = [p for p in (dirname, MANIFEST_NAME) if p]
    path = storage.display(*parts)
    try:
        data = storage.read_bytes(*parts)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    try:
        manifest = Manifest.from_json(data, path)
    except _NewerFormat as exc:
        raise NewerFormatError(str(exc)) from None
    except ValueError as exc:
        raise IntegrityError(str(exc)) from None
    named = parse_step_dir(dirname.rstrip("/").rsplit("/", 1)[-1]) if dirname else None
    if named is not None and manifest.step != named:
        raise IntegrityError(f"{path}: field 'step' is {manifest.step}, but the manifest is in the directory of step {named}")
    return manifest


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of a committed ``step`` under ``storage``, bound to its directory
    (:func:`load_manifest`).

    Raises:
        FileNotFoundError: not committed.
        IntegrityError: malformed, or written for another step.
    """
    try:
        return load_manifest(storage, step_dir(step))
    except FileNotFoundError:
        path = storage.display(step_dir(step), MANIFEST_NAME)
        raise FileNotFoundError(f"checkpoint step {step} is not committed: {path} does not exist") from None
