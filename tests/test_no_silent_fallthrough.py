"""No silent fall-throughs (trust round 3): metadata the manifest cannot hold exactly, an empty
root, storage options for a local path, load patterns that match nothing, checkpoints without
checksums loaded unverified, and retention deleting another job's steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from exactness import flip_a_stored_bit
from distckpt.state.statecheck import StateDivergedError

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _state() -> dict:
    return {"model": torch.nn.Linear(4, 3), "step": 1}


@pytest.mark.parametrize(
    "metadata,error,match",
    [
        ({"loss": float("nan")}, ValueError, r"metadata\['loss'\] is nan"),
        ({"best": {"acc": float("inf")}}, ValueError, r"metadata\['best'\]\['acc'\] is inf"),
        ({"shape": (2, 3)}, TypeError, "tuple, which would read back as a list"),
        ({"by_step": {10: 0.5}}, TypeError, "key 10 .int.; JSON keys are strings"),
        ({"when": Path("/x")}, TypeError, "metadata holds JSON values only"),
        ([1, 2], TypeError, "must be a dict"),
    ],
)
def test_metadata_must_be_json_that_reads_back_equal(tmp_path, metadata, error, match):
    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(error, match=match):
            ckpt.save(1, _state(), metadata=metadata)
        assert ckpt.steps() == []


def test_deep_metadata_is_a_clear_error_not_a_recursion_error(tmp_path):
    deep: dict = {}
    node = deep
    for _ in range(2000):
        node["x"] = {}
        node = node["x"]
    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(TypeError, match="nested deeper than 32 levels"):
            ckpt.save(1, _state(), metadata=deep)


def test_valid_metadata_reads_back_equal(tmp_path):
    meta = {"run": "a", "lr": 3e-4, "steps": [1, 2, 3], "nested": {"ok": True, "none": None}, "big": 2**70}
    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, _state(), metadata=meta)
        assert ckpt.manifest(1).extra == meta


class _Tag(str):
    """A str subclass defined in the test module: the async writer process cannot import it."""


@pytest.mark.parametrize("blocking", [True, False])
def test_str_subclasses_in_metadata_are_stored_as_str(tmp_path, blocking):
    """A str subclass in metadata was sent to the async writer process as it was: the writer
    died unpickling it, and the save failed with 'exited (code 1)' (found by a helper,
    2026-12-07, /tmp/attack82). Keys too."""
    import enum

    class Kind(str, enum.Enum):  # its str() is "Kind.A", its text "alpha"
        A = "alpha"

    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, _state(), metadata={"tag": _Tag("run-a"), _Tag("k"): [_Tag("x")], "kind": Kind.A, Kind.A: 1}, blocking=blocking)
        ckpt.wait()
        extra = ckpt.manifest(1).extra
    assert extra == {"tag": "run-a", "k": ["x"], "kind": "alpha", "alpha": 1} and type(extra["tag"]) is str


def test_a_key_that_is_not_unicode_fails_the_save_naming_it(tmp_path):
    class Obj:
        def state_dict(self):
            return {"k\ud800": torch.ones(1)}

        def load_state_dict(self, sd):
            pass

    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(TypeError, match=r"'o\.k\\ud800'.*lone surrogate"):
            ckpt.save(1, {"o": Obj()})
        ckpt.save(2, _state())
        assert ckpt.steps() == [2]


def test_an_empty_root_and_local_storage_options_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for root in ("", "   ", None, 3):
        with pytest.raises(ValueError, match="root must be a local path or an fsspec URL"):
            distckpt.Checkpointer(root)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory
    with pytest.raises(ValueError, match="storage_options configure the filesystem of a URL"):
        distckpt.Checkpointer(str(tmp_path / "ck"), storage_options={"key": "x"})
    with distckpt.Checkpointer(tmp_path / "ck") as ckpt:  # a Path is a root
        ckpt.save(1, _state())
        assert ckpt.steps() == [1]


def test_load_patterns_that_match_nothing_are_errors(tmp_path):
    optim_model = torch.nn.Linear(4, 3)
    state = {"model": optim_model, "optim": torch.optim.SGD(optim_model.parameters(), lr=0.1), "step": 1}
    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(ValueError, match=r"exclude='optm'.*matches nothing.*entries: \['_rng', 'model', 'optim', 'step'\]"):
            ckpt.load(state, exclude="optm")
        with pytest.raises(ValueError, match=r"only='model.bais'") as info:
            ckpt.load(state, only=["model.weight", "model.bais"])
        assert "model.weight" not in str(info.value)
        ckpt.load(state, only=["model.weight", "model.bias"])  # patterns that match load as before
        ckpt.load(state, exclude=["optim", "_rng"])


def _one_rank_typo(rank: int, world: int, root: str) -> str:
    model = torch.nn.Linear(4, 3)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model})
        try:
            ckpt.load({"model": model}, exclude="_rng" if rank == 0 else "_rgn")
        except ValueError as exc:
            return str(exc)
    return "loaded"


def test_a_pattern_wrong_on_one_rank_fails_every_rank(tmp_path):
    out = run_ranks(_one_rank_typo, 2, tmp_path, str(tmp_path / "ck"))
    assert all("exclude='_rgn'" in o for o in out), out


def test_a_checkpoint_without_checksums_is_verified_by_its_fingerprints(tmp_path):
    # The probe: a flipped bit loaded as 512.00006 with no error, although the manifest held the
    # tensor's fingerprint. Checked by default now; verify_state=False opts out explicitly.
    w = torch.full((64,), 512.0)
    with distckpt.Checkpointer(str(tmp_path), checksum=None) as ckpt:
        ckpt.save(1, {"w": w.clone()})
    flip_a_stored_bit(tmp_path, w)
    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(StateDivergedError, match="w"):
            ckpt.load({"w": torch.zeros(64)})
        back = {"w": torch.zeros(64)}
        ckpt.load(back, verify_state=False)
        assert not torch.equal(back["w"], w)  # what opting out means


def _committed_jobs(root: Path) -> dict[int, str]:
    return {
        int(d.name.split("_")[1]): json.loads((d / "manifest.json").read_text())["job"]
        for d in root.iterdir()
        if (d / "manifest.json").exists()
    }


def test_jobs_sharing_a_root_never_delete_each_others_steps(tmp_path):
    a = distckpt.Checkpointer(str(tmp_path), keep_last=2)
    b = distckpt.Checkpointer(str(tmp_path), keep_last=2)
    for step in (1, 2, 3):
        a.save(step, _state())
    for step in (10, 11, 12):
        b.save(step, _state())
    a.save(4, _state())
    assert a.steps() == [3, 4, 11, 12]
    jobs = _committed_jobs(tmp_path)
    assert jobs[3] == jobs[4] != jobs[11] == jobs[12]
    a.close()
    b.close()
    # A restarted run resumes from its own step with load(): it continues that job.
    again = distckpt.Checkpointer(str(tmp_path), keep_last=2)
    again.load(_state(), step=4)
    again.save(5, _state())
    assert again.steps() == [4, 5, 11, 12]
    # A new run that saves without loading is another job: it deletes nothing of the others.
    fresh = distckpt.Checkpointer(str(tmp_path), keep_last=1)
    fresh.save(20, _state())
    fresh.save(21, _state())
    assert fresh.steps() == [4, 5, 11, 12, 21]
    again.close()
    fresh.close()


def test_named_jobs_and_steps_saved_before_jobs_were_recorded(tmp_path):
    with distckpt.Checkpointer(str(tmp_path), keep_last=2, job="sweep-a") as a:
        for step in (1, 2):
            a.save(step, _state())
    # Manifests written by an older distckpt record no job.
    for d in tmp_path.iterdir():
        m = json.loads((d / "manifest.json").read_text())
        del m["job"]
        (d / "manifest.json").write_text(json.dumps(m))
    with distckpt.Checkpointer(str(tmp_path), keep_last=2, job="sweep-b") as b:
        b.save(3, _state())
        b.save(4, _state())
        b.save(5, _state())
        assert b.steps() == [1, 2, 4, 5]  # a named job leaves unattributed steps alone
    with distckpt.Checkpointer(str(tmp_path), keep_last=2) as resumed:
        resumed.load(_state(), step=2)  # a run resumed from an old step owns the old steps
        resumed.save(6, _state())
        assert resumed.steps() == [2, 4, 5, 6]
        resumed.save(7, _state())
        assert resumed.steps() == [4, 5, 6, 7]
    for bad in ("", " ", "a\nb", "nul\x00", "x" * 201, 5):
        with pytest.raises(ValueError, match="job must be None or a string of at most 200 characters, not blank"):
            distckpt.Checkpointer(str(tmp_path), job=bad)
    distckpt.Checkpointer(str(tmp_path), job="../x/é").close()  # never a path: any visible name


def test_a_root_inside_a_committed_step_is_refused(tmp_path):
    """launch/train.py --ckpt-dir run/step_000000008 (a resume from that step, one would think)
    started from scratch and wrote its steps into the committed step (found by a helper,
    2026-12-07, /tmp/attack81)."""
    import shutil

    with distckpt.Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save(8, _state())
    step = tmp_path / "run" / "step_000000008"
    shutil.copytree(step, tmp_path / "best")
    for root in (step, step / "sub", tmp_path / "best", tmp_path / "best" / "x" / "y"):
        with pytest.raises(ValueError, match=r"committed step .*Pass the checkpoint's root"):
            distckpt.Checkpointer(str(root))
    assert sorted(p.name for p in step.iterdir()) == sorted(p.name for p in (tmp_path / "best").iterdir())
    with distckpt.Checkpointer(str(tmp_path / "run")) as ckpt:  # the root itself, and a new one, as before
        assert ckpt.latest_step() == 8
    distckpt.Checkpointer(str(tmp_path / "new" / "deeper")).close()
    # A link to the step names where it really lies; replicate_to and local_dir are judged alike.
    (tmp_path / "link").symlink_to(step)
    with pytest.raises(ValueError, match=rf"Pass the checkpoint's root, {tmp_path / 'run'} "):
        distckpt.Checkpointer(str(tmp_path / "link"))
    with pytest.raises(ValueError, match=r"replicate_to .* lies inside the committed step"):
        distckpt.Checkpointer(str(tmp_path / "other"), replicate_to=str(step / "replica"))
    with pytest.raises(ValueError, match=r"local_dir .* lies inside the committed step"):
        distckpt.Checkpointer(str(tmp_path / "other"), local_dir=str(step / "tier"))
    # Folders holding someone else's manifest.json (a plain DCP checkpoint with a dataset's
    # manifest, a sweep folder named like a step) are no step: roots below them are fine.
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.ones(1)}, checkpoint_id=str(tmp_path / "exp1"))
    (tmp_path / "exp1" / "manifest.json").write_text('{"files": ["a.bin"]}')
    (tmp_path / "sweep" / "step_000000005").mkdir(parents=True)
    (tmp_path / "sweep" / "step_000000005" / "manifest.json").write_text("{}")
    for root in (tmp_path / "exp1" / "distckpt", tmp_path / "sweep" / "step_000000005" / "run"):
        distckpt.Checkpointer(str(root)).close()
