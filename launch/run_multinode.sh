#!/usr/bin/env bash
# Run launch/train.py on several nodes: start this once per node, with the same RDZV_ENDPOINT.
#
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 launch/run_multinode.sh [train.py arguments...]
#   NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 launch/run_multinode.sh [train.py arguments...]
#
# Rendezvous is torchrun's c10d backend: the agent that can bind RDZV_ENDPOINT hosts the store,
# the others connect to it (NODE_RANK is informational there: ranks follow arrival order).
# --ckpt-dir must be shared by all nodes (a shared file system or an fsspec URL such as s3://).
# Shown on one machine as two nodes:
#
#   for n in 0 1; do NNODES=2 NODE_RANK=$n NPROC_PER_NODE=1 RDZV_ENDPOINT=127.0.0.1:29400 \
#       launch/run_multinode.sh --steps 40 --global-batch 12 --ckpt-dir /tmp/two_nodes & done; wait
#   launch/run_local.sh 3 --steps 80 --global-batch 12 --ckpt-dir /tmp/two_nodes   # resume on one node
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT (host:port)}"
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RDZV_ID=${RDZV_ID:-distckpt-train}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-120}
# One CPU thread per rank unless told otherwise: torchrun sets it only for more than one process
# per node, so a rank alone on its node computed with several threads, rounded otherwise, and a
# run moved between layouts of one world size (2 nodes x 1 -> 1 node x 2) was not bit-exact.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    "$HERE/train.py" "$@"
