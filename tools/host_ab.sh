#!/bin/bash
# One device call: the plugin's host time of the work tree against a baseline copy, in
# alternation on the same machine with the same harness (BENCHMARKS.md 2h). Prepare here:
#
#   bash tools/host_baseline.sh HEAD
#
# then on the device (carry .gpu/bin, .gpu/wheels, .gpu/base): bash tools/host_ab.sh [pairs]
# Results: $OUT/host-19.tgz (each process's JSON and log, and guard_floor_{base,new}.json);
# benchmarks/host_summary.py prints each side's pieces and their shares per process.
set -uo pipefail
pairs=${1:-3}
bash tools/gpu_session.sh quick 19 || exit 1
source /tmp/gpu/env19.sh
mkdir -p /tmp/host-19
for side in base new; do
  root=.; [ "$side" = base ] && root=.gpu/base
  python3 "$root/benchmarks/guard_floor.py" --json "/tmp/host-19/guard_floor_$side.json" \
    > "/tmp/host-19/guard_floor_$side.log" 2>&1
  tail -2 "/tmp/host-19/guard_floor_$side.log"
done
for n in $(seq "$pairs"); do
  HOST_ROOT=.gpu/base HOST_TAG=base$n HOST_ARGS="--steps 300" \
    bash tools/gpu_session.sh host 19 full_iteration full_iteration_optimizer
  HOST_TAG=new$n HOST_ARGS="--steps 300" \
    bash tools/gpu_session.sh host 19 full_iteration full_iteration_optimizer
done
nvidia-smi --query-gpu=name,driver_version --format=csv
lscpu | grep -E "Model name" | head -1
python3 benchmarks/host_summary.py /tmp/host-19
