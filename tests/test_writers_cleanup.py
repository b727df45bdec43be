"""Cleanup of incomplete step directories never removes a committed step, whatever the timing.

Writer A saves step 1 on a local root; writer B's cleanup (what ``claim`` runs before every
save) runs *inside* A's commit phase, and A's real commit is driven at the exact point of B's
cleanup that loses data without the fix. One process, no sleeps: the interleaving is fixed by
hooks at function boundaries (``_saving.commit``, ``ownership.is_stale``,
``ownership._tombstone``).
"""

from __future__ import annotations

import os

import pytest
import torch

import distckpt
from distckpt.save import phases as _saving
from distckpt.storage import ownership
from distckpt.integrity.manifest import MANIFEST_NAME, step_dir
from distckpt.storage.base import Storage

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _state(v: float) -> dict:
    return {"w": torch.full((8, 8), v), "epoch": int(v)}


def _assert_loads(root, step: int, v: float) -> None:
    got = _state(-1.0)
    assert distckpt.Checkpointer(root).load(got, step=step) == step
    assert torch.equal(got["w"], _state(v)["w"]) and got["epoch"] == int(v)


def _save_with_cleanup_inside_commit(monkeypatch, root, b_cleanup):
    """A saves step 1; once A's data is written, ``b_cleanup(commit_a)`` runs B's cleanup, where
    ``commit_a()`` is A's real commit followed by A's lease release (its record goes)."""
    a = distckpt.Checkpointer(root)
    real_commit = _saving.commit
    outcome: dict = {}

    def commit_a_then(opts, world_size, prepared, written, lease, job=None):
        def commit_a():
            try:
                outcome["manifest"] = real_commit(opts, world_size, prepared, written, lease, job)
            except BaseException as exc:  # noqa: BLE001 - handed to A's save below
                outcome["error"] = exc
                raise
            a._saver._release_lease(committed=True)

        b_cleanup(commit_a)
        assert outcome, "the hook never ran A's commit"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["manifest"]

    monkeypatch.setattr(_saving, "commit", commit_a_then)
    return a, outcome


def test_a_step_committed_while_cleanup_judges_it_is_kept(tmp_path, monkeypatch):
    # B lists step 1 (no manifest yet), A commits and drops its owner record, then B asks
    # whether step 1's lease is stale: no record must not mean "stale" for it.
    root = tmp_path / "ck"
    real_is_stale = ownership.is_stale

    def b_cleanup(commit_a):
        def is_stale(storage, name, *args, **kwargs):
            if name == step_dir(1):
                commit_a()
            return real_is_stale(storage, name, *args, **kwargs)

        monkeypatch.setattr(ownership, "is_stale", is_stale)
        ownership.remove_stale_leftovers(Storage(root), 600.0)

    a, outcome = _save_with_cleanup_inside_commit(monkeypatch, root, b_cleanup)
    a.save(1, _state(1.0))
    assert "manifest" in outcome and a.steps() == [1], "a committed step was removed by cleanup"
    _assert_loads(root, 1, 1.0)


def test_a_step_committed_after_cleanup_judged_it_stale_is_kept(tmp_path, monkeypatch):
    # B judged A's lease stale (A had stalled past lease_s), then A committed before B removed
    # the directory: the removal must see the manifest and leave the step alone.
    root = tmp_path / "ck"

    def b_cleanup(commit_a):
        def is_stale(storage, name, *args, **kwargs):
            if name == step_dir(1):
                commit_a()
                return True  # B's verdict was reached before A's commit
            return False

        monkeypatch.setattr(ownership, "is_stale", is_stale)
        ownership.remove_stale_leftovers(Storage(root), 600.0)

    a, outcome = _save_with_cleanup_inside_commit(monkeypatch, root, b_cleanup)
    a.save(1, _state(1.0))
    assert "manifest" in outcome and a.steps() == [1], "a committed step was removed by cleanup"
    _assert_loads(root, 1, 1.0)


def test_a_commit_between_the_last_check_and_the_removal_is_kept(tmp_path, monkeypatch):
    # The narrowest window: A commits after B's last manifest check, just before B moves the
    # directory away. B then finds the manifest in its tombstone and moves it back.
    root = tmp_path / "ck"
    real_tombstone = ownership._tombstone

    def b_cleanup(commit_a):
        def tombstone(storage, name):
            if name == step_dir(1):
                commit_a()
            return real_tombstone(storage, name)

        monkeypatch.setattr(ownership, "is_stale", lambda storage, name, *a, **k: name == step_dir(1))
        monkeypatch.setattr(ownership, "_tombstone", tombstone)
        with pytest.warns(UserWarning, match="committed while it was being cleaned up"):
            ownership.remove_stale_leftovers(Storage(root), 600.0)

    a, outcome = _save_with_cleanup_inside_commit(monkeypatch, root, b_cleanup)
    a.save(1, _state(1.0))
    assert "manifest" in outcome and a.steps() == [1], "a committed step was removed by cleanup"
    assert sorted(os.listdir(root)) == [step_dir(1)]
    _assert_loads(root, 1, 1.0)


def test_a_commit_after_the_directory_was_moved_away_fails(tmp_path, monkeypatch):
    # A passed its ownership check and is about to write its manifest when B (to which A's
    # lease looked stale) moves A's directory away and deletes it. A's lease refresh and A's
    # manifest write must fail, not re-create an empty step directory and report success.
    root = tmp_path / "ck"
    a = distckpt.Checkpointer(root)
    real_write = a.storage.write_bytes
    seen: dict = {}

    def write_bytes(data, *parts, exclusive=False):
        if parts[-1] == MANIFEST_NAME and not seen:
            monkeypatch.setattr(ownership, "is_stale", lambda storage, name, *args, **kw: name == step_dir(1))
            ownership.remove_stale_leftovers(Storage(root), 600.0)  # B
            seen["gone"] = not os.path.exists(root / step_dir(1))
            a._saver.lease.renew()  # A's refresh thread, at this moment
            try:  # ... even had it passed its ownership check just before the move
                ownership._write_record(a.storage, step_dir(1), b"{}")
            except FileNotFoundError:
                pass
            seen["recreated_by_renew"] = os.path.exists(root / step_dir(1))
        return real_write(data, *parts, exclusive=exclusive)

    monkeypatch.setattr(a.storage, "write_bytes", write_bytes)
    with pytest.raises(Exception, match="step_000000001"):
        a.save(1, _state(1.0))
    assert seen == {"gone": True, "recreated_by_renew": False}
    assert a.steps() == [] and os.listdir(root) == [], "a save reported success for a step without its data"
    monkeypatch.undo()
    a.save(2, _state(2.0))  # the root keeps working
    _assert_loads(root, 2, 2.0)


def test_a_directory_without_a_record_gets_a_lease_of_grace(tmp_path):
    # A writer's directory may exist before its owner record (fsspec stores create the
    # directory, then put the record): cleanup leaves it for lease_s after its last change.
    storage = Storage(f"memory://{tmp_path.name}-grace/root")
    storage.makedirs(step_dir(3))
    storage.write_bytes(b"partial", step_dir(3), "__0_0.distcp")
    ownership.remove_stale_leftovers(storage, lease_s=600.0)
    assert storage.list_dirs() == [step_dir(3)]
    assert not ownership.is_stale(storage, step_dir(3), 600.0)
    assert ownership.is_stale(storage, step_dir(3), 600.0, now=__import__("time").time() + 601)
    ownership.remove_stale_leftovers(storage, lease_s=1e-9)
    assert storage.list_dirs() == []

    local = Storage(tmp_path / "local")
    (tmp_path / "local" / step_dir(4)).mkdir(parents=True)
    (tmp_path / "local" / step_dir(4) / "__0_0.distcp").write_bytes(b"partial")
    ownership.remove_stale_leftovers(local, lease_s=600.0)
    assert local.list_dirs() == [step_dir(4)]
    old = os.stat(tmp_path / "local" / step_dir(4)).st_mtime - 700
    for p in (tmp_path / "local" / step_dir(4), tmp_path / "local" / step_dir(4) / "__0_0.distcp"):
        os.utime(p, (old, old))
    ownership.remove_stale_leftovers(local, lease_s=600.0)
    assert local.list_dirs() == []


def test_an_interrupted_removal_is_finished_by_the_next_cleanup(tmp_path):
    # A tombstone without a manifest is a removal already decided; one with a manifest (a step
    # committed during cleanup that could not be moved back) is kept, with a warning.
    root = tmp_path / "ck"
    distckpt.Checkpointer(root).save(1, _state(1.0))
    os.rename(root / step_dir(1), root / f"{ownership.TOMBSTONE_PREFIX}{step_dir(1)}-x")
    (root / f"{ownership.TOMBSTONE_PREFIX}{step_dir(2)}-y").mkdir()
    (root / f"{ownership.TOMBSTONE_PREFIX}{step_dir(2)}-y" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.warns(UserWarning, match="kept"):
        ownership.remove_stale_leftovers(Storage(root), 600.0)
    assert sorted(os.listdir(root)) == [f"{ownership.TOMBSTONE_PREFIX}{step_dir(1)}-x"]


def test_retired_steps_are_deleted_in_the_background_and_cleanup_leaves_them_to_it(tmp_path, monkeypatch):
    """keep_last retires a step synchronously (released, uncommitted, moved to a tombstone that
    holds no manifest) and unlinks its files in the reaper's thread: the save returns while the
    files are still being deleted, the next save's cleanup leaves that tombstone to the reaper,
    and close() waits until it is gone. Held by an event, not by timing."""
    import threading

    from distckpt.storage.local import LocalStorage

    gate, entered = threading.Event(), threading.Event()
    real_remove_tree = LocalStorage.remove_tree
    cleanup_removed: list[str] = []

    def remove_tree(self, *parts):
        name = parts[0] if parts else ""
        if threading.current_thread().name == "distckpt-reaper":
            entered.set()
            assert gate.wait(60), "never released"
        else:
            cleanup_removed.append(name)
        return real_remove_tree(self, *parts)

    monkeypatch.setattr(LocalStorage, "remove_tree", remove_tree)
    ckpt = distckpt.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, _state(1.0))
    ckpt.save(2, _state(2.0))  # retires step 1: returns while the reaper is held
    assert entered.wait(60)
    assert ckpt.steps() == [2]
    tombs = [p.name for p in tmp_path.iterdir() if p.name.startswith(ownership.TOMBSTONE_PREFIX)]
    assert len(tombs) == 1 and not (tmp_path / tombs[0] / MANIFEST_NAME).exists()
    assert ckpt._saver.reaper.busy == frozenset(tombs)
    ckpt.save(3, _state(3.0))  # its cleanup sees the tombstone and leaves it to the reaper
    assert tombs[0] not in cleanup_removed
    gate.set()
    ckpt.close()  # drains: every retired step's files are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(3)]
    _assert_loads(tmp_path, 3, 3.0)


def test_a_tombstone_the_reaper_could_not_delete_is_removed_by_the_next_cleanup(tmp_path, monkeypatch):
    from distckpt.storage.local import LocalStorage

    real_remove_tree = LocalStorage.remove_tree

    def failing(self, *parts):
        import threading

        if threading.current_thread().name == "distckpt-reaper":
            raise PermissionError("simulated")
        return real_remove_tree(self, *parts)

    monkeypatch.setattr(LocalStorage, "remove_tree", failing)
    ckpt = distckpt.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, _state(1.0))
    with pytest.warns(UserWarning, match="could not delete"):
        ckpt.save(2, _state(2.0))
        ckpt._saver.reaper.drain()
    assert any(p.name.startswith(ownership.TOMBSTONE_PREFIX) for p in tmp_path.iterdir())
    monkeypatch.setattr(LocalStorage, "remove_tree", real_remove_tree)
    ckpt.save(3, _state(3.0))  # cleanup: the tombstone is nobody's any more
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(3)]


def test_a_temporary_directory_of_a_killed_creator_is_stale_at_once(tmp_path):
    """A writer killed between creating a step's temporary directory and writing the owner
    record inside leaves a directory nobody claims (seen, rarely, by test_faults' SIGKILL
    trials: the next save then left it for the lease's 600 s). Its name says which process of
    which host made it: gone means stale now, not after the lease; a live creator, another host
    or an older name (no creator in it) keep the lease."""
    import subprocess
    import sys

    from distckpt.storage.base import NEW_DIR_PREFIX, new_dir_creator, new_dir_name

    storage = Storage(str(tmp_path))
    mine = new_dir_name()
    assert new_dir_creator(mine) == os.getpid()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    tag = mine[len(NEW_DIR_PREFIX):].split("-")[1]
    names = {
        "dead": f"{NEW_DIR_PREFIX}{dead_pid}-{tag}-0123456789ab",
        "alive": mine,
        "other_host": f"{NEW_DIR_PREFIX}{dead_pid}-zzzzzzzz-0123456789ab",
        "old_name": f"{NEW_DIR_PREFIX}0123456789ab",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / ".owner.tmp-0123abcd").write_bytes(b"x")  # not empty, just changed: no record yet
    assert {k: ownership.is_stale(storage, n) for k, n in names.items()} == {
        "dead": True, "alive": False, "other_host": False, "old_name": False,
    }
    ownership.remove_stale_leftovers(storage)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(NEW_DIR_PREFIX)) == sorted(
        n for k, n in names.items() if k != "dead"
    )


def test_garbled_pids_and_times_in_records_and_names_neither_crash_nor_claim_forever(tmp_path):
    """A root is shared storage: an owner record or a temporary directory's name may hold any
    pid and any time. A pid no process can have (larger than ``pid_t``: ``os.kill`` raised
    OverflowError; ``"²"``, which ``str.isdigit`` takes and ``int`` refuses: ValueError) failed
    every later save of the root; a time of NaN or infinity was a claim that never expired, so
    that step could never be saved. Now such pids are "cannot tell" (the lease's time decides)
    and such times are no claim."""
    import json
    import socket
    import time

    from distckpt.storage.base import NEW_DIR_PREFIX, new_dir_creator, new_dir_name

    tag = new_dir_name()[len(NEW_DIR_PREFIX):].split("-")[1]
    for pid in ("99999999999999999999999", "²", "0", "٣"):  # the last: an Arabic-Indic 3
        assert new_dir_creator(f"{NEW_DIR_PREFIX}{pid}-{tag}-0123456789ab") is None, pid
    root = tmp_path / "root"
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, _state(1.0))
    host = socket.gethostname()
    records = {  # step -> (record, stale: removed by the next save's cleanup)
        10: ({"writer": "x", "host": host, "pid": 2**70, "time": time.time()}, False),
        11: ({"writer": "x", "host": host, "pid": 2**70, "time": 0}, True),
        12: ({"writer": "x", "host": host, "pid": -1, "time": time.time()}, False),
        13: ({"writer": "x", "host": "elsewhere", "pid": 5, "time": float("nan")}, True),
        14: ({"writer": "x", "host": "elsewhere", "pid": 5, "time": float("inf")}, True),
        15: ({"writer": "x", "host": "elsewhere", "pid": 5, "time": time.time()}, False),  # a live lease
    }
    for step, (record, _) in records.items():
        (root / step_dir(step)).mkdir()
        (root / step_dir(step) / ownership.OWNER_NAME).write_text(json.dumps(record))
    for pid in ("99999999999999999999999", "²"):
        (root / f"{NEW_DIR_PREFIX}{pid}-{tag}-0123456789ab").mkdir()
    ckpt.save(2, _state(2.0))  # before: OverflowError (or ValueError) from the cleanup
    left = {int(p.name.split("_")[1]) for p in root.iterdir() if p.name.startswith("step_")}
    assert left == {1, 2} | {s for s, (_, stale) in records.items() if not stale}
    assert len([p for p in root.iterdir() if p.name.startswith(NEW_DIR_PREFIX)]) == 2  # recent: leased
    ckpt.save(13, _state(13.0))  # the step a NaN time held is free
    ckpt.close()
    _assert_loads(root, 13, 13.0)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_cleanup_removes_only_folders_that_hold_nothing_but_distckpts_files(tmp_path, where):
    """A checkpoint root is often a run's output folder, where other tools keep their own
    ``step_100/`` or even ``step_000000005/``. Every save's cleanup removed any folder whose name
    parsed as a step (``step_\\d+``: also ``step_100``, ``step_٣``, a name ending in a newline) and
    held no manifest once it was older than the lease, with whatever was inside. Now a step is
    exactly ``step_dir(n)``'s name, and an incomplete one is removed only if it holds nothing but
    the files distckpt and DCP write there (warned once otherwise)."""
    import time
    import warnings

    old = time.time() - 7200
    if where == "local":
        root = tmp_path / "root"
        ckpt = distckpt.Checkpointer(root)
        ckpt.save(1, _state(1.0))

        def put(name: str, files: dict[str, bytes], subdir: bool = False) -> None:
            d = root / name
            d.mkdir()
            for f, data in files.items():
                (d / f).write_bytes(data)
                os.utime(d / f, (old, old))
            if subdir:
                (d / "extra").mkdir()
                os.utime(d / "extra", (old, old))
                (d / "latest").symlink_to(d / "nowhere")  # a link that leads to no file
                os.utime(d / "latest", (old, old), follow_symlinks=False)
            os.utime(d, (old, old))

        def names() -> set[str]:
            return {p.name for p in root.iterdir()}

        saved = [100]

        def cleanup() -> None:
            saved[0] += 1
            ckpt.save(saved[0], _state(2.0))  # a save's cleanup, with the default lease
    else:
        storage = Storage(f"memory://{tmp_path.name}-{where}/root")
        storage.makedirs(step_dir(1))
        storage.write_bytes(b"{}", step_dir(1), MANIFEST_NAME)

        def put(name: str, files: dict[str, bytes], subdir: bool = False) -> None:
            storage.makedirs(name)
            for f, data in files.items():
                storage.write_bytes(data, name, f)
            if subdir:
                storage.write_bytes(b"x", name, "extra", "inner.bin")

        def names() -> set[str]:
            return set(storage.list_dirs())

        def cleanup() -> None:
            ownership.remove_stale_leftovers(storage, lease_s=1e-9)  # memory:// has no times

    put(step_dir(5), {"model.pt": b"the user's weights", "__0_0.distcp": b"x"})
    put(step_dir(6), {"__0_0.distcp": b"x"}, subdir=True)
    put(step_dir(8), {"__0_0.distcp": b"x", ".metadata.tmp": b"x", ".owner.tmp-0123abcd": b"x"})  # a crashed save's
    for name in ("step_100", "step_0000000007", "step_\u0663", "step_000000009\n"):
        put(name, {"__0_0.distcp": b"x"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cleanup()
    left = names()
    assert step_dir(8) not in left, "a crashed save's leftover was kept"
    assert {step_dir(5), step_dir(6), "step_100", "step_0000000007", "step_\u0663", "step_000000009\n"} <= left
    foreign = [str(w.message) for w in seen if "does not write" in str(w.message)]
    assert len(foreign) == 2 and any(step_dir(5) in m and "'model.pt'" in m for m in foreign), foreign
    assert any(step_dir(6) in m and "'extra/'" in m for m in foreign), foreign  # (it said "1 sub-folders or ...")
    if where == "local":
        assert any(step_dir(6) in m and "'latest/'" in m for m in foreign), foreign
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cleanup()  # the second cleanup: kept again, not warned again
    assert not [w for w in seen if "does not write" in str(w.message)]
    assert {step_dir(5), step_dir(6)} <= names()
    if where == "local":
        assert ckpt.steps() == [1, 101, 102]  # the other folders are no steps
        ckpt.close()


def test_a_plain_dcp_checkpoint_under_a_steps_name_is_kept_and_a_crashed_save_is_not(tmp_path, capsys):
    """A user's ``dcp.save`` into ``root/step_000000005`` (or a step copied without its
    ``manifest.json``) holds only the files DCP writes, so cleanup took it for a crashed save and
    deleted it once older than the lease. It has no owner record, which every save of distckpt's
    keeps in the step until it commits: kept now, warned once, and still loads with
    ``dcp.load``. A crashed save's step (stale record, ``.metadata`` written) still goes."""
    import json
    import time
    import warnings

    import torch.distributed.checkpoint as dcp

    root = tmp_path / "root"
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, _state(1.0))
    dcp.save({"w": torch.full((4, 4), 7.0)}, checkpoint_id=str(root / step_dir(5)))
    crashed = root / step_dir(6)  # what a save killed after DCP wrote .metadata leaves
    crashed.mkdir()
    (crashed / ".metadata").write_bytes(b"x")
    (crashed / "__0_0.distcp").write_bytes(b"x")
    (crashed / ".owner").write_text(json.dumps({"writer": "w", "host": "elsewhere", "pid": 1, "time": time.time() - 7200}))
    old = time.time() - 7200
    for d in (root / step_dir(5), crashed):
        for f in d.iterdir():
            os.utime(f, (old, old))
        os.utime(d, (old, old))
    for step in (7, 8):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ckpt.save(step, _state(float(step)))  # a save's cleanup, the default lease
        kept = [str(w.message) for w in seen if "no distckpt save wrote" in str(w.message)]
        assert len(kept) == (1 if step == 7 else 0), kept  # warned once, not at the second save
        assert not kept or step_dir(5) in kept[0]
    # Saving that step says why it cannot (it said "being written by another writer").
    with pytest.raises(distckpt.StepExistsError, match=r"step 5 cannot be saved: .*step_000000005 holds a DCP checkpoint"):
        ckpt.save(5, _state(5.0))
    ckpt.close()
    assert (root / step_dir(5)).is_dir() and not crashed.exists()
    got = {"w": torch.zeros(4, 4)}
    dcp.load(got, checkpoint_id=str(root / step_dir(5)))
    assert torch.equal(got["w"], torch.full((4, 4), 7.0))
    assert distckpt.Checkpointer(root).steps() == [1, 7, 8]
    # The command line says what it is: ls "plain dcp" (it said "incomplete"); inspect and
    # convert read it unverified (they said "incomplete (no manifest.json)").
    from distckpt.tools.cli import main

    assert main(["ls", str(root), "--json", "-q"]) == 0
    rows = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows == {1: "committed", 5: "plain dcp", 7: "committed", 8: "committed"}, rows
    assert main(["inspect", str(root / step_dir(5)), "--json", "-q"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [e["key"] for e in shown["entries"]] == ["w"] and shown["verified"] is False
    assert main(["convert", str(root / step_dir(5)), "--to", "torch", str(tmp_path / "w.pt"), "-q"]) == 0
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.full((4, 4), 7.0))


def test_a_removal_without_a_rename_cut_short_leaves_no_dcp_checkpoint_behind(tmp_path, monkeypatch):
    """Object stores delete a step's files in batches, without a rename first: a removal cut short
    after its owner record went but before ``.metadata`` did would leave what looks like another
    tool's DCP checkpoint, kept forever. ``.metadata`` is deleted first, so the rest is garbage
    the next cleanup removes."""
    storage = Storage(f"memory://{tmp_path.name}-cut/root")
    name = step_dir(3)
    storage.makedirs(name)
    for f in (".owner", ".metadata", "__0_0.distcp", "__1_0.distcp"):
        storage.write_bytes(b"{}" if f == ".owner" else b"x", name, f)
    real = type(storage).remove_tree

    def cut_short(self, *parts):  # the batch holding the record went through, then a crash
        self.remove(*parts, ".owner")
        raise OSError("connection reset")

    monkeypatch.setattr(type(storage), "remove_tree", cut_short)
    with pytest.raises(OSError):
        ownership.remove_uncommitted(storage, name)
    monkeypatch.setattr(type(storage), "remove_tree", real)
    assert set(storage.list_files(name)) == {"__0_0.distcp", "__1_0.distcp"}
    assert not ownership.unowned_dcp_checkpoint(storage, name)
    ownership.remove_stale_leftovers(storage, lease_s=1e-9)  # memory:// has no times
    assert name not in storage.list_dirs()


@pytest.mark.parametrize("live", [False, True])
def test_a_record_dated_ahead_is_judged_by_the_stores_times(tmp_path, live):
    """A writer on another host whose clock ran a day ahead, killed mid-save, left a record dated
    tomorrow: its lease looked live until then, and every save of that step (the one a resumed
    job writes next) raised StepExistsError for a day. A record dated more than a lease ahead is
    judged by the store's times instead: stale once nothing in the directory changed for a lease;
    a live writer (its record rewritten every lease / 4) keeps its step."""
    import json
    import time

    root = tmp_path / "root"
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, _state(1.0))
    d = root / step_dir(2)
    d.mkdir()
    (d / ownership.OWNER_NAME).write_text(json.dumps({"writer": "x", "host": "elsewhere", "pid": 5, "time": time.time() + 86400}))
    (d / "__0_0.distcp").write_bytes(b"x")
    if not live:
        old = time.time() - 7200
        for f in (*d.iterdir(), d):
            os.utime(f, (old, old))
    if live:
        with pytest.raises(distckpt.StepExistsError, match="lease is live"):
            ckpt.save(2, _state(2.0))
        assert (d / "__0_0.distcp").exists()
    else:
        ckpt.save(2, _state(2.0))  # before: StepExistsError until tomorrow
        ckpt.close()
        _assert_loads(root, 2, 2.0)


def test_cleanup_never_fails_a_save_when_asking_for_manifests_fails(tmp_path, monkeypatch):
    """Cleanup asks every step directory for its manifest at once; one failed query (a transient
    I/O error) must not fail the save: each directory is asked again, and a failure is logged for
    it alone (as every failure of cleanup)."""
    from distckpt.storage.local import LocalStorage

    root = tmp_path / "root"
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, _state(1.0))
    real = LocalStorage.exists
    failed = []

    def flaky(self, *parts):
        if parts == (step_dir(1), MANIFEST_NAME) and not failed:
            failed.append(parts)
            raise OSError("transient")
        return real(self, *parts)

    monkeypatch.setattr(LocalStorage, "exists", flaky)
    ckpt.save(2, _state(2.0))
    ckpt.close()
    assert failed and distckpt.Checkpointer(root).steps() == [1, 2]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_retention_keeps_a_step_holding_files_the_user_added(tmp_path, where, request):
    """Users copy a tokenizer or eval results into a committed step's folder. Retention deleted
    the step with them. Now such a step is kept, committed and loadable, with one warning naming
    the files; once they are moved out, a later save retires it."""
    import warnings

    if where == "local":
        root, opts = str(tmp_path / "root"), None
        fs = None
    else:
        import fsspec

        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        root, opts = f"s3://{bucket}/run", server.storage_options
        fs = fsspec.filesystem("s3", **opts)
    storage = Storage(root, opts)
    ckpt = distckpt.Checkpointer(root, keep_last=1, storage_options=opts)
    ckpt.save(1, _state(1.0))
    storage.write_bytes(b'{"vocab": 3}', step_dir(1), "tokenizer.json")
    storage.write_bytes(b"x", step_dir(1), "{run}.log")  # braces in a name: the warning is no format string
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ckpt.save(2, _state(2.0))
        ckpt.save(3, _state(3.0))  # step 2 retired; step 1 kept again, not warned again
    kept = [str(w.message) for w in seen if "keep_last would delete" in str(w.message)]
    assert len(kept) == 1 and step_dir(1) in kept[0] and "'tokenizer.json'" in kept[0], kept
    assert ckpt.steps() == [1, 3]
    assert storage.read_bytes(step_dir(1), "tokenizer.json") == b'{"vocab": 3}'
    ckpt.close()
    _assert_loads_at(root, opts, 1, 1.0)
    storage.remove(step_dir(1), "tokenizer.json")
    storage.remove(step_dir(1), "{run}.log")
    if fs is not None:
        fs.invalidate_cache()
    with distckpt.Checkpointer(root, keep_last=1, storage_options=opts) as again:
        again.load(_state(-1.0))  # (the same job: its retention counts steps 1 and 3)
        again.save(4, _state(4.0))
        assert again.steps() == [4]


def _assert_loads_at(root, opts, step: int, v: float) -> None:
    got = _state(-1.0)
    assert distckpt.Checkpointer(root, storage_options=opts).load(got, step=step) == step
    assert torch.equal(got["w"], _state(v)["w"]) and got["epoch"] == int(v)


def test_judging_a_folder_lists_it_once_on_object_stores(tmp_path):
    """Every save checks its step's folder before creating it (``not_distckpts``): that was two
    listings on object stores (files, then every entry), one request each; one now, with the
    same verdicts."""
    storage = Storage(f"memory://{tmp_path.name}-once/root")
    storage.write_bytes(b"x", step_dir(1), "model.pt")
    storage.write_bytes(b"x", step_dir(2), "__0_0.distcp")
    storage.write_bytes(b"x", step_dir(2), "extra", "inner.bin")
    storage.write_bytes(b"x", step_dir(3), ".metadata")
    storage.write_bytes(b"x", step_dir(4), "__0_0.distcp")
    calls = []
    real = storage._ls
    storage._ls = lambda *parts: calls.append(parts) or real(*parts)
    verdicts = {s: ownership.not_distckpts(storage, step_dir(s)) for s in (1, 2, 3, 4, 5)}
    assert len(calls) == 5, calls
    assert "'model.pt'" in verdicts[1] and "'extra/'" in verdicts[2] and "DCP checkpoint" in verdicts[3]
    assert verdicts[4] is None and verdicts[5] is None
    # The base class's listing (what a Storage subclass of a user's inherits) agrees.
    assert all(Storage.list_entries(storage, step_dir(s)) == storage.list_entries(step_dir(s)) for s in (1, 2, 3, 4, 5))
    local = Storage(str(tmp_path / "local"))
    (tmp_path / "local" / "s" / "sub").mkdir(parents=True)
    (tmp_path / "local" / "s" / "a.bin").write_bytes(b"xy")
    (tmp_path / "local" / "s" / "gone").symlink_to(tmp_path / "nowhere")
    assert local.list_entries("s") == Storage.list_entries(local, "s") == ({"a.bin": 2}, ["gone", "sub"])


def test_a_record_is_judged_by_its_writers_lease_where_longer(tmp_path):
    """Job A with lease_s=5 judged job B's record by its own lease: B (lease_s=600) refreshes
    every 150 s, so A's first save removed B's step while B wrote it (found by a helper). The
    record carries its writer's lease; the longer one decides, up to MAX_LEASE_S (a record
    claiming more, forged or garbled, does not hold its step for longer)."""
    import json
    import time

    storage = Storage(tmp_path / "root")
    lease = ownership.Lease(storage, step_dir(1), lease_s=600.0)
    lease.acquire()
    try:
        now = time.time()
        assert not ownership.is_stale(storage, step_dir(1), 5.0, now=now + 7)
        assert ownership.is_stale(storage, step_dir(1), 5.0, now=now + 601)
    finally:
        lease.release(committed=False)
    (tmp_path / "root" / step_dir(2)).mkdir()
    forged = {"writer": "x", "host": "elsewhere", "pid": 5, "time": time.time(), "lease_s": 1e12}
    (tmp_path / "root" / step_dir(2) / ownership.OWNER_NAME).write_text(json.dumps(forged))
    assert not ownership.is_stale(storage, step_dir(2), 5.0, now=time.time() + 3600)
    assert ownership.is_stale(storage, step_dir(2), 5.0, now=time.time() + ownership.MAX_LEASE_S + 10)
    for garbled in ("600", True, float("nan"), -1):
        (tmp_path / "root" / step_dir(2) / ownership.OWNER_NAME).write_text(json.dumps({**forged, "lease_s": garbled}))
        assert ownership.is_stale(storage, step_dir(2), 5.0, now=time.time() + 7), garbled  # the cleaner's lease


def test_a_local_listing_survives_odd_links_and_files_vanishing(tmp_path, monkeypatch):
    """A link whose text ends in '/' to a file (stat fails with ENOTDIR) made every listing of
    its folder a bare NotADirectoryError (a load_pretrained of that folder, a step holding it); a
    file deleted between the folder's scan and its stat made the whole folder list as empty."""
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"xyz")
    (folder / "b.bin").write_bytes(b"xy")
    (folder / "odd").symlink_to("a.bin/")
    local = Storage(str(folder))
    assert local.list_files() == {"a.bin": 3, "b.bin": 2}
    real = os.scandir

    class Vanishing:
        """scandir whose entry 'a.bin' is deleted after the scan, before its stat."""

        def __init__(self, path):
            self.entries = list(real(path))

        def __iter__(self):
            (folder / "a.bin").unlink(missing_ok=True)
            return iter(self.entries)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(os, "scandir", Vanishing)
    assert local.list_files() == {"b.bin": 2}
