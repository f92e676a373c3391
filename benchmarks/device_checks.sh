#!/usr/bin/env bash
# Every GPU check of this project in one time-boxed call (about 11 minutes on one H200; the
# throughput part alone, PARTS=throughput, at most 6 minutes).
#
#   bash benchmarks/device_checks.sh                     # results in $OUT (else benchmarks/results/device/)
#   PARTS=throughput bash benchmarks/device_checks.sh    # replica throughput only (<= 360 s)
#   QUICK=1 PARTS=throughput bash benchmarks/device_checks.sh   # CPU smoke test of the Python parts
#
# Runs, each under its own hard timeout so that one slow part cannot eat the others' time, and each
# writing its JSON as it goes (a part cut short keeps the rows it finished):
#   throughput  (PARTS word "throughput")
#     1. benchmarks/vmap_convs.py    each conv formulation per conv shape of ResNet-14/18 at R=16,
#                                    batch 128 (forward, input and weight gradient); afterwards
#                                    `python benchmarks/vmap_convs.py --table-from <its json>` makes it
#                                    the GPU table in nondet_jax/measured.json
#     2. benchmarks/gpu_bench.py     whole training steps: sequential, vmap with each formulation forced,
#                                    float32 and bfloat16, R = 16 then 64 (docs/benchmarks.md's GPU tables)
#     3. gpu_flags                   sequential R=1 ResNet-14 steps (the small programs) under XLA GPU flag sets
#                                    for small programs (command buffers incl. cuDNN convolutions, autotune
#                                    level), one process per set (an unknown flag fails its set only)
#   instruments  benchmarks/instruments.py     instruments overhead, ResNet-14 32x32x3 and ResNet-8 digits
#   determinism  benchmarks/determinism_gpu.py hardware nondeterminism: spread and the cost of the flags
# The package runs from this checkout (PYTHONPATH) with the machine's own jax/flax/optax, so nothing
# is installed; the versions are printed first. Budgets (seconds) can be changed through the
# environment: VMAP_CONVS_S, GPU_BENCH_S, GPU_FLAGS_S, INSTRUMENTS_S, DETERMINISM_S.
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-benchmarks/results/device}"
mkdir -p "$O"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
PARTS="${PARTS:-throughput instruments determinism}"
QUICK="${QUICK:-}"
VMAP_CONVS_S="${VMAP_CONVS_S:-100}"
GPU_BENCH_S="${GPU_BENCH_S:-140}"
GPU_FLAGS_S="${GPU_FLAGS_S:-120}"
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
has() { [[ " $PARTS " == *" $1 "* ]]; }
{
  [ -n "$QUICK" ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  $PY -c "import sys, jax, flax, optax, orbax.checkpoint as oc; print(sys.version.split()[0], 'jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, 'orbax', oc.__version__, jax.devices())"
} > "$O/env.txt" 2>&1
cat "$O/env.txt"
if has throughput; then
  if [ -n "$QUICK" ]; then  # every Python path of the part on CPU, in about a minute
    export JAX_PLATFORMS=cpu
    GPU_FLAGS_S=400  # two CPU sets of a compile-bound smoke row, on a shared machine
    part vmap_convs 300 $PY benchmarks/vmap_convs.py --quick --out "$O/vmap_convs.json"
    part gpu_bench 300 $PY benchmarks/gpu_bench.py --quick --strategies sequential,vmap_im2col --dtypes float32,bfloat16 \
      --out "$O/gpu_bench.json"
    FLAG_SETS=("default|" "eigen_1thread|--xla_cpu_multi_thread_eigen=false")  # CPU stand-ins for the GPU sets
    BENCH_ARGS=(--quick --strategies sequential --dtypes float32)
  else
    part vmap_convs "$VMAP_CONVS_S" $PY benchmarks/vmap_convs.py --models resnet14,resnet18 --replicas 16 \
      --batch 128 --reps 5 --budget-s $((VMAP_CONVS_S - 40)) --out "$O/vmap_convs.json"
    part gpu_bench "$GPU_BENCH_S" $PY benchmarks/gpu_bench.py --budget-s $((GPU_BENCH_S - 40)) --models resnet14 \
      --dtypes float32,bfloat16 --replicas 16,64 \
      --strategies sequential,vmap,vmap_grouped,vmap_map,vmap_im2col,vmap_shifted --epochs 2 --out "$O/gpu_bench.json"
    FLAG_SETS=("default|"
               "command_buffer_with_cudnn|--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
               "command_buffer_off|--xla_gpu_enable_command_buffer="
               "autotune_0|--xla_gpu_autotune_level=0")
    BENCH_ARGS=(--models resnet14 --dtypes float32 --strategies sequential --epochs 2)
  fi
  per_set=$((GPU_FLAGS_S / ${#FLAG_SETS[@]}))
  for entry in "${FLAG_SETS[@]}"; do  # one process per flag set: flags are read when the backend starts
    name=${entry%%|*} flags=${entry#*|}
    XLA_FLAGS="$(echo ${XLA_FLAGS:-} $flags)" part "gpu_flags_$name" "$per_set" $PY benchmarks/gpu_bench.py "${BENCH_ARGS[@]}" \
      --budget-s $((per_set - 10)) --out "$O/gpu_flags_$name.json"
  done
fi
has instruments && part instruments "$INSTRUMENTS_S" $PY benchmarks/instruments.py --workloads resnet14_random,resnet8_digits \
  --rounds 3 --breakdown-after-s $((INSTRUMENTS_S - 50)) --out "$O/instruments.json"
has determinism && part determinism "$DETERMINISM_S" $PY benchmarks/determinism_gpu.py --quick --parts spread,cost,audit \
  --out "$O/determinism_gpu.json"
echo "== done in $((SECONDS - t0)) s"
