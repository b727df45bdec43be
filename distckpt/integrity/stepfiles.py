"""One step directory opened for reading: the one verified read path of load, verify, inspect
and convert.

:class:`StepFiles` is a step directory with what vouches for its files:

* its manifest, bound to the directory (a directory named ``step_N`` must hold step N's
  manifest; one copied or renamed to another name, e.g. ``best/``, takes its step from the
  manifest and is verified the same way), or none for a plain DCP directory, which stays
  readable but is reported as unverified (:attr:`StepFiles.unverified`);
* ``.metadata``, read once: its size and checksum compared with the manifest, unpickled by the
  allow-list unpickler, then validated (:mod:`distckpt.integrity.metadata_check`: chunk coverage, byte
  ranges inside the files, each chunk's bytes bounded by its stored item);
* its data files, read through :class:`VerifiedFile`: every byte a reader uses is hashed on its
  way, and :meth:`VerifiedFile.finish` compares size and checksum with the manifest. Callers
  finish a file before they publish anything made from it.

A :class:`VerifiedFile` reads its file front to back in one pass (one read of every byte, no
second pass to check). Reads that go backwards, and random reads of a record's header
(:meth:`VerifiedFile.peek`), are served from their own read and remembered by their digest; the
pass confirms each of them when it goes over their bytes, or one extra pass at :meth:`finish`
does. So no byte is used unless the bytes the checksum covered are the same bytes: a file
changed between two reads is an :class:`~distckpt.errors.IntegrityError`, not a mix.

Not collective: any process may open a step. The DCP reader over a step is
:class:`distckpt.load.reader.CheckpointReader` (made by ``checkpoint_reader``), one layer up.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO

from torch.distributed.checkpoint.metadata import Metadata

from distckpt.errors import IntegrityError, Interrupted, StepDeletedError, UnsafeCheckpointError
from distckpt.integrity.checksums import CHUNK, Hasher, new_hasher
from distckpt.integrity.manifest import MANIFEST_NAME, FileRecord, Manifest, load_manifest, step_dir
from distckpt.integrity.metadata_check import validate_metadata
from distckpt.integrity.safe_pickle import check_relative_name, load_metadata
from distckpt.integrity.torchfile import ByteRange
from distckpt.storage.base import Storage

METADATA_NAME = ".metadata"

# Bytes read before they are hashed (a few MiB: cache-sized, and large enough that the per-read
# cost of a syscall or an object-store request does not matter).
HOT_BLOCK = 1024 * 1024
# A record's zip headers and pickle, or its central directory: one read each (see _Peek).
PEEK_WINDOW = 4096


class StepFiles:
    """The files of one step directory, read verified (see the module doc).

    Args:
        storage: the root the directory lives in.
        dirname: the directory's name under ``storage`` ("" for the root itself).
        manifest: the step's manifest (already bound to ``dirname``), or ``None``.
        files: name -> expected size and checksum; default: the manifest's. ``None`` with no
            manifest: nothing is verified.
        algorithm: the checksum algorithm of ``files``; default: the manifest's.
        metadata: DCP metadata already read and verified by another process (a load's
            coordinator hands it to every rank), served instead of reading ``.metadata``.
        verify: check sizes and checksums (``False``: ``Checkpointer(verify=False)``).

    Attributes:
        step: the step (from the manifest), ``None`` for a plain DCP directory.
    """

    def __init__(
        self,
        storage: Storage,
        dirname: str,
        *,
        manifest: Manifest | None = None,
        files: Mapping[str, FileRecord] | None = None,
        algorithm: str | None = None,
        metadata: Metadata | None = None,
        verify: bool = True,
    ) -> None:
        self.storage = storage
        self.dirname = dirname.strip("/")
        self.manifest = manifest
        self.step = manifest.step if manifest is not None else None
        if files is None and manifest is not None:
            files, algorithm = manifest.files, manifest.checksum_algorithm
        self.files = dict(files) if files is not None and verify else None
        self.algorithm = algorithm if verify else None
        self._metadata = metadata

    @classmethod
    def open(cls, storage: Storage, dirname: str, *, verify: bool = True) -> StepFiles:
        """The step in ``dirname``: with its manifest if it has one (bound to the directory by
        :func:`distckpt.integrity.manifest.load_manifest`), else a plain DCP directory (unverified).

        Args:
            verify: check sizes and checksums (``False``: the manifest is read, not used to check).

        Raises:
            IntegrityError: the manifest is malformed or belongs to another step's directory.
        """
        manifest = None
        if storage.exists(*[p for p in (dirname, MANIFEST_NAME) if p]):
            manifest = load_manifest(storage, dirname)
        return cls(storage, dirname, manifest=manifest, verify=verify)

    def changed_since(self, doing: str) -> str | None:
        """After a read of this step failed: why the directory no longer holds the step that was
        opened (its manifest gone or another in its place: deleted or committed anew while it was
        being ``doing``), or ``None``: the failure is then the step's own."""
        if self.manifest is None:
            return None
        return changed_since(self.storage, self.dirname, self.manifest, doing)

    def kept(self, doing: str) -> AbstractContextManager[None]:
        """A read of this step whose failure is a :class:`StepDeletedError` where the step was
        deleted or committed anew meanwhile (:func:`kept`), else stands."""
        return kept(self.storage, self.dirname, self.manifest, doing)

    # where -------------------------------------------------------------------------------------
    def display(self, *parts: str) -> str:
        """User-facing location of the directory or of ``parts`` inside it."""
        return self.storage.display(*[p for p in (self.dirname, *parts) if p])

    def rel(self, name: str) -> str:
        """Path of file ``name`` relative to the storage root; refuses names that leave the directory."""
        check_relative_name(name, self.display(METADATA_NAME))
        return f"{self.dirname}/{name}" if self.dirname else name

    # how much is vouched for -------------------------------------------------------------------
    @property
    def verifying(self) -> bool:
        """Whether file sizes (and checksums, where recorded) are checked."""
        return self.files is not None

    @property
    def unverified(self) -> list[str]:
        """Why reads of this step are not (fully) verified; [] if every file has a checksum."""
        if self.manifest is None:
            return ["no distckpt manifest (a plain DCP checkpoint): sizes and checksums are not checked"]
        if self.files is None:
            return ["verification is turned off"]
        reasons = []
        if not self.algorithm:
            reasons.append("the manifest records no checksum algorithm")
        else:
            reasons += [f"{name} has no checksum" for name, r in sorted(self.files.items()) if not r.checksum]
        if METADATA_NAME not in self.files:
            reasons.append(f"{METADATA_NAME} is not listed in the manifest")
        return reasons

    # reading -----------------------------------------------------------------------------------
    def file(self, name: str) -> VerifiedFile:
        """A verified reader of file ``name`` of this step.

        Raises:
            IntegrityError: verifying, and the manifest does not list ``name`` (a data file the
                manifest does not know was not written by the save it describes).
        """
        record = None
        if self.files is not None:
            record = self.files.get(name)
            if record is None and name != METADATA_NAME:
                raise IntegrityError(f"{self.display(name)}: not listed in the manifest")
        return VerifiedFile(self.storage, self.rel(name), self.display(name), record, self.algorithm)

    def metadata(self) -> Metadata:
        """DCP's metadata, read once: verified against the manifest, unpickled safely, validated.

        Raises:
            IntegrityError: missing, wrong size or checksum, or inconsistent (naming the field).
            UnsafeCheckpointError: it would run code to unpickle.
        """
        if self._metadata is None:

            f = self.file(METADATA_NAME)
            try:
                data = f.read_range(0, f.record.size if f.record is not None else None)
                f.finish()
            finally:
                f.close()
            where = self.display(METADATA_NAME)
            metadata = load_metadata(data, where)
            sizes: Mapping[str, int] | None = None
            if self.files is not None:
                sizes = {name: r.size for name, r in self.files.items()}
            elif self.manifest is None:  # a plain DCP directory: the files as they are
                sizes = self.storage.list_files(self.dirname) if self.dirname else self.storage.list_files()
            validate_metadata(metadata, where, sizes)
            self._metadata = metadata
        return self._metadata

    def check_file(self, name: str) -> None:
        """Read file ``name`` whole and compare it with its manifest record.

        Raises:
            IntegrityError: missing, wrong size or wrong checksum (naming the file).
            UnsafeCheckpointError: a symbolic link or not a regular file.
        """
        f = self.file(name)
        try:
            f.finish()
        finally:
            f.close()

    def problems(self) -> list[str]:
        """What ``verify`` reports: one line per bad file, [] if every listed file is intact.

        Checks every file the manifest lists, and that the directory holds no data file the
        manifest does not know. Reads every file once.
        """

        if self.files is None:
            raise ValueError(f"{self.display()} has no distckpt manifest: nothing to verify its files against")
        present = self.storage.list_files(self.dirname) if self.dirname else self.storage.list_files()
        problems: list[str] = []
        for name in sorted(self.files):
            if name not in present:
                problems.append(f"{self.display(name)}: missing")
                continue
            try:
                self.check_file(name)
            except (IntegrityError, UnsafeCheckpointError) as exc:
                problems.append(str(exc))
        for name in sorted(set(present) - set(self.files) - {MANIFEST_NAME}):
            if name.endswith(".distcp"):
                problems.append(f"{self.display(name)}: not listed in the manifest")
        return problems


# ---------------------------------------------------------------------------------------------
@dataclass
class _Range:
    """Bytes ``[start, end)`` served by a read of their own, to be confirmed by a pass."""

    start: int
    end: int
    algorithm: str
    digest: str
    hasher: Hasher | None = None
    fed: int = 0


class VerifiedFile:
    """One file of a step, read in one front-to-back pass whose bytes are all hashed.

    Every read is given as ``(offset, length)``. Reads at or after the pass's position are
    served by the pass (the bytes in between are read and hashed, not seeked over); reads behind
    it, and :meth:`peek`, are served by reads of their own whose digests the pass confirms
    (see the module doc). :meth:`finish` reads to the end and compares size and checksum with
    the manifest record. Without a record (a plain DCP directory, or ``verify=False``) reads
    simply seek and nothing is checked.

    One thread at a time. The handle is opened on first use and may be released between reads
    (:meth:`close` keeps the pass's state; the next read reopens at its position).
    """

    def __init__(self, storage: Storage, rel: str, where: str, record: FileRecord | None, algorithm: str | None) -> None:
        self.storage = storage
        self.rel = rel
        self.where = where
        self.record = record
        self.algorithm = algorithm if record is not None and record.checksum and algorithm else None
        self._hasher = new_hasher(self.algorithm) if self.algorithm else None
        self.pos = 0
        self._cm: AbstractContextManager[IO[bytes]] | None = None
        self._f: IO[bytes] | None = None
        # A second handle for peeks ahead of the pass: a read far ahead on the pass's own handle
        # would reset its sequential readahead (on a cold disk, every large record then paid a
        # seek and a readahead ramp-up; measured: benchmarks/README.md).
        self._peek_cm: AbstractContextManager[IO[bytes]] | None = None
        self._peek_f: IO[bytes] | None = None
        self._ahead: list[_Range] = []  # served bytes the pass has not reached yet
        self._behind: list[_Range] = []  # served bytes the pass had passed already
        self._finished = False
        self._failure: IntegrityError | None = None

    @property
    def verifying(self) -> bool:
        return self.record is not None

    # the handle --------------------------------------------------------------------------------
    def _open(self, at: int) -> tuple[AbstractContextManager[IO[bytes]], IO[bytes]]:
        try:
            cm = self.storage.open(self.rel, "rb")
            f = cm.__enter__()
        except FileNotFoundError:
            raise IntegrityError(f"{self.where}: missing") from None
        if at:
            f.seek(at)
        return cm, f

    def _handle(self) -> IO[bytes]:
        if self._f is None:
            self._cm, self._f = self._open(self.pos)
            _advise_sequential(self._f)
        return self._f

    def _peek_handle(self) -> IO[bytes]:
        if self._peek_f is None:
            self._peek_cm, self._peek_f = self._open(0)
        return self._peek_f

    def close(self) -> None:
        """Release the file handles (the pass can go on later from where it is)."""
        if self._cm is not None:
            cm, self._cm, self._f = self._cm, None, None
            cm.__exit__(None, None, None)
        if self._peek_cm is not None:
            cm, self._peek_cm, self._peek_f = self._peek_cm, None, None
            cm.__exit__(None, None, None)

    # the pass ----------------------------------------------------------------------------------
    def _consumed(self, view: memoryview, start: int) -> None:
        """Bytes ``[start, start + len(view))`` went by: hash them, confirm reads they cover."""
        if self._hasher is None:
            return
        self._hasher.update(view)
        if self._ahead:
            self._ahead = _feed(self._ahead, view, start, self.where)

    def _read_pass(self, view: memoryview) -> int:
        # Block by block, each hashed right after it arrives, while it is still in the CPU's
        # cache: hashing a whole tensor after reading it would fetch it from memory again.
        f = self._handle()
        total = 0
        for start in range(0, len(view), HOT_BLOCK):
            part = view[start : start + HOT_BLOCK]
            got = _readinto(f, part)
            self._consumed(part[:got], self.pos)
            self.pos += got
            total += got
            if got < len(part):
                break
        return total

    def _skip(self, n: int | None) -> None:
        """Read (and hash) ``n`` bytes, or to the end with ``None``, in bounded chunks."""
        if n is not None and n <= 0:
            return
        if n is None:
            # To the end: usually a few bytes of archive tail. A buffer sized to what the manifest
            # says is left (plus one byte, to see a longer file end) spares zeroing 8 MiB per file.
            left = self.record.size - self.pos if self.record is not None else CHUNK
            size = min(CHUNK, max(left, 0) + 1)
        else:
            size = min(CHUNK, n)
        buf = memoryview(bytearray(size))
        while n is None or n > 0:
            got = self._read_pass(buf if n is None or n >= len(buf) else buf[:n])
            if not got:
                return
            if n is not None:
                n -= got
            elif got == len(buf) < CHUNK:
                buf = memoryview(bytearray(CHUNK))  # longer than the manifest says: read on in full chunks

    def _goto(self, offset: int) -> bool:
        """Move the pass to ``offset``; False if it lies behind (verifying) and must be read aside."""
        if not self.verifying:
            if offset != self.pos:
                self._handle().seek(offset)
                self.pos = offset
            return True
        if offset < self.pos:
            return False
        self._skip(offset - self.pos)
        return True

    def _read_aside(self, offset: int, view: memoryview) -> int:
        """Serve ``view`` from a read of its own, remembered for the pass to confirm."""
        cm, f = self._open(offset)
        try:
            got = _readinto(f, view)
        finally:
            cm.__exit__(None, None, None)
        self._remember(offset, view[:got])
        return got

    def _remember(self, offset: int, data: memoryview) -> None:
        if self.algorithm is None or not len(data):
            return
        h = new_hasher(self.algorithm)
        h.update(data)
        r = _Range(offset, offset + len(data), self.algorithm, h.hexdigest())
        (self._ahead if offset >= self.pos else self._behind).append(r)

    def _resume(self) -> None:
        """Before a read: a file already checked whole starts a new pass, which the next
        :meth:`finish` checks (reads after a check are never left unchecked)."""
        if not self._finished:
            return
        if self._failure is not None:
            raise self._failure
        self._finished = False
        self.pos = 0
        self._hasher = new_hasher(self.algorithm) if self.algorithm else None

    # reads -------------------------------------------------------------------------------------
    def readinto(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` with the bytes at ``offset``; returns how many there were."""
        view = memoryview(view).cast("B")
        self._resume()
        if self._goto(offset):
            return self._read_pass(view)
        return self._read_aside(offset, view)

    def read_range(self, offset: int, length: int | None) -> bytes:
        """The bytes ``[offset, offset + length)`` (``None``: to the end); fewer at the end of the file."""
        if length is None:
            out = io.BytesIO()
            for block in self.blocks(offset, None):
                out.write(block)
            return out.getvalue()
        self._resume()
        if self._goto(offset):
            data = _read_bytes(self._handle(), length)  # one copy, from the file into ``bytes``
            self._consumed(memoryview(data), self.pos)
            self.pos += len(data)
            return data
        cm, f = self._open(offset)
        try:
            data = _read_bytes(f, length)
        finally:
            cm.__exit__(None, None, None)
        self._remember(offset, memoryview(data))
        return data

    def blocks(self, offset: int, length: int | None, block: int = CHUNK) -> Iterator[memoryview]:
        """The bytes ``[offset, offset + length)`` in blocks of at most ``block`` bytes (one buffer,
        reused: use each block before asking for the next). Stops early at the end of the file."""
        buf = memoryview(bytearray(block if length is None else max(1, min(block, length))))
        at, left = offset, length
        while left is None or left > 0:
            view = buf if left is None or left >= len(buf) else buf[:left]
            got = self.readinto(at, view)
            if not got:
                return
            yield view[:got]
            at += got
            if left is not None:
                left -= got

    def peek(self, offset: int, length: int) -> io.RawIOBase:
        """Bytes ``[offset, offset + length)`` as a seekable stream for random reads (a record's
        layout), without moving the pass; what is read is confirmed by the pass later."""
        return _Peek(self, offset, length)

    def _peek_into(self, at: int, view: memoryview) -> int:
        self._resume()
        if self.verifying and at < self.pos:
            return self._read_aside(at, view)
        f = self._peek_handle()
        f.seek(at)
        got = _readinto(f, view)
        if self.verifying:
            self._remember(at, view[:got])
        return got

    # the end -----------------------------------------------------------------------------------
    def finish(self) -> None:
        """Read to the end of the file and compare size and checksum with the manifest record;
        confirm every read the pass did not cover (one more pass, only if there were such).

        Raises:
            IntegrityError: missing, wrong size, wrong checksum, or changed while being read.
        """
        if self._finished:
            if self._failure is not None:
                raise self._failure
            return
        try:
            if self.verifying:
                self._skip(None)
                self.close()
                self._check(self.pos, self._hasher, "")
                if self._ahead:  # reads past the end: the file is shorter than they were
                    raise IntegrityError(f"{self.where}: changed while being read (it ended at {self.pos} bytes)")
                if self._behind:
                    self._second_pass()
        except IntegrityError as exc:
            self._failure = exc
            raise
        finally:
            self.close()
            self._finished = True

    def _check(self, size: int, hasher: Hasher | None, when: str) -> None:
        assert self.record is not None
        if size != self.record.size:
            raise IntegrityError(f"{self.where}: {size} bytes{when}, manifest says {self.record.size} (truncated or overwritten)")
        if hasher is not None and hasher.hexdigest() != self.record.checksum:
            raise IntegrityError(
                f"{self.where}: {self.algorithm} {hasher.hexdigest()}{when} does not match the manifest's "
                f"{self.record.checksum} (corrupted)"
            )

    def _second_pass(self) -> None:
        """Confirm the reads served behind the pass: read the file again, whole, hashed."""
        pending = sorted(self._behind, key=lambda r: r.start)
        hasher = new_hasher(self.algorithm) if self.algorithm else None
        cm, f = self._open(0)
        pos = 0
        try:
            buf = memoryview(bytearray(CHUNK))
            while True:
                got = _readinto(f, buf)
                if not got:
                    break
                if hasher is not None:
                    hasher.update(buf[:got])
                pending = _feed(pending, buf[:got], pos, self.where)
                pos += got
        finally:
            cm.__exit__(None, None, None)
        self._check(pos, hasher, " on a second read")
        if pending:
            raise IntegrityError(f"{self.where}: changed while being read (it ended at {pos} bytes)")
        self._behind = []


def _feed(ranges: list[_Range], view: memoryview, start: int, where: str) -> list[_Range]:
    """Feed the part of ``view`` (bytes from ``start``) that each range covers; return the
    ranges still waiting for bytes. A completed range whose digest differs was read differently
    the two times (the file changed in between)."""
    end = start + len(view)
    left = []
    for r in ranges:
        lo, hi = max(start, r.start + r.fed), min(end, r.end)
        if lo < hi:
            if r.hasher is None:
                r.hasher = new_hasher(r.algorithm)
            r.hasher.update(view[lo - start : hi - start])
            r.fed = hi - r.start
        if r.start + r.fed < r.end:
            left.append(r)
        elif r.hasher is None or r.hasher.hexdigest() != r.digest:
            raise IntegrityError(f"{where}: bytes [{r.start}, {r.end}) changed while being read (two reads differ)")
    return left


def _advise_sequential(f: IO[bytes]) -> None:
    """Tell the kernel a local file is read front to back (a larger readahead window); a no-op
    for files without a descriptor (object stores) or systems without ``posix_fadvise``."""
    try:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass


def _readinto(f: IO[bytes], view: memoryview) -> int:
    """Fill ``view`` from ``f`` as far as the file goes (files may return short reads; ``readinto``
    where the file has it, else ``read``)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:]) if hasattr(f, "readinto") else None
        if n is None:
            data = f.read(len(view) - got)
            n = len(data)
            view[got : got + n] = data
        if not n:
            break
        got += n
    return got


def _read_bytes(f: IO[bytes], n: int) -> bytes:
    """Up to ``n`` bytes from ``f`` (fewer only at the end of the file)."""
    data = f.read(n)
    if len(data) < n:
        parts = [data]
        while n > (got := sum(len(p) for p in parts)):
            more = f.read(n - got)
            if not more:
                break
            parts.append(more)
        data = b"".join(parts)
    return bytes(data)


class _Peek(ByteRange):
    """Random reads of ``[offset, offset + length)`` of a :class:`VerifiedFile` (see ``peek``).

    Reads are served from windows of :data:`PEEK_WINDOW` bytes fetched on demand: a record's
    layout takes a dozen small reads at its head and tail (zip headers, the pickle, the central
    directory), which would otherwise each cost a seek, a read and a digest of their own.
    """

    def __init__(self, owner: VerifiedFile, offset: int, length: int) -> None:
        super().__init__(offset, length)
        self._owner = owner
        self._windows: list[tuple[int, bytearray]] = []  # (offset in the slice, bytes)

    def _window(self, pos: int, n: int) -> tuple[int, bytearray]:
        for start, data in self._windows:
            if start <= pos and pos + n <= start + len(data):
                return start, data
        # Near the end: the tail window (the central directory is read backwards from the end),
        # started early enough to hold a read that begins before it.
        start = min(pos, max(0, self._len - PEEK_WINDOW)) if pos + n > self._len - PEEK_WINDOW else pos
        end = min(self._len, max(pos + n, start + PEEK_WINDOW))
        data = bytearray(end - start)
        got = self._owner._peek_into(self._start + start, memoryview(data))
        del data[got:]
        self._windows.append((start, data))
        return start, data

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        n = min(len(view), self._len - self._pos)
        if n <= 0:
            return 0
        if n > PEEK_WINDOW:  # a large read: straight into the caller's buffer
            got = self._owner._peek_into(self._start + self._pos, view[:n])
        else:
            start, data = self._window(self._pos, n)
            got = max(0, min(n, start + len(data) - self._pos))
            view[:got] = data[self._pos - start : self._pos - start + got]
        self._pos += got
        return got


def changed_since(storage: Storage, dirname: str, manifest: Manifest, doing: str) -> str | None:
    """(one process, after a read of the step in ``dirname`` failed) Why that directory no longer
    holds the step ``manifest`` was read from: its manifest gone (deleted while it was being
    ``doing``: retention removes a step's manifest before its files), or another manifest in its
    place (committed anew); ``None`` if it still holds it, or cannot be read now (no proof of
    either: the first error stands)."""
    where = storage.display(*[p for p in (dirname, MANIFEST_NAME) if p])
    try:
        now = load_manifest(storage, dirname)
    except FileNotFoundError:
        return deleted_while(storage, dirname, manifest.step, doing)
    except Exception:  # noqa: BLE001 - unreadable now: no proof of a deletion
        return None
    if now != manifest:
        return f"checkpoint step {manifest.step}: {where} was committed anew while the step was being {doing}"
    return None


@contextlib.contextmanager
def kept(
    storage: Storage,
    dirname: str,
    manifest: Manifest | None,
    doing: str,
    catch: tuple[type[BaseException], ...] = (Exception,),
    ask: Callable[[Callable[[], str | None]], str | None] = lambda check: check(),
    error: Callable[[str], Exception] = StepDeletedError,
) -> Iterator[None]:
    """A read of the step in ``dirname`` (opened from ``manifest``) whose failure (one of
    ``catch``) is told apart from damage: if the directory no longer holds that step
    (:func:`changed_since`), ``error(why)`` is raised from it (:class:`StepDeletedError` unless
    told otherwise), else the failure stands. ``ask`` runs the check: a load's ranks, which fail
    alike, route it through the coordinator so that every rank gets one answer.
    ``manifest`` ``None`` (a plain DCP directory): nothing to compare, the failure stands."""
    try:
        yield
    except catch as exc:
        if isinstance(exc, Interrupted):  # every rank leaves alike, asking nothing on the way
            raise
        try:
            why = ask(lambda: changed_since(storage, dirname, manifest, doing)) if manifest is not None else None
        except Exception:  # noqa: BLE001 - the ranks could not ask (a peer died): the failure stands, as said
            why = None
        if why:
            raise error(why) from exc
        raise


def deleted_while(storage: Storage, dirname: str, step: int | None, doing: str) -> str:
    """The message of a step deleted under a reader (``step`` ``None``: not known yet)."""
    where = storage.display(dirname) if dirname else storage.display()
    what = f"checkpoint step {step} at {where}" if step is not None else f"checkpoint {where}"
    return (
        f"{what} was deleted while it was being {doing} (its {MANIFEST_NAME} is gone: deleted by another "
        "process, such as the retention, keep_last, of a job saving to this root)"
    )


def read_metadata(storage: Storage, manifest: Manifest, verify: bool = True) -> Metadata:
    """DCP metadata of a committed step, unpickled safely and (``verify``) checked against the
    manifest: read through :class:`StepFiles`, the one read path."""
    return StepFiles(storage, step_dir(manifest.step), manifest=manifest, verify=verify).metadata()
