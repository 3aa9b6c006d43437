#!/bin/bash
# The GPU limit and the plugin's host time, each mode in its own process (issue 15):
#   MODES="eager eager_device_norm full_iteration full_iteration_optimizer" HOST_MODES="full_iteration" \
#     bash benchmarks/fresh_process_bench.sh $OUT TAG
# on the H200 after ../shared/gpu/README.md's install; leaves $OUT/bench_TAG.tgz.
source /tmp/gpu/env.sh
OUTD=$1; TAG=$2; mkdir -p /tmp/bench_$TAG
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/proj ./hookspecs . > /tmp/bench_$TAG/pip.log 2>&1
export PYTHONPATH=/tmp/proj:$PWD:$PWD/examples:$PYTHONPATH
for mode in $MODES; do
  timeout 150 python3 benchmarks/gpu_limit.py --modes $mode --out /tmp/bench_$TAG/limit_$mode.json > /tmp/bench_$TAG/limit_$mode.log 2>&1
  echo "limit $mode rc=$?"; grep -h "GPU limit\|step\b.*ms\|kernel" /tmp/bench_$TAG/limit_$mode.log | tail -2
done
for mode in $HOST_MODES; do
  timeout 120 python3 benchmarks/plugin_host_time.py --mode $mode --out /tmp/bench_$TAG/host_$mode.json > /tmp/bench_$TAG/host_$mode.log 2>&1
  echo "host $mode rc=$?"; python3 -c "import json;d=json.load(open('/tmp/bench_$TAG/host_$mode.json'));print(d['us_per_step'],d['total_us_per_step'],d['total_us_p90'])" 2>&1 | tail -1
done
tar czf $OUTD/bench_$TAG.tgz -C /tmp bench_$TAG
