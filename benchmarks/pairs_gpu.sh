#!/usr/bin/env bash
# The fresh-process pairs of benchmarks/pairs.py on the H200, within one device call:
#
#   bash benchmarks/pairs_gpu.sh OUT TAG
#
# after ../shared/gpu/README.md's install (MCORE=19 for the optimizer graph: megatron-core
# 0.16.1 has none, and pairs.py reports that mode skipped there). Runs the modes $MODES
# (eager,full_iteration,full_iteration_optimizer,te_attn_mlp), $PAIRS pairs each (5), then one
# profiled run per side and mode, into /tmp/pairs_TAG; leaves in OUT: pairs_TAG.tgz (every
# run's JSON and log, settings, summary), summary.md, summary.json and this call's log.
#
# Splitting: one run is a fresh Python process: ~15-18 s on the H200 (BENCHMARKS.md: a
# fresh train_gpt.py job of 12 steps took 15-18 s there, three at a time; 60 steps add
# 0.2-1.5 s), so the 40 timed and 8 profiled runs take ~12-14 min, more than one device call
# (600 s). Each call starts no run that would end after $PAIRS_BUDGET seconds (460), by the
# longest run so far, so a call takes ~8-9 min (install ~5 s, the runs, the tarball; a hard
# stop at 550 s), and ends with "N run(s) still missing" until none is; call it again with
# the same TAG to continue (pairs.py --resume makes only the missing runs). Two calls are
# expected, three if start-up is slower. /tmp/pairs_TAG lasts while the
# machine stays up; if it was replaced between calls, send the last pairs_TAG.tgz along with
# the tree and set PAIRS_FROM=path/to/pairs_TAG.tgz: the runs continue from it. Pairs are
# taken round-robin over the modes, so a call that stops early leaves fewer pairs, not
# missing modes; the summary says INCOMPLETE until every pair and profile is there.
# PAIRS_ARGS adds pairs.py arguments (e.g. --retry-failed: make failed runs again).
# PAIRS_STOP (550) is the hard stop in seconds: lower it, with PAIRS_BUDGET ~90 s below it,
# when the device call has less time left than 600 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTD=${1:?usage: bash benchmarks/pairs_gpu.sh OUT TAG}
TAG=${2:?usage: bash benchmarks/pairs_gpu.sh OUT TAG}
GPU_ENV=${GPU_ENV:-/tmp/gpu/env.sh}
if [ ! -f "$GPU_ENV" ]; then
  echo "$GPU_ENV is missing: install megatron-core (and TE) first (shared/gpu/README.md)" >&2
  exit 2
fi
# shellcheck disable=SC1090
source "$GPU_ENV"
# Installed (not just on PYTHONPATH) so the plugin's entry point exists; a fresh folder each
# call, so no copy of an older tree is left in it.
PROJ=/tmp/proj_pairs
rm -rf "$PROJ"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$PROJ" ./hookspecs . \
  > /tmp/pairs_pip.log 2>&1 || { cat /tmp/pairs_pip.log; echo "could not install the project" >&2; exit 2; }
export PYTHONPATH=$PROJ:$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}
DIR=/tmp/pairs_$TAG
if [ -n "${PAIRS_FROM:-}" ] && [ ! -d "$DIR" ]; then
  tar xzf "$PAIRS_FROM" -C /tmp || exit 2
fi
mkdir -p "$DIR" "$OUTD"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
  --format=csv > "$DIR/gpu.csv" 2>&1 || true
call=$(ls "$DIR"/call*.log 2>/dev/null | wc -l)
log="$DIR/call$((call + 1)).log"
# The hard stop leaves time for the tarball within the device's 600 s.
timeout -k 5 "${PAIRS_STOP:-550}" python3 -u benchmarks/pairs.py \
  --modes "${MODES:-eager,full_iteration,full_iteration_optimizer,te_attn_mlp}" \
  --pairs "${PAIRS:-5}" --out "$DIR" --resume --time-budget "${PAIRS_BUDGET:-460}" \
  ${PAIRS_ARGS:-} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
tar czf "$OUTD/pairs_$TAG.tgz" -C /tmp "pairs_$TAG"
cp "$DIR/summary.md" "$DIR/summary.json" "$log" "$OUTD/" 2>/dev/null || true
echo "pairs.py rc=$rc; results in $OUTD/pairs_$TAG.tgz"
exit "$rc"
