"""Checkpoints on object storage, against a real S3-compatible server (moto, HTTP on 127.0.0.1).

Nothing of s3fs is mocked: ranks are real processes talking HTTP through s3fs/botocore to the
server the fixtures run in the pytest process. Also: ``memory://`` and ``file://`` roots, and
tiered saving (local first, replicated to S3 in the background).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from models import assert_same, full_model_state, full_optim_state, make_model, make_optimizer, train_steps, wrap
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"), pytest.mark.timeout(180)]

KIND = "fsdp"  # real shards: each rank writes its own files, and 2 -> 3 reshards them


def _fresh(world: int):
    model = wrap(make_model(seed=123), KIND, world)
    return model, make_optimizer(model, KIND)


# -------------------------------------------------------------------------------------------
# 2 ranks save (sync and async) to S3, 3 ranks load


def _save_body(rank: int, world: int, root: str, opts: dict) -> dict:
    model = wrap(make_model(seed=0), KIND, world)
    optim = make_optimizer(model, KIND)
    ckpt = distckpt.Checkpointer(root, storage_options=opts)
    train_steps(model, optim, range(2), rank, world)
    ckpt.save(1, {"model": model, "optim": optim, "epoch": 1})
    ref1 = (full_model_state(model), full_optim_state(model, optim))
    train_steps(model, optim, range(2, 3), rank, world)
    ref2 = (full_model_state(model), full_optim_state(model, optim))
    ckpt.save(2, {"model": model, "optim": optim, "epoch": 2}, blocking=False)
    # Training goes on while the upload runs: the checkpoint must hold the values at save().
    train_steps(model, optim, range(3, 4), rank, world)
    stats = ckpt.wait()
    ckpt.close()
    return {"ref": {1: ref1, 2: ref2}, "steps": ckpt.steps(), "async_total_s": stats.total_s}


def _load_body(rank: int, world: int, root: str, opts: dict) -> dict:
    ckpt = distckpt.Checkpointer(root, storage_options=opts)
    out = {}
    for step in (1, 2):
        model, optim = _fresh(world)
        state = {"model": model, "optim": optim, "epoch": 0}
        assert ckpt.load(state, step=step) == step
        out[step] = (full_model_state(model), full_optim_state(model, optim), state["epoch"])
    ckpt.close()
    return out


def test_save_sync_and_async_at_2_ranks_to_s3_load_at_3(tmp_path, s3_server, s3_bucket):
    root = f"s3://{s3_bucket}/run"
    saved = run_ranks(_save_body, 2, tmp_path, root, s3_server.storage_options)
    assert saved[0]["steps"] == [1, 2]
    loaded = run_ranks(_load_body, 3, tmp_path, root, s3_server.storage_options)
    for step in (1, 2):
        ref_model, ref_optim = saved[0]["ref"][step]
        for rank, got in enumerate(loaded):
            model, optim, epoch = got[step]
            assert_same(ref_model, model, f"model step {step} rank {rank}")
            assert_same(ref_optim, optim, f"optim step {step} rank {rank}")
            assert epoch == step
    # The objects are really on the server: one data file per rank, metadata, manifest last.
    storage = distckpt.Storage(root, s3_server.storage_options)
    files = storage.list_files("step_000000002")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json"} <= set(files)
    assert not [f for f in files if f.endswith(".tmp")]
    manifest = distckpt.read_manifest(storage, 2)
    assert {n: r.size for n, r in manifest.files.items()} == {n: s for n, s in files.items() if n != "manifest.json"}


# -------------------------------------------------------------------------------------------
# the server stops in the middle of an async save


def _big_state(rank: int, fill: float) -> dict:
    # ~48 MB in 6 replicated tensors: DCP spreads them over the ranks (~24 MB each).
    return {f"t{i}": torch.full((2 << 20,), fill + i) for i in range(6)}


def _interrupted_body(rank: int, world: int, root: str, opts: dict, flags: str) -> dict:
    flag_dir = Path(flags)
    ckpt = distckpt.Checkpointer(root, storage_options=opts, thread_count=1)
    ckpt.save(1, _big_state(rank, 1.0))
    ckpt.save(2, _big_state(rank, 2.0), blocking=False)
    (flag_dir / f"writing{rank}").touch()  # the parent stops the server now
    deadline = time.monotonic() + 60
    while not (flag_dir / "stopped").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("parent never stopped the server")
        time.sleep(0.01)
    t0 = time.monotonic()
    try:
        ckpt.wait()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = (type(exc).__name__, isinstance(exc, (distckpt.CheckpointError, OSError)), str(exc))
    else:
        error = None
    wait_s = time.monotonic() - t0
    # close() must not hang or raise again: the failed save is gone.
    ckpt.close()
    return {"error": error, "wait_s": wait_s}


def _after_restart_body(rank: int, world: int, root: str, opts: dict) -> dict:
    ckpt = distckpt.Checkpointer(root, storage_options=opts)
    steps = ckpt.steps()
    step2_manifest = ckpt.storage.exists("step_000000002", "manifest.json")
    state = {f"t{i}": torch.zeros(2 << 20) for i in range(6)}
    loaded = ckpt.load(state)
    ok = all(torch.equal(state[f"t{i}"], torch.full((2 << 20,), 1.0 + i)) for i in range(6))
    ckpt.save(2, _big_state(rank, 2.0))  # the interrupted step can be saved again
    after = ckpt.steps()
    ckpt.close()
    return {"steps": steps, "step2_manifest": step2_manifest, "loaded": loaded, "ok": ok, "after": after}


def test_server_stopped_during_async_save(tmp_path):
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server().start()  # its own server: this test stops it
    try:
        bucket = server.make_bucket(f"t-{uuid.uuid4().hex[:16]}")
        root = f"s3://{bucket}/run"
        flags = tmp_path / "flags"
        flags.mkdir()
        box: dict = {}

        def ranks() -> None:
            try:
                box["result"] = run_ranks(_interrupted_body, 2, tmp_path, root, server.storage_options, str(flags), timeout=120)
            except BaseException as exc:  # noqa: BLE001
                box["error"] = exc

        thread = threading.Thread(target=ranks, daemon=True)
        thread.start()
        deadline = time.monotonic() + 100
        while not all((flags / f"writing{r}").exists() for r in range(2)):
            assert thread.is_alive() and time.monotonic() < deadline, box.get("error", "ranks never started the save")
            time.sleep(0.005)
        t_stop = time.monotonic()
        server.stop()
        stop_s = time.monotonic() - t_stop
        (flags / "stopped").touch()
        thread.join(150)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]
        results = box["result"]
        errors = [r["error"] for r in results]
        assert all(e is not None for e in errors), f"a rank's save succeeded although the server stopped (stop took {stop_s:.2f}s): {errors}"
        assert all(e[1] for e in errors), errors  # CheckpointError or an OSError
        assert len({e[2] for e in errors}) == 1, f"ranks got different errors: {errors}"
        message = errors[0][2]
        assert "step 2" in message and root in message and SECRET_KEY not in message, message
        assert max(r["wait_s"] for r in results) < 60

        server = S3Server(port=server.port).start()  # moto keeps the objects: same data again
        after = run_ranks(_after_restart_body, 2, tmp_path, root, server.storage_options)
        for r in after:
            assert r["steps"] == [1] and not r["step2_manifest"], r
            assert r["loaded"] == 1 and r["ok"], r
            assert r["after"] == [1, 2], r
    finally:
        server.stop()


# -------------------------------------------------------------------------------------------
# wrong bucket / wrong credentials


def _set_moto_auth(endpoint: str, on: bool) -> None:
    """moto checks credentials only when told to (then every request is authenticated, the
    fixture's dummy key too): switch it through moto's own HTTP API."""
    import urllib.request

    body = b"0" if on else b"inf"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=body, method="POST", headers={"Content-Type": "text/plain"}), timeout=10).read()


def _misconfigured_body(rank: int, world: int, endpoint: str, cases: dict) -> dict:
    out = {}
    for name, (root, opts) in cases.items():
        if name == "credentials":
            torch.distributed.barrier()
            if rank == 0:
                _set_moto_auth(endpoint, True)
            torch.distributed.barrier()
        for op in ("save", "load", "latest_step", "latest_step with a local tier", "steps", "steps all with a local tier"):
            tier = {"local_dir": f"{os.environ.get('DISTCKPT_TEST_TMP', '/tmp')}/tier-{uuid.uuid4().hex[:8]}"} if "tier" in op else {}
            ckpt = distckpt.Checkpointer(root, storage_options=opts, timeout=30, **tier)
            try:
                if op.startswith("steps"):  # listed as an empty root before (2026-12-07)
                    out[(name, op)] = ckpt.steps(tier="all" if "tier" in op else "root")
                    ckpt.close()
                    continue
                if op == "save":
                    ckpt.save(1, {"w": torch.ones(4), "epoch": 1})
                elif op.startswith("latest_step"):  # the quickstart's check: a typo is no fresh start
                    out[(name, op)] = ckpt.latest_step()
                    ckpt.close()
                    continue
                else:
                    ckpt.load({"w": torch.zeros(4), "epoch": 0})
                out[(name, op)] = None
            except Exception as exc:  # noqa: BLE001
                out[(name, op)] = (type(exc).__name__, str(exc))
            ckpt.close()
    return out


def test_wrong_bucket_or_credentials_fail_clearly_on_every_rank(tmp_path, s3_server, s3_bucket):
    bad_secret = "wrong-secret-ABC123"
    bad = dict(s3_server.storage_options, key="AKIAWRONGKEY000", secret=bad_secret)
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    cases = {
        "bucket": (f"s3://{missing}/run", s3_server.storage_options),
        "credentials": (f"s3://{s3_bucket}/run", bad),
    }
    t0 = time.monotonic()
    try:
        results = run_ranks(_misconfigured_body, 2, tmp_path, s3_server.endpoint, cases)
    finally:
        _set_moto_auth(s3_server.endpoint, False)
    elapsed = time.monotonic() - t0
    for key in results[0]:
        got = [r[key] for r in results]
        assert all(g is not None for g in got), f"{key}: no error: {got}"
        assert len(set(got)) == 1, f"{key}: ranks got different errors: {got}"
        kind, message = got[0]
        assert bad_secret not in message and SECRET_KEY not in message and "AKIAWRONGKEY000" not in message, message
        if key[0] == "bucket":
            assert kind == "FileNotFoundError" and f"bucket {missing!r} does not exist" in message, got[0]
        else:
            assert kind == "PermissionError" and s3_bucket in message and "credentials" in message, got[0]
    # The save did not create the misspelt bucket.
    storage = distckpt.Storage(f"s3://{missing}", s3_server.storage_options)
    assert not storage.fs.exists(missing)
    assert elapsed < 60


# -------------------------------------------------------------------------------------------
# other fsspec roots, single process


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_memory_and_file_urls(tmp_path, scheme):
    root = f"memory://distckpt-{uuid.uuid4().hex[:8]}/run" if scheme == "memory" else f"file://{tmp_path}/run"
    model = make_model(seed=1)
    optim = make_optimizer(model, "plain")
    train_steps(model, optim, range(2), 0, 1)
    with distckpt.Checkpointer(root, keep_last=1) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim, "epoch": 1})
        ckpt.save(2, {"model": model, "optim": optim, "epoch": 2}, blocking=False)
        ckpt.wait()
        assert ckpt.steps() == [2]
    fresh = make_model(seed=5)
    fresh_optim = make_optimizer(fresh, "plain")
    state = {"model": fresh, "optim": fresh_optim, "epoch": 0}
    with distckpt.Checkpointer(root) as ckpt:
        assert ckpt.load(state) == 2
    assert state["epoch"] == 2
    assert_same(model.state_dict(), fresh.state_dict(), "model")
    if scheme == "file":
        assert (tmp_path / "run" / "step_000000002" / "manifest.json").is_file()


# -------------------------------------------------------------------------------------------
# tiered: local first, replicated to S3; resume from S3 on a "new machine"


def _tiered_body(rank: int, world: int, local: str, remote: str, opts: dict) -> dict:
    model = wrap(make_model(seed=0), KIND, world)
    optim = make_optimizer(model, KIND)
    ckpt = distckpt.Checkpointer(local, keep_last=1, replicate_to=remote, replicate_storage_options=opts)
    train_steps(model, optim, range(1), rank, world)
    ckpt.save(1, {"model": model, "optim": optim, "epoch": 1})
    train_steps(model, optim, range(1, 2), rank, world)
    ckpt.save(2, {"model": model, "optim": optim, "epoch": 2}, blocking=False)
    ref = (full_model_state(model), full_optim_state(model, optim))
    ckpt.wait()
    ckpt.close()  # waits for the uploads (coordinator)
    replica = ckpt.replica
    info = {"local_steps": ckpt.steps(), "failed": list(replica.failed), "uploaded": list(replica.uploaded)}
    torch.distributed.barrier()

    # A new machine: no local copy at all.
    if rank == 0:
        shutil.rmtree(local)
    torch.distributed.barrier()
    model2, optim2 = _fresh(world)
    state = {"model": model2, "optim": optim2, "epoch": 0}
    ckpt2 = distckpt.Checkpointer(local, keep_last=1, replicate_to=remote, replicate_storage_options=opts)
    info["latest"] = ckpt2.latest_step()
    info["loaded"] = ckpt2.load(state)
    info["tier"] = ckpt2.last_load_report.tier
    info["epoch"] = state["epoch"]
    info["got"] = (full_model_state(model2), full_optim_state(model2, optim2))
    info["ref"] = ref
    ckpt2.close()
    return info


def test_tiered_local_then_s3_and_resume_from_s3(tmp_path, s3_server, s3_bucket):
    local = str(tmp_path / "local")
    remote = f"s3://{s3_bucket}/tiered"
    opts = s3_server.storage_options
    results = run_ranks(_tiered_body, 2, tmp_path, local, remote, opts)
    coordinator = results[0]
    assert coordinator["failed"] == [], coordinator["failed"]
    assert 2 in coordinator["uploaded"]
    for rank, r in enumerate(results):
        assert r["local_steps"] == [2]
        assert r["latest"] == 2 and r["loaded"] == 2 and r["epoch"] == 2 and r["tier"] == "replica"
        assert_same(r["ref"][0], r["got"][0], f"model rank {rank}")
        assert_same(r["ref"][1], r["got"][1], f"optim rank {rank}")

    storage = distckpt.Storage(remote, opts)
    committed = [d for d in storage.list_dirs() if storage.exists(d, "manifest.json")]
    assert committed == ["step_000000002"], storage.list_dirs()
    assert storage.list_dirs() == ["step_000000002"]  # retention removed step 1 entirely
    raw = storage.read_bytes("step_000000002", "manifest.json").decode()
    manifest = json.loads(raw)
    assert manifest["step"] == 2
    for secret in (SECRET_KEY, ACCESS_KEY, s3_server.endpoint):
        assert secret not in raw
    files = storage.list_files("step_000000002")
    assert {n: r["size"] for n, r in manifest["files"].items()} == {n: s for n, s in files.items() if n != "manifest.json"}
    assert not os.path.exists(local) or not os.listdir(local)


def test_tiered_upload_failure_warns_and_keeps_the_local_commit(tmp_path, s3_server):
    from dist_harness import free_port

    # Nothing listens on this port: every upload fails (fast, with the fixture's retry limits).
    opts = dict(s3_server.storage_options, client_kwargs={"endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-east-1"})
    ckpt = distckpt.Checkpointer(str(tmp_path / "local"), replicate_to="s3://nowhere/run", replicate_storage_options=opts)
    with pytest.warns(UserWarning, match="step 1 was committed locally .* upload to s3://nowhere/run/step_000000001 failed"):
        ckpt.save(1, {"w": torch.ones(4), "epoch": 1})
        ckpt.close()  # waits for the (failing) upload; does not raise
    assert ckpt.steps() == [1]
    assert [s for s, _ in ckpt.replica.failed] == [1] and ckpt.replica.uploaded == []
    assert SECRET_KEY not in ckpt.replica.failed[0][1]


def test_aws_environment_variables_configure_s3_without_storage_options(tmp_path, s3_server, s3_bucket, monkeypatch):
    """The usual AWS settings work: credentials and endpoint from the environment only."""
    from s3_server import ACCESS_KEY, SECRET_KEY

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    model = make_model(seed=2)
    root = f"s3://{s3_bucket}/env-run"
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(5, {"model": model})
        assert ckpt.steps() == [5]
        manifest = ckpt.storage.read_bytes("step_000000005", "manifest.json").decode()
    assert SECRET_KEY not in manifest and ACCESS_KEY not in manifest
    fresh = make_model(seed=3)
    assert distckpt.Checkpointer(root).load({"model": fresh}) == 5
    assert_same(model.state_dict(), fresh.state_dict(), "model")


def test_replica_wait_reports_uploads_and_raises_a_failed_one(tmp_path):
    # The replica's public surface: wait for the uploads submitted so far (or up to one step,
    # with a timeout), see which steps were uploaded and which failed and why; a failed upload
    # is raised by wait(). The S3 server is stopped in the middle of step 2's upload (after its
    # first file reached the server: observed, not timed).
    from distckpt.storage import replica as replica_mod
    from distckpt.storage.replica import ReplicationError

    server = S3Server().start()  # its own server: this test stops it
    try:
        bucket = server.make_bucket(f"t-{uuid.uuid4().hex[:12]}")
        ckpt = distckpt.Checkpointer(
            str(tmp_path / "local"), replicate_to=f"s3://{bucket}/run", replicate_storage_options=server.storage_options
        )
        model = torch.nn.Linear(64, 64)
        ckpt.save(1, {"model": model})
        status = ckpt.replica.wait(timeout=120)
        assert status.uploaded == (1,) and status.failed == () and status.pending == ()
        original = replica_mod.Replicator._put
        puts = []

        def put_then_stop(self, name, filename):
            original(self, name, filename)
            puts.append(filename)
            if name.endswith("2") and len(puts) == 1:
                server.stop()

        replica_mod.Replicator._put = put_then_stop
        try:
            with pytest.warns(UserWarning, match="upload .* failed"):
                ckpt.save(2, {"model": model})
                with pytest.raises(ReplicationError, match="step 2: ") as info:
                    ckpt.replica.wait(timeout=120)
        finally:
            replica_mod.Replicator._put = original
        assert set(info.value.steps) == {2} and puts
        status = ckpt.replica.wait(raise_on_failure=False)
        assert status.uploaded == (1,) and [s for s, _ in status.failed] == [2]
        assert ckpt.replica.wait(step=1).uploaded == (1,)  # step 1 alone: uploaded, nothing raised
        assert ckpt.steps() == [1, 2]  # both committed locally whatever the replica did
        with pytest.raises(ValueError, match="timeout"):
            ckpt.replica.wait(timeout=-1)
        ckpt.close()
    finally:
        server.stop()


def test_replica_wait_times_out_naming_the_pending_step(tmp_path):
    from distckpt.storage import replica as replica_mod

    release = threading.Event()
    original = replica_mod.Replicator._put

    def held_put(self, name, filename):
        release.wait(60)  # the upload of step 1 stays in flight until the test lets it go
        original(self, name, filename)

    replica_mod.Replicator._put = held_put
    try:
        ckpt = distckpt.Checkpointer(str(tmp_path / "local"), replicate_to=f"memory://replica-{uuid.uuid4().hex}/run")
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
        with pytest.raises(TimeoutError, match=r"step\(s\) \[1\]"):
            ckpt.replica.wait(timeout=0.05)
        assert ckpt.replica.status().pending == (1,)
        release.set()
        assert ckpt.replica.wait(timeout=60).uploaded == (1,)
        ckpt.close()
    finally:
        release.set()
        replica_mod.Replicator._put = original


def test_an_unreachable_store_is_not_reported_as_a_missing_bucket(tmp_path):
    # s3fs's exists() answers False when it cannot reach the store at all: that must surface as
    # an OSError naming the failed check (a save then names its step), not as a missing bucket.
    from dist_harness import free_port

    opts = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 1, "read_timeout": 2},
        "skip_instance_cache": True,
    }
    storage = distckpt.Storage(f"s3://nowhere-{uuid.uuid4().hex[:8]}/run", opts)
    with pytest.raises(OSError, match=r"could not check bucket 'nowhere-") as info:
        storage.check_bucket()
    assert not isinstance(info.value, FileNotFoundError) and SECRET_KEY not in str(info.value)
    with pytest.raises(distckpt.CheckpointError, match=r"save of step 3: could not create"):
        distckpt.Checkpointer(f"s3://nowhere-{uuid.uuid4().hex[:8]}/run", storage_options=opts).save(3, {"w": torch.ones(2)})


def test_which_steps_are_committed_is_asked_concurrently(s3_server, s3_bucket, monkeypatch):
    """Every load (its latest step), `ls`, retention and every save's cleanup ask whether each
    step directory of the root holds a manifest (and `ls` reads each manifest): one request per
    step, one after another, so a root of hundreds of steps on S3 cost hundreds of round trips
    each time. They overlap now; the answers are the same (committed steps listed, incomplete
    ones left to cleanup)."""
    import json

    from distckpt.integrity.manifest import MANIFEST_NAME, committed_steps, step_dir
    from distckpt.storage import ownership
    from distckpt.storage.base import Storage
    from distckpt.storage.objectstore import FsspecStorage
    from distckpt.tools.catalog import list_steps

    storage = Storage(f"s3://{s3_bucket}/root", s3_server.storage_options)
    for step in range(24):
        storage.write_bytes(b"x", step_dir(step), "__0_0.distcp")
        if step % 3:
            storage.write_bytes(b"{}", step_dir(step), MANIFEST_NAME)
        elif step % 2:  # a crashed save's, its lease released: cleanup removes it
            storage.write_bytes(json.dumps({"writer": "w", "released": True}).encode(), step_dir(step), ownership.OWNER_NAME)
    real = FsspecStorage.exists
    cond = threading.Condition()
    seen = {"now": 0, "most": 0, "gave_up": False}

    def overlapping(self, *parts):
        # The first calls wait (for observed progress, not time) until four are in flight at
        # once; one at a time, the first wait gives up and the test fails on the count below.
        with cond:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
            cond.notify_all()
            if not seen["gave_up"] and not cond.wait_for(lambda: seen["most"] >= 4, timeout=30):
                seen["gave_up"] = True
        try:
            return real(self, *parts)
        finally:
            with cond:
                seen["now"] -= 1

    monkeypatch.setattr(FsspecStorage, "exists", overlapping)
    committed = [s for s in range(24) if s % 3]
    assert committed_steps(storage) == committed
    assert seen["most"] >= 4, seen
    seen.update(most=0, gave_up=False)
    rows = list_steps(storage)  # `distckpt ls`: a manifest or a listing per step besides
    # ("bad manifest": these manifests are "{}", read and refused)
    assert [(r["step"], r["status"]) for r in rows] == [(s, "bad manifest" if s % 3 else "incomplete") for s in range(24)]
    assert seen["most"] >= 4, seen
    ownership.remove_stale_leftovers(storage)
    assert sorted(storage.list_dirs()) == sorted(step_dir(s) for s in range(24) if s % 3 or not s % 2)
    monkeypatch.undo()
    assert committed_steps(storage) == committed


def test_a_save_or_upload_never_writes_into_another_tools_folder_on_s3(tmp_path, s3_server, s3_bucket):
    """On a local disk a step is created by renaming a prepared folder into place, which fails
    over an existing one; on S3 creation is a conditional put of the owner record alone, so a
    save of step 5 wrote its files into the user's ``step_000000005/`` beside their
    ``model.pt`` and committed, and retention would later have deleted ``model.pt`` with the
    step. The save (and the replica's upload) now refuse, naming the folder and what it holds;
    the user's file stays, other steps save as before."""
    import warnings

    from distckpt.storage.base import Storage
    from distckpt.storage.replica import ReplicationError

    url = f"s3://{s3_bucket}/root"
    storage = Storage(url, s3_server.storage_options)
    storage.write_bytes(b"the user's weights", "step_000000005", "model.pt")
    storage.write_bytes(b"x", "step_000000006", "notes.txt")
    ckpt = distckpt.Checkpointer(url, storage_options=s3_server.storage_options, keep_last=1)
    with pytest.raises(distckpt.StepExistsError, match=r"step_000000005 holds files distckpt does not write \('model.pt'\)"):
        ckpt.save(5, {"w": torch.ones(4)})
    ckpt.save(7, {"w": torch.ones(4)})
    ckpt.save(8, {"w": torch.ones(4)})  # retention deletes 7, nothing of the user's
    ckpt.close()
    assert storage.list_files("step_000000005") == {"model.pt": 18}
    assert storage.read_bytes("step_000000006", "notes.txt") == b"x"
    assert distckpt.Checkpointer(url, storage_options=s3_server.storage_options).steps() == [8]
    # The replica's uploader: the same refusal, reported as a failed upload; the local commit stays.
    local = distckpt.Checkpointer(str(tmp_path / "local"), replicate_to=url, replicate_storage_options=s3_server.storage_options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failed upload's warning
        local.save(6, {"w": torch.ones(4)})
        with pytest.raises(ReplicationError, match=r"step_000000006 holds files distckpt does not write \('notes.txt'\)"):
            local.replica.wait(timeout=120)
    assert local.steps() == [6]
    local.close()
    assert storage.list_files("step_000000006") == {"notes.txt": 1}


@pytest.mark.parametrize("where", ["missing bucket", "missing folder", "local"])
def test_load_pretrained_from_nowhere_says_so(s3_server, s3_bucket, tmp_path, where):
    """A missing bucket (or folder) was reported as a folder without safetensors files, while
    save_pretrained to it said the bucket does not exist. Found by a helper (2026-12-06)."""
    opts = s3_server.storage_options
    path = {
        "missing bucket": f"s3://nowhere-{uuid.uuid4().hex[:8]}/hf",
        "missing folder": f"s3://{s3_bucket}/no/such/hf",
        "local": str(tmp_path / "no-such-hf"),
    }[where]
    with pytest.raises(FileNotFoundError, match="no such folder"):
        distckpt.load_pretrained(torch.nn.Linear(2, 2), path, storage_options=None if where == "local" else opts)
    if where == "missing folder":  # a folder that is there but holds no weights: as before
        import s3fs

        s3fs.S3FileSystem(**opts).pipe(f"{s3_bucket}/no/such/hf/readme.txt", b"x")
        with pytest.raises(FileNotFoundError, match=r"no model\.safetensors\.index\.json"):
            distckpt.load_pretrained(torch.nn.Linear(2, 2), path, storage_options=opts)


@pytest.mark.parametrize("where", ["s3", "local", "relative", "memory root"])
def test_load_pretrained_takes_a_safetensors_file(s3_server, s3_bucket, tmp_path, monkeypatch, where):
    """"Single file or sharded": the path of ``model.safetensors`` itself was a bare
    ``NotADirectoryError``. A file is read alone (an index beside it is not read); another file
    is named. Found by a helper (2026-12-07)."""
    from safetensors.torch import save

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    data = save({k: v.contiguous() for k, v in model.state_dict().items()})
    other = b"not weights"
    index = b'{"weight_map": {"weight": "elsewhere.safetensors"}}'  # beside it, not read
    if where == "s3":
        import s3fs

        fs, base, opts = s3fs.S3FileSystem(**s3_server.storage_options), f"{s3_bucket}/hf", s3_server.storage_options
        for name, body in (("model.safetensors", data), ("notes.txt", other), ("model.safetensors.index.json", index)):
            fs.pipe(f"{base}/{name}", body)
        path, bad = f"s3://{base}/model.safetensors", f"s3://{base}/notes.txt"
    elif where == "memory root":  # a file at the store's root (was read as a local folder "memory:/")
        import fsspec

        fs, opts = fsspec.filesystem("memory"), None
        fs.pipe_file("/model.safetensors", data)
        fs.pipe_file("/notes.txt", other)
        path, bad = "memory://model.safetensors", "memory://notes.txt"
    else:
        (tmp_path / "hf").mkdir()
        for name, body in (("model.safetensors", data), ("notes.txt", other), ("model.safetensors.index.json", index)):
            (tmp_path / "hf" / name).write_bytes(body)
        opts = None
        path, bad = str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "hf" / "notes.txt")
        if where == "relative":
            monkeypatch.chdir(tmp_path / "hf")
            path, bad = "model.safetensors", "notes.txt"
    fresh = torch.nn.Linear(3, 2)
    distckpt.load_pretrained(fresh, path, storage_options=opts)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.raises(NotADirectoryError, match=r"notes\.txt is a file, not a \.safetensors file or a folder of them"):
        distckpt.load_pretrained(torch.nn.Linear(3, 2), bad, storage_options=opts)
    if where == "memory root":
        fs.rm(["/model.safetensors", "/notes.txt"])


def test_load_pretrained_reads_a_hugging_face_cache_snapshot(tmp_path):
    """``snapshot_download``/``hf_hub_download`` return a snapshot folder of the hub cache whose
    files are symbolic links into the repository's ``blobs``: every load of it was refused
    (``UnsafeCheckpointError``: reads never follow links). Those links are followed, to a
    regular file in ``blobs`` only; any other link is still refused. Found by a helper
    (2026-12-07)."""
    import json as _json

    from safetensors.torch import save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    shards = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias"], "model-00002-of-00002.safetensors": ["1.weight", "1.bias"]}
    files = {n: save({k: sd[k] for k in keys}) for n, keys in shards.items()}
    files["model.safetensors.index.json"] = _json.dumps({"weight_map": {k: n for n, keys in shards.items() for k in keys}}).encode()
    for i, (name, body) in enumerate(files.items()):
        (repo / "blobs" / f"blob{i}").write_bytes(body)
        os.symlink(f"../../blobs/blob{i}", snap / name)
    for path in (snap, snap / "model-00001-of-00002.safetensors"):
        fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        report = distckpt.load_pretrained(fresh, str(path), strict=path == snap)
        got = fresh.state_dict()
        assert all(torch.equal(got[k], sd[k]) for k in (sd if path == snap else ["0.weight", "0.bias"])), path
        assert path == snap or sorted(report.missing) == ["1.bias", "1.weight"], report
    # A link anywhere else is refused as before: out of the blobs, or in a folder that is no snapshot.
    (tmp_path / "secret.safetensors").write_bytes(files["model-00001-of-00002.safetensors"])
    (snap / "model-00001-of-00002.safetensors").unlink()
    os.symlink(tmp_path / "secret.safetensors", snap / "model-00001-of-00002.safetensors")
    with pytest.raises(distckpt.UnsafeCheckpointError):
        distckpt.load_pretrained(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), str(snap))
    plain = tmp_path / "plain"
    plain.mkdir()
    os.symlink(repo / "blobs" / "blob0", plain / "model.safetensors")
    with pytest.raises(distckpt.UnsafeCheckpointError):
        distckpt.load_pretrained(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), str(plain), strict=False)


def test_a_tree_that_only_looks_like_a_hub_cache_reads_nothing_outside_it(tmp_path):
    """Review (2026-12-07): the snapshot was told by folder names only and ``blobs`` resolved
    with realpath, so a downloaded tree ``evil/snapshots/main`` whose ``blobs`` is a link to
    another folder loaded that folder's files (any regular file) into the weights. ``blobs`` and
    the folders above it are now opened without following links; a user's own link to a real
    snapshot still loads, and so does ``convert HF_DIR --to dcp``."""
    from safetensors.torch import save

    from cli_runner import run_cli

    secret = tmp_path / "victim"
    secret.mkdir()
    (secret / "model.safetensors").write_bytes(save({"weight": torch.full((2, 3), 1337.0), "bias": torch.full((2,), 1337.0)}))
    evil = tmp_path / "evil" / "models--evil--m"
    (evil / "snapshots" / "main").mkdir(parents=True)
    os.symlink(secret, evil / "blobs")  # blobs: a link elsewhere
    os.symlink("../../blobs/model.safetensors", evil / "snapshots" / "main" / "model.safetensors")
    with pytest.raises(distckpt.UnsafeCheckpointError, match="symbolic link"):
        distckpt.load_pretrained(torch.nn.Linear(3, 2), str(evil / "snapshots" / "main"))
    # An absolute link to the file elsewhere: not into <repo>/blobs, refused as any link.
    (evil / "snapshots" / "main" / "model.safetensors").unlink()
    os.symlink(secret / "model.safetensors", evil / "snapshots" / "main" / "model.safetensors")
    with pytest.raises(distckpt.UnsafeCheckpointError):
        distckpt.load_pretrained(torch.nn.Linear(3, 2), str(evil / "snapshots" / "main"))
    # Link text and kernel disagreeing (blobs/sub/../x with sub a link elsewhere): the text named
    # one file, the listing sized another (the index's 100 MB limit was bypassed: review).
    (evil / "blobs").unlink()
    (evil / "blobs").mkdir()
    (evil / "blobs" / "model.safetensors").write_bytes(b"x" * 64)
    os.symlink(secret, evil / "blobs" / "sub")
    (tmp_path / "model.safetensors").write_bytes((secret / "model.safetensors").read_bytes())  # the kernel's target
    (evil / "snapshots" / "main" / "model.safetensors").unlink()
    os.symlink("../../blobs/sub/../model.safetensors", evil / "snapshots" / "main" / "model.safetensors")
    with pytest.raises(distckpt.UnsafeCheckpointError):
        distckpt.load_pretrained(torch.nn.Linear(3, 2), str(evil / "snapshots" / "main"))
    # A real cache reached through the user's own link to its snapshot: loads.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "r1").mkdir(parents=True)
    (repo / "blobs" / "b0").write_bytes(save({k: v.contiguous() for k, v in model.state_dict().items()}))
    os.symlink("../../blobs/b0", repo / "snapshots" / "r1" / "model.safetensors")
    os.symlink(repo / "snapshots" / "r1", tmp_path / "mine")
    fresh = torch.nn.Linear(3, 2)
    distckpt.load_pretrained(fresh, str(tmp_path / "mine"))
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    out = tmp_path / "imported"
    assert run_cli("convert", str(repo / "snapshots" / "r1"), "--to", "dcp", str(out), "-q").returncode == 0
    state = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}}
    distckpt.Checkpointer(str(out)).load(state)
    assert torch.equal(state["model"]["weight"], model.weight)
