# One device call (issue 22's diagnosis): megatron-core 0.19.2 without TE, then
# tools/diag/abort_unblocks.py in each mode, each its own torchrun job.
set -u
bash tools/gpu_session.sh quick 19 >/dev/null || exit 1
source /tmp/gpu/env19.sh
mkdir -p /tmp/d
for m in ${MODES:-alive reset mcore stuck}; do
  timeout -s KILL 40 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/diag/abort_unblocks.py "$m" > "/tmp/d/$m.log" 2>&1
  echo "$m rc=$?"
  pkill -9 -f abort_unblocks; sleep 1
  grep -E "rank 0|Error|error" "/tmp/d/$m.log" | head -10
done
tar czf "$OUT/d.tgz" -C /tmp d
