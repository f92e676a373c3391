#!/usr/bin/env bash
# The GPU checks that decide how replicas are batched, in one prepared, time-boxed call: at most 8.5 minutes (500 s of blocks)
# with JAX's compiles, every block under its own hard timeout, on a machine that already has JAX (nothing is
# installed or downloaded).
#
#   bash benchmarks/device_checks.sh                        # results in $OUT (else benchmarks/results/device/)
#   QUICK=1 bash benchmarks/device_checks.sh                # every block's path on the CPU, tiny sizes
#   QUICK=1 QUICK_SCALE=3 ONLY=smoke,speed_r18 bash ...     # a loaded CPU: limits x3; only the blocks named
#
# Everything is written into a work folder ($WORK, else a new temporary one) and packed into $OUT at the end
# and from the EXIT/INT/TERM trap (benchmarks/device_pack.py): the result JSONs (smoke, speed_bf16, speed_f32,
# speed_r18, defaults, hardware), logs.tar.gz (env, every log, the hardware study's records) and
# profile.tar.gz (the traces, under 16 MiB): at most 8 files, none more than two folders down, which is what
# a device call brings back. Every block's JSON exists before the block starts and says how the block ended
# ("status": complete, interrupted or failed; "block": exit code, seconds, limit). The blocks share one
# persistent compilation cache, so the profile and a rerun compile nothing twice.
#
# Blocks (limits in seconds, changeable through the environment), most important first:
#   smoke       (SMOKE_S=40)      devices, versions, imports, one tiny jit; without a GPU (and without QUICK)
#                                 the run stops here
#   speed_bf16  (SPEED_BF16_S=160) benchmarks/replica_speed.py, ResNet-14 bfloat16, R=16, under the control
#                                 arm's determinism flags: the real loop (the study's sequential path), the
#                                 ceiling (one replica at batch 16x128), vmap with the weight gradient in
#                                 backward-filter form (bgc) and grouped, the loop driven step by step, the
#                                 fused loop (unrolled); the two vmap rows traced (their top kernels in the JSON)
#   hardware    (HARDWARE_S=130)  the hardware arm (determinism flags off, a fresh process per replica, no
#                                 caches) at R=4 on a short study, then the per-tensor ulp differences
#   speed_f32   (SPEED_F32_S=60)  ResNet-14 float32 (TF32): loop, ceiling, vmap bgc and grouped
#   speed_r18   (SPEED_R18_S=65)  ResNet-18 bfloat16, R=16: loop, ceiling, vmap bgc
#   defaults    (DEFAULTS_S=45)   ResNet-14 bfloat16 under XLA's defaults: loop and vmap bgc (the flags' cost)
# Afterwards: `python benchmarks/replica_speed.py --table-from speed_bf16.json` prints the measured rule, and
# nondet_jax/machine/measured.json follows the numbers (by hand, in the commit that adds them).
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-benchmarks/results/device}"
W="${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/nondet_jax_device.XXXXXX")}"
mkdir -p "$O" "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# one persistent compilation cache for every block (the hardware arm's replica processes turn it off themselves)
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$W/jax_cache}" \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
export NONDET_JAX_COMPILE_CACHE="$JAX_COMPILATION_CACHE_DIR"
PY="${PYTHON:-python3}"
QUICK="${QUICK:-}"
ONLY="${ONLY:-smoke,speed_bf16,hardware,speed_f32,speed_r18}"
SMOKE_S="${SMOKE_S:-40}" SPEED_BF16_S="${SPEED_BF16_S:-180}" HARDWARE_S="${HARDWARE_S:-160}"
SPEED_F32_S="${SPEED_F32_S:-60}" SPEED_R18_S="${SPEED_R18_S:-60}" DEFAULTS_S="${DEFAULTS_S:-60}"
if [ -n "$QUICK" ]; then  # the CPU: each limit is QUICK_LIMIT_S x QUICK_SCALE (raise the scale on a loaded machine)
  export JAX_PLATFORMS=cpu
  q=$(( ${QUICK_LIMIT_S:-120} * ${QUICK_SCALE:-1} ))
  SMOKE_S=$q SPEED_BF16_S=$q HARDWARE_S=$q SPEED_F32_S=$q SPEED_R18_S=$q DEFAULTS_S=$q
fi
t0=$SECONDS
packed=""
pack() {
  [ -n "$packed" ] && return
  packed=1
  $PY benchmarks/device_pack.py pack "$W" "$O"
  echo "== [$((SECONDS - t0)) s] packed into $O (work folder $W)"
}
trap pack EXIT
trap 'echo "== interrupted"; exit 130' INT TERM
wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
part() {  # part NAME SECONDS COMMAND...: its JSON first, the command under a hard timeout, the JSON marked after
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  echo "== [$((SECONDS - t0)) s] $name (limit ${limit} s)"
  echo "{\"status\": \"running\", \"block\": {\"name\": \"$name\", \"limit_s\": $limit}}" > "$W/$name.json"
  local s=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  $PY benchmarks/device_pack.py mark "$W/$name.json" --block "$name" --exit $rc --seconds $((SECONDS - s)) \
    --limit "$limit" > /dev/null
  echo "== [$((SECONDS - t0)) s] $name exit $rc"
  tail -n 25 "$W/$name.log"
  return $rc
}
if [ -n "$QUICK" ]; then  # every block's Python path on the CPU, tiny
  SIZE=(--model resnet8 --image 8 --replicas 2 --steps 2 --epochs 1)
  R18=(--model mlp)  # the smallest stand-in: the CI test of this script runs this block
  HW=(--model mlp --epochs 1 --replicas 2 --arms control,hardware --no-progress --out "$W/hardware_run")
else
  SIZE=(--model resnet14 --replicas 16 --steps 16 --epochs 2)
  R18=(--model resnet18)
  HW=(--model resnet8 --epochs 2 --replicas 4 --arms control,hardware --set study.hardware_processes=replica
      --no-progress --out "$W/hardware_run")
fi
S=(--timeout 0)  # each child's own limit: the block's timeout already bounds it
{
  [ -n "$QUICK" ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  echo "work folder $W, blocks $ONLY"
} > "$W/env.txt" 2>&1
cat "$W/env.txt"
part smoke "$SMOKE_S" $PY -c "
import json, sys, time
t = time.perf_counter()
import jax, jaxlib, jax.numpy as jnp, flax, optax, chex, orbax.checkpoint, nondet_jax
from nondet_jax.machine.determinism import DETERMINISM_ON
x = jnp.ones((512, 512), jnp.bfloat16)
y = jax.jit(lambda a: (a @ a).sum())(x).block_until_ready()
rec = {'python': sys.version.split()[0], 'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'flax': flax.__version__,
       'optax': optax.__version__, 'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
       'device_kind': jax.devices()[0].device_kind, 'jit_ok': float(y) == 512.0 ** 3,
       'seconds': time.perf_counter() - t, 'determinism_flags': list(DETERMINISM_ON)}
print(json.dumps(rec, indent=1))
json.dump(rec, open('$W/smoke.json', 'w'))
"
smoke_rc=$?
if wanted smoke; then
  if [ $smoke_rc -ne 0 ]; then echo "== smoke failed: no further block"; exit 1; fi
  if [ -z "$QUICK" ] && ! grep -q '"backend": "gpu"' "$W/smoke.json"; then
    echo "== no GPU backend (see smoke.json): no further block"; exit 1
  fi
fi
part speed_bf16 "$SPEED_BF16_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" --dtype bfloat16 "${S[@]}" \
  --candidates loop,ceiling,vmap:grouped,vmap:rhs=bgc,unrolled --flags determinism \
  --profile "$W/profile" --profile-candidates vmap:grouped,vmap:rhs=bgc --out "$W/speed_bf16.json"
part hardware "$HARDWARE_S" bash -c "$PY -m nondet_jax.sweep ${HW[*]} && $PY benchmarks/replica_speed.py \
  --ulps-of $W/hardware_run --out $W/hardware.json"
part speed_f32 "$SPEED_F32_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" --dtype float32 "${S[@]}" \
  --candidates loop,ceiling,vmap:grouped,vmap:rhs=bgc --flags determinism --out "$W/speed_f32.json"
part speed_r18 "$SPEED_R18_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" "${R18[@]}" --dtype bfloat16 "${S[@]}" \
  --candidates loop,ceiling,vmap:grouped --flags determinism --out "$W/speed_r18.json"
part defaults "$DEFAULTS_S" $PY benchmarks/replica_speed.py "${SIZE[@]}" --dtype bfloat16 "${S[@]}" \
  --candidates loop,vmap:rhs=bgc --flags default --out "$W/defaults.json"
echo "== [$((SECONDS - t0)) s] done"
