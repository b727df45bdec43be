"""One rank of a job that destroys the process group while an async save is still running
(used by tests/test_exit.py): step 4 saved and committed, step 5 saved with ``blocking=False``
(its write held until the group is gone, so the order is certain), then
``dist.destroy_process_group()`` and the end of the script.

    python tests/destroy_job.py RANK WORLD ROOT STORE_FILE
"""

import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import distckpt
from distckpt.save import phases

rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60))
gone = threading.Event()
write = phases.write


def held_write(*args, **kwargs):
    gone.wait(60)
    return write(*args, **kwargs)


ckpt = distckpt.Checkpointer(root, keep_last=1, async_mode="thread")
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
state = {"model": model, "position": distckpt.PerRank(torch.full((4,), float(rank)))}
ckpt.save(4, state)
phases.write = held_write
ckpt.save(5, state, blocking=False)
dist.destroy_process_group()
gone.set()
print(f"rank {rank} done", flush=True)
