#!/bin/bash
# The GPU checks of one lent device call (../.library/device). Logs go to $OUT (or /tmp/device_check).
# Only the checkout travels: carry `.whl` holding the crc32c wheel for the machine's Python (3.12);
# its torch (2.11) is used as is.
#   usage: bash tests/gpu/device_check.sh [bench] [bench-disk] [tests] [probes]   (default: bench bench-disk)
#   bench:      benchmarks/gpu.py with its scratch in /dev/shm (tmpfs), up to BENCH_TIMEOUT (300 s);
#               BENCH_ARGS adds options (e.g. "--parts sync --ab-proof-chunk 4194304")
#   bench-disk: the same on the machine's disk (benchmarks/.scratch), up to DISK_TIMEOUT (250 s)
#   tests:      the CUDA tier, up to TIER_TIMEOUT (350 s; it needs ~410 s on an H200: select with TIER)
#   probes:     the overflow probe and the bitwise rerun of the first probe's gpu_correct.py
# Measured: on one H100 (2026-11-26) probes ~190 s, benchmark ~160 s on its disk; on one H200
# (2026-11-26) the whole tier passed in ~410 s (results/h200-2026-11-26), the benchmark's sync part
# took 72 s on tmpfs and more than 230 s on the disk. gpu.py prints every sample as it is measured,
# so a cut run still reports. A session has 15 minutes of device time, the machine's start included
# (~30 s): run the default once, with timeout_s 600. On one H100 (2026-11-27) the tmpfs run took
# 209 s (with an A/B row), the disk run more than 250 s (cut in its async rows).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1
O=${OUT:-/tmp/device_check}; mkdir -p "$O"
T0=$(date +%s); WHAT=${*:-bench bench-disk}
rm -rf /tmp/pytest-of-* benchmarks/.scratch /tmp/gcb /dev/shm/distckpt-gpu  # a warm machine keeps the last call's GBs
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
  X=tests/gpu/test_cuda_exactness.py
  # shellcheck disable=SC2086
  timeout "${TIER_TIMEOUT:-350}" python3 -m pytest -v -p no:cacheprovider -rA --durations=0 \
    ${TIER:-tests/gpu/test_cuda_load.py tests/gpu/test_cuda_tuple_values.py tests/gpu/test_nccl_collectives.py tests/gpu/test_cuda_d2h.py $X} > "$O/tests_gpu.txt" 2>&1
  stamp $? "$O/tests_gpu.txt"
fi
wait
if [[ " $WHAT " == *" bench "* ]]; then
  mkdir -p /dev/shm/distckpt-gpu  # (gpu.py makes its run folder inside an existing --dir)
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 -W ignore benchmarks/gpu.py --repeats 3 --dir /dev/shm/distckpt-gpu \
    ${BENCH_ARGS:-} --out "$O/gpu_tmpfs.json" > "$O/bench.txt" 2>&1
  stamp $? "$O/bench.txt"; rm -rf /dev/shm/distckpt-gpu
fi
if [[ " $WHAT " == *" bench-disk "* ]]; then
  timeout "${DISK_TIMEOUT:-250}" python3 -W ignore benchmarks/gpu.py --repeats 3 --out "$O/gpu_disk.json" > "$O/bench_disk.txt" 2>&1
  stamp $? "$O/bench_disk.txt"
fi
for f in env overflow correct_bits tests_gpu bench bench_disk; do
  [ -f "$O/$f.txt" ] && { echo "=== $f"; grep -v -i warn "$O/$f.txt" | tail -n 24 | cut -c1-220; }
done
