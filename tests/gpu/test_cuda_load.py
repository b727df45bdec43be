"""The CUDA tier of a load's host-to-device path (distckpt/load/reader.py, ``_DeviceSink``): reads
of device destinations go through pinned buffers of at most ``DEVICE_PIECE`` bytes on a side
stream that follows the caller's stream, in reader threads that take the caller's device and
streams, and the caller's stream sees every value when ``load`` returns. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt.load import reader

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.xdist_group("cuda"),
    pytest.mark.timeout(600),
]


def _saved(tmp_path, threads: int) -> dict:
    torch.manual_seed(0)
    # 20 tensors of 24 MiB over several files: two reader threads, each tensor in 3 pieces of 8 MiB.
    state = {f"t{i}": torch.randn(6 << 20, device="cuda") for i in range(20)}
    state["bf"] = torch.randn(3 << 20, device="cuda").to(torch.bfloat16)
    state["odd"] = torch.randn(1_000_003, device="cuda")  # a last piece of odd length
    with distckpt.Checkpointer(tmp_path, save_rng=False, thread_count=threads) as ckpt:
        ckpt.save(1, {"w": state})
    torch.cuda.synchronize()
    return state


@pytest.mark.parametrize("threads", [1, 2])
def test_a_load_into_the_callers_stream_sees_every_value_in_pieces(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(reader, "DEVICE_PIECE", 8 << 20)
    pinned_sizes: list[int] = []
    real_buffer = reader._DeviceSink.buffer
    monkeypatch.setattr(reader._DeviceSink, "buffer", lambda self, n: pinned_sizes.append(n) or real_buffer(self, n))
    state = _saved(tmp_path, threads)
    side = torch.cuda.Stream()
    dest = {"w": {k: torch.empty_like(v) for k, v in state.items()}}
    with torch.cuda.stream(side):
        # The destinations are written on the caller's stream behind a long kernel: the copies
        # must be ordered after it (else the fill lands on top of the loaded values).
        torch.cuda._sleep(200_000_000)
        for v in dest["w"].values():
            v.fill_(7)
        with distckpt.Checkpointer(tmp_path, thread_count=threads) as ckpt:
            ckpt.load(dest)
        # No synchronization: the caller's stream itself must see the values.
        same = [torch.equal(dest["w"][k], v) for k, v in state.items()]
    torch.cuda.synchronize()
    assert all(same), [k for k, ok in zip(state, same) if not ok]
    assert pinned_sizes and max(pinned_sizes) <= 8 << 20
    assert torch.cuda.current_device() == 0  # the caller's device is untouched by the reader threads
