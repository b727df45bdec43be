"""Peer recovery streamed into the load (distckpt.storage.stream): a node that lost its tier
receives what its ranks read straight into their destinations, never into its tier.

Two gloo ranks as two simulated nodes of one (``LOCAL_WORLD_SIZE=1``, one ``local_dir`` each):

* node 1's tier wiped, root moved away: bit-exact from rank 0's copies, node 1's tier keeps no
  data file, the report names rank 0 as the source; the tensors' bytes are received in place
  (no copy from a scratch buffer);
* both nodes lacking files (each sends and receives at once);
* rank 0's replica of rank 1's file damaged: the streamed load fails its checksum, the retry
  checks every copy and takes the root, exact;
* the receiving rank's load failing before it reads the stream (an injected failure, once): the
  sender is not left waiting, the retry loads exactly;
* the wire format (table, rest, data pieces) fuzzed: it always covers the file exactly, and a
  table that does not fit the file's records is refused.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

import distckpt
from dist_harness import run_ranks
from distckpt.storage import stream

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")]


def _state(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    # Large tensors (their data travels on its own), small ones and plain values (with the rest).
    return {
        "model": {
            "big": torch.randn(512, 300, generator=g),
            "wide": torch.randn(64, 1024, generator=g).to(torch.bfloat16),
            "small": torch.randn(7, generator=g),
            "scalar": torch.tensor(3.5),
        },
        "hyper": {"lr": 0.01 * seed, "betas": (0.9, 0.95)},
        "step": seed,
    }


def _blank():

    s = _state(0)
    for v in s["model"].values():
        v.zero_()
    s["hyper"] = {"lr": -1.0, "betas": (0.0, 0.0)}
    return s


def _save(rank: int, world: int, root: str, nodes: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank}", save_rng=False) as ck:
        ck.save(1, _state(1))  # replicated: every rank the same


def _load(rank: int, world: int, root: str, nodes: str, inject: str = "") -> tuple:
    import warnings

    import torch

    from distckpt.load import reader as reader_mod

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    copies: dict[str, int] = {}
    real_place = stream.StreamedFile.place

    def counting_place(self, placements):
        copies["placed"] = copies.get("placed", 0) + len(placements)
        return real_place(self, placements)

    stream.StreamedFile.place = counting_place
    if inject == "sender" and rank == 0:
        real_source = stream.Streams._source

        def failing_source(self, name, size):
            stream.Streams._source = real_source  # once
            raise MemoryError("injected failure preparing a file to send")

        stream.Streams._source = failing_source
    if inject == "receiver" and rank == 1:
        real = reader_mod.CheckpointReader._placements

        def failing(self, *args):
            reader_mod.CheckpointReader._placements = real  # once
            raise RuntimeError("injected failure before the stream is read")

        reader_mod.CheckpointReader._placements = failing
    state = _blank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank}", save_rng=False) as ck:
            step = ck.load(state)
            report = ck.last_load_report
    want = _state(1)
    exact = all(torch.equal(state["model"][k], want["model"][k]) for k in want["model"]) and state["hyper"] == want["hyper"]
    return step, report.tier, dict(report.sources), exact, copies.get("placed", 0), [str(w.message) for w in caught]


def _saved_then_node1_lost(tmp_path: Path) -> tuple[Path, Path]:
    """Step 1 saved by both ranks; node 1's tier wiped and the root moved away."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_save, 2, tmp_path, str(root), str(nodes), timeout=120)
    shutil.rmtree(nodes / "node1")
    root.rename(tmp_path / "away")
    return root, nodes


@pytest.mark.timeout(200)
def test_a_lost_node_recovers_streamed_in_place_and_keeps_no_copy(tmp_path):
    root, nodes = _saved_then_node1_lost(tmp_path)
    results = run_ranks(_load, 2, tmp_path, str(root), str(nodes), timeout=120)
    for rank, (step, tier, sources, exact, placed, _) in enumerate(results):
        assert (step, tier, exact) == (1, "local", True), (rank, results[rank])
    step, tier, sources, exact, placed, _ = results[1]
    streamed = {f for f, src in sources.items() if f.endswith(".distcp")}
    assert streamed and all(sources[f] == "rank 0" for f in streamed), sources
    assert placed >= 2, placed  # "big" and "wide" received straight into their destinations
    # Node 1's tier got .metadata to plan with, no data file and no manifest: it does not hold
    # the step (the next save brings it); node 0 still holds every file.
    kept = {p.name for p in (nodes / "node1" / "step_000000001").iterdir()}
    assert not {n for n in kept if n.endswith(".distcp")} and "manifest.json" not in kept, kept
    # A second restart: streamed again, still exact.
    results = run_ranks(_load, 2, tmp_path, str(root), str(nodes), timeout=120)
    assert all(r[:2] == (1, "local") and r[3] for r in results), results


@pytest.mark.timeout(200)
def test_both_nodes_send_and_receive_at_once(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_save, 2, tmp_path, str(root), str(nodes), timeout=120)
    (nodes / "node0" / "step_000000001" / "__0_0.distcp").unlink()  # node 0 lacks its own file
    (nodes / "node1" / "step_000000001" / "__1_0.distcp").unlink()  # node 1 lacks its own file
    root.rename(tmp_path / "away")
    results = run_ranks(_load, 2, tmp_path, str(root), str(nodes), timeout=120)
    for rank, (step, tier, sources, exact, _, _) in enumerate(results):
        assert (step, tier, exact) == (1, "local", True), (rank, results[rank])
        assert sources[f"__{rank}_0.distcp"] == f"rank {1 - rank}", sources


@pytest.mark.timeout(200)
def test_a_damaged_replica_fails_the_stream_and_the_root_serves(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_save, 2, tmp_path, str(root), str(nodes), timeout=120)
    shutil.rmtree(nodes / "node1")
    replica = nodes / "node0" / "step_000000001" / "__1_0.distcp"
    data = bytearray(replica.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a large tensor's data: received in place, then refused
    replica.write_bytes(bytes(data))
    results = run_ranks(_load, 2, tmp_path, str(root), str(nodes), timeout=120)
    for rank, (step, tier, _, exact, _, messages) in enumerate(results):
        assert (step, tier, exact) == (1, "root", True), (rank, results[rank])
        assert any("checksum" in m and "retrying" in m for m in messages), messages


@pytest.mark.timeout(200)
def test_a_receiver_failing_before_it_reads_leaves_no_sender_waiting(tmp_path):
    root, nodes = _saved_then_node1_lost(tmp_path)
    results = run_ranks(_load, 2, tmp_path, str(root), str(nodes), "receiver", timeout=120, pg_timeout=60)
    for rank, (step, tier, _, exact, _, messages) in enumerate(results):
        assert (step, tier, exact) == (1, "local", True), (rank, results[rank])
        assert any("injected failure" in m and "retrying" in m for m in messages), messages


@pytest.mark.timeout(200)
def test_a_sender_failing_to_prepare_a_file_still_sends_and_the_retry_loads(tmp_path):
    """The sending thread fails preparing a file (here: no memory): it still sends every message
    the receiver expects (zeros), whose checksum fails, and the retry loads exactly. Before, the
    thread died silently and the receiver waited out the group's timeout, breaking the group."""
    root, nodes = _saved_then_node1_lost(tmp_path)
    results = run_ranks(_load, 2, tmp_path, str(root), str(nodes), "sender", timeout=120, pg_timeout=60)
    for rank, (step, tier, _, exact, _, messages) in enumerate(results):
        assert (step, tier, exact) == (1, "local", True), (rank, results[rank])
        assert any("checksum" in m and "retrying" in m for m in messages), messages


def _tuple_save(rank: int, world: int, root: str, nodes: str) -> None:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    # A value whose torch.save record is large and whose pickle looks like a tensor's to a
    # head parser (a tuple of a tuple holding a tensor, then ints): its sender used to crash.
    value = ((torch.arange(20000.0).reshape(200, 100), 1, 2), 0, (5,), (1,))
    with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank}", save_rng=False) as ck:
        ck.save(1, {"model": {"w": torch.ones(300, 256)}, "stats": value})


def _tuple_load(rank: int, world: int, root: str, nodes: str) -> tuple:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    state = {"model": {"w": torch.zeros(300, 256)}, "stats": ((torch.zeros(200, 100), 0, 0), 9, (0,), (0,))}
    with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank}", save_rng=False, timeout=60) as ck:
        ck.load(state)
        tier = ck.last_load_report.tier
    (t, a, b), c, d, e = state["stats"]
    exact = torch.equal(t, torch.arange(20000.0).reshape(200, 100)) and (a, b, c, d, e) == (1, 2, 0, (5,), (1,))
    return tier, exact and torch.equal(state["model"]["w"], torch.ones(300, 256))


@pytest.mark.timeout(200)
def test_a_large_value_that_looks_like_a_tensor_streams(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_tuple_save, 2, tmp_path, str(root), str(nodes), timeout=120)
    shutil.rmtree(nodes / "node1")
    root.rename(tmp_path / "away")
    results = run_ranks(_tuple_load, 2, tmp_path, str(root), str(nodes), timeout=120, pg_timeout=60)
    assert results == [("local", True), ("local", True)], results


@pytest.mark.parametrize("seed", range(40))
def test_the_wire_layout_covers_every_file_exactly(seed):
    """Seeded fuzz of the layout both ends compute: the rest and the data pieces, put back in
    file order, are the file; a table whose ranges leave their records is refused."""
    rng = random.Random(seed)
    size = rng.randrange(1, 3 * stream.PIECE)
    records, at = [], 0
    while at < size:
        n = rng.choice([rng.randrange(1, 4096), rng.randrange(stream.LARGE, 2 * stream.LARGE), rng.randrange(1, stream.PIECE * 2)])
        records.append((at, min(n, size - at)))
        at += n + rng.choice([0, 0, rng.randrange(0, 100)])
    large = stream.large_records(size, records + [(rng.randrange(size), stream.LARGE)])  # an overlapping one is dropped
    assert all(a[0] + a[1] <= b[0] for a, b in zip(large, large[1:])) and all(o + n <= size for o, n in large)
    ranges = []
    for o, n in large:
        if rng.random() < 0.2:
            ranges.append((0, 0))
        else:
            s = o + rng.randrange(30, min(n, 4096))
            ranges.append((s, rng.randrange(s + 1, o + n + 1)))
    assert stream.valid_ranges(ranges, large)
    layout = stream.Layout(size, tuple(r for r in ranges if r != (0, 0)))
    data = bytes(rng.getrandbits(8) for _ in range(min(size, 4096))) * (size // 4096 + 1)
    data = data[:size]
    rest = b"".join(data[a:b] for a, b, _ in layout.rest_spans())
    assert len(rest) == layout.rest_size
    pieces = layout.data_pieces()
    assert all(n <= stream.PIECE for _, n in pieces)
    # Put back: every byte exactly once, in order.
    rebuilt = bytearray(size)
    for a, b, p in layout.rest_spans():
        rebuilt[a:b] = rest[p : p + b - a]
    for s, n in pieces:
        rebuilt[s : s + n] = data[s : s + n]
    covered = sorted([(a, b) for a, b, _ in layout.rest_spans()] + [(s, s + n) for s, n in pieces])
    assert covered[0][0] == 0 and covered[-1][1] == size and all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    assert bytes(rebuilt) == data
    if large:  # a range outside its record, or one too many, is refused
        i = rng.randrange(len(large))
        o, n = large[i]
        bad = list(ranges)
        bad[i] = rng.choice([(o - 1, o + 10), (o + 40, o + n + 1), (o + 50, o + 50), (size, size + 1)])
        assert not stream.valid_ranges(bad, large)
        assert not stream.valid_ranges(ranges + [(0, 0)], large)


def _sharded(world: int, fill):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(fill.clone(), mesh, [Shard(0)], src_data_rank=None)


def _full(i: int):
    import torch

    return torch.arange(96 * 1024, dtype=torch.float32).reshape(96, 1024) * (i + 1)  # 96 rows of 4 KiB


def _sharded_save(rank: int, world: int, root: str, nodes: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank // 2}", save_rng=False) as ck:
        ck.save(1, {"model": {f"w{i}": _sharded(world, _full(i)) for i in range(3)}, "step": 1})


def _sharded_load(rank: int, world: int, root: str, nodes: str) -> tuple:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    state = {"model": {f"w{i}": _sharded(world, torch.zeros(96, 1024)) for i in range(3)}, "step": 0}
    with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank // 2}", save_rng=False) as ck:
        step = ck.load(state)
        report = ck.last_load_report
    exact = all(torch.equal(state["model"][f"w{i}"].full_tensor(), _full(i)) for i in range(3))
    return step, report.tier, dict(report.sources), exact


@pytest.mark.timeout(200)
def test_a_streamed_recovery_at_another_world_size(tmp_path):
    """Saved by 4 ranks (2 nodes of 2), node 1 lost, resumed by 3 (rank 2 alone on node 1): rank
    2 reads parts of the lost ranks' shards (rows of records, not whole ones), streamed from
    node 0 and copied out of scratch buffers; bit-exact."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_sharded_save, 4, tmp_path, str(root), str(nodes), timeout=120)
    shutil.rmtree(nodes / "node1")
    root.rename(tmp_path / "away")
    results = run_ranks(_sharded_load, 3, tmp_path, str(root), str(nodes), timeout=120)
    for rank, (step, tier, sources, exact) in enumerate(results):
        assert (step, tier, exact) == (1, "local", True), (rank, results[rank])
    streamed = {f for f, src in results[2][2].items() if f.endswith(".distcp") and src != "local"}
    assert any(f.startswith(("__2_", "__3_")) for f in streamed), results[2][2]  # the lost node's shards
