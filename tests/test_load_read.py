"""The read phase of a load (distckpt.load.phases.read): each rank plans and reads on its own, one
collective of O(1) per rank agrees on the outcome, and a failure on one rank fails every rank alike;
the state check after it (distckpt.load.verify) gathers no rank's fingerprint parts."""

from __future__ import annotations

import pickle

import pytest
from torch import nn

import distckpt
from dist_harness import run_ranks
from models import make_model, wrap


# torch.distributed's object collectives (DCP's collective load uses them) and distckpt's own
# (distckpt._dist.Group), each with the position of the argument each rank sends.
_TORCH = (("all_gather_object", 1), ("gather_object", 0), ("scatter_object_list", 1), ("broadcast_object_list", 0))
_OURS = (("all_gather", 1), ("gather", 1), ("scatter", 1), ("broadcast", 1))


def _counting_collectives(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Count object collectives: name -> pickled size of each call's input (torch's under their
    names, distckpt's ``Group`` methods as ``Group.<name>``)."""
    import torch.distributed as dist

    from distckpt._dist import Group

    seen: dict[str, list[int]] = {}

    def counted(owner: object, name: str, arg: int, label: str):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            obj = args[arg] if len(args) > arg else next(iter(kwargs.values()))
            seen.setdefault(label, []).append(len(pickle.dumps(obj)))
            return real(*args, **kwargs)

        return call

    for name, arg in _TORCH:
        monkeypatch.setattr(dist, name, counted(dist, name, arg, name))
    for name, arg in _OURS:
        monkeypatch.setattr(Group, name, counted(Group, name, arg, f"Group.{name}"))
    return seen


def _load_body(rank: int, world: int, root: str, parallel: str) -> dict:
    out = {}
    for tensors in (4, 64):
        model = wrap(nn.Sequential(*[nn.Linear(10, 10) for _ in range(tensors // 2)]), parallel, world)
        ckpt = distckpt.Checkpointer(f"{root}-{tensors}", save_rng=False)
        ckpt.save(1, {"model": model})
        ckpt.load({"model": model})  # first-call costs
        for checked in (False, True):
            with pytest.MonkeyPatch.context() as mp:
                seen = _counting_collectives(mp)
                ckpt.load({"model": model}, verify_state=checked)
            out[tensors, checked] = seen
        ckpt.close()
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_load_gathers_no_plans_and_sends_the_same_bytes_for_4_or_64_tensors(tmp_path, parallel):
    res = run_ranks(_load_body, 2, tmp_path, str(tmp_path / "ck"), parallel)
    for rank, per_size in enumerate(res):
        for checked in (False, True):
            small, large = per_size[4, checked], per_size[64, checked]
            for seen in (small, large):
                # DCP's collective load gathers every rank's read items on the coordinator and
                # scatters them back, then all-gathers the outcome: none of torch's object
                # collectives runs, nor a gather or scatter of distckpt's.
                assert not set(seen) & {name for name, _ in _TORCH}, seen
                assert "Group.gather" not in seen and "Group.scatter" not in seen, seen
            # Views (digests) and the read's outcome, and with the state check its error
            # agreement (its sums travel in all-reduces of O(keys), not gathers of every
            # rank's parts): O(1) per rank, whatever the number of tensors.
            assert len(small["Group.all_gather"]) == len(large["Group.all_gather"]) == 2 + checked, small
            assert large["Group.all_gather"] == small["Group.all_gather"], (rank, checked, small, large)


def _failure_body(rank: int, world: int, root: str, where: str) -> str:
    import distckpt.load.run
    from distckpt.load import reader

    model = wrap(make_model(0), "ddp", world)
    ckpt = distckpt.Checkpointer(root, save_rng=False)
    if where == "save":
        ckpt.save(1, {"model": model})
        return ""
    with pytest.MonkeyPatch.context() as mp:
        if rank == 1 and where == "read":

            def unreadable(self, plan, planner):
                raise distckpt.IntegrityError("rank 1 could not read __9_9.distcp")

            mp.setattr(reader.CheckpointReader, "read_data", unreadable)
        if rank == 0 and where == "apply":

            def refused(*args):
                raise ValueError("rank 0's objects refused their state")

            mp.setattr(distckpt.load.run, "apply_load", refused)
        try:
            ckpt.load({"model": model})
        except (distckpt.CheckpointError, ValueError) as exc:
            return f"{type(exc).__name__}|{sorted(getattr(exc, 'failures', {}))}|{exc}"
    return "loaded"


def test_a_read_or_apply_failure_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    root = str(tmp_path / "ck")
    run_ranks(_failure_body, 2, tmp_path, root, "save")
    read = run_ranks(_failure_body, 2, tmp_path, root, "read")
    assert read[0] == read[1], read
    kind, ranks, text = read[0].split("|", 2)
    assert kind == "IntegrityError" and ranks == "[1]" and "__9_9.distcp" in text and "reading" in text, read[0]
    apply = run_ranks(_failure_body, 2, tmp_path, root, "apply")
    kinds = {r.split("|", 1)[0] for r in apply}
    # One rank's caller mistake keeps its builtin type on every rank (as all_ranks does).
    assert kinds == {"ValueError"} and all("refused their state" in r for r in apply), apply
