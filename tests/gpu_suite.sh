#!/usr/bin/env bash
# The GPU suite (tests/test_gpu.py, tests/test_gpu_in_process.py, tests/test_gpu_rl.py) in one device call.
#
#   bash tests/gpu_suite.sh OUT_DIR [single|multi|all] [pytest arguments, e.g. -k te_attn]
#
#   single  the one-GPU scenarios (marker gpu), two at a time with pytest-xdist when two GPUs
#           are visible (each worker's jobs pinned to its own GPU), else one at a time
#   multi   the two-GPU scenarios (marker multigpu), one at a time, no xdist
#   all     both, one after the other (default; rarely fits one 600 s call)
#
# Leaves in OUT_DIR (at most 4 files: the device returns 8): results.jsonl (one line per job,
# MCGRAPH_GPU_RESULTS), table.md (tests/gpu_table.py), summary.txt (pytest's summary lines)
# and logs.tar.gz (every job's stdout/stderr and probe records, junit XML, pytest's output,
# the GPU processes left at the end, which must be none).
#
# Environment: PYTHON (default python3); SINGLE_WORKERS / MULTI_WORKERS (default 2 / 1): xdist
# workers for each part; SUITE_BUDGET_S (default 540): the pytest runs get what
# is left of it (then SIGINT: the running job is killed whole, junit and logs still written);
# MCGRAPH_GPU_JOB_TIMEOUT (default 180): the timeout of each good job. On the H200, after the
# install steps of ../shared/gpu/README.md: `source /tmp/gpu/env.sh` first.
set -uo pipefail

OUT=${1:?usage: tests/gpu_suite.sh OUT_DIR [single|multi|all] [pytest args...]}
PART=${2:-all}
shift $(( $# >= 2 ? 2 : $# ))
case $PART in single|multi|all) ;; *) echo "part must be single, multi or all, not $PART" >&2; exit 2;; esac

START=$(date +%s)
BUDGET=${SUITE_BUDGET_S:-540}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mcgraph-gpu-suite.XXXXXX")
mkdir -p "$WORK/logs"
export MCGRAPH_GPU_RESULTS="$OUT/results.jsonl" MCGRAPH_GPU_LOGS="$WORK/logs"
export MCGRAPH_JOB_TAGS_FILE="$WORK/job_tags"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

finish() {
  # Normally nothing: the launcher ends every job. This catches a pytest killed outright.
  "$PY" tests/jobs.py --kill-tags "$MCGRAPH_JOB_TAGS_FILE" >> "$OUT/summary.txt" 2>&1
  {
    echo "# GPU processes left at the end (pid, memory): must be none"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  } > "$WORK/gpu_processes_after.txt" 2>&1
  if [ -s "$MCGRAPH_GPU_RESULTS" ]; then
    "$PY" tests/gpu_table.py "$MCGRAPH_GPU_RESULTS" --junit "$WORK"/junit_*.xml --out "$OUT/table.md" \
      || echo "gpu_table.py failed" >> "$OUT/summary.txt"
  else
    echo "no job ran" > "$OUT/table.md"
  fi
  tar czf "$OUT/logs.tar.gz" -C "$WORK" . && rm -rf "$WORK"
}
trap finish EXIT
trap "exit 143" TERM INT

{
  echo "# $(date -u +%FT%TZ) part=$PART args=$*"
  "$PY" - "$WORK/ngpu" <<'PY'
import importlib.metadata as md
import sys
import torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
print("torch", torch.__version__, "| megatron-core", version("megatron-core"),
      "| transformer-engine", version("transformer-engine"), "| pytest", version("pytest"),
      "| pytest-xdist", version("pytest-xdist"))
print("GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
with open(sys.argv[1], "w") as out:
    out.write(str(torch.cuda.device_count()))
PY
} > "$OUT/summary.txt" 2>&1

# The CUDA graph plugin is found through its entry point, as users install it: without the
# project's dist-info on the path, install it (no dependencies, no network) next to the tree.
has_entry_point() {
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(all(e.name != 'cudagraph' for e in m.entry_points(group='mcgraph')))"
}
if ! has_entry_point; then
  PROJ=${TMPDIR:-/tmp}/mcgraph-proj
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$PROJ" "$ROOT" >> "$OUT/summary.txt" 2>&1
  export PYTHONPATH="$PYTHONPATH:$PROJ"   # after the tree: only its dist-info is used
  has_entry_point || { echo "the cudagraph entry point is still missing" | tee -a "$OUT/summary.txt"; exit 1; }
fi

XDIST=()
NGPU=$(cat "$WORK/ngpu" 2>/dev/null || echo 0)
if [ "$NGPU" -ge 2 ] || { [ "$NGPU" -ge 1 ] && [ -n "${SINGLE_WORKERS:-}" ]; }; then
  # pytest-xdist is pure Python: wheels dropped in .gpu/wheels/test install without network.
  if ! "$PY" -c "import xdist" 2>/dev/null && ls .gpu/wheels/test/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-index --target "${TMPDIR:-/tmp}/mcgraph-xdist" .gpu/wheels/test/*.whl \
      && export PYTHONPATH="$PYTHONPATH:${TMPDIR:-/tmp}/mcgraph-xdist"
  fi
  if "$PY" -c "import xdist" 2>/dev/null; then
    # SINGLE_WORKERS=4 runs two jobs per GPU (speed is never asserted, memory is plenty).
    XDIST=(-n "${SINGLE_WORKERS:-2}" --dist loadgroup)
    # setup.cfg's test extra keeps pytest below 9.2, whose node ids pytest-xdist 3.8 does not
    # group by (pytest-dev/pytest-xdist#1386): tests sharing an eager twin would each run it
    if ! "$PY" -c 'import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) >= (9, 2))'; then
      echo "warning: pytest $("$PY" -c 'import pytest; print(pytest.__version__)') does not keep xdist_group" \
        "tests on one worker (pytest-dev/pytest-xdist#1386): shared eager twins may run twice;" \
        "send pytest<9.2 in .gpu/wheels/test" | tee -a "$OUT/summary.txt"
    fi
  else
    echo "pytest-xdist not installed: the single-GPU scenarios run one at a time" | tee -a "$OUT/summary.txt"
  fi
fi

STATUS=0
run_part() {
  local name=$1; shift
  local left=$(( BUDGET - ($(date +%s) - START) - 20 ))
  if [ "$left" -le 30 ]; then
    echo "$name: not started, the time budget is spent" | tee -a "$OUT/summary.txt"; STATUS=1; return
  fi
  timeout --signal=INT --kill-after=30 "$left" \
    "$PY" -m pytest "$@" -W ignore -q -rA -p no:cacheprovider --junitxml "$WORK/junit_$name.xml" \
    > "$WORK/pytest_$name.log" 2>&1
  local rc=$?
  { echo "## $name: pytest exit code $rc"; grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|^=+ .* in [0-9.]+s' "$WORK/pytest_$name.log"; } >> "$OUT/summary.txt"
  tail -n 40 "$WORK/pytest_$name.log"
  # 5: nothing selected in this part (e.g. -k names only scenarios of the other part)
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || STATUS=1
}

if [ "$PART" = single ] || [ "$PART" = all ]; then
  run_part single tests/test_gpu.py tests/test_gpu_in_process.py tests/test_gpu_rl.py -m "gpu and not multigpu" "${XDIST[@]}" "$@"
fi
if [ "$PART" = multi ] || [ "$PART" = all ]; then
  # MULTI_WORKERS=2 runs two 2-GPU jobs at a time (good runs only: the failure jobs' 60 s
  # bound is measured on a machine they do not share).
  MULTI_XDIST=()
  if [ "${MULTI_WORKERS:-1}" -gt 1 ] && [ ${#XDIST[@]} -gt 0 ]; then
    MULTI_XDIST=(-n "$MULTI_WORKERS" --dist loadgroup)
  fi
  run_part multi tests/test_gpu.py tests/test_gpu_rl.py -m multigpu "${MULTI_XDIST[@]}" "$@"
fi
echo "suite part $PART took $(( $(date +%s) - START )) s, status $STATUS" | tee -a "$OUT/summary.txt"
exit $STATUS
