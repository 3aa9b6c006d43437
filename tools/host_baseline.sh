#!/bin/bash
# A copy of the project at REV in .gpu/base (ignored by git; carry it to the device), with
# today's benchmarks/plugin_host_time.py and guard_floor.py in it, so that `HOST_ROOT=.gpu/base
# bash tools/gpu_session.sh host ...` and tools/host_ab.sh measure REV's plugin with the same
# harness as the work tree's.
#
#   bash tools/host_baseline.sh HEAD~3
set -euo pipefail
rev=${1:?a git revision}
rm -rf .gpu/base && mkdir -p .gpu/base
git archive "$rev" | tar -x -C .gpu/base --exclude=benchmarks/results
cp benchmarks/plugin_host_time.py benchmarks/guard_floor.py .gpu/base/benchmarks/
echo "$rev = $(git rev-parse --short "$rev")" > .gpu/base/REV
du -sh .gpu/base
