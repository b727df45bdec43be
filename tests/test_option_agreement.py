"""Ranks that create their Checkpointer with different options (a careless launch script: a flag
given on one node only). Before, a tier on one rank only failed with ``unhashable type:
'SaveView'``, different ``local_peers`` or ``async_mode`` hung every rank until the timeout, and
different checksum algorithms committed a step that no load could verify ("corrupted"). Now the
first collective call raises one ``ValueError`` on every rank naming each option and the ranks of
each value, and every later call raises it again (never a collective on a broken protocol).
Options that may differ (a node's ``local_dir`` path, ``local_keep``) still work. The same for
the arguments of a call that must agree: ``save(blocking=...)``, ``load(step=, strict=,
verify_state=)``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_harness import run_ranks

from distckpt._process import _span, disagreement

# name -> (per-rank keyword arguments, what the error must name)
DIFFER = {
    "tier on one rank": (lambda r, d: {"local_dir": f"{d}/tier"} if r == 0 else {}, ["local_dir: 'set' on ranks 0; None on ranks 1"]),
    "peers": (lambda r, d: {"local_dir": f"{d}/tier{r}", "local_peers": r}, ["local_peers: 0 on ranks 0; 1 on ranks 1"]),
    "async mode": (lambda r, d: {"async_mode": "process" if r == 0 else "thread"}, ["async_mode: 'process' on ranks 0; 'thread' on ranks 1"]),
    "checksum": (lambda r, d: {"checksum": "crc32c" if r == 0 else "sha256"}, ["checksum: 'crc32c' on ranks 0; 'sha256' on ranks 1"]),
    "state check": (lambda r, d: {"verify_state": r == 0}, ["verify_state: True on ranks 0; False on ranks 1"]),
    "replica retention": (
        lambda r, d: {"replicate_to": f"{d}/remote", "replicate_keep_last": None if r == 0 else 1},
        ["replicate_keep_last: None on ranks 0; 1 on ranks 1"],
    ),
}


def _body(rank: int, world: int, base: str) -> dict[str, object]:
    import distckpt

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two simulated nodes: the tier has a peer
    out: dict[str, object] = {}
    for name, (kwargs, _) in DIFFER.items():
        d = f"{base}/{name.replace(' ', '_')}"
        ck = distckpt.Checkpointer(f"{d}/root", **kwargs(rank, d))
        errors = []
        for call in (lambda: ck.save(1, {"w": torch.ones(4)}), lambda: ck.load({"w": torch.zeros(4)})):
            try:
                call()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        ck.close()
        out[name] = (errors, sorted(os.listdir(f"{d}/root")) if os.path.isdir(f"{d}/root") else [])
    # What may differ: each node's own tier path, how many steps each node keeps.
    d = f"{base}/agree"
    ck = distckpt.Checkpointer(f"{d}/root", local_dir=f"{d}/tier_of_node{rank}", local_keep=1 + rank)
    ck.save(1, {"w": torch.full((4,), 1.0 + rank)})
    state = {"w": torch.zeros(4)}
    step = ck.load(state)
    out["agree"] = (step, state["w"].tolist(), ck.last_load_report.tier)
    ck.close()
    return out


@pytest.mark.timeout(180)
def test_ranks_with_different_options_fail_alike_and_never_hang(tmp_path: Path) -> None:
    results = run_ranks(_body, 2, tmp_path, str(tmp_path / "runs"), timeout=150, pg_timeout=30)
    for name, (_, named) in DIFFER.items():
        (errors0, listing0), (errors1, _) = results[0][name], results[1][name]
        assert errors0 == errors1, name  # the same error on every rank
        for error in errors0:  # save and then load: raised both times
            assert error is not None and "different options" in error, (name, error)
            for part in named:
                assert part in error, (name, error)
        assert not [n for n in listing0 if n.startswith("step_")], (name, listing0)  # nothing committed
    for rank in (0, 1):
        assert results[rank]["agree"] == (1, [1.0 + rank] * 4, "local"), results[rank]["agree"]


def test_the_error_names_every_differing_option_with_ranks_as_spans() -> None:
    per_rank = [{"checksum": "crc32c", "async_mode": "process"} for _ in range(1000)]
    for r in (7, 8, 9, 500):
        per_rank[r] = {"checksum": "sha256", "async_mode": "process"}
    err = disagreement(per_rank)
    assert err is not None and "async_mode" not in str(err)
    assert "checksum: 'crc32c' on ranks 0-6, 10-499, 501-999; 'sha256' on ranks 7-9, 500" in str(err), str(err)
    assert disagreement([{"checksum": None}] * 3) is None
    assert disagreement([{"a": 1}, {}]) is not None  # an option one rank does not even send
    assert _span([3]) == "3" and _span([0, 2, 3, 4, 9]) == "0, 2-4, 9"


def _calls_body(rank: int, world: int, base: str, async_mode: str) -> dict[str, object]:
    import distckpt

    out: dict[str, object] = {}
    ck = distckpt.Checkpointer(f"{base}/{async_mode}", async_mode=async_mode)
    state = {"w": torch.full((4,), float(rank))}

    def attempt(name: str, call) -> None:
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)

    # Before any writer process exists (process mode: the first async save starts them).
    attempt("blocking, first save", lambda: ck.save(1, state, blocking=rank == 0))
    ck.save(1, state, blocking=False)
    ck.wait()
    # The writers run now: compared in the save's own exchange.
    attempt("blocking, later save", lambda: ck.save(2, state, blocking=rank == 1))
    ck.save(2, state)
    attempt("load step", lambda: ck.load({"w": torch.zeros(4)}, step=1 + rank))
    attempt("load strict", lambda: ck.load({"w": torch.zeros(4)}, strict=rank == 0))
    attempt("load verify_state", lambda: ck.load({"w": torch.zeros(4)}, verify_state=rank == 0))
    attempt("load only", lambda: ck.load({"w": torch.zeros(4)}, only="w" if rank == 0 else None))
    attempt("load exclude", lambda: ck.load({"w": torch.zeros(4)}, exclude=["_rng", "_r*"] if rank == 1 else "_rng"))
    attempt("load malformed only", lambda: ck.load({"w": torch.zeros(4)}, only=[] if rank == 0 else "w"))
    # The same selection written differently on each rank is the same selection.
    same = {"w": torch.zeros(4)}
    out["same selection"] = (ck.load(same, only=["w", "w*"] if rank == 0 else ["w*", "w"]), same["w"].tolist())
    loaded = {"w": torch.zeros(4)}
    out["after"] = (ck.load(loaded), loaded["w"].tolist(), ck.steps())  # still usable, nothing half-done
    ck.close()
    # From the fast recovery tier (two simulated nodes): its own first collective compares them.
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    with distckpt.Checkpointer(f"{base}/{async_mode}-tier", local_dir=f"{base}/{async_mode}-node{rank}") as tiered:
        tiered.save(1, state)
        tiered.save(2, state)
        attempt("tier load step", lambda: tiered.load({"w": torch.zeros(4)}, step=1 + rank))
        attempt("tier load strict", lambda: tiered.load({"w": torch.zeros(4)}, strict=rank == 1))
        attempt("tier load only", lambda: tiered.load({"w": torch.zeros(4)}, only=None if rank == 0 else "w"))
        loaded = {"w": torch.zeros(4)}
        out["tier after"] = (tiered.load(loaded), loaded["w"].tolist(), tiered.last_load_report.tier)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_mode", ["process", "thread"])
def test_ranks_calling_with_different_arguments_fail_alike_and_never_hang(tmp_path: Path, async_mode: str) -> None:
    """``save(blocking=...)`` differing between ranks hung every rank (the first async save
    starts writer processes, a collective the synchronous rank never takes); ``load(step=...)``
    served every rank the coordinator's step silently; ``strict`` or ``verify_state`` differing
    raised on some ranks only; ``only``/``exclude`` differing failed one rank with a gloo
    "connection reset" and the other with a wrong "unexpected keys" (or left an optimizer loaded
    on some ranks only)."""
    results = run_ranks(_calls_body, 2, tmp_path, str(tmp_path / "roots"), async_mode, timeout=150, pg_timeout=30)
    expect = {
        "blocking, first save": "blocking",
        "blocking, later save": "blocking",
        "load step": "step: 1 on ranks 0; 2 on ranks 1",
        "load strict": "strict: True on ranks 0; False on ranks 1",
        "load verify_state": "verify_state: True on ranks 0; False on ranks 1",
        "tier load step": "step: 1 on ranks 0; 2 on ranks 1",
        "tier load strict": "strict: False on ranks 0; True on ranks 1",
        "load only": "only: ['w'] on ranks 0; None on ranks 1",
        "load exclude": "exclude: ['_rng'] on ranks 0; ['_r*', '_rng'] on ranks 1",
        "load malformed only": "load(only=...) takes a non-empty pattern or list of patterns, got []",
        "tier load only": "only: None on ranks 0; ['w'] on ranks 1",
    }
    for name, part in expect.items():
        assert results[0][name] == results[1][name], name
        assert results[0][name] is not None and part in results[0][name], (name, results[0][name])
    for rank in (0, 1):
        assert results[rank]["after"] == (2, [float(rank)] * 4, [1, 2]), results[rank]["after"]
        assert results[rank]["same selection"] == (2, [float(rank)] * 4), results[rank]["same selection"]
        assert results[rank]["tier after"] == (2, [float(rank)] * 4, "local"), results[rank]["tier after"]


def test_selections_are_compared_as_the_patterns_they_mean() -> None:
    """Pure: what each rank sends for ``only``/``exclude``. A set's repr follows the string hash
    of each process (torchrun's ranks are separate interpreters), so it is compared sorted."""
    from distckpt.load.run import arguments

    same = [arguments(None, True, None, only=v) for v in ("model", ["model"], ("model", "model"), {"model"})]
    assert all(a == same[0] for a in same) and same[0]["only"] == ["model"], same
    assert arguments(None, True, None, exclude={"b", "a"})["exclude"] == arguments(None, True, None, exclude=["a", "b"])["exclude"]
    assert arguments(None, True, None)["only"] is None
    # Malformed: its repr (the rank's load raises it, inside the exchange, on every rank).
    assert arguments(None, True, None, only=[])["only"] == "[]" and arguments(None, True, None, only=3)["only"] == "3"
