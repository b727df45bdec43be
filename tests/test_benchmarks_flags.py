"""The benchmark scripts' command lines: a bad value is a usage error naming its flag (exit 2, no
traceback, no empty table), ``--quick`` changes only the defaults the user left out, and a run
writes only where it was told to (a ``--quick`` run never over the committed
``benchmarks/results/``; the plot beside the JSON; nothing in ``--dir`` but its own folder)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def _bench(script: str, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def _common() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    return _common


MISSING = "/nonexistent/distckpt-bench-dir"

#: (script, arguments, the flag the usage error must name); every one of these ran (or crashed
#: with a traceback, or recorded an empty or mislabelled table) before the flags were checked.
BAD = [
    *[(s, ["--repeats", v], "--repeats") for s in ("verify_cost.py", "hf_load.py", "read_share.py", "zero_memory.py",
                                                   "save_throughput.py", "recovery.py", "gpu.py") for v in ("0", "-1", "a")],
    ("verify_cost.py", ["--quick", "--size-gib", "nan"], "--size-gib"),
    ("verify_cost.py", ["--world-sizes", "1,0"], "--world-sizes"),
    ("verify_cost.py", ["--dir", MISSING], "--dir"),
    ("hf_load.py", ["--size-gib", "inf"], "--size-gib"),
    ("hf_load.py", ["--shard-mib", "0"], "--shard-mib"),
    ("hf_load.py", ["--world-size", "0"], "--world-size"),
    ("hf_load.py", ["--dir", MISSING], "--dir"),
    ("read_share.py", ["--hidden", "-4"], "--hidden"),
    ("read_share.py", ["--dir", MISSING], "--dir"),
    ("zero_memory.py", ["--world-size", "0"], "--world-size"),
    ("zero_memory.py", ["--dir", MISSING], "--dir"),
    ("save_throughput.py", ["--quick", "--size-gib", "nan"], "--size-gib"),
    ("save_throughput.py", ["--size-gib", "-1"], "--size-gib"),
    ("save_throughput.py", ["--small-mib", "1,x"], "--small-mib"),
    ("save_throughput.py", ["--world-sizes", "a"], "--world-sizes"),
    ("save_throughput.py", ["--world-sizes", ""], "--world-sizes"),
    ("save_throughput.py", ["--world-sizes", "1,1"], "--world-sizes"),
    ("save_throughput.py", ["--only", "sav"], "--only"),
    ("save_throughput.py", ["--s3-size-gib", "0"], "--s3-size-gib"),
    ("save_throughput.py", ["--dir", MISSING], "--dir"),
    ("recovery.py", ["--gib", "nan"], "--gib"),
    ("recovery.py", ["--dir", MISSING], "--dir"),
    ("convert_memory.py", ["--quick", "--dir", MISSING], "--dir"),
    ("convert_memory.py", ["--gib", "0"], "--gib"),
    ("plan_scaling.py", ["--quick", "--planners", "dpc"], "--planners"),
    ("plan_scaling.py", ["--quick", "--saves", "firts"], "--saves"),
    ("plan_scaling.py", ["--quick", "--layouts", "shardd"], "--layouts"),
    ("plan_scaling.py", ["--quick", "--layouts", "hsdp", "--planners", "dcp"], "--layouts"),
    ("plan_scaling.py", ["--world-sizes", "8,-2"], "--world-sizes"),
    ("plan_scaling.py", ["--tensors", "0"], "--tensors"),
    ("gpu.py", ["--size-gb", "nan"], "--size-gb"),
    ("gpu.py", ["--threads", "0"], "--threads"),
    ("gpu.py", ["--nproc", "0"], "--nproc"),
    ("gpu.py", ["--train-steps", "0"], "--train-steps"),
    ("gpu.py", ["--unprepared-repeats", "-1"], "--unprepared-repeats"),
    ("gpu.py", ["--dir", MISSING], "--dir"),
]  # fmt: skip


@pytest.mark.parametrize("script,args,flag", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_a_bad_value_is_a_usage_error(script: str, args: list[str], flag: str, tmp_path: Path) -> None:
    # --json into tmp_path: should a check be missing, the run's results land there, not in results/.
    proc = _bench(script, *args, "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The error line names the flag (not merely the usage line, which lists every flag).
    assert re.search(rf"error: (argument )?{flag}\b", proc.stderr) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out.json").exists()


def test_the_shared_value_types() -> None:
    c = _common()
    assert c.positive_int("3") == 3 and c.nonnegative_int("0") == 0 and c.positive_float("0.5") == 0.5
    assert c.positive_ints("8, 32") == [8, 32] and c.positive_ints_or_none("") == []
    assert c.choice_list(("a", "b"))("b,a") == ["b", "a"] and c.choice_list(("a",), allow_empty=True)("") == []
    for fn, text in [(c.positive_int, "0"), (c.positive_int, "1.5"), (c.nonnegative_int, "-1"), (c.positive_float, "nan"),
                     (c.positive_float, "-inf"), (c.positive_float, "inf"), (c.positive_float, "0"), (c.positive_ints, ""),
                     (c.positive_ints, "1,,2"), (c.positive_ints_or_none, "0"), (c.choice_list(("a", "b")), "a,a"),
                     (c.choice_list(("a", "b")), ""), (c.existing_dir, MISSING)]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_quick_fills_only_what_was_not_given(tmp_path: Path) -> None:
    c = _common()
    args = argparse.Namespace(quick=True, repeats=5, size_gib=None, json=None, png=None)
    c.resolve_quick(args, full={"repeats": 3, "size_gib": 1.0}, quick={"repeats": 1, "size_gib": 0.01})
    assert (args.repeats, args.size_gib) == (5, 0.01)
    args = argparse.Namespace(quick=False, repeats=None, size_gib=2.0)
    c.resolve_quick(args, full={"repeats": 3, "size_gib": 1.0}, quick={"repeats": 1, "size_gib": 0.01})
    assert (args.repeats, args.size_gib) == (3, 2.0)
    # End to end: `verify_cost.py --quick --repeats 2` ran one repetition.
    out = tmp_path / "vc.json"
    proc = _bench("verify_cost.py", "--quick", "--repeats", "2", "--world-sizes", "1", "--dir", str(tmp_path), "--json", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(out.read_text())["config"]["repeats"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vc.json", "vc.md"]  # its run folder removed


def _digests() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.iterdir()) if p.is_file()}


@pytest.mark.timeout(240)
def test_quick_without_json_leaves_the_committed_results(tmp_path: Path) -> None:
    # A smoke run with no --json writes to a new temporary folder it names (the plot beside its
    # JSON), not over benchmarks/results/<name>.json/.md/.png, which the READMEs quote.
    before = _digests()
    proc = _bench("plan_scaling.py", "--quick", "--world-sizes", "8", "--layouts", "replicated", "--planners", "distckpt", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"results go to (\S+plan_scaling\.json)", proc.stdout)
    assert m, proc.stdout[-2000:]
    out = Path(m.group(1))
    try:
        assert out.parent != RESULTS and out.is_file() and out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    assert _digests() == before


def test_the_plot_follows_the_json(tmp_path: Path) -> None:
    # --json elsewhere, no --png: the plot goes beside the JSON, not over results/plan_scaling.png.
    before = _digests()
    out = tmp_path / "ps.json"
    proc = _bench("plan_scaling.py", "--quick", "--world-sizes", "8", "--layouts", "replicated", "--planners", "distckpt", "--json", str(out), timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "ps.png").stat().st_size > 0 and _digests() == before
    c = _common()
    args = argparse.Namespace(quick=False, json=str(tmp_path / "st.json"), png=None)
    c.resolve_outputs(args, "save_throughput", png=True)
    assert args.png == str(tmp_path / "st.png")
    args = argparse.Namespace(quick=False, json=None, png=None)
    c.resolve_outputs(args, "save_throughput", png=True)
    assert (args.json, args.png) == (str(RESULTS / "save_throughput.json"), str(RESULTS / "save_throughput.png"))


@pytest.mark.timeout(240)
def test_gpu_quick_and_json(tmp_path: Path) -> None:
    # gpu.py takes --quick and --json like every script (--out still works: the smoke test's).
    out = tmp_path / "g.json"
    proc = _bench("gpu.py", "--quick", "--device", "cpu", "--parts", "sync", "--json", str(out), "--dir", str(tmp_path), timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["threads"] == 2 and res["state_bytes"] < 0.05e9 and all(len(v) == 1 for v in res["samples"][0].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json", "g.md"]  # its run folder removed


@pytest.mark.timeout(240)
def test_save_throughput_removes_each_repetitions_steps(tmp_path: Path) -> None:
    # The per-repetition cleanup removes the torchcrc checkpointer's steps too (their folders are
    # distckpt's step_{step:09d}): what is left right before the run folder goes holds no step.
    code = f"""
import shutil, sys
from pathlib import Path
sys.path.insert(0, {str(BENCH)!r})
import save_throughput as st
def show(scratch, own):
    print("LEFT", sorted(str(p.relative_to(scratch)) for p in Path(scratch).rglob("step_0*") if p.is_dir()))
    shutil.rmtree(scratch, ignore_errors=True)
st.remove_scratch = show
st.main(["--size-gib", "0.005", "--repeats", "2", "--world-sizes", "1", "--no-s3", "--no-train", "--small-mib", "",
         "--only", "save", "--dir", {str(tmp_path)!r}, "--json", {str(tmp_path / "st.json")!r}])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LEFT []" in proc.stdout, proc.stdout[-2000:]
    assert (tmp_path / "st.png").is_file()  # (the plot beside its JSON)


def test_a_json_path_its_table_or_plot_would_overwrite_is_refused(tmp_path: Path) -> None:
    # --json res.md: the table overwrote the results; res.png: the plot did; a folder: a
    # traceback once the whole run was spent. Refused before the run, exit 2.
    c = _common()
    for text, png in ((str(tmp_path / "r.md"), False), (str(tmp_path / "r.png"), True), (str(tmp_path), False), (str(tmp_path / "new") + "/", False)):
        with pytest.raises(SystemExit) as exc:
            c.resolve_outputs(argparse.Namespace(quick=False, json=text, png=None), "x", png=png)
        assert exc.value.code == 2, text
    args = argparse.Namespace(quick=False, json=str(tmp_path / "r.png"), png=None)
    c.resolve_outputs(args, "x")  # (no plot: a .png name is the user's choice)
    proc = _bench("verify_cost.py", "--quick", "--json", str(tmp_path))
    assert proc.returncode == 2 and "error: --json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_gpu_targets_read_as_they_are_written() -> None:
    # The "<=" targets recorded the inverse ratio (steady/first, d2h/steady): 0.015 for a steady
    # save 66x the floor, under "<= 1.2x".
    sys.path.insert(0, str(BENCH))
    try:
        import gpu
    finally:
        sys.path.remove(str(BENCH))
    rows = {"distckpt_async_blocked_first_s": 0.2, "distckpt_async_blocked_steady_s": 0.1, "d2h_floor_s": 0.05,
            "distckpt_sync_s": 2.0, "dcp_sync_s": 4.0}  # fmt: skip
    got = gpu.targets(rows)
    assert got["first async save <= 1.5x a steady one"] == {"ratio": 2.0, "met": False}
    assert got["steady blocked <= 1.2x the D2H floor"] == {"ratio": 2.0, "met": False}
    assert got[">= 1.5x faster than plain DCP"] == {"ratio": 2.0, "met": True}


def _sigterm_leaves_only_mine(tmp_path: Path, argv: list[str], started: Callable[[Path], bool], what: str) -> None:
    """Run a benchmark with ``--dir`` holding a file of the user's, SIGTERM it once ``started``
    (its work under way: by observed progress), and check only the user's file is left."""
    import signal
    import time

    work = tmp_path / "dir"
    work.mkdir()
    (work / "mine.txt").write_text("the user's")
    proc = subprocess.Popen(
        [sys.executable, *argv, "--dir", str(work), "--json", str(tmp_path / "o.json")],
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while not started(work):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else what
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and sorted(p.name for p in work.iterdir()) == ["mine.txt"]


@pytest.mark.timeout(200)
def test_sigterm_removes_the_run_folder(tmp_path: Path) -> None:
    # timeout, kill or a scheduler's cancel (SIGTERM) skipped the cleanup: the run folder stayed
    # in --dir (8.5 GB of a default save_throughput run), and the script waited for its ranks,
    # which saved on. Stopped once its ranks are saving.
    argv = [str(BENCH / "save_throughput.py"), "--size-gib", "0.25", "--world-sizes", "1", "--repeats", "50",
            "--no-s3", "--no-train", "--small-mib", ""]  # fmt: skip
    _sigterm_leaves_only_mine(tmp_path, argv, lambda work: any((p / "ws1").exists() for p in work.iterdir()), "no run folder")


@pytest.mark.timeout(200)
def test_sigterm_removes_convert_memorys_checkpoint(tmp_path: Path) -> None:
    # convert_memory.py kept SIGTERM's default action: its finally never ran, and a killed run
    # left its whole checkpoint (2 GiB by default) in --dir. Stopped once the checkpoint is being
    # written or converted.
    _sigterm_leaves_only_mine(
        tmp_path, [str(BENCH / "convert_memory.py"), "--gib", "0.25"],
        lambda work: any((p / "ckpt").exists() for p in work.iterdir() if p.is_dir()), "no checkpoint",
    )  # fmt: skip


@pytest.mark.parametrize("mark", ["manifest.json", ".metadata"])
def test_a_dir_inside_a_checkpoint_step_is_refused(tmp_path: Path, mark: str) -> None:
    # The raw-I/O rows wrote their files into the committed step before distckpt's save refused.
    existing_dir = _common().existing_dir
    step = tmp_path / "root" / "step_000000003"
    (step / "sub").mkdir(parents=True)
    (step / mark).write_text("{}")
    for inside in (step, step / "sub"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"inside the checkpoint step .*{mark}"):
            existing_dir(str(inside))
    assert existing_dir(str(tmp_path / "root")) == str(tmp_path / "root")
    # A manifest.json elsewhere is someone's web app, not a step (found by a reviewer).
    (tmp_path / "app" / "out").mkdir(parents=True)
    (tmp_path / "app" / "manifest.json").write_text('{"name": "my web app"}')
    assert existing_dir(str(tmp_path / "app" / "out")) == str(tmp_path / "app" / "out")
    proc = _bench("save_throughput.py", "--quick", "--dir", str(step / "sub"))
    assert proc.returncode == 2 and "--dir" in proc.stderr and "inside the checkpoint step" in proc.stderr
    assert sorted(p.name for p in (step / "sub").iterdir()) == []


def test_results_are_replaced_whole(tmp_path: Path) -> None:
    # publish() truncated and rewrote the committed results in place: a kill or a full disk
    # mid-write left a truncated .json. A link to the old file keeps the old bytes only if the
    # new file is renamed into place.
    publish = _common().publish
    out = tmp_path / "r.json"
    publish({"v": 1}, "| old |", str(out))
    os.link(out, tmp_path / "old.json")
    os.link(out.with_suffix(".md"), tmp_path / "old.md")
    publish({"v": 2}, "| new |", str(out))
    assert json.loads(out.read_text()) == {"v": 2} and out.with_suffix(".md").read_text() == "| new |\n"
    assert json.loads((tmp_path / "old.json").read_text()) == {"v": 1} and (tmp_path / "old.md").read_text() == "| old |\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json", "old.md", "r.json", "r.md"]
    umask = os.umask(0)
    os.umask(umask)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~umask)
