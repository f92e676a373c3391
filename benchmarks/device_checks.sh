#!/usr/bin/env bash
# The GPU checks that decide how replicas are batched, in one prepared, time-boxed call (at most 8.5
# minutes; each block under its own hard timeout, JSON written as it goes).
#
#   bash benchmarks/device_checks.sh                     # results in $OUT (else benchmarks/results/device/)
#   QUICK=1 bash benchmarks/device_checks.sh             # CPU smoke test of every block (tiny model)
#
# Blocks (budgets in seconds, changeable through the environment):
#   speed_bf16   (SPEED_BF16_S=200) benchmarks/replica_speed.py, ResNet-14 bfloat16, R=16: the ceiling (one
#                replica at batch 16x128), the real loop, vmap with the weight gradient grouped / in
#                backward-filter form (bgc) / mapped, the fused loop (unrolled); under the control arm's
#                determinism flags (the headline) and XLA's defaults; replica-position invariance per row
#   speed_f32    (SPEED_F32_S=100)  the same in float32 (TF32), fewer candidates
#   speed_r18    (SPEED_R18_S=80)   ResNet-18 bfloat16, R=16: loop, ceiling, vmap:rhs=bgc, unrolled
#   concurrent   (CONCURRENT_S=40)  the fused loop again with XLA's concurrent command-buffer scheduling
#   profile      (PROFILE_S=30)     jax.profiler traces of one vmap epoch, grouped and bgc, into $OUT/profile
#   hardware     (HARDWARE_S=60)    the hardware arm (determinism flags off, a fresh process per replica)
#                at R=4 on a short study, then the per-tensor ulp differences between its replicas
# Afterwards: `python benchmarks/replica_speed.py --table-from $OUT/speed_bf16.json` prints the measured
# rule, and nondet_jax/machine/measured.json follows the numbers (by hand, in the commit that adds them).
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-benchmarks/results/device}"
mkdir -p "$O"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
QUICK="${QUICK:-}"
SPEED_BF16_S="${SPEED_BF16_S:-200}"
SPEED_F32_S="${SPEED_F32_S:-100}"
SPEED_R18_S="${SPEED_R18_S:-80}"
CONCURRENT_S="${CONCURRENT_S:-40}"
PROFILE_S="${PROFILE_S:-30}"
HARDWARE_S="${HARDWARE_S:-60}"
t0=$SECONDS
part() {  # part NAME SECONDS COMMAND...: run under a hard timeout, log to $O/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== [$((SECONDS - t0)) s] $name (limit ${limit} s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$O/$name.log" 2>&1
  echo "== [$((SECONDS - t0)) s] $name exit $?"
  tail -n 20 "$O/$name.log"
}
{
  [ -n "$QUICK" ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  $PY -c "import sys, jax, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())"
} > "$O/env.txt" 2>&1
cat "$O/env.txt"
if [ -n "$QUICK" ]; then  # every block's Python path on the CPU, tiny
  export JAX_PLATFORMS=cpu
  SIZE=(--model resnet8 --image 8 --replicas 2 --steps 2 --epochs 1)
  SPEED_BF16_S=300 SPEED_F32_S=300 SPEED_R18_S=300 CONCURRENT_S=200 PROFILE_S=200 HARDWARE_S=300
  R18=(--model resnet8)
else
  SIZE=(--model resnet14 --replicas 16 --steps 16 --epochs 2)
  R18=(--model resnet18)
fi
S=(--timeout 0)  # each child's own limit: the block's timeout already bounds it
part speed_bf16 "$SPEED_BF16_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" --dtype bfloat16 "${S[@]}" \
  --out "$O/speed_bf16.json"
part speed_f32 "$SPEED_F32_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" --dtype float32 "${S[@]}" \
  --candidates loop,ceiling,vmap:grouped,vmap:rhs=bgc,unrolled --out "$O/speed_f32.json"
part speed_r18 "$SPEED_R18_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" "${R18[@]}" --dtype bfloat16 "${S[@]}" \
  --candidates loop,ceiling,vmap:rhs=bgc,unrolled --flags determinism --out "$O/speed_r18.json"
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_enable_concurrent_region=true"
[ -n "$QUICK" ] && CB=""
XLA_FLAGS="$(echo ${XLA_FLAGS:-} $CB)" part concurrent "$CONCURRENT_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" \
  --dtype bfloat16 "${S[@]}" --candidates loop,unrolled --flags default --out "$O/concurrent.json"
part profile "$PROFILE_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" --dtype bfloat16 "${S[@]}" \
  --candidates vmap:grouped,vmap:rhs=bgc --flags determinism --profile "$O/profile" --out "$O/profile.json"
HW=(--model resnet8 --epochs 2 --replicas 4 --arms control,hardware --set study.hardware_processes=replica
    --no-progress --out "$O/hardware_run")
[ -n "$QUICK" ] && HW=(--model mlp --epochs 1 --replicas 2 --arms control,hardware --no-progress --out "$O/hardware_run")
part hardware "$HARDWARE_S" bash -c "$PY -m nondet_jax.sweep ${HW[*]} && $PY benchmarks/replica_speed.py \
  --ulps-of $O/hardware_run --out $O/hardware_ulps.json"
echo "== [$((SECONDS - t0)) s] done; results in $O"
