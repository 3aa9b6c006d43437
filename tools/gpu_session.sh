#!/bin/bash
# The device calls of one GPU session, as run on 2026-11-30/12-01 (see BENCHMARKS.md):
#
#   bash tools/gpu_session.sh install        # after the TE parts were staged (device_stage.sh):
#                                            # megatron-core 0.16.1 and 0.19.2 (one TE build),
#                                            # pytest from .gpu/wheels/test
#   bash tools/gpu_session.sh suite 16|19 single|multi [pytest args]   # tests/gpu_suite.sh
#
# Results go to $OUT (the device tool's folder), at most 8 files per call.
set -uo pipefail
cmd=${1:?install|suite}; shift
case $cmd in
install)
  set -e
  bash .gpu/bin/device_stage.sh
  bash .gpu/bin/device_install.sh > /tmp/gpu/install16.log 2>&1 || { tail -30 /tmp/gpu/install16.log; exit 1; }
  MCORE=19 bash .gpu/bin/device_install.sh > /tmp/gpu/install19.log 2>&1 || { tail -30 /tmp/gpu/install19.log; exit 1; }
  python3 -m pip install -q --no-deps --no-index --target /tmp/pt .gpu/wheels/test/*.whl
  for v in 16 19; do
    printf 'export PYTHONPATH=/tmp/gpu/site%s:/tmp/pt${PYTHONPATH:+:$PYTHONPATH}\nexport NVTE_FRAMEWORK=pytorch\n' $v > /tmp/gpu/env$v.sh
  done
  for log in /tmp/gpu/install16.log /tmp/gpu/install19.log; do tail -n 3 "$log"; done
  nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
suite)
  v=${1:?16|19}; part=${2:?single|multi}; shift 2
  source /tmp/gpu/env$v.sh
  PYTHON=python3 bash tests/gpu_suite.sh "$OUT/s$v-$part" "$part" "$@"
  cat "$OUT/s$v-$part/summary.txt" | tail -15
  head -40 "$OUT/s$v-$part/table.md"
  ;;
esac
