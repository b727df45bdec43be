"""One rank of a job that did everything right, then exits (used by tests/test_exit.py).

It loads a checkpoint, catches a distckpt error and keeps it in a variable (as user code does),
saves asynchronously, calls ``dist.destroy_process_group()`` and returns from the script while a
module-level Checkpointer is still referenced. distckpt's own gloo group must not outlive the
interpreter into finalisation, where its threads abort the process (SIGABRT, "terminate called
without an active exception") and torchrun counts the job as failed.

    python tests/exit_job.py RANK WORLD ROOT STORE_FILE STEP [ASYNC_MODE]
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import distckpt

rank, world, root, store, step = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
mode = sys.argv[6] if len(sys.argv) > 6 else "process"
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60))
ckpt = distckpt.Checkpointer(root, async_mode=mode)
model = torch.nn.Linear(8, 8)
if ckpt.latest_step() is not None:
    try:
        ckpt.load({"model": model, "not_saved": torch.zeros(2)})
    except distckpt.StateMismatchError as exc:
        kept = exc  # its traceback holds frames that reference the checkpointer's group
        ckpt.load({"model": model})
ckpt.save(step, {"model": model}, blocking=False)
ckpt.wait()
dist.destroy_process_group()
print(f"rank {rank} done")
