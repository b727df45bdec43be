"""Conditional puts whose answer is lost: the put landed, the connection dropped before the
client heard, botocore retried and the store answered 412 (it exists). The writer's own record
or manifest was then taken for another writer's: a committed step reported lost (no retention,
no upload to the replica, and a retry refused as a second commit), or a claim that blocked its
own step for ``lease_s``. Real S3 server (moto) behind a proxy that drops the chosen answer."""

from __future__ import annotations

import pytest
import torch

import distckpt
from fault_proxy import LosingProxy

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"), pytest.mark.timeout(180)]

STEP2 = "step_000000002/"


@pytest.fixture
def proxy(s3_server):
    p = LosingProxy(s3_server.port)
    yield p
    p.close()


@pytest.mark.parametrize("blocking, mode", [(True, "process"), (False, "process"), (False, "thread")])
def test_a_commit_whose_answer_is_lost_is_this_writers(s3_bucket, proxy, blocking, mode):
    fired = proxy.lose_answer_once(STEP2 + "manifest.json")
    root = f"s3://{s3_bucket}/run"
    with distckpt.Checkpointer(root, keep_last=1, storage_options=proxy.storage_options, async_mode=mode) as ckpt:
        ckpt.save(1, {"w": torch.arange(10.0)})
        ckpt.save(2, {"w": torch.arange(10.0) * 2}, blocking=blocking)
        ckpt.wait()
        assert fired, "the manifest's put was never seen"
        assert ckpt.steps() == [2]  # committed, and this save's retention ran
        ckpt.save(3, {"w": torch.arange(10.0) * 3})
    state = {"w": torch.zeros(10)}
    with distckpt.Checkpointer(root, storage_options=proxy.storage_options) as again:
        assert again.load(state) == 3 and torch.equal(state["w"], torch.arange(10.0) * 3)


def test_a_claim_whose_answer_is_lost_is_this_writers(s3_bucket, proxy):
    fired = proxy.lose_answer_once(STEP2 + ".owner")
    root = f"s3://{s3_bucket}/run"
    with distckpt.Checkpointer(root, storage_options=proxy.storage_options) as ckpt:
        ckpt.save(1, {"w": torch.arange(10.0)})
        ckpt.save(2, {"w": torch.arange(10.0) * 2})
        assert fired and ckpt.steps() == [1, 2]
    state = {"w": torch.zeros(10)}
    with distckpt.Checkpointer(root, storage_options=proxy.storage_options) as again:
        assert again.load(state) == 2 and torch.equal(state["w"], torch.arange(10.0) * 2)


def test_a_replica_commit_whose_answer_is_lost_is_uploaded(tmp_path, s3_bucket, proxy):
    fired = proxy.lose_answer_once("step_000000001/manifest.json")
    replica = f"s3://{s3_bucket}/replica"
    with distckpt.Checkpointer(
        tmp_path / "root", replicate_to=replica, replicate_storage_options=proxy.storage_options
    ) as ckpt:
        ckpt.save(1, {"w": torch.arange(10.0)})
        status = ckpt.replica.wait(timeout=120)
        assert fired and status.uploaded == (1,) and not status.failed, status
        assert ckpt.steps(tier="replica") == [1]


def test_another_writers_record_is_still_refused(s3_bucket, s3_server):
    """(passes) The same-bytes rule never takes another writer's commit for this one's."""
    root = f"s3://{s3_bucket}/run"
    with distckpt.Checkpointer(root, storage_options=s3_server.storage_options) as first:
        first.save(1, {"w": torch.arange(10.0)})
    with distckpt.Checkpointer(root, storage_options=s3_server.storage_options) as second:
        with pytest.raises(distckpt.StepExistsError):
            second.save(1, {"w": torch.arange(10.0)})
