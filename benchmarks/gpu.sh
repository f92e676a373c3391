#!/usr/bin/env bash
# Replica throughput of the strategies on one GPU (H100/H200 class), time-boxed to 8 minutes, on a machine
# that already has JAX with its GPU plugin (nothing is installed or downloaded here).
#
#   bash benchmarks/gpu.sh [extra gpu_bench.py arguments]
#
# Runs benchmarks/gpu_bench.py (resnet14 and resnet18, float32 and bfloat16, R = 1, 4, 16, 64,
# vmap / sequential / sharded over 1 device / vmap with matmul convs) on the first GPU, with a
# 400 s budget for starting configurations and a hard 470 s timeout; the JSON is rewritten after
# every configuration, so a timeout still leaves benchmarks/results/gpu_bench.json with the rows
# done. On an H200 a row took 12-38 s (mostly compiling and autotuning), so the budget covers about
# 25 of the 32 rows; raise --budget-s (and the timeout below) for all of them. Prints the table and
# the environment. benchmarks/device_checks.sh runs the checks that decide the `auto` rule.
#
# Installing JAX for a GPU (once, on a machine with a network): `pip install -e '.[cuda13]'` for a CUDA 13
# driver (jax[cuda13]), `pip install -e '.[cuda]'` for CUDA 12 (jax[cuda12]); `nvidia-smi` names the
# driver's CUDA version. The script checks that JAX sees a GPU and stops otherwise.
#
# TPU (one host): pip install -e '.[tpu]', then
#   python benchmarks/gpu_bench.py --sharded-devices 0 --out benchmarks/results/tpu_bench.json
# which shards the sharded rows over every chip (see the docstring of gpu_bench.py).
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
# Let XLA grow its allocation instead of grabbing 75% up front: the peak memory it reports is then
# the memory the rows used, and an out-of-memory row fails alone.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices()); assert jax.default_backend() == 'gpu', \
  'JAX sees no GPU: install jax with its GPU plugin (see the header of this script)'"
timeout --signal=INT --kill-after=10 470 python3 benchmarks/gpu_bench.py --budget-s 400 "$@"
