"""The load's path to accelerator tensors, on the parts a CPU can run (tests/gpu runs it whole):

* a stored tensor read for a device destination goes through pinned buffers of at most
  ``DEVICE_PIECE`` bytes (two per reader thread), in order, head bytes included: the pieces are
  checked here through the real reader with a host sink standing in for the device one;
* the sinks are finished after a failed read too (copies still in flight would race the retry);
* values saved on a GPU (a tuple's tensors, stored inside it) load on a host without one.
"""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import distckpt
from distckpt.load import reader
from distckpt.load.planner import SafeLoadPlanner


class _HostSink:
    """The device sink's protocol on the host: what the reader hands over, piece by piece."""

    made: list[_HostSink] = []

    def __init__(self) -> None:
        self.pieces: list[int] = []
        self.finished = 0
        self._pending: torch.Tensor | None = None
        _HostSink.made.append(self)

    def buffer(self, nbytes: int) -> memoryview:
        self._pending = torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # never what was saved
        self.pieces.append(nbytes)
        return memoryview(self._pending.numpy())

    def copy_to(self, target: torch.Tensor) -> None:
        assert target.dtype == torch.uint8 and target.numel() == self._pending.numel()
        target.copy_(self._pending)

    def finish(self) -> None:
        self.finished += 1


@pytest.fixture
def through_sink(monkeypatch):
    """Every direct read goes the device way, through :class:`_HostSink`, in pieces of 4 KiB."""
    _HostSink.made = []
    monkeypatch.setattr(reader, "_DeviceSink", _HostSink)
    monkeypatch.setattr(reader, "_on_host", lambda target: False)
    monkeypatch.setattr(reader, "DEVICE_PIECE", 4096)
    return _HostSink.made


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "big": torch.randn(300, 37, generator=g),  # 44,400 bytes: 11 pieces, the last short
            "piece": torch.randn(1024, generator=g),  # exactly one piece
            "small": torch.randn(5, generator=g),  # inside the record's head
            "empty": torch.zeros(0, 8),
            "half": torch.randn(64, 65, generator=g).to(torch.bfloat16),
            "flags": torch.rand(5000, generator=g) > 0.5,
            "cplx": torch.randn(700, generator=g, dtype=torch.complex64),
            "ints": torch.randint(-128, 127, (9000,), generator=g, dtype=torch.int8),
        },
        "step": 3,
    }


def _blank() -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}, "step": 0}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("threads", [1, 2])
def test_device_reads_go_in_bounded_pieces_and_land_exactly(tmp_path, through_sink, threads):
    saved = _state()
    with distckpt.Checkpointer(tmp_path / "root", save_rng=False, thread_count=threads) as ck:
        ck.save(1, saved)
        out = _blank()
        ck.load(out)
    for k, v in saved["model"].items():
        assert _bits(out["model"][k]) == _bits(v), k
    pieces = [n for sink in through_sink for n in sink.pieces]
    assert pieces, "no read went through the sink: the test would prove nothing"
    assert max(pieces) <= 4096
    nonempty = [v for v in saved["model"].values() if v.numel()]
    assert len(pieces) > len(nonempty)  # the big tensors were split
    assert sum(pieces) == sum(v.numel() * v.element_size() for v in nonempty)
    assert all(sink.finished == 1 for sink in through_sink)


def test_sinks_are_finished_after_a_failed_read(tmp_path, through_sink):
    root = tmp_path / "root"
    with distckpt.Checkpointer(root, save_rng=False) as ck:
        ck.save(1, _state())
    data = sorted((root / "step_000000001").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a flipped bit in the middle: the checksum fails at the file's end
    data.write_bytes(bytes(raw))
    with distckpt.Checkpointer(root) as ck, pytest.raises(distckpt.IntegrityError):
        ck.load(_blank())
    assert through_sink and all(sink.finished == 1 for sink in through_sink)


def _saved_on_cuda(value: object) -> bytes:
    """``torch.save(value)`` as a GPU rank writes it: the storages' location ``cuda:0``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(info, data)
    return out.getvalue()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the point is a host without a GPU")
def test_a_tuple_saved_on_a_gpu_loads_on_a_host_without_one():
    raw = _saved_on_cuda((torch.arange(4.0), "x"))
    with pytest.raises(RuntimeError, match="CUDA"):  # what torch.load does without a location
        torch.load(io.BytesIO(raw), weights_only=True)
    planner = SafeLoadPlanner(where="test")
    obj = planner._unpickled(memoryview(raw), io.BytesIO(raw), "extra", None)
    assert isinstance(obj, tuple) and obj[1] == "x"
    assert obj[0].device.type == "cpu" and torch.equal(obj[0], torch.arange(4.0))


def test_a_tuple_tensor_of_another_shape_goes_to_the_live_ones_device_but_never_to_meta():
    from distckpt.state.entries import _merged_tuple

    loaded = (torch.arange(6.0),)
    on_meta = _merged_tuple((torch.empty(2, device="meta"),), loaded)
    assert on_meta[0].device.type == "cpu" and torch.equal(on_meta[0], torch.arange(6.0))
    live = torch.zeros(3)
    same = _merged_tuple((torch.zeros(6),), loaded)
    assert torch.equal(same[0], torch.arange(6.0))
    other = _merged_tuple((live,), loaded)
    assert other[0].device == live.device and torch.equal(other[0], torch.arange(6.0))
