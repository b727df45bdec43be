"""Asynchronous saves: staging semantics, own process group, retention, errors on every rank, memory."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import distckpt
from dist_harness import run_ranks
from distckpt.integrity.manifest import MANIFEST_NAME, step_dir
from models import assert_same, full_model_state, full_optim_state, make_model, make_optimizer, train_steps, wrap

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


class _DiskFull:
    """Inject ENOSPC at the file layer of this rank's checkpoint writes (the real error type)."""

    def __enter__(self):
        from distckpt.save import writer as _writer

        self._orig = _writer._ChecksumStream.write

        def write(stream, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        _writer._ChecksumStream.write = write
        return self

    def __exit__(self, *exc):
        from distckpt.save import writer as _writer

        _writer._ChecksumStream.write = self._orig


class _FileSizeLimit:
    """A real write fault in this rank's running writer process (async_mode="process"): a
    file-size limit (RLIMIT_FSIZE), so its writes fail with EFBIG. After a failed save every rank
    starts a new writer, which has no limit."""

    LIMIT = 4096

    def __enter__(self):
        import resource

        import psutil

        writers = [p for p in psutil.Process().children() if "distckpt.save.background" in " ".join(p.cmdline())]
        assert len(writers) == 1, writers
        hard = resource.prlimit(writers[0].pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(writers[0].pid, resource.RLIMIT_FSIZE, (self.LIMIT, hard))
        return self

    def __exit__(self, *exc):
        return None


class _CommitGate:
    """Hold the commit of this rank's async saves (``_saving.commit``, which the coordinator runs
    in the training process in every async mode) until :attr:`opened` is set, so that what a
    caller sees while a save is in flight is observed, not raced."""

    def __enter__(self):
        import threading

        from distckpt.save import phases as _saving

        self.opened, self.reached = threading.Event(), threading.Event()
        self._orig = orig = _saving.commit

        def commit(*args, **kwargs):
            self.reached.set()
            if not self.opened.wait(120):
                raise TimeoutError("the test never opened the commit gate")
            return orig(*args, **kwargs)

        _saving.commit = commit
        return self

    def __exit__(self, *exc):
        from distckpt.save import phases as _saving

        self.opened.set()
        _saving.commit = self._orig


def _async_body(rank: int, world: int, root: str, mode: str) -> dict:
    model = wrap(make_model(0), "ddp", world)
    optim = make_optimizer(model, "ddp")
    ckpt = distckpt.Checkpointer(root, keep_last=1, async_mode=mode)
    fault = _DiskFull if mode == "thread" else _FileSizeLimit
    state = {"model": model, "optim": optim}
    train_steps(model, optim, range(2), rank, world)
    ckpt.save(1, state)
    train_steps(model, optim, range(2, 3), rank, world)
    expected = full_model_state(model)

    with _CommitGate() as gate:
        ckpt.save(2, state, blocking=False)
        # save() returned while its commit cannot have happened: the save is still in flight.
        in_flight_at_return = ckpt.in_flight
        # Training goes on at once: parameters change in place, and collectives run on the default
        # group while the background save runs its own (sharing one group deadlocks in torch 2.13).
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        visible = []
        t = torch.ones(4)
        for _ in range(20):
            dist.all_reduce(t)
            visible.append(ckpt.steps())  # step 1 stays until step 2 is committed
        # One more collective: the coordinator must not let step 2 commit while another rank is
        # still listing the steps of its last round (the loop's all_reduce alone let rank 1 list
        # after rank 0 had left the loop and opened its gate: it saw [1, 2], once in a full run).
        dist.all_reduce(t)
        gate.opened.set()  # every rank has passed the loop above: let step 2 commit
        while ckpt.in_flight:
            time.sleep(0.01)
        stats = ckpt.wait()
    assert not ckpt.in_flight
    # Replicated (DDP) state: each rank staged only the share it writes, not all of it.
    replicated = sum(v.numel() * v.element_size() for v in expected.values())
    assert stats is not None and stats.step == 2 and stats.blocking_s > 0
    # model + AdamW's two moments (+ small step tensors); every rank stages its own RNG states
    rng_bytes = sum(t.numel() * t.element_size() for t in distckpt.state.rng.capture().values() if isinstance(t, torch.Tensor))
    staged_share = (stats.staged_bytes - rng_bytes) / (replicated * 3)
    assert ckpt.steps() == [2], ckpt.steps()

    fresh = wrap(make_model(5), "ddp", world)
    ckpt.load({"model": fresh, "optim": make_optimizer(fresh, "ddp")})
    loaded = full_model_state(fresh)

    # A full disk on one rank: every rank gets the error from wait(); nothing is committed.
    with fault() if rank == 1 else _Nothing():
        ckpt.save(3, state, blocking=False)
        try:
            ckpt.wait()
            err3 = None
        except distckpt.CheckpointError as exc:
            err3 = str(exc)
    committed_after_failure = ckpt.steps()
    manifest3 = os.path.exists(os.path.join(root, step_dir(3), MANIFEST_NAME))

    ckpt.save(4, state, blocking=False)  # the fault is gone: saving works again
    ckpt.wait()
    # A background error not waited for surfaces at the next save (which then saves nothing).
    with fault() if rank == 0 else _Nothing():
        ckpt.save(5, state, blocking=False)
        try:
            ckpt.save(6, state, blocking=False)
            err4 = None
        except distckpt.CheckpointError as exc:
            err4 = str(exc)
    ckpt.save(7, state, blocking=False)
    ckpt.close()
    return {
        "in_flight_at_return": in_flight_at_return,
        "visible": visible,
        "gate_reached": gate.reached.is_set(),
        "staged_share": staged_share,
        "expected": expected,
        "loaded": loaded,
        "err3": err3,
        "err4": err4,
        "committed_after_failure": committed_after_failure,
        "manifest3": manifest3,
        "final_steps": ckpt.steps(),
        "local_ranks": ckpt._groups.local_ranks,
    }


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_async_save_semantics_and_errors(tmp_path, mode):
    root = str(tmp_path / "ck")
    results = run_ranks(_async_body, 2, tmp_path, root, mode)
    cause = "No space left on device" if mode == "thread" else "File too large"
    for r, res in enumerate(results):
        assert res["in_flight_at_return"], f"rank {r}: save(blocking=False) returned after its commit"
        assert res["visible"] == [[1]] * 20, res["visible"]  # nothing half-committed is listed
        assert_same(res["expected"], res["loaded"], f"rank {r}: checkpoint holds the values as of save()")
        assert 0.2 < res["staged_share"] < 0.8, res["staged_share"]
        assert res["err3"] is not None and cause in res["err3"] and "rank 1" in res["err3"], res["err3"]
        assert res["committed_after_failure"] == [2] and not res["manifest3"]
        assert res["err4"] is not None and "rank 0" in res["err4"] and cause in res["err4"], res["err4"]
        assert res["final_steps"] == [7]
        assert res["local_ranks"] == 2, "both ranks run on this host"
    assert results[0]["err3"] == results[1]["err3"], "the same error on every rank"
    assert results[0]["gate_reached"], "the coordinator's commit was not held by the gate"


def _memory_body(rank: int, world: int, root: str, saves: int) -> list[int]:
    import psutil

    tensors = {f"w{i}": torch.randn(256, 1024) for i in range(20)}  # 20 MiB
    ckpt = distckpt.Checkpointer(root, keep_last=2, sync_files=False)
    proc = psutil.Process()
    rss = []
    for step in range(saves):
        for t in tensors.values():
            t.add_(1.0)
        ckpt.save(step, {"weights": tensors}, blocking=False)
        ckpt.wait()
        rss.append(proc.memory_info().rss)
    ckpt.close()
    return rss


def test_fifty_async_saves_keep_memory_flat(tmp_path):
    rss = run_ranks(_memory_body, 1, tmp_path, str(tmp_path / "ck"), 50)[0]
    # After warm-up (buffers allocated once), resident memory must not grow save after save.
    base = rss[9]
    assert max(rss[10:]) <= base * 1.05, [r // 2**20 for r in rss]



def _layout_change_body(rank: int, world: int, root: str, mode: str) -> list:
    import gc
    import weakref

    weights = torch.randn(4 * 2**20 // 4)
    ckpt = distckpt.Checkpointer(root, keep_last=1, sync_files=False, async_mode=mode)
    seen, refs = [], []
    gc.disable()  # what a writer process that makes few objects amounts to: cycles live on
    try:
        for step in range(5):
            # A fixed model and a metrics history growing by one value per save: a new layout,
            # so new staging buffers, at every save.
            ckpt.save(step, {"w": weights, "history": torch.arange(step + 1.0)}, blocking=False)
            ckpt.wait()
            if mode == "process":
                writer = ckpt._saver.writer.proc.pid
                with open(f"/proc/{writer}/maps") as f:
                    seen.append(sum("memfd:distckpt-stage" in line for line in f))
            else:  # the training process's own buffers: how many staged histories live
                refs.append(weakref.ref(ckpt._saver.stager._buffers["history"]))
                seen.append(sum(ref() is not None for ref in refs))
    finally:
        gc.enable()
    ckpt.close()
    return seen


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_staging_buffers_of_an_old_layout_are_freed_without_the_garbage_collector(tmp_path, mode):
    """Every save left its planner in a reference cycle holding the save's state dict: an
    async save's staged copy. With the state's layout changing at each save, the writer process
    kept one staging arena mapped per layout (seen: 5 for 5 saves, shared memory growing by the
    whole state each time) until its rarely-running collector freed them."""
    seen = run_ranks(_layout_change_body, 1, tmp_path, str(tmp_path / "ck"), mode)[0]
    where = "staging arenas mapped by the writer" if mode == "process" else "staged copies alive"
    assert seen == [1] * 5, f"{where} after each save: {seen}"


def test_in_flight_save_is_finished_at_interpreter_exit(tmp_path):
    root = tmp_path / "ck"
    script = textwrap.dedent(
        f"""
        import torch, distckpt
        ckpt = distckpt.Checkpointer({str(root)!r})
        ckpt.save(7, {{"w": {{"a": torch.randn(512, 512)}}}}, blocking=False)
        # no wait(), no close(): the atexit hook must commit it
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert distckpt.Checkpointer(root).steps() == [7]


def _explicit_group_body(rank: int, world: int, root: str) -> bool:
    group = dist.new_group(backend="gloo")
    model = wrap(make_model(0), "ddp", world)
    ckpt = distckpt.Checkpointer(root, process_group=group)
    ckpt.save(1, {"model": model}, blocking=False)
    ckpt.wait()
    fresh = wrap(make_model(4), "ddp", world)
    ckpt.load({"model": fresh})
    return all(torch.equal(a, b) for a, b in zip(full_model_state(model).values(), full_model_state(fresh).values()))


def test_checkpointer_on_a_given_process_group(tmp_path):
    assert all(run_ranks(_explicit_group_body, 2, tmp_path, str(tmp_path / "ck")))


def _zero_async_body(rank: int, world: int, root: str) -> dict:
    model = wrap(make_model(0), "zero", world)
    optim = make_optimizer(model, "zero")
    train_steps(model, optim, range(2), rank, world)
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(2, {"model": model, "optim": optim}, blocking=False)
    ref = (full_model_state(model), full_optim_state(model, optim))
    ckpt.wait()
    fresh = wrap(make_model(7), "zero", world)
    fresh_optim = make_optimizer(fresh, "zero")
    ckpt.load({"model": fresh, "optim": fresh_optim})
    return {"ref": ref, "got": (full_model_state(fresh), full_optim_state(fresh, fresh_optim))}


def test_async_save_of_replicated_model_with_partitioned_zero_state(tmp_path):
    """Model replicated (staged as shares), ZeRO optimizer partitioned (staged per rank): exact."""
    for r, res in enumerate(run_ranks(_zero_async_body, 2, tmp_path, str(tmp_path / "ck"))):
        assert_same(res["ref"][0], res["got"][0], f"rank {r} model")
        assert_same(res["ref"][1], res["got"][1], f"rank {r} optimizer")


def test_an_async_save_after_a_failed_one_writes_the_new_state(tmp_path):
    """A failed async save restarts the writer process at the next async save. The new writer
    must map the state staged for *that* save (regression: when arenas were named files, the name
    was unlinked once the old writer mapped it, and mapping the name again created an empty
    file, so the next save committed zeros that passed every check). The failure here: another
    writer's live lease on the step, found by the save's background claim."""
    import json
    import socket

    from distckpt.storage.ownership import OWNER_NAME

    ckpt = distckpt.Checkpointer(tmp_path)  # async_mode="process"
    state = {"w": torch.arange(4096, dtype=torch.float32), "v": torch.ones(8, dtype=torch.int64)}
    ckpt.save(1, state, blocking=False)
    ckpt.wait()
    (tmp_path / step_dir(2)).mkdir()
    record = {"writer": "other", "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "released": False}
    (tmp_path / step_dir(2) / OWNER_NAME).write_text(json.dumps(record))
    state["w"].add_(1)
    ckpt.save(2, state, blocking=False)
    with pytest.raises(distckpt.StepExistsError, match="another writer"):
        ckpt.wait()
    state["w"].add_(1)
    ckpt.save(3, state, blocking=False)
    ckpt.wait()
    got = {"w": torch.zeros(4096), "v": torch.zeros(8, dtype=torch.int64)}
    ckpt.load(got, step=3)
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32) + 2) and torch.equal(got["v"], state["v"])
    ckpt.close()


def test_a_writer_refuses_a_staging_arena_shorter_than_staged():
    """A writer maps only a memory file that holds every staged byte: ``torch.from_file`` would
    extend a shorter one with zeros, which the writer would write as if staged and every check
    would pass. A closed arena is not handed out."""
    from distckpt.save.shared_arena import SharedArena, attach, descriptor

    arena = SharedArena(4096)
    assert attach(descriptor(arena.name), 4096).numel() == 4096
    with pytest.raises(FileNotFoundError, match="holds 4096 bytes, not the 8192"):
        attach(arena.fd, 8192)
    assert os.fstat(arena.fd).st_size == 4096, "nothing extended"
    arena.close()
    with pytest.raises(FileNotFoundError, match="is closed"):
        descriptor(arena.name)


def test_background_writes_use_at_most_the_cores_per_rank_on_this_host(monkeypatch):
    """An async save's writer threads: thread_count, capped by cores / ranks on this host (the
    writers compete with training for memory bandwidth, which niceness does not share out)."""
    from distckpt._process import background_threads

    for cores, local, expected in ((2, 2, 1), (2, 1, 2), (16, 2, 4), (96, 8, 4), (1, 4, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert background_threads(4, local) == expected, (cores, local)


def _main_thread_in(qualname: str, depth: int = 1) -> bool:
    """Whether the main thread is inside the function of that qualified name now (``depth``
    calls of it deep: a signal handler's call inside the interrupted one)."""
    import sys
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    found = 0
    while frame is not None:
        found += frame.f_code.co_qualname == qualname
        frame = frame.f_back
    return found >= depth


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_close_ended_by_ctrl_c_keeps_the_save_in_flight_and_a_second_close_finishes_it(tmp_path, monkeypatch, mode):
    """Ctrl-C while close() waited for an async save: close went on releasing everything under
    the running save (process mode: the writer stopped, the step never committed, the second
    close a no-op). Found by a helper (2026-12-06)."""
    import signal
    import threading

    from distckpt.save import writer as _writer

    release = threading.Event()
    if mode == "thread":  # a disk that stalls until the interrupt came (writer processes: a bigger state)
        orig = _writer._ChecksumStream.write

        def write(stream, b):
            release.wait(120)
            return orig(stream, b)

        monkeypatch.setattr(_writer._ChecksumStream, "write", write)

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    ck = distckpt.Checkpointer(tmp_path / "ck", async_mode=mode)
    n = 1 << 16 if mode == "thread" else 1 << 24
    w = torch.full((n,), 7.0)
    interrupted = False
    try:
        ck.save(1, {"w": w}, blocking=False)

        def watch():
            deadline = time.monotonic() + 120
            while not _main_thread_in("SaveDriver.wait") and time.monotonic() < deadline and ck.in_flight:
                time.sleep(0.001)
            if ck.in_flight:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            ck.close()
        except KeyboardInterrupt:
            interrupted = True
            assert not ck._closed and ck.in_flight  # nothing released: the save still runs
        t.join()
        release.set()
        ck.close()  # finishes it
        assert ck._closed and (interrupted or mode == "process")  # (writer processes may finish first)
        with distckpt.Checkpointer(tmp_path / "ck") as again:
            got = {"w": torch.zeros(n)}
            assert again.load(got) == 1 and bool((got["w"] == 7.0).all())
    finally:
        release.set()
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_forked_child_leaves_its_parents_checkpointer_alone(tmp_path, mode):
    """A child forked while an async save ran hung forever at its exit (waiting for a save thread
    that does not exist in it), and an idle one's exit closed the parent's writer process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).resolve().parent / "fork_job.py"
    done = subprocess.run([sys.executable, str(job), str(tmp_path / "ck"), mode], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"child": 0, "writer_alive": True, "steps": [1, 2, 4]}, (got, done.stderr[-2000:])


def test_a_wait_ended_by_ctrl_c_keeps_the_save_in_flight(tmp_path, monkeypatch):
    """A KeyboardInterrupt (Ctrl-C, or a preemption handler raising) ending ``wait()`` while an
    async save was writing made the checkpointer forget that save: ``wait`` dropped it before
    joining, and before Python 3.13 an interrupted ``Thread.join`` even marks the thread stopped.
    The next save then staged into the buffers the first was still writing: step 1 committed
    holding step 2's values, checksums and all (with writer processes, the two saves'
    collectives interleaved and hung). Found by a helper (2026-11-29)."""
    import signal
    import threading

    from distckpt.save import writer as _writer

    release = threading.Event()
    orig = _writer._ChecksumStream.write

    def write(stream, b):  # a disk that stalls until the test lets it go
        release.wait(120)
        return orig(stream, b)

    monkeypatch.setattr(_writer._ChecksumStream, "write", write)

    def interrupt(*_):
        raise KeyboardInterrupt

    def when_waiting(then, depth=1):  # acts once the main thread is seen inside the save's wait
        def watch():
            deadline = time.monotonic() + 120
            while not _main_thread_in("SaveDriver.wait", depth) and time.monotonic() < deadline:
                time.sleep(0.005)
            then()

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        return t

    previous = signal.signal(signal.SIGUSR1, interrupt)
    w = torch.zeros(1 << 20)
    ck = distckpt.Checkpointer(tmp_path / "ck", async_mode="thread")
    try:
        ck.save(1, {"w": w}, blocking=False)
        w.fill_(1.0)  # training goes on
        watcher = when_waiting(lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1))
        with pytest.raises(KeyboardInterrupt):
            ck.wait()
        watcher.join()
        assert ck.in_flight, "the interrupted wait forgot the save still writing"
        watcher = when_waiting(release.set)
        ck.save(2, {"w": w}, blocking=False)  # waits for step 1 first
        release.set()
        ck.wait()
        watcher.join()
        got = {"w": torch.empty(1 << 20)}
        ck.load(got, step=1)
        assert torch.count_nonzero(got["w"]) == 0, "step 1 holds the values of step 2"
        ck.load(got, step=2)
        assert bool((got["w"] == 1.0).all())

        # A preemption handler that saves, run while the main thread waits for a save: its save
        # waits for that one, and the main thread's wait then leaves the handler's in flight.
        release.clear()

        def handler(*_):
            ck.save(4, {"w": w}, blocking=False)

        signal.signal(signal.SIGUSR1, handler)
        w.fill_(3.0)
        ck.save(3, {"w": w}, blocking=False)
        w.fill_(4.0)
        watchers = [
            when_waiting(lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)),
            when_waiting(release.set, depth=2),
        ]
        stats = ck.wait()
        assert stats is not None and stats.step == 3
        for t in watchers:
            t.join()
        assert ck.wait().step == 4
        for step, value in ((3, 3.0), (4, 4.0)):
            ck.load(got, step=step)
            assert bool((got["w"] == value).all()), step
    finally:
        release.set()
        ck.close()
        signal.signal(signal.SIGUSR1, previous)
