#!/usr/bin/env bash
# Run launch/train.py on N local processes: gloo on CPU, NCCL with one GPU per process.
#
#   launch/run_local.sh N [train.py arguments...]
#   launch/run_local.sh 2 --parallel fsdp --steps 200 --global-batch 12 --ckpt-dir /tmp/run1 \
#       --save-every 50 --async --log-file /tmp/run1.jsonl
#
# Run it again (any N dividing --global-batch) to resume from the newest checkpoint.
# SIGTERM/SIGINT/SIGUSR1 to this script (it execs torchrun) reach every rank: each finishes its
# step, saves synchronously and exits 0 (torchrun itself then exits non-zero: it re-raises the
# signal after its workers are done).
# PYTHON selects the interpreter (default: python3 on PATH, e.g. an activated venv).
set -euo pipefail
if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NPROC [train.py arguments...]" >&2
    exit 2
fi
NPROC=$1
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# torchrun's --signals-to-handle/--shutdown-timeout as environment variables (versions without
# them ignore these): forward SIGUSR1 too, and give ranks time to save before SIGKILL.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-120}
# One CPU thread per rank unless told otherwise: torchrun sets it only for more than one process
# per node, so a rank alone on its node computed with several threads, rounded otherwise, and a
# run moved between layouts of one world size (2 nodes x 1 -> 1 node x 2) was not bit-exact.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    "$HERE/train.py" "$@"
