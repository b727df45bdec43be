"""The copies of accelerator tensors to host memory ahead of a sync save's writer threads
(distckpt/save/d2h.py), on the CPU paths they share with CUDA: the ring's bookkeeping, the order
and values handed out, the bounded memory, the records written, and the proof of each copy.
The CUDA-only parts (pinned memory, side streams, events) run in tests/gpu/ (sync saves)."""

from __future__ import annotations

import io
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import distckpt
from distckpt.errors import StagingMismatchError
from distckpt.save import d2h, records


@pytest.fixture
def host_pipelined(monkeypatch):
    """Host tensors take the ring's path (plain copies instead of a side stream's)."""
    monkeypatch.setattr(d2h, "PIPELINED", frozenset({"cpu", "cuda"}))


def _item(key: str, t: torch.Tensor) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(key),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0] * t.dim()), sizes=t.shape),
            properties=TensorProperties(dtype=t.dtype),
            size=t.shape,
        ),
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_ring_never_hands_out_overlapping_rooms(seed):
    rng = random.Random(seed)
    capacity = rng.choice([64, 640, 4096, 10_000])
    ring = d2h.Ring(capacity)
    live: list[tuple[int, int]] = []
    refused = 0
    for _ in range(3000):
        if live and (rng.random() < 0.45):
            ring.give_back(live.pop(0)[0])
            continue
        n = rng.choice([1, 63, 64, 65, rng.randrange(1, capacity + 200)])
        offset = ring.take(n)
        if offset is None:
            refused += 1
            if not live:  # refusals are legal while rooms are live, but an empty ring takes what fits
                assert not ring.fits(n)
            continue
        end = offset + d2h.Ring.room(n)
        assert offset % d2h.ALIGN == 0 and 0 <= offset and end <= capacity
        assert all(end <= a or offset >= b for a, b in live), (offset, end, live)
        live.append((offset, end))
        assert ring.live == live
    assert refused  # the sizes exceed the room sometimes: refusals were exercised
    with pytest.raises(RuntimeError, match="out of order"):
        ring.take(1)
        ring.give_back(capacity + 1)


def test_the_ring_wraps_around_to_the_start():
    ring = d2h.Ring(640)
    a, b = ring.take(256), ring.take(256)
    assert (a, b) == (0, 256)
    assert ring.take(256) is None  # 128 left at the end, the start is taken
    ring.give_back(a)
    assert ring.take(200) == 0  # wraps: the end has 128, the start 256
    assert ring.take(64) is None  # between the new head (256) and the oldest room (256)
    ring.give_back(b)
    assert ring.take(300) == 256


@pytest.mark.parametrize("seed", range(4))
def test_tensors_come_out_in_order_with_their_values_from_a_bounded_ring(host_pipelined, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    capacity = 4096
    tensors = []
    for i in range(60):
        n = rng.choice([1, 3, 100, 500, 1024, 1025, 2000])  # fp32: up to 2x the ring
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64])
        t = (torch.randn(n) * 50).to(dtype) if dtype != torch.bool else torch.rand(n) > 0.5
        tensors.append((f"t{i}", t.reshape(rng.choice([(n,), (1, n)]))))
    items = [_item(k, t) for k, t in tensors]
    by_key = dict(tensors)
    as_host_calls = []

    def as_host(t):
        as_host_calls.append(t.nbytes)
        return records._host_tensor(t)

    seen = []
    gen = d2h.host_tensors(items, lambda it: by_key[it.index.fqn], as_host, prove=True, capacity=capacity)
    ring_memory = None
    for item, data, host in gen:
        key = item.index.fqn
        seen.append(key)
        assert data is by_key[key]
        assert torch.equal(host, data) and host.dtype == data.dtype and host.shape == data.shape
        assert host.untyped_storage().nbytes() == host.nbytes  # torch.save writes only its bytes
        if d2h.Ring.room(data.nbytes) <= capacity:
            assert host.data_ptr() != data.data_ptr()  # a copy, in the ring
            ring_memory = ring_memory or set()
            ring_memory.add(host.data_ptr())
    assert seen == [k for k, _ in tensors]
    assert sorted(as_host_calls) == sorted(t.nbytes for _, t in tensors if d2h.Ring.room(t.nbytes) > capacity)
    assert ring_memory


def test_the_ring_is_no_larger_than_the_threads_tensors(host_pipelined, monkeypatch):
    sizes = []
    real = d2h._Copier.__init__

    def init(self, capacity, *args, **kwargs):
        sizes.append(capacity)
        real(self, capacity, *args, **kwargs)

    monkeypatch.setattr(d2h._Copier, "__init__", init)
    tensors = {f"t{i}": torch.randn(100) for i in range(3)}
    items = [_item(k, t) for k, t in tensors.items()]
    assert len(list(d2h.host_tensors(items, lambda it: tensors[it.index.fqn], records._host_tensor))) == 3
    assert sizes == [3 * 448]  # 400 bytes each, on whole cache lines; not RING_BYTES


def test_an_error_while_writing_waits_for_the_copies_in_flight(host_pipelined, monkeypatch):
    finished = []
    monkeypatch.setattr(d2h._Copier, "finish", lambda self: finished.append(True))
    tensors = {f"t{i}": torch.randn(100) for i in range(5)}
    items = [_item(k, t) for k, t in tensors.items()]
    gen = d2h.host_tensors(items, lambda it: tensors[it.index.fqn], records._host_tensor, capacity=1024)
    next(gen)
    gen.close()
    assert finished == [True]


def test_a_copy_that_differs_from_its_device_tensor_fails_the_proof(host_pipelined, monkeypatch, tmp_path):
    real = d2h._Copier.issue

    def issue(self, pending, prove):
        real(self, pending, prove)
        if pending.item.index.fqn.endswith("w.t3"):
            self.memory[pending.offset + 5] ^= 1  # one bit of the copy flips

    monkeypatch.setattr(d2h._Copier, "issue", issue)
    torch.manual_seed(0)
    state = {"w": {f"t{i}": torch.randn(300) for i in range(6)}}
    ckpt = distckpt.Checkpointer(tmp_path, save_rng=False)
    with pytest.raises(StagingMismatchError, match=r"w\.t3 was copied to host memory with values other"):
        ckpt.save(1, state)
    assert ckpt.steps() == []  # nothing committed
    # Without the proof (verify_staging=False) the same flip is written: the proof is what catches it.
    unproven = distckpt.Checkpointer(tmp_path / "off", save_rng=False, verify_staging=False)
    unproven.save(1, state)
    dest = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}}
    unproven.load(dest, verify_state=False)
    assert not torch.equal(dest["w"]["t3"], state["w"]["t3"])


def _distcp_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("step_*/*.distcp"))}


def test_a_save_through_the_ring_writes_the_same_files_and_loads_exactly(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 7))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    extra = {"bf": torch.randn(33, 17).bfloat16(), "b": torch.rand(9) > 0.5, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3)}
    state = {"model": model, "optim": optim, "extra": extra}
    plain = distckpt.Checkpointer(tmp_path / "plain", save_rng=False)
    plain.save(1, state)
    monkeypatch.setattr(d2h, "PIPELINED", frozenset({"cpu"}))
    monkeypatch.setattr(d2h, "RING_BYTES", 8192)  # smaller than the largest tensors: both paths
    ringed = distckpt.Checkpointer(tmp_path / "ring", save_rng=False, verify_staging=True)
    ringed.save(1, state)
    assert _distcp_bytes(tmp_path / "ring") == _distcp_bytes(tmp_path / "plain")
    # Where the copies' time went (SaveStats.phases, thread-seconds): only a save through the ring.
    assert set(d2h.PARTS) <= set(ringed.last_save.phases), ringed.last_save.phases
    assert not set(d2h.PARTS) & set(plain.last_save.phases)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 7))
    dest = {"model": fresh, "optim": torch.optim.AdamW(fresh.parameters()), "extra": {k: torch.zeros_like(v) for k, v in extra.items()}}
    ringed.load(dest)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert all(torch.equal(dest["extra"][k], v) for k, v in extra.items())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(1000, dtype=torch.float32)[100:300],  # a view of a larger storage
        lambda: torch.randn(40, 30).bfloat16()[5:9],
        lambda: torch.randn(64, dtype=torch.complex64)[8:16],
        lambda: (torch.rand(100) > 0.5)[3:50],
        lambda: torch.arange(50.0)[7],  # 0-dim
        lambda: torch.randn(10, 10)[:, 2:5],  # not contiguous: cloned
        lambda: torch.zeros(100)[5:5],  # empty
    ],
)
def test_host_tensors_of_larger_storages_give_the_records_clones_would(make):
    t = make()
    alias, clone = io.BytesIO(), io.BytesIO()
    records.write_torch_record(records._host_tensor(t), alias, False)
    records.write_torch_record(t.clone(), clone, False)
    assert alias.getvalue() == clone.getvalue()
    assert torch.equal(torch.load(io.BytesIO(alias.getvalue())), t)


def test_the_host_digest_runs_beside_the_write_and_ends_before_the_room_is_reused(host_pipelined, monkeypatch):
    # The digest of copy n waits until the writer got tensor n (a digest taken before the hand-out
    # would wait forever: the assert below fails it), and no room is given back before its
    # digest returned.
    real_digest = d2h.staging_digest
    written = [threading.Event() for _ in range(5)]
    done: list[int] = []
    threads = set()

    given_early = threading.Event()

    def digest(t, chunk=None):
        if t.data_ptr() not in origin:  # a copy in the ring (device tensors are digested before their copy)
            threads.add(threading.current_thread().name)
            assert written[len(done)].wait(30), "the digest of a copy ran before the writer got it"
            # Room for a give_back that does not wait for this digest to show itself (bounded:
            # a correct one waits for this digest, so nothing comes).
            given_early.wait(0.2)
            done.append(t.data_ptr())
            assert chunk == d2h.PROOF_CHUNK  # in calls few enough not to queue on the GIL
        return real_digest(t, chunk)

    real_give_back = d2h.Ring.give_back
    given = []

    def give_back(self, offset):
        if len(done) != len(given) + 1:
            given_early.set()
            raise AssertionError("a room was given back before its digest returned")
        given.append(offset)
        real_give_back(self, offset)

    monkeypatch.setattr(d2h, "staging_digest", digest)
    monkeypatch.setattr(d2h.Ring, "give_back", give_back)
    tensors = {f"t{i}": torch.randn(100) for i in range(5)}
    origin = {t.data_ptr() for t in tensors.values()}
    items = [_item(k, t) for k, t in tensors.items()]
    out = []
    gen = d2h.host_tensors(items, lambda it: tensors[it.index.fqn], records._host_tensor, prove=True, capacity=1024)
    for n, (_, _, host) in enumerate(gen):
        assert len(given) == n  # this tensor's room is still taken
        out.append(host.clone())
        written[n].set()  # "written": its digest may end now
    assert [torch.equal(a, b) for a, b in zip(out, tensors.values())] == [True] * 5
    assert len(done) == 5 and len(given) == 5
    assert threads and all(n.startswith("distckpt-d2h-proof") for n in threads)


def test_closing_the_writer_waits_for_the_digest_still_reading_the_ring(host_pipelined, monkeypatch):
    real_digest = d2h.staging_digest
    started, release = threading.Event(), threading.Event()
    order = []

    def digest(t, chunk=None):
        if t.data_ptr() not in origin:
            started.set()
            assert release.wait(30)
            order.append("digest done")
        return real_digest(t, chunk)

    monkeypatch.setattr(d2h, "staging_digest", digest)
    tensors = {f"t{i}": torch.randn(100) for i in range(3)}
    origin = {t.data_ptr() for t in tensors.values()}
    items = [_item(k, t) for k, t in tensors.items()]
    gen = d2h.host_tensors(items, lambda it: tensors[it.index.fqn], records._host_tensor, prove=True, capacity=1024)
    next(gen)
    assert started.wait(30)
    closer = threading.Thread(target=lambda: (gen.close(), order.append("closed")))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # (a close that did not wait would have returned by now)
    release.set()
    closer.join(30)
    assert order == ["digest done", "closed"]


@pytest.mark.parametrize("flip", ["first", "middle", "last"])
def test_a_wrong_copy_fails_the_proof_wherever_it_is_in_the_file(host_pipelined, monkeypatch, flip):
    # The last tensor's digest is checked when the writer comes back after writing it (the end of
    # the file): a wrong last copy must fail like any other.
    tensors = {f"t{i}": torch.randn(100) for i in range(4)}
    bad = {"first": "t0", "middle": "t2", "last": "t3"}[flip]
    real = d2h._Copier.issue

    def issue(self, pending, prove):
        real(self, pending, prove)
        if pending.item.index.fqn == bad:
            self.memory[pending.offset + 7] ^= 4

    monkeypatch.setattr(d2h._Copier, "issue", issue)
    items = [_item(k, t) for k, t in tensors.items()]
    got = []
    with pytest.raises(StagingMismatchError, match=rf"f\.distcp: verify_staging: {bad} was copied"):
        for item, _, _ in d2h.host_tensors(items, lambda it: tensors[it.index.fqn], records._host_tensor, prove=True, capacity=1024, where="f.distcp"):
            got.append(item.index.fqn)
    assert got == list(tensors)[: list(tensors).index(bad) + 1]  # it was handed out (written), then failed


def test_a_save_made_while_the_interpreter_exits_still_proves_its_copies(tmp_path):
    # Executors refuse new work once the interpreter is shutting down (atexit handlers, threads
    # outliving the main one): the digest is then taken in the writer thread itself.
    script = tmp_path / "atexit_save.py"
    script.write_text(
        "import atexit, torch\n"
        "from distckpt.save import d2h, records\n"
        "from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties\n"
        "from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType\n"
        "def item(k, t):\n"
        "    return WriteItem(index=MetadataIndex(k), type=WriteItemType.TENSOR, tensor_data=TensorWriteData(\n"
        "        chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=t.shape), properties=TensorProperties(dtype=t.dtype), size=t.shape))\n"
        "def at_exit():\n"
        "    d2h.PIPELINED = frozenset({'cpu'})\n"
        "    ts = {f't{i}': torch.randn(64) for i in range(3)}\n"
        "    out = list(d2h.host_tensors([item(k, t) for k, t in ts.items()], lambda it: ts[it.index.fqn], records._host_tensor, prove=True, capacity=1024))\n"
        "    print('proved', len(out), flush=True)\n"
        "atexit.register(at_exit)\n"
    )
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "proved 3" in proc.stdout, proc.stderr[-2000:]
