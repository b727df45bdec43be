"""Where a tensor's bytes sit in a torch.save record: from the record's head, as torch's zip reader says."""

from __future__ import annotations

import io
import random

import pytest
import torch

from distckpt.integrity.torchfile import HEAD, _zip_layout, head_layout, raw_layout
from distckpt.state.shape import numel

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64,
          # no <X>Storage class: torch.save pickles _rebuild_tensor_v3 over an UntypedStorage
          torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


def _record(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _random_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape: tuple[int, ...] = ()
    for _ in range(rng.randint(0, 3)):
        shape += (rng.choice([0, 1, 2, 3, 7, 64, 1000]),)
        if torch.Size(shape).numel() > 70_000:  # small records keep the test fast
            shape = shape[:-1] + (1,)
    t = torch.zeros(shape, dtype=dtype) if dtype == torch.bool else torch.randint(0, 100, shape).to(dtype)
    if t.dim() and rng.random() < 0.3 and t.shape[0] > 1:
        t = t[1:].clone()  # as DCP writes views: their own storage
    return t


class _Counting(io.BytesIO):
    """A record stream that remembers the furthest byte read."""

    furthest = 0

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        data = super().read(n)
        self.furthest = max(self.furthest, self.tell())
        return data

    def readinto(self, b) -> int:  # type: ignore[override]
        n = super().readinto(b)
        self.furthest = max(self.furthest, self.tell())
        return n


def test_head_layout_equals_torchs_zip_reader_and_reads_only_the_head():
    rng = random.Random(1234)
    crc = torch.serialization.get_crc32_options()
    try:
        for i in range(300):
            torch.serialization.set_crc32_options(i % 2 == 0)  # records with and without CRCs
            t = _random_tensor(rng)
            data = _record(t)
            full = _zip_layout(io.BytesIO(data))
            assert full is not None, (t.dtype, t.shape)
            assert head_layout(data[:HEAD]) == full, (t.dtype, t.shape)
            stream = _Counting(data)
            assert raw_layout(stream) == full
            assert stream.furthest <= HEAD, "no read beyond the head (a cold disk would seek per record)"
            start, n = full.data_offset, full.nbytes
            got = torch.frombuffer(bytearray(data[start : start + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            want = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            if t.is_complex():
                want = torch.view_as_real(t).contiguous().view(-1).view(torch.uint8)
            assert torch.equal(got, want), (t.dtype, t.shape)
    finally:
        torch.serialization.set_crc32_options(crc)


def test_head_layout_of_damaged_heads_is_none_or_self_consistent():
    """Seeded mutations of record heads: never an exception; a layout it still returns is
    self-consistent (its byte count is its shape's elements times its dtype's size, and its data
    starts after the data entry's local header, inside the head it was given, or further by an
    element offset the pickle claims), so the reader's one bound decides whether to use it: the
    range must end inside the record (else torch's reader takes the record, and the file's
    checksum decides; ``tests/test_fuzz.py`` runs such records through the reader)."""
    rng = random.Random(99)
    returned = 0
    for _ in range(500):
        data = bytearray(_record(_random_tensor(rng)))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(min(len(data), 400))
            data[at] = rng.randrange(256)
        head = bytes(data[:HEAD])
        layout = head_layout(head)
        if layout is None:
            continue
        returned += 1
        assert layout.nbytes == numel(layout.shape) * layout.dtype.itemsize, layout
        assert 30 <= layout.data_offset, layout  # past a zip local header at least
    assert returned > 100  # most mutations miss what the layout is read from


def test_head_layout_of_a_memo_bomb_or_a_foreign_value_is_none_and_cheap():
    """A damaged head whose pickle names a huge memo index (one byte: a ``'storage'`` string's
    length, or a crafted ``LONG_BINPUT`` of 2**30) used to make the C unpickler allocate and zero
    gigabytes before failing; a value that pickles alike but is no tensor (a tuple of a tuple
    holding a tensor, then ints) raised AttributeError. Now: at once, in little memory, and
    ``None`` where the head is no plain tensor's."""
    import io
    import resource
    import time

    rec = bytearray(_record(torch.randn(256, 128)))
    at = rec.index(b"X\x07\x00\x00\x00storage")
    heads = []
    damaged = bytearray(rec[:HEAD])
    damaged[at + 1] = 24  # the string's length byte
    heads.append(bytes(damaged))
    crafted = bytearray(rec[:HEAD])
    proto = crafted.index(b"\x80\x02")
    crafted[proto + 2 : proto + 2] = b"Nr" + (1 << 30).to_bytes(4, "little") + b"0"  # None, LONG_BINPUT 2**30, POP
    heads.append(bytes(crafted))
    buf = io.BytesIO()
    torch.save(((torch.arange(20000.0).reshape(200, 100), 1, 2), 0, (5,), (1,)), buf)
    heads.append(buf.getvalue()[:HEAD])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    got = [head_layout(h) for h in heads]
    assert got[0] is None and got[2] is None, got  # (the crafted index alone harms nothing now)
    assert time.perf_counter() - t0 < 2.0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 512, grown_mib  # the C unpickler's memo: 2.9-16 GiB


@pytest.mark.parametrize("n", [0, 1, HEAD, 10 * HEAD])
def test_records_smaller_and_larger_than_the_head(n):
    data = _record(torch.arange(n, dtype=torch.float32))
    assert head_layout(data[:HEAD]) == _zip_layout(io.BytesIO(data))


def test_alike_heads_are_parsed_once_and_every_head_gets_its_own_layout(monkeypatch):
    """Heads already parsed are remembered up to their data (what a layout is read from): a
    record whose head is byte for byte one seen before is not parsed again; one differing in
    any of those bytes (another shape, dtype, storage offset, a damaged byte) is, and gets its
    own layout, the one :func:`_zip_layout` (torch's reader) gives."""
    from distckpt.integrity import torchfile

    monkeypatch.setattr(torchfile, "_SEEN", {})
    monkeypatch.setattr(torchfile, "_SEEN_LENGTHS", {})
    parsed = []
    inner = torchfile._parse_head
    monkeypatch.setattr(torchfile, "_parse_head", lambda head: parsed.append(head) or inner(head))
    base = torch.arange(64.0 * 32).reshape(64, 32)
    views = [base, base + 1, base.to(torch.float64), base[:63].clone(), base.reshape(32, 64), base.flatten()[5:].view(-1)]
    records = [_record(t) for t in views]
    for _ in range(3):
        for data in records:
            assert head_layout(data[:HEAD]) == _zip_layout(io.BytesIO(data))
    assert len(parsed) == 5  # base and base + 1 alike: 5 distinct heads, each parsed once
    damaged = bytearray(records[0][:HEAD])
    damaged[damaged.index(b"K@") + 1] = 0x3F  # a shape entry 64 -> 63: a new head, parsed
    assert head_layout(bytes(damaged)) != head_layout(records[0][:HEAD]) and len(parsed) == 6


def test_the_cache_of_heads_is_bounded(monkeypatch):
    from distckpt.integrity import torchfile

    monkeypatch.setattr(torchfile, "_SEEN", {})
    monkeypatch.setattr(torchfile, "_SEEN_LENGTHS", {})
    for n in range(1, 200):
        data = _record(torch.zeros(n))
        assert head_layout(data[:HEAD]) == _zip_layout(io.BytesIO(data))
    assert len(torchfile._SEEN) == torchfile._SEEN_MAX


def test_a_head_cut_inside_the_data_entrys_header_is_parsed_but_not_remembered(monkeypatch):
    """A window that ends inside the data entry's extra field (torch's alignment padding) still
    shows the layout, but its bytes end before what the layout depends on: no key of its own."""
    from distckpt.integrity import torchfile

    monkeypatch.setattr(torchfile, "_SEEN", {})
    monkeypatch.setattr(torchfile, "_SEEN_LENGTHS", {})
    data = _record(torch.arange(64.0))
    full = _zip_layout(io.BytesIO(data))
    assert full is not None and head_layout(data[: full.data_offset - 3]) == full
    assert torchfile._SEEN == {}
    assert head_layout(data[:HEAD]) == full and list(torchfile._SEEN_LENGTHS) == [full.data_offset]
