#!/bin/bash
# The GPU checks of one lent device call (../.library/device): the CUDA tier, the overflow probe,
# the bitwise rerun of the first probe's gpu_correct.py, then benchmarks/gpu.py alone. Logs go to
# $OUT (or /tmp/device_check). Only the checkout travels: carry `.whl` holding the crc32c wheel for
# the machine's Python (3.12); its torch (2.11) is used as is.
#   usage: bash tests/gpu/device_check.sh [tests] [probes] [bench]     (default: tests bench)
# Measured on one H100 (2026-11-26): probes ~190 s, benchmark ~160 s, the tier over 320 s
# (11 of its 17 tests in 320 s beside the probes; their answer is in results/h100-2026-11-26,
# so they are no longer run by default). A session has 15 minutes of device time, the machine's
# start included: run the default once, with timeout_s 600.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1
O=${OUT:-/tmp/device_check}; mkdir -p "$O"
T0=$(date +%s); WHAT=${*:-tests bench}
rm -rf /tmp/pytest-of-* benchmarks/.scratch /tmp/gcb  # a warm machine keeps the last call's GBs
{ nvidia-smi -L; python3 -c 'import torch,sys;print(torch.__version__, torch.version.cuda, sys.version)'
  python3 -m pip list 2>/dev/null | grep -i -E '^(pytest|pytest-xdist|pytest-timeout|numpy|fsspec|crc32c) '
  df -h /tmp /dev/shm; nproc; free -g; } > "$O/env.txt" 2>&1
stamp() { echo "rc=$1 t=$(( $(date +%s)-T0 ))s" >> "$2"; }
if [[ " $WHAT " == *" probes "* ]]; then
  ( timeout 100 python3 tests/gpu/overflow_probe.py > "$O/overflow.txt" 2>&1; stamp $? "$O/overflow.txt"
    cd /tmp && timeout 240 torchrun --nproc-per-node 1 "$REPO/tests/gpu/gpu_correct_bits.py" /tmp/gcb > "$O/correct_bits.txt" 2>&1
    stamp $? "$O/correct_bits.txt"; rm -rf /tmp/gcb ) &
fi
if [[ " $WHAT " == *" tests "* ]]; then
  # The tests not yet run on a GPU first (the H100 call of 2026-11-26 ran out of time before them).
  X=tests/gpu/test_cuda_exactness.py
  timeout "${TIER_TIMEOUT:-350}" python3 -m pytest -v -p no:cacheprovider -rA --durations=0 \
    tests/gpu/test_nccl_collectives.py $X::test_sync_saves_are_exact $X::test_fsdp2_saves_are_exact \
    $X::test_special_values_are_exact tests/gpu/test_cuda_d2h.py $X::test_async_saves_are_exact > "$O/tests_gpu.txt" 2>&1
  stamp $? "$O/tests_gpu.txt"
fi
wait
if [[ " $WHAT " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-230}" python3 benchmarks/gpu.py --repeats 3 --out "$O/gpu.json" > "$O/bench.txt" 2>&1
  stamp $? "$O/bench.txt"
fi
for f in env overflow correct_bits tests_gpu bench; do
  [ -f "$O/$f.txt" ] && { echo "=== $f"; grep -v -i warn "$O/$f.txt" | tail -n 24 | cut -c1-220; }
done
