#!/usr/bin/env bash
# The GPU benchmarks in one go, on the H200 machine after the install of shared/gpu/README.md
# (steps 1-4): CUDA-graph modes (plugin vs hand-written loop, both sizes) then the GPU limit.
# Results, logs and the GPU description go to $OUT (the device tool's folder), or runs/bench.
# Extra arguments go to gpu_modes.py (e.g. --repeats 2 or --sizes 4L-512H), $LIMIT_ARGS to
# gpu_limit.py; GPU_ENV names the environment file the install wrote.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_ENV=${GPU_ENV:-/tmp/gpu/env.sh}
if [ ! -f "$GPU_ENV" ]; then
  echo "$GPU_ENV is missing: install megatron-core (and TE) first (shared/gpu/README.md)" >&2
  exit 2
fi
# shellcheck disable=SC1090
source "$GPU_ENV"
# Installed (not just on PYTHONPATH) so the cudagraph entry point exists; the hook contract
# (hookspecs/) is its own distribution.
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/proj ./hookspecs . \
  || { echo "could not install the project into /tmp/proj" >&2; exit 2; }
export PYTHONPATH=/tmp/proj:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
  --format=csv > "$OUT/gpu.csv" 2>&1 || true
start=$(date +%s)
python3 -u benchmarks/gpu_modes.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/gpu_modes.log"
modes_rc=${PIPESTATUS[0]}
# shellcheck disable=SC2086
python3 -u benchmarks/gpu_limit.py --out "$OUT/limit.json" ${LIMIT_ARGS:-} 2>&1 | tee "$OUT/gpu_limit.log"
limit_rc=${PIPESTATUS[0]}
echo "gpu_modes rc=$modes_rc, gpu_limit rc=$limit_rc, $(( $(date +%s) - start )) s in all"
exit $(( modes_rc || limit_rc ))
