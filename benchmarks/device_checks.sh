#!/usr/bin/env bash
# Every GPU check of this project in one time-boxed call (about 9 minutes on one H200).
#
#   bash benchmarks/device_checks.sh            # results in $OUT (else benchmarks/results/device/)
#
# Runs, each under its own hard timeout so that one slow part cannot eat the others' time, and each
# writing its JSON as it goes (a part cut short keeps the rows it finished):
#   1. benchmarks/gpu_bench.py       replica throughput of the strategies (issue 6's GPU table)
#   2. benchmarks/instruments.py     instruments overhead, ResNet-14 32x32x3 and ResNet-8 digits
#   3. benchmarks/determinism_gpu.py hardware nondeterminism: spread and the cost of the flags
# The package runs from this checkout (PYTHONPATH) with the machine's own jax/flax/optax, so nothing
# is installed; the versions are printed first. Budgets (seconds) can be changed through the
# environment: GPU_BENCH_S, INSTRUMENTS_S, DETERMINISM_S.
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-benchmarks/results/device}"
mkdir -p "$O"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
GPU_BENCH_S="${GPU_BENCH_S:-250}"
INSTRUMENTS_S="${INSTRUMENTS_S:-160}"
DETERMINISM_S="${DETERMINISM_S:-130}"
t0=$SECONDS
part() {  # part NAME SECONDS COMMAND...: run under a hard timeout, log to $O/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== [$((SECONDS - t0)) s] $name (limit ${limit} s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$O/$name.log" 2>&1
  echo "== [$((SECONDS - t0)) s] $name exit $?"
  tail -n 30 "$O/$name.log"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  $PY -c "import sys, jax, flax, optax, orbax.checkpoint as oc; print(sys.version.split()[0], 'jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, 'orbax', oc.__version__, jax.devices())"
} > "$O/env.txt" 2>&1
cat "$O/env.txt"
part gpu_bench "$GPU_BENCH_S" $PY benchmarks/gpu_bench.py --budget-s $((GPU_BENCH_S - 70)) \
  --dtypes float32,bfloat16 --out "$O/gpu_bench.json"
part instruments "$INSTRUMENTS_S" $PY benchmarks/instruments.py --workloads resnet14_random,resnet8_digits \
  --rounds 3 --breakdown-after-s $((INSTRUMENTS_S - 50)) --out "$O/instruments.json"
part determinism "$DETERMINISM_S" $PY benchmarks/determinism_gpu.py --quick --parts spread,cost,audit \
  --out "$O/determinism_gpu.json"
echo "== done in $((SECONDS - t0)) s"
