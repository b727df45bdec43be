"""Step files streamed by the rank that holds them into the load of the rank that reads them:
the local tier's peer recovery without writing a file into the receiving node's tier and
reading it back (:mod:`distckpt.storage.local_tier`).

A recovery used to complete a node's tier first (the files it lacks sent by a peer and written
to its ``local_dir``), then load from there. Every byte then landed twice in fresh memory (the
tier's new pages, then the destination) and was copied once more, on a machine whose cores a
recovery already keeps busy (benchmarks/README.md, "fifth session"). Streamed, a tensor's bytes
arrive straight in its destination (memory the model already touched), as the file reader's
``readinto`` would have put them there, and are hashed there.

How the two ends agree: the sender reads the head of each large record of the file (where the
step's ``.metadata`` puts the records; the receiving node got it, checked, before planning)
and sends a table of where each one's tensor data lies (:class:`Layout`), then every byte
outside those ranges ("the rest": heads, small records, values) in a few messages, then the
ranges' data in pieces of :data:`~distckpt.storage.transfer.PIECE`, in file order. The receiver
hands the rest to the reader like a file's bytes, lets the reader choose which destination takes
each data range (the destinations its direct read would fill, :meth:`StreamedFile.place`), and
posts the data pieces' receives ahead, all at once for destinations: one wait per file instead
of a round trip per record (each round trip costs milliseconds on a busy machine). Each message
is one gloo message (``tag``: one per stream), sent from a read-only mapping of the sender's
file (no copy on the sender, beyond the rest).

Safety is the reader's, unchanged: every byte of a streamed file is hashed in file order and
compared with the manifest's checksum at the end (:meth:`StreamedFile.finish`), so a damaged
replica fails the load (which then checks every copy and retries, or reads the root), never
loads silently. A sender that cannot open its copy sends zeros of the file's size (the receiver
must not wait forever), which fail that check; streams are only used where the manifest holds
checksums. Every stream is drained to its end even where the load fails early
(:meth:`Streams.finish`), so no sender waits for a receiver that gave up.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distckpt._dist import Group
from distckpt.errors import CheckpointError, IntegrityError, one_line
from distckpt.integrity.checksums import new_hasher
from distckpt.integrity.manifest import Manifest
from distckpt.integrity.torchfile import HEAD, head_layout
from distckpt.storage.transfer import PIECE, global_rank, map_file, open_regular

log = logging.getLogger("distckpt")

#: A record at least this long has its tensor's data sent on its own, to be received in place.
LARGE = 64 << 10
#: Scratch (received data no destination takes) that one stream posts ahead of the reader, at most.
AHEAD = 64 << 20


def records_by_file(storage_data: Mapping[Any, Any]) -> dict[str, list[tuple[int, int]]]:
    """``(offset, length)`` of every record, per file, from DCP's ``metadata.storage_data``."""
    out: dict[str, list[tuple[int, int]]] = {}
    for info in storage_data.values():
        out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length)))
    return out


def large_records(size: int, records: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(both ends alike) The records of a file whose data may travel on its own: at least
    :data:`LARGE` bytes, inside the file, not overlapping an earlier one."""
    out: list[tuple[int, int]] = []
    end = 0
    for offset, length in sorted(records):
        if length >= LARGE and offset >= end and offset + length <= size:
            out.append((offset, length))
            end = offset + length
    return out


def data_range(head: bytes, offset: int, length: int) -> tuple[int, int]:
    """(sender) Where the plain tensor data of the record at ``offset`` lies in the file, from the
    record's ``head``; ``(0, 0)``: no plain tensor (its bytes travel with the rest)."""
    try:
        layout = head_layout(head)
    except Exception:  # noqa: BLE001 - an unchecked head: no plain tensor, whatever it holds
        return (0, 0)
    if layout is None or layout.nbytes == 0 or layout.data_offset < 30 or layout.data_offset + layout.nbytes > length:
        return (0, 0)
    return (offset + layout.data_offset, offset + layout.data_offset + layout.nbytes)


def _chunks(start: int, end: int) -> list[tuple[int, int]]:
    return [(a, min(PIECE, end - a)) for a in range(start, end, PIECE)]


@dataclass(frozen=True)
class Layout:
    """The messages of one streamed file (both ends alike once the ranges are known): a table of
    the large records' data ranges (an int64 pair each, ``(0, 0)`` for none), the rest of the
    file (every byte outside the ranges, in file order) in pieces, then the ranges' data in
    pieces, in file order."""

    size: int
    ranges: tuple[tuple[int, int], ...]  # (start, end) in the file, sorted, non-empty, disjoint

    @property
    def rest_size(self) -> int:
        return self.size - sum(e - s for s, e in self.ranges)

    def data_pieces(self) -> list[tuple[int, int]]:
        return [p for s, e in self.ranges for p in _chunks(s, e)]

    def rest_spans(self) -> list[tuple[int, int, int]]:
        """``(file start, file end, offset in the rest)`` of each span outside the ranges."""
        out, at, pos = [], 0, 0
        for s, e in [*self.ranges, (self.size, self.size)]:
            if s > at:
                out.append((at, s, pos))
                pos += s - at
            at = e
        return out


def valid_ranges(ranges: Sequence[tuple[int, int]], large: Sequence[tuple[int, int]]) -> bool:
    """Each range inside its record (or ``(0, 0)``); the records are disjoint, so are the ranges."""
    return len(ranges) == len(large) and all(r == (0, 0) or o <= r[0] < r[1] <= o + n for r, (o, n) in zip(ranges, large))


class StreamedFile:
    """One step file arriving from rank ``src`` (``tag``), read by the load like a
    :class:`~distckpt.integrity.stepfiles.VerifiedFile` read front to back (``readinto``,
    ``read_range``, ``finish``, ``close``), after :meth:`begin` and :meth:`place`.

    :meth:`begin` receives the table and the rest of the file (a few messages: every record's
    head, small records, values); the reader then says which destination takes each data range
    (:meth:`place`), and the data pieces are posted ahead in file order (destinations all at
    once, scratch up to :data:`AHEAD`), so the wire does not wait for the reader at each record.
    A read of a placed range into that very memory copies nothing. Every byte is hashed in file
    order as it arrives. One thread at a time."""

    def __init__(
        self, group: Group, src: int, tag: int, size: int, records: Sequence[tuple[int, int]],
        checksum: str | None, algorithm: str | None, where: str,
    ) -> None:
        self.where = where
        self.size = size
        self._pg = group.pg
        self._src = global_rank(group, src)
        self._tag = tag
        self._checksum = checksum
        self._hasher = new_hasher(algorithm) if algorithm and checksum else None
        self._large = large_records(size, records)
        self._layout: Layout | None = None
        self._by_record: dict[int, tuple[int, int]] = {}
        self._rest = memoryview(b"")
        self._spans: list[tuple[int, int, int]] = []
        self._pieces: list[tuple[int, int]] = []  # data pieces (start, length), file order
        self._starts: list[int] = []
        self._landing: list[memoryview] = []  # where each data piece is received (after place())
        self._placed: set[int] = set()  # pieces received into a destination
        self._works: list[Any] = []  # posted receives, by piece
        self._waited = 0  # pieces received and hashed
        self._released = 0  # pieces the reader has gone past (scratch ones freed)
        self._hashed = 0  # bytes of the file hashed, in file order
        self._ahead = 0  # scratch bytes posted, not yet hashed
        self.pos = 0
        self._finished = False
        self._failure: BaseException | None = None

    # the wire ----------------------------------------------------------------------------------
    def _recv(self, into: memoryview | torch.Tensor) -> Any:
        tensor = into if isinstance(into, torch.Tensor) else torch.frombuffer(into, dtype=torch.uint8)
        try:
            return dist.irecv(tensor, src=self._src, group=self._pg, tag=self._tag)
        except Exception as exc:  # noqa: BLE001 - the sender died: nothing more will come
            raise self._broken(exc) from exc

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the sender died
            raise self._broken(exc) from exc

    def _broken(self, exc: BaseException) -> CheckpointError:
        self._failure = CheckpointError(f"{self.where}: the transfer failed ({one_line(exc)})")
        return self._failure

    def begin(self) -> None:
        """Receive the table of data ranges and the rest of the file."""
        if self._failure is not None:
            raise self._failure
        if self._layout is not None:
            return
        ranges: list[tuple[int, int]] = []
        if self._large:
            table = torch.zeros(2 * len(self._large), dtype=torch.int64)
            self._wait(self._recv(table))
            flat = [int(v) for v in table.tolist()]
            ranges = list(zip(flat[0::2], flat[1::2]))
            if not valid_ranges(ranges, self._large):
                # Never sent by a sender running this code (it checks the same): nothing more
                # can be received in step with this stream.
                raise self._broken(ValueError(f"a table of data ranges that does not fit the file's records: {ranges[:3]}"))
        self._by_record = {o: r for (o, _), r in zip(self._large, ranges) if r != (0, 0)}
        layout = Layout(self.size, tuple(r for r in ranges if r != (0, 0)))
        rest = memoryview(bytearray(layout.rest_size))
        for work in [self._recv(rest[a : a + n]) for a, n in _chunks(0, len(rest))]:
            self._wait(work)
        self._rest = rest
        self._spans = layout.rest_spans()
        self._pieces = layout.data_pieces()
        self._starts = [s for s, _ in self._pieces]
        self._layout = layout

    def data_range(self, offset: int) -> tuple[int, int] | None:
        """(after :meth:`begin`) The data range of the record at ``offset``, if it travels alone."""
        return self._by_record.get(offset)

    def _rest_views(self, start: int, end: int) -> list[memoryview]:
        """File bytes ``[start, end)``, which lie outside every data range, as views of the rest."""
        out = []
        for a, b, p in self._spans:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append(self._rest[p + lo - a : p + hi - a])
        return out

    def rest_bytes(self, start: int, end: int) -> bytes:
        """(after :meth:`begin`) File bytes ``[start, end)`` outside the data ranges (a head)."""
        return b"".join(bytes(v) for v in self._rest_views(start, end))

    def place(self, placements: Mapping[int, torch.Tensor]) -> None:
        """(after :meth:`begin`, once) Where data ranges go: ``{range start: destination}`` (a
        contiguous uint8 CPU tensor of the range's length); the others into scratch. Then the
        receives are posted ahead."""
        assert self._layout is not None and not self._landing
        for s, e in self._layout.ranges:
            dest = placements.get(s)
            if dest is not None and (dest.numel() != e - s or dest.dtype != torch.uint8 or dest.device.type != "cpu"):
                dest = None
            for a, n in _chunks(s, e):
                if dest is not None:
                    self._placed.add(len(self._landing))
                    self._landing.append(memoryview(dest[a - s : a - s + n].numpy()))
                else:
                    self._landing.append(memoryview(b""))  # a scratch buffer, allocated when posted
        self._post()

    def _post(self) -> None:
        while len(self._works) < len(self._pieces):
            i = len(self._works)
            if i not in self._placed:
                n = self._pieces[i][1]
                if self._ahead and self._ahead + n > AHEAD:
                    return
                self._landing[i] = memoryview(bytearray(n))
                self._ahead += n
            self._works.append(self._recv(self._landing[i]))

    def _hash_to(self, end: int) -> None:
        """Receive and hash the file's bytes up to at least ``end``, in file order."""
        if self._failure is not None:
            raise self._failure
        while self._hashed < end:
            i = self._waited
            if i < len(self._pieces) and self._pieces[i][0] == self._hashed:
                if i >= len(self._works):
                    self._post()
                self._wait(self._works[i])
                if self._hasher is not None:
                    self._hasher.update(self._landing[i])
                self._hashed += self._pieces[i][1]
                self._waited += 1
                if i not in self._placed:
                    self._ahead -= self._pieces[i][1]
                    self._post()
                continue
            stop = self._pieces[i][0] if i < len(self._pieces) else self.size
            if self._hasher is not None:
                for view in self._rest_views(self._hashed, stop):
                    self._hasher.update(view)
            self._hashed = stop

    # reads -------------------------------------------------------------------------------------
    def readinto(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` with the bytes at ``offset``; returns how many there were (fewer at the
        end). Bytes already received into this very memory (:meth:`place`) are not copied."""
        view = memoryview(view).cast("B")
        if offset < self.pos:
            raise IntegrityError(f"{self.where}: read at byte {offset} behind the transfer (at {self.pos})")
        self.begin()
        if not self._landing and self._pieces:
            self.place({})
        end = min(self.size, offset + len(view))
        if end <= offset:
            return 0
        self._hash_to(end)
        address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
        at = offset
        while at < end:
            k = bisect.bisect_right(self._starts, at) - 1
            if k >= 0 and at < self._pieces[k][0] + self._pieces[k][1]:
                s, n = self._pieces[k]
                stop = min(end, s + n)
                src = self._landing[k][at - s : stop - s]
                if k not in self._placed or torch.frombuffer(src, dtype=torch.uint8).data_ptr() != address + (at - offset):
                    view[at - offset : stop - offset] = src
            else:
                stop = min(end, self._starts[k + 1] if k + 1 < len(self._starts) else self.size)
                pos = at - offset
                for part in self._rest_views(at, stop):
                    view[pos : pos + len(part)] = part
                    pos += len(part)
            at = stop
        self.pos = end
        # Scratch the reader has gone past is never read again (reads go forward): let it go,
        # so a stream holds at most what is posted ahead, not the file.
        while self._released < self._waited and sum(self._pieces[self._released]) <= self.pos:
            if self._released not in self._placed:
                self._landing[self._released] = memoryview(b"")
            self._released += 1
        return end - offset

    def read_range(self, offset: int, length: int | None) -> bytes:
        """The bytes ``[offset, offset + length)`` (``None``: to the end); fewer at the end."""
        end = self.size if length is None else min(self.size, offset + length)
        out = bytearray(max(0, end - offset))
        got = self.readinto(offset, memoryview(out))
        return bytes(out) if got == len(out) else bytes(out[:got])

    def finish(self) -> None:
        """Receive to the end, then compare the checksum with the manifest's.

        Raises:
            IntegrityError: the file that arrived is not the one the manifest describes.
            CheckpointError: the transfer failed.
        """
        if self._finished:
            if self._failure is not None:
                raise self._failure
            return
        self._finished = True
        try:
            self.begin()
            if not self._landing and self._pieces:
                self.place({})
            self._hash_to(self.size)
        except BaseException as exc:
            self._failure = self._failure or exc
            raise
        if self._hasher is not None and self._hasher.hexdigest() != self._checksum:
            self._failure = IntegrityError(f"{self.where}: does not match its checksum")
            raise self._failure

    def drain(self) -> None:
        """:meth:`finish`, its failure kept for whoever reads on but not raised: the sender is
        waiting for every piece whatever became of the load."""
        try:
            self.finish()
        except BaseException:  # noqa: BLE001 - reported by the load's own read, or not needed
            pass

    def close(self) -> None:
        """Nothing to release (the reader's call after each file)."""


@dataclass
class Streams:
    """The streams of one load on this rank: files it receives and files it sends. Made by
    :meth:`plan` on every rank from the same list of moves."""

    group: Group
    directory: str  # this node's tier copy of the step (what this rank sends from)
    manifest: Manifest
    records: dict[str, list[tuple[int, int]]]
    incoming: dict[str, tuple[int, int]]  # file -> (sending rank, tag)
    outgoing: list[tuple[str, int, int]]  # (file, receiving rank, tag)
    _opened: dict[str, StreamedFile] = field(default_factory=dict)
    _sender: threading.Thread | None = None
    _send_problems: list[str] = field(default_factory=list)
    _done: bool = False

    @classmethod
    def plan(
        cls, group: Group, directory: str, manifest: Manifest, metadata: Any, moves: Sequence[tuple[str, int, int]]
    ) -> Streams:
        """(each rank, the same ``moves`` on every rank) This rank's part of ``moves``
        (``(file, from rank, to rank)``, each a stream of its own)."""
        me = group.rank
        incoming = {name: (src, 1 + i) for i, (name, src, dst) in enumerate(moves) if dst == me}
        outgoing = [(name, dst, 1 + i) for i, (name, src, dst) in enumerate(moves) if src == me]
        return cls(group, directory, manifest, records_by_file(metadata.storage_data), incoming, outgoing)

    def open(self, name: str, where: str) -> StreamedFile:
        """The reader of incoming file ``name`` (once)."""
        if name in self._opened:
            raise IntegrityError(f"{where}: opened twice in one load")
        src, tag = self.incoming[name]
        record = self.manifest.files[name]
        f = StreamedFile(
            self.group, src, tag, record.size, self.records.get(name, []), record.checksum,
            self.manifest.checksum_algorithm, f"{where} (streamed from rank {src})",
        )
        self._opened[name] = f
        return f

    def start(self) -> None:
        """Start sending this rank's outgoing files (a thread: this rank's own reads go on)."""
        if self._sender is None and self.outgoing:
            self._sender = threading.Thread(target=self._send_all, name="distckpt-stream", daemon=True)
            self._sender.start()

    def finish(self) -> None:
        """(each rank, after its load's reads, failed or not) Every incoming stream received to
        its end and every outgoing one sent, so that no peer waits for this rank.

        Raises:
            CheckpointError: sending failed (a receiver died).
        """
        if self._done:
            return
        self._done = True
        self.start()
        for name in self.incoming:
            if name not in self._opened:
                self.open(name, name)
            self._opened[name].drain()
        if self._sender is not None:
            self._sender.join()
        if self._send_problems:
            raise CheckpointError(f"streaming the local tier's files failed: {'; '.join(self._send_problems)}")

    def _send_all(self) -> None:
        """(the sending thread) Post every message of every outgoing file, then wait for them
        all. Posted at once: a receiver reads its files in its own order, and gloo moves a
        message only once its receiver asks for it (nothing is buffered). Whatever goes wrong
        short of the wire, every message its receiver expects is still sent (see
        :meth:`_messages`): a receiver must never wait for a message that will not come."""
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        try:
            for name, dst, tag in self.outgoing:
                messages = self._messages(name)
                keep += messages
                peer = global_rank(self.group, dst)
                try:
                    works += [dist.isend(m, peer, self.group.pg, tag) for m in messages]
                except Exception as exc:  # noqa: BLE001 - the receiver died
                    self._send_problems.append(f"{name} to rank {dst}: {one_line(exc)}")
                    break
            for work in works:
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - the receiver died
                    self._send_problems.append(one_line(exc))
                    break
        except BaseException as exc:  # noqa: BLE001 - reported by finish(), never lost with the thread
            self._send_problems.append(f"rank {self.group.rank}: {one_line(exc)}")

    def _messages(self, name: str) -> list[torch.Tensor]:
        """The messages of outgoing file ``name`` (:class:`Layout`). Its bytes are this node's
        copy, unchecked: a damaged record head is no tensor's (its bytes travel with the rest),
        and any failure preparing them sends zeros of the same shape of messages, which the
        receiver's checksum refuses."""
        size = self.manifest.files[name].size
        large = large_records(size, self.records.get(name, []))
        try:
            data = self._source(name, size)
            ranges = [data_range(data[o : o + min(HEAD, n)].numpy().tobytes(), o, n) for o, n in large]
            layout = Layout(size, tuple(r for r in ranges if r != (0, 0)))
            rest = torch.empty(layout.rest_size, dtype=torch.uint8)
            for a, b, p in layout.rest_spans():
                rest[p : p + b - a] = data[a:b]
        except Exception as exc:  # noqa: BLE001 - e.g. no memory for the rest
            log.warning("distckpt: rank %d cannot send %s (%s): its receiver's checksum check will fail", self.group.rank, name, one_line(exc))
            ranges, layout = [(0, 0)] * len(large), Layout(size, ())
            data = rest = torch.zeros(size, dtype=torch.uint8)
        messages = [torch.tensor([v for r in ranges for v in r], dtype=torch.int64)] if large else []
        messages += [rest[a : a + n] for a, n in _chunks(0, layout.rest_size)]
        messages += [data[a : a + n] for a, n in layout.data_pieces()]
        return messages

    def _source(self, name: str, size: int) -> torch.Tensor:
        """The bytes of this node's copy of ``name`` (a read-only mapping), or zeros of its
        size where it cannot be read: the receiver waits for every byte, and its checksum
        check refuses them."""
        try:
            fd = open_regular(os.path.join(self.directory, name), size)
            try:
                mapped = map_file(fd, size)
            finally:
                os.close(fd)
            if mapped is not None or size == 0:
                return mapped if mapped is not None else torch.empty(0, dtype=torch.uint8)
            problem = "it cannot be mapped"
        except OSError as exc:
            problem = one_line(exc)
        log.warning("distckpt: rank %d cannot send %s (%s): its receiver's checksum check will fail", self.group.rank, name, problem)
        return torch.zeros(size, dtype=torch.uint8)
