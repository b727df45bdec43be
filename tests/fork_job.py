"""A process that forks while an async save runs (used by tests/test_async.py). The child tries
a save (refused), then exits normally: its exit must neither wait for the parent's save (it hung
forever) nor close the parent's writer process. Prints one JSON line from the parent.

    python tests/fork_job.py ROOT MODE
"""

import json
import os
import sys
import time

import torch

import distckpt

root, mode = sys.argv[1], sys.argv[2]
ck = distckpt.Checkpointer(root, async_mode=mode)
w = torch.full((1 << 20,), 3.0)
ck.save(1, {"w": w}, blocking=False)
ck.wait()
ck.save(2, {"w": w}, blocking=False)  # in flight at the fork (or just done)
pid = os.fork()
if pid == 0:
    try:
        ck.save(3, {"w": w})
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    sys.exit(0 if "forked from process" in refused else 3)  # a normal exit: atexit and finalizers run
deadline = time.monotonic() + 60
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done or time.monotonic() > deadline:
        break
    time.sleep(0.05)
if not done:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
child = os.waitstatus_to_exitcode(status) if done else "hung"
ck.wait()
writer = ck._saver.writer
alive = writer is None or writer.proc.poll() is None
ck.save(4, {"w": w}, blocking=False)
ck.close()
print(json.dumps({"child": child, "writer_alive": alive, "steps": distckpt.Checkpointer(root).steps()}))
