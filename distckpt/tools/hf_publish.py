"""Publishing a Hugging Face checkpoint into a folder that may hold other files, replacing only
what distckpt wrote there.

* what a publish writes (:class:`Layout`): the tensors (:func:`plan_tensor`), cut into shard
  files as Hugging Face does (:func:`plan_files`, ``max_shard_size`` by :func:`parse_size`), each
  file's safetensors header, the index and an optional ``config.json``;
* what distckpt wrote into a folder: a record, ``.distckpt-publish.json``, names those files
  (:class:`PublishRecord`, :class:`OwnedFile`); files it does not name, or that changed since,
  are the user's and are replaced only when named (:func:`replace_patterns`);
* the atomic publish itself (:class:`Publish`): plan, write the shards aside (or in place on
  object stores), commit with the index last, or abandon and remove what was written.

Used by :func:`distckpt.tools.hf.save_pretrained` (from every rank; the coordinator plans and
commits) and :func:`distckpt.tools.hf_convert.export_hf` (one process). Nothing here is
collective.
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

import torch

from distckpt._version import __version__
from distckpt.errors import IntegrityError, UnsafeCheckpointError
from distckpt.integrity.checksums import digest_of_file, new_hasher
from distckpt.state.shape import numel
from distckpt.storage.base import Storage
from distckpt.tools.outputs import check_output
from distckpt.tools.safetensors_io import (
    INDEX_NAME,
    NAMES,
    check_tensor_name,
    header_bytes,
)
from distckpt.tools.selection import cast_dtype

RECORD_NAME = ".distckpt-publish.json"
CONFIG_NAME = "config.json"
_RECORD_FORMAT = "distckpt-hf-publish"
_MAX_RECORD = 16 * 2**20  # bytes; also the largest file whose content a record pins by sha256
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


# --------------------------------------------------------------------------------------------------
# what a publish writes
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5GB`` (10**9, as Hugging Face counts), ``5GiB`` (2**30) or a byte count -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclass
class PlannedTensor:
    """One tensor as a publish writes it: its name in the files, shape, dtype and byte count."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def plan_tensor(
    name: str, key: str, shape: Sequence[int], stored: torch.dtype, dtype: torch.dtype | None, where: str
) -> PlannedTensor:
    """Tensor ``key`` (of dtype ``stored``) as a publish writes it: under ``name``, cast to
    ``dtype`` (floating-point tensors only, :func:`~distckpt.tools.selection.cast_dtype`).

    Raises:
        ValueError: ``name`` is reserved by safetensors or empty (naming ``where``).
        TypeError: a cast that would truncate values, or a dtype safetensors cannot store.
    """
    check_tensor_name(name, where)
    odt = cast_dtype(key, stored, dtype, shape)
    if odt not in NAMES:
        raise TypeError(f"tensor {key!r} has dtype {odt}, which safetensors cannot store")
    dims = tuple(int(d) for d in shape)
    return PlannedTensor(name, dims, odt, numel(dims) * odt.itemsize)


def plan_files(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Hugging Face's sharding: tensors in order, a new file when the next would overflow."""
    files: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def _file_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


@dataclass
class Layout:
    """What a publish writes: shard files (tensors, names, headers), the index, an optional config."""

    files: list[list[PlannedTensor]]
    config: bytes | None = None
    names: list[str] = field(init=False)
    headers: list[bytes] = field(init=False)
    index: bytes = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.names = _file_names(len(self.files))
        self.headers = [header_bytes([(t.key, t.dtype, t.shape) for t in entries], {"format": "pt"}) for entries in self.files]
        self.total = sum(t.nbytes for entries in self.files for t in entries)
        weight_map = {t.key: self.names[i] for i, entries in enumerate(self.files) for t in entries}
        self.index = json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2, sort_keys=True).encode()

    def owned(self) -> list[OwnedFile]:
        """Every file this publish writes, as its record names them."""
        shards = [OwnedFile(n, len(h) + sum(t.nbytes for t in e)) for n, h, e in zip(self.names, self.headers, self.files)]
        small = [(CONFIG_NAME, self.config)] if self.config is not None else []
        small.append((INDEX_NAME, self.index))
        return shards + [OwnedFile(n, len(data), hashlib.sha256(data).hexdigest()) for n, data in small]

    def small_files(self) -> list[tuple[str, bytes]]:
        """The files the coordinator writes at the commit, the index (the commit itself) last."""
        return ([(CONFIG_NAME, self.config)] if self.config is not None else []) + [(INDEX_NAME, self.index)]


# --------------------------------------------------------------------------------------------------
# what distckpt wrote into a folder
def publish_folder(out: str, storage_options: Mapping[str, object]) -> Storage:
    """The storage of a folder to publish into. A local folder reached through a symbolic link
    is published at its target: the shards are staged beside the folder itself (same
    filesystem, so they can be renamed into it), and a new folder replaces no link."""
    storage = Storage(out, storage_options)
    return Storage(os.path.realpath(storage.path), storage_options) if storage.is_local else storage


def _writable_name(name: str) -> bool:
    """Whether distckpt ever writes a file of this name: a record can claim only these, so no
    record (crafted, copied or corrupted) can make a publish replace a tokenizer or a README."""
    return name in (INDEX_NAME, CONFIG_NAME) or bool(_SHARD_NAME.match(name))


def _hf_weights(name: str) -> bool:
    """A Hugging Face weight file a new publish must replace or remove: left beside the new one
    it would be stale, or make the folder ambiguous (``model.safetensors`` beside an index)."""
    return name == INDEX_NAME or bool(_SHARD_NAME.match(name))


def replace_patterns(replace: str | Iterable[str] | None) -> list[str]:
    """``replace`` as a list of file-name patterns (a single string is one name).

    Raises:
        TypeError: not a string or an iterable of strings.
        ValueError: an entry that is empty or a path (names are of files directly in the folder).
    """
    if replace is None:
        return []
    given: Iterable[object] = [replace] if isinstance(replace, str) else replace
    try:
        items = list(given)
    except TypeError:
        raise TypeError(f"replace must be a file name or a list of file names, got {type(replace).__name__}") from None
    names: list[str] = []
    for p in items:
        if not isinstance(p, str):
            raise TypeError(f"replace entries must be file names (str), got {p!r:.60} ({type(p).__name__})")
        if not p or "/" in p or "\\" in p or p in (".", "..") or "\x00" in p:
            raise ValueError(f"replace entry {p!r:.100} is not a file name: name files directly in the folder (or a pattern such as '*.safetensors')")
        names.append(p)
    return names


@dataclass(frozen=True)
class OwnedFile:
    """One file a publish wrote: its name in the folder, its size and, for the small JSON files
    (index, config), the sha256 of its content; for shards, once committed, the stamp of the
    version written (:meth:`~distckpt.storage.base.Storage.file_stamp`) and the CRC-32C of its
    bytes: a shard the user rewrote at the same size (the same model's weights) is theirs. The
    stamp spares reading it; a shard whose stamp changed (a copy of the folder, a move to
    another filesystem, ``touch``) is still distckpt's if its bytes are."""

    name: str
    size: int
    sha256: str | None = None
    stamp: str | None = None
    crc32c: str | None = None


@dataclass
class PublishRecord:
    """``.distckpt-publish.json``: the files distckpt wrote into a Hugging Face folder.

    A publish replaces (with ``overwrite=True``) only files its record names *and* that are
    unchanged since (same size; same sha256 for the index and config): a file the user rewrote,
    replaced by a link, or that a record claims under a name distckpt never writes is theirs.
    Written atomically; before any file of a publish is written it names them too
    (``complete: false``), so a publish killed half-way leaves nothing unclaimed (where a file
    may be cut short, on filesystems written in place a piece at a time, a shard of an
    unfinished publish is claimed by name, whatever its size).
    """

    files: list[OwnedFile]
    complete: bool

    def to_bytes(self) -> bytes:
        files = [
            {"name": f.name, "size": f.size, **{k: v for k in ("sha256", "stamp", "crc32c") if (v := getattr(f, k))}}
            for f in self.files
        ]
        body = {"format": _RECORD_FORMAT, "version": 1, "complete": self.complete, "written_by": f"distckpt {__version__}", "files": files}
        return json.dumps(body, indent=1).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> PublishRecord:
        """Validate a record. Raises ``IntegrityError`` (malformed, or claiming a file distckpt
        never writes) or ``UnsafeCheckpointError`` (a path leaving the folder), naming it."""
        fix = f"delete {where} to treat every file there as not written by distckpt"
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise IntegrityError(f"{where}: not a distckpt publish record ({type(exc).__name__}); {fix}") from None
        if not isinstance(body, dict) or body.get("format") != _RECORD_FORMAT or body.get("version") != 1:
            raise IntegrityError(f"{where}: not a distckpt publish record (format/version); {fix}")
        entries, complete = body.get("files"), body.get("complete")
        if not isinstance(entries, list) or not isinstance(complete, bool):
            raise IntegrityError(f"{where}: 'files' must be a list and 'complete' a bool; {fix}")
        files = []
        for e in entries:
            name, size, digest, stamp, crc = (
                (e.get("name"), e.get("size"), e.get("sha256"), e.get("stamp"), e.get("crc32c")) if isinstance(e, dict) else (None,) * 5
            )
            if not isinstance(name, str) or type(size) is not int or size < 0 or not (
                digest is None or (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest))
            ) or not (stamp is None or (isinstance(stamp, str) and 0 < len(stamp) <= 200)) or not (
                crc is None or (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc))
            ):
                raise IntegrityError(f"{where}: entry {e!r:.100} is not a name, a size and an optional sha256, stamp and crc32c; {fix}")
            if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
                raise UnsafeCheckpointError(f"{where}: names {name!r:.100}, which is not a file inside the folder; {fix}")
            if not _writable_name(name):
                raise IntegrityError(f"{where}: claims {name!r:.100}, which distckpt never writes; {fix}")
            files.append(OwnedFile(name, size, digest, stamp, crc))
        return cls(files, complete)


def read_record(storage: Storage, files: Mapping[str, int]) -> PublishRecord | None:
    """The record of the folder ``storage`` (whose files are ``files``: name -> size), or None.

    Raises:
        IntegrityError / UnsafeCheckpointError: see :meth:`PublishRecord.parse`; also a record
            that is a symbolic link (local disks never read through one) or not a file.
    """
    where = storage.display(RECORD_NAME)
    if RECORD_NAME not in files:
        if storage.exists(RECORD_NAME):
            raise UnsafeCheckpointError(f"{where} is not a regular file; remove it")
        return None
    if files[RECORD_NAME] > _MAX_RECORD:
        raise IntegrityError(f"{where}: {files[RECORD_NAME]} bytes, larger than a publish record can be; delete it")
    return PublishRecord.parse(storage.read_bytes(RECORD_NAME), where)


# --------------------------------------------------------------------------------------------------
# the protocol that replaces only that
@dataclass
class Publish:
    """One publish into a folder, planned by the coordinator (picklable: every rank learns where
    to write). The call order, all on the coordinator except the writing of the shards:

    1. :meth:`begin`: refuse what must not be replaced; choose ``staged``, where the shards are
       written: a new temporary sibling directory (local disks), or the folder itself (object
       stores: no rename; the record then claims the files and the old index goes first);
    2. the shard files are written into ``staged`` (by their owner ranks);
    3. :meth:`commit`: a folder that did not exist (or was empty) is renamed into place whole;
       otherwise the record claims the new files, the old index goes, the shards are moved in
       (local), files this publish replaces are removed, then the config and the index (the
       commit) are written, and the record names exactly this publish's files;
    on failure before the commit: :meth:`abandon` removes what this publish wrote.
    """

    staged: str
    in_place: bool
    fresh: bool
    writes: list[OwnedFile]
    shards: list[str]
    previous: list[OwnedFile]
    stale: list[str]
    uncommit: bool
    committed: bool = False
    unsettle: list[str] = field(default_factory=list)  # files to remove before new weights appear

    @classmethod
    def begin(cls, storage: Storage, layout: Layout, overwrite: bool, patterns: list[str], out: str) -> Publish:
        """(coordinator) Plan the publish of ``layout`` into ``storage``'s folder (``out``, as
        the caller gave it).

        Raises:
            FileExistsError: distckpt's previous publish is there and ``overwrite`` is False, or
                files it did not write would be replaced or removed and ``patterns`` do not name them.
            ValueError: the folder lies inside a checkpoint step.
        """
        check_output(out, storage.storage_options)
        where = storage.display()
        files = storage.list_files()
        record = read_record(storage, files)
        writes = layout.owned()
        write_names = {w.name for w in writes}
        for name in sorted(write_names) if storage.is_local else []:  # object stores: a key is never a folder
            if name not in files and os.path.lexists(storage.join(name)):
                raise FileExistsError(f"{storage.display(name)} exists and is not a regular file; a publish cannot replace it")
        owned = _still_owned(storage, record, files)
        if owned and not overwrite:
            what = "an unfinished publish" if record is not None and not record.complete else "a Hugging Face checkpoint"
            raise FileExistsError(
                f"{where} holds {what} written by distckpt ({_shown(sorted(owned))}); pass overwrite=True (distckpt convert: --overwrite) to replace it "
                "(files distckpt did not write are kept)"
            )
        foreign = sorted(n for n in files if n != RECORD_NAME and n not in owned)
        conflicts = [n for n in foreign if n in write_names or _hf_weights(n)]
        allowed = [n for n in conflicts if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        refused = [n for n in conflicts if n not in allowed]
        if refused:
            kept = [n for n in foreign if n not in conflicts]
            it, was = ("it", "was") if len(refused) == 1 else ("them", "were")
            raise FileExistsError(
                f"{where}: {_shown(refused)} {was} not written by distckpt (its record {RECORD_NAME} does not name {it} "
                f"as written and unchanged since), and this publish would replace or remove {it}: pass "
                f"replace={refused!r} (distckpt convert: --replace NAME) to allow that, or move {it} away"
                + (f"; the other files ({_shown(kept)}) are never touched" if kept else "")
            )
        _, entries = storage.last_change()
        staged = storage.stage_directory()  # local: a new temporary sibling; object stores: the folder itself
        stale = sorted((set(owned) | set(allowed)) - write_names)
        # A config this publish replaces or removes goes before any new weights appear: a lone
        # model.safetensors needs no index, so the new weights were readable beside the old
        # config from their rename (or upload) on, and a publish cut short there left a folder
        # that looked whole to transformers and load_pretrained.
        # One of yours that replace= allows goes then only where that is the commit (local: the
        # shards are renamed in right after); where shards are written in place first (object
        # stores), a publish failing there removed it with nothing in its place.
        unsettle = [
            n for n in (CONFIG_NAME,)
            if n in files and (n in stale or (n in write_names and storage.read_bytes(n) != layout.config))
            and (n in owned or staged != storage.url)
        ]  # fmt: skip
        plan = cls(
            staged=staged,
            in_place=staged == storage.url,
            fresh=entries == 0,
            writes=writes,
            shards=list(layout.names),
            previous=list(owned.values()),
            stale=stale,
            uncommit=INDEX_NAME in files,
            unsettle=unsettle,
        )
        if not plan.in_place and not plan.fresh and os.stat(staged).st_dev != os.stat(storage.path).st_dev:
            storage.abandon_directory(staged, [])
            raise OSError(
                errno.EXDEV,
                f"{where} is on another filesystem than the folder around it (a mount point): the new files could "
                "not be renamed into it; publish into a folder inside it",
            )
        if plan.in_place:
            plan._claim(storage)
        return plan

    def target(self, storage: Storage) -> Storage:
        """(every writer) Where the shard files are written: ``staged``, opened with the options
        of ``storage`` (the folder the publish began on)."""
        return Storage(self.staged, storage.storage_options) if self.staged != storage.url else storage

    def _claim(self, storage: Storage) -> None:
        """Name every file of the previous and this publish in the record before one is written
        in place, then remove the old index (no reader sees it over a mix of old and new shards)
        and a config this publish changes (none sees it beside the new weights)."""
        storage.write_bytes(PublishRecord(self.previous + self.writes, complete=False).to_bytes(), RECORD_NAME)
        if self.uncommit:
            storage.remove(INDEX_NAME)
        for name in self.unsettle:
            storage.remove(name)

    def commit(self, storage: Storage, layout: Layout, digests: Mapping[str, str] | None = None) -> None:
        """(coordinator) Make the written shards the folder's checkpoint (see the class doc).
        ``digests``: shard name -> CRC-32C of the bytes written (:class:`DigestingFile`)."""
        digests = digests or {}
        if self.fresh and not self.in_place:
            target = Storage(self.staged)
            for name, data in layout.small_files():
                target.write_bytes(data, name)
            target.write_bytes(self._record(target, digests), RECORD_NAME)  # (a rename keeps the stamps)
            try:
                storage.commit_directory(self.staged, overwrite=False)
            except FileExistsError:
                # Empty when the publish began; another process wrote there meanwhile (the
                # message said "pass overwrite=True", given or not, which would not help).
                files, folders = storage.list_entries() if storage.root_exists() else ({}, [])
                appeared = sorted([*files, *(f"{d}/" for d in folders)])
                raise FileExistsError(
                    f"{storage.display()}: files appeared there while this publish was written ({_shown(appeared)}); "
                    "nothing there was replaced and this publish was discarded: publish again"
                ) from None
            self.committed = True
            return
        if not self.in_place:
            self._claim(storage)
            for name in self.shards:
                # Same filesystem (a sibling directory): an atomic rename per file. A link
                # standing at the name is replaced itself, never written through.
                os.replace(os.path.join(self.staged, name), storage.join(name))
        for name in self.stale:
            storage.remove(name)
        for name, data in layout.small_files():
            storage.write_bytes(data, name)
        self.committed = True  # the index is written: from here on nothing may be removed
        try:
            storage.write_bytes(self._record(storage, digests), RECORD_NAME)
        except Exception as exc:  # noqa: BLE001 - the unfinished record still names these files
            warnings.warn(f"distckpt: {storage.display(RECORD_NAME)}: could not record the published files: {exc}", stacklevel=3)
        if not self.in_place:
            storage.abandon_directory(self.staged, [])  # the emptied temporary directory

    def _record(self, where: Storage, digests: Mapping[str, str]) -> bytes:
        """The complete record of this publish, each shard stamped as it is in ``where`` and
        with its CRC-32C (``digests``)."""
        shards = set(self.shards)
        return PublishRecord(
            [
                dataclasses.replace(f, stamp=where.file_stamp(f.name), crc32c=digests.get(f.name)) if f.name in shards else f
                for f in self.writes
            ],
            complete=True,
        ).to_bytes()

    def abandon(self, storage: Storage) -> None:
        """(coordinator) After a failure before the commit, remove what this publish wrote, best
        effort: the temporary directory (local), or its shards in place (object stores); the
        record then names only what is left of the previous publish."""
        if self.committed:
            return
        if not self.in_place:
            storage.abandon_directory(self.staged, [])
            return
        storage.abandon_directory(self.staged, self.shards)
        try:
            left = [f for f in self.previous if storage.exists(f.name)]
            if left:
                storage.write_bytes(PublishRecord(left, complete=False).to_bytes(), RECORD_NAME)
            else:
                storage.remove(RECORD_NAME)
        except Exception:  # noqa: BLE001 - best effort: the publish's own error is what counts
            pass


def _still_owned(storage: Storage, record: PublishRecord | None, files: Mapping[str, int]) -> dict[str, OwnedFile]:
    """The files of ``record`` that are still what distckpt wrote: name -> entry."""
    owned: dict[str, OwnedFile] = {}
    for entry in record.files if record is not None else []:
        name = entry.name
        if name in owned or name not in files or (storage.is_local and os.path.islink(storage.join(name))):
            continue  # a link is never distckpt's: it writes none
        # A shard of an unfinished publish may be cut short only where files are written in
        # place a piece at a time (sftp, HDFS...): local folders get whole files by rename, object
        # stores by atomic uploads, so there a size other than recorded means another file.
        cut_short = not (record.complete or entry.sha256 is not None or storage.is_local or storage.flat)
        if not cut_short and files[name] != entry.size:
            continue
        if entry.stamp is not None and storage.file_stamp(name) not in (None, entry.stamp):
            # Another version (the same size: the same model's weights?), or the same bytes
            # copied or moved: read to tell (only then).
            if entry.crc32c is None or _crc32c_of(storage, name) != entry.crc32c:
                continue
        if entry.sha256 is not None and (
            entry.size > _MAX_RECORD or hashlib.sha256(storage.read_bytes(name)).hexdigest() != entry.sha256
        ):
            continue
        owned[name] = entry
    return owned


def _crc32c_of(storage: Storage, name: str) -> str:
    """The CRC-32C of file ``name`` of ``storage``, read in pieces."""
    with storage.open(name, "rb") as f:
        return digest_of_file(f, "crc32c")


class DigestingFile:
    """A shard file being written whose bytes are checksummed (CRC-32C) on the way, for the
    publish record (:attr:`OwnedFile.crc32c`). ``file``: the open file (synced through it)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self._hasher = new_hasher("crc32c")

    def write(self, data: bytes | bytearray | memoryview) -> int | None:
        self._hasher.update(data)
        return self.file.write(data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def _shown(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

