#!/bin/bash
# The device calls of one GPU session, as run on 2026-11-30/12-01 (see BENCHMARKS.md):
#
#   bash tools/gpu_session.sh install        # after the TE parts were staged (device_stage.sh):
#                                            # megatron-core 0.16.1 and 0.19.2 (one TE build),
#                                            # pytest from .gpu/wheels/test
#   bash tools/gpu_session.sh quick 16|19    # instead of install, in one call and ~20 s: that
#                                            # megatron-core without TE (no staging; enough
#                                            # for `host` and the full-iteration modes),
#                                            # pytest from .gpu/wheels/test
#   bash tools/gpu_session.sh suite 16|19 single|multi [pytest args]   # tests/gpu_suite.sh
#   bash tools/gpu_session.sh host 16|19 [modes]  # benchmarks/plugin_host_time.py, one
#                                            # process per mode (default: full_iteration
#                                            # full_iteration_optimizer), $OUT/host-v.tgz;
#                                            # HOST_ARGS: more of its arguments for each
#                                            # (e.g. "--steps 200 --size host-bound"),
#                                            # HOST_TAG: a suffix for the files of that set,
#                                            # HOST_ROOT: another copy of the project to
#                                            # measure (e.g. the commit before a change,
#                                            # `bash tools/host_baseline.sh REV`),
#                                            # HOST_PREFIX: a command to run each under
#                                            # (e.g. "setarch -R": no address randomisation)
#
# The pytest wheels (here, once): python3 -m pip download --no-deps --python-version 3.12
#   --only-binary=:all: -d .gpu/wheels/test "pytest>=8,<9.2" pytest-xdist execnet pytest-timeout
#   iniconfig pluggy packaging pygments
# (pytest below 9.2, as setup.cfg's test extra: with 9.2 pytest-xdist 3.8 stops grouping
# xdist_group tests, pytest-dev/pytest-xdist#1386; tests/gpu_suite.sh warns if it gets one).
#
# After `install`, /tmp/gpu/env.sh is megatron-core 0.19.2's (installed last), which is what
# `bash benchmarks/pairs_gpu.sh $OUT TAG` (issue 21's pairs, two calls with the same TAG) and
# `MODES="eager_device_norm full_iteration_optimizer" bash benchmarks/fresh_process_bench.sh
# $OUT TAG` (the optimizer graph vs the device-norm eager step) use.
#
# Results go to $OUT (the device tool's folder), at most 8 files per call.
set -uo pipefail
cmd=${1:?install|quick|suite|host}; shift
case $cmd in
install)
  set -e
  bash .gpu/bin/device_stage.sh
  # device_install.sh joins the staged parts into the TE core wheel only where none is there
  # yet, and an install that ran with a part missing (the machine was replaced between two
  # staging calls) leaves a partial one that fails its checksum for good: always join again
  rm -f /tmp/gpu/transformer_engine_cu13-*.whl
  bash .gpu/bin/device_install.sh > /tmp/gpu/install16.log 2>&1 || { tail -30 /tmp/gpu/install16.log; exit 1; }
  MCORE=19 bash .gpu/bin/device_install.sh > /tmp/gpu/install19.log 2>&1 || { tail -30 /tmp/gpu/install19.log; exit 1; }
  python3 -m pip install -q --no-deps --no-index --target /tmp/pt .gpu/wheels/test/*.whl
  for v in 16 19; do
    printf 'export PYTHONPATH=/tmp/gpu/site%s:/tmp/pt${PYTHONPATH:+:$PYTHONPATH}\nexport NVTE_FRAMEWORK=pytorch\n' $v > /tmp/gpu/env$v.sh
  done
  for log in /tmp/gpu/install16.log /tmp/gpu/install19.log; do tail -n 3 "$log"; done
  nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
quick)
  v=${1:?16|19}
  TE=0 MCORE=$v bash .gpu/bin/device_install.sh > /tmp/gpu_quick$v.log 2>&1 || { tail -30 /tmp/gpu_quick$v.log; exit 1; }
  python3 -m pip install -q --no-deps --no-index --target /tmp/pt .gpu/wheels/test/*.whl
  printf 'export PYTHONPATH=/tmp/gpu/site%s:/tmp/pt${PYTHONPATH:+:$PYTHONPATH}\nexport NVTE_FRAMEWORK=pytorch\n' "$v" > /tmp/gpu/env$v.sh
  tail -n 3 /tmp/gpu_quick$v.log
  ;;
suite)
  v=${1:?16|19}; part=${2:?single|multi}; shift 2
  source /tmp/gpu/env$v.sh
  PYTHON=python3 bash tests/gpu_suite.sh "$OUT/s$v-$part" "$part" "$@"
  cat "$OUT/s$v-$part/summary.txt" | tail -15
  head -40 "$OUT/s$v-$part/table.md"
  ;;
host)
  v=${1:?16|19}; shift
  source /tmp/gpu/env$v.sh
  root=$(cd "${HOST_ROOT:-.}" && pwd); proj=/tmp/proj$(echo "$root" | md5sum | cut -c1-8)
  rm -rf "$proj"; python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$proj" "$root/hookspecs" "$root" > /tmp/gpu/proj.log 2>&1 || { tail -5 /tmp/gpu/proj.log; exit 1; }
  export PYTHONPATH=$proj:$root:$root/examples:$PYTHONPATH
  mkdir -p /tmp/host-$v
  for mode in ${*:-full_iteration full_iteration_optimizer}; do
    name=$mode${HOST_TAG:+_$HOST_TAG}
    # shellcheck disable=SC2086
    timeout 120 ${HOST_PREFIX:-} python3 "$root/benchmarks/plugin_host_time.py" --mode "$mode" ${HOST_ARGS:-} --out /tmp/host-$v/$name.json > /tmp/host-$v/$name.log 2>&1
    echo "$name rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(x or 0, 1) for k, x in d['us_per_step'].items()}, 'cpu', {k: round(x or 0, 1) for k, x in d['cpu_us_per_step'].items()}, 'total', d['total_us_per_step'], 'p90', d['total_us_p90'], 'timed', d['timed_steps'], 'untimed', d['untimed_steps'], 'period', d.get('step_period_us'))" /tmp/host-$v/$name.json 2>&1 | tail -1
  done
  tar czf "$OUT/host-$v.tgz" -C /tmp host-$v
  ;;
esac
