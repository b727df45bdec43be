"""Global vs per-rank state (distckpt.state.scope): state that differs between ranks is never merged."""

from __future__ import annotations

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from distckpt.state import scope


class Counter:
    """A stateful object whose state differs per rank (like a data loader's position)."""

    def __init__(self, t: int, pos: int) -> None:
        self.t, self.pos = t, pos

    def state_dict(self) -> dict:
        return {"t": self.t, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.t, self.pos = sd["t"], sd["pos"]


def _state(rank: int, world: int, fill: int | None = None) -> dict:
    v = rank if fill is None else fill
    return {
        # the example: rank 0 {"t": 10, "pos": 100}, rank 1 {"t": 20, "pos": 200}
        "counter": Counter(10 * (v + 1), 100 * (v + 1)),
        "value": {"seen": [v, v + 1]},
        "tree": {"a": torch.full((3,), float(v)), "n": v},
        "loose": torch.full((4,), float(v)),
        "declared": distckpt.PerRank({"x": 1 if fill is None else -1}),  # equal on all ranks, yet per rank
        "same": 5 if fill is None else 0,
        "sampler": distckpt.GlobalBatchSampler(48, 12, rank, world, seed=3),
    }


def _snapshot(state: dict) -> dict:
    return {
        "counter": state["counter"].state_dict(),
        "value": state["value"],
        "tree": (state["tree"]["a"].tolist(), state["tree"]["n"]),
        "loose": state["loose"].tolist(),
        "declared": state["declared"].obj,
        "same": state["same"],
        "sampler": state["sampler"].batches_consumed,
    }


def _save_body(rank: int, world: int, root: str) -> dict:
    state = _state(rank, world)
    for _ in range(3):
        state["sampler"].next_batch()
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, state)
    ckpt.save(2, state, blocking=False)
    ckpt.wait()
    expected = _snapshot(state)
    out: dict = {"expected": expected, "scopes": {k: v.get("scope") for k, v in ckpt.manifest(1).entries.items()}}
    for step in (1, 2):
        fresh = _state(rank, world, fill=9)
        ckpt.load(fresh, step=step)
        out[f"loaded{step}"] = _snapshot(fresh)
    try:
        ckpt.save(3, {"g": distckpt.Global(rank % 2), "h": 1})
        out["global_error"] = None
    except ValueError as exc:
        out["global_error"] = str(exc)
    ckpt.close()
    return out


def _other_world_body(rank: int, world: int, root: str) -> dict:
    ckpt = distckpt.Checkpointer(root)
    out: dict = {}
    try:
        ckpt.load(_state(rank, world, fill=9), step=1)
        out["strict"] = None
    except distckpt.StateMismatchError as exc:
        out["strict"] = (str(exc), exc.per_rank)
    fresh = _state(rank, world, fill=9)
    with pytest.warns(UserWarning, match="per-rank state") as seen:
        ckpt.load(fresh, step=1, strict=False)
    # (It did load with strict=False: the warning says what it skipped, no advice to do so.)
    out["warned"] = [str(w.message) for w in seen if "per-rank state" in str(w.message)]
    out["loaded"] = _snapshot(fresh)
    out["skipped"] = ckpt.last_load_report.skipped
    ckpt.close()
    return out


PER_RANK_ENTRIES = {"counter", "value", "tree", "loose", "declared"}


def test_per_rank_state_round_trips_and_refuses_another_world_size(tmp_path):
    root = str(tmp_path / "ck")
    saved = run_ranks(_save_body, 2, tmp_path, root)
    for r, res in enumerate(saved):
        assert res["expected"]["counter"] == {"t": 10 * (r + 1), "pos": 100 * (r + 1)}
        for step in (1, 2):  # sync and async
            assert res[f"loaded{step}"] == res["expected"], f"rank {r}, step {step}"
        assert {k for k, v in res["scopes"].items() if v == scope.PER_RANK} == PER_RANK_ENTRIES | {"_rng"}
        assert res["scopes"]["same"] == res["scopes"]["sampler"] == scope.GLOBAL
        assert res["global_error"] is not None and "'g'" in res["global_error"] and "[0] vs [1]" in res["global_error"]
    assert saved[0]["global_error"] == saved[1]["global_error"]
    assert distckpt.Checkpointer(root).steps() == [1, 2], "a refused save commits nothing"

    other = run_ranks(_other_world_body, 3, tmp_path, root)
    for r, res in enumerate(other):
        message, per_rank = res["strict"]
        assert set(per_rank) == PER_RANK_ENTRIES and all(v == (2, 3) for v in per_rank.values())
        assert "counter (saved by 2 ranks, loading at 3" in message
        assert set(res["skipped"]) == PER_RANK_ENTRIES
        assert all("; skipped" in w and "load with strict=False" not in w for w in res["warned"]), res["warned"]
        # World-size independent state still loads; per-rank entries keep their own values.
        assert res["loaded"]["same"] == 5 and res["loaded"]["sampler"] == 3
        assert res["loaded"]["counter"] == {"t": 100, "pos": 1000}
    assert other[0]["strict"] == other[2]["strict"]


def test_scope_rules():
    from distckpt.state.scope import GLOBAL, PER_RANK, classify, digest, unwrap

    assert classify("a", None, ["x", "x"]) == GLOBAL
    assert classify("a", None, ["x", "y"]) == PER_RANK
    assert classify("a", PER_RANK, ["x", "x"]) == PER_RANK
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] vs \[1\]"):
        classify("a", GLOBAL, ["x", "y", "x"])
    assert digest({"a": torch.ones(3), "b": [1, 2.5]}) == digest({"b": [1, 2.5], "a": torch.ones(3)})
    assert digest(torch.ones(3)) != digest(torch.ones(3, dtype=torch.float64))
    assert digest(1) != digest(True) and digest(1.0) != digest(1)
    assert unwrap(distckpt.GlobalBatchSampler(8, 4, 0, 1))[1] == GLOBAL
    from torch.utils.data import DistributedSampler

    assert unwrap(DistributedSampler(range(8), num_replicas=2, rank=0))[1] == PER_RANK
    with pytest.raises(TypeError):
        distckpt.PerRank(distckpt.Global(1))


def test_values_equal_as_dicts_but_of_other_types_are_per_rank():
    """A Counter on one rank and a dict on another (equal) were digested alike: the entry was
    global and every rank loaded one rank's type (found by a helper, 2026-12-07,
    /tmp/attack82). Mappings in another order are still one global value: an OrderedDict built
    from a set differs between ranks (hash seeds), and per rank it would be refused at another
    world size. Ints of more than 4300 digits made the digest fail with a bare ValueError."""
    import collections

    from distckpt.state.scope import digest

    assert digest(collections.OrderedDict(a=1, b=2)) == digest(collections.OrderedDict(b=2, a=1))
    assert digest([{"a": 1}]) != digest([collections.Counter(a=1)])
    assert digest({"a": 1}) != digest(collections.defaultdict(int, a=1))
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest(7**6000) != digest(7**6000 + 1) and digest({7**6000: 1}) == digest({7**6000: 1})


def _mixed_body(rank: int, world: int, root: str) -> dict:
    import collections

    od = collections.OrderedDict([("a", 1), ("b", 2)] if rank == 0 else [("b", 2), ("a", 1)])
    counts = {"a": 1} if rank == 0 else collections.Counter({"a": 1})  # equal, of another type
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, {"od": od, "counts": counts})
    state = {"od": None, "counts": None}
    ckpt.load(state)
    entries = ckpt.manifest(1).entries
    ckpt.close()
    return {"scopes": (entries["od"]["scope"], entries["counts"]["scope"]), "order": list(state["od"]), "type": type(state["counts"]).__name__}


def test_a_value_whose_ranks_differ_in_type_loads_back_on_each(tmp_path):
    results = run_ranks(_mixed_body, 2, tmp_path, str(tmp_path / "ck"))
    assert [r["scopes"] for r in results] == [("global", "per_rank")] * 2
    assert [r["type"] for r in results] == ["dict", "Counter"]


class _Data:
    """A user's wrapper of a per-rank loader (an epoch and the loader's state): found by a
    helper (2026-12-07, /tmp/attack87/wrapped.py)."""

    def __init__(self, rank: int, world: int) -> None:
        from torch.utils.data import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = list(range(60))
        self.loader = StatefulDataLoader(data, batch_size=2, sampler=DistributedSampler(data, world, rank, shuffle=False))

    def state_dict(self) -> dict:
        return {"epoch": 0, "loader": self.loader.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.loader.load_state_dict(sd["loader"])


def _wrapped_loader_body(rank: int, world: int, root: str) -> object:
    data = _Data(rank, world)
    state = {"data": data}
    with distckpt.Checkpointer(root) as ckpt:
        if ckpt.latest_step() is None:
            it = iter(data.loader)
            seen = [next(it).tolist() for _ in range(3)]
            ckpt.save(3, state)
            return seen, ckpt.manifest(3).entries["data"]["scope"]
        try:
            ckpt.load(state)
        except distckpt.StateMismatchError as exc:
            return sorted(exc.per_rank)
        return next(iter(data.loader)).tolist()


@pytest.mark.timeout(200)
def test_a_loader_wrapped_in_a_users_object_is_per_rank(tmp_path):
    """A loader over a DistributedSampler keeps counts only, equal on every rank: wrapped in a
    user's object, its state looked global, was stored once, and a resume at 3 ranks of a save
    at 2 gave every rank one position (samples 12..17 never seen, silently). Per rank by kind,
    as the loader itself is: refused at another world size, exact at the same."""
    pytest.importorskip("torchdata")
    from distckpt.state.scope import holds_per_rank_state

    assert not holds_per_rank_state({"epoch": 1, "pos": [1, 2]})
    loader_state = {"_num_yielded": 3, "_sampler_iter_state": None}
    # Breadth first: a long history beside it spent the budget before (depth first, from the end).
    assert holds_per_rank_state({"loader": loader_state, "history": [{"loss": float(i)} for i in range(5000)]})
    root = str(tmp_path / "root")
    saved = run_ranks(_wrapped_loader_body, 2, tmp_path, root, timeout=150)
    assert saved[0][1] == "per_rank" and saved[0][0] == [[0, 2], [4, 6], [8, 10]], saved
    assert run_ranks(_wrapped_loader_body, 3, tmp_path, root, timeout=150) == [["data"]] * 3
    assert run_ranks(_wrapped_loader_body, 2, tmp_path, root, timeout=150) == [[12, 14], [13, 15]]
