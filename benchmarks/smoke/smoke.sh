#!/bin/bash
# Fresh-process smoke jobs on the 2xH200, run before the GPU suite of tests/test_gpu.py
# existed (2026-11-30): the TE build-stream A/B of issue 11 (A2 builds DDP on the default
# stream on purpose), the NCCL failure jobs of issue 12 (B: a rank raising at step 6, both
# TP ranks failing their capture, SIGTERM to one worker) and pipeline parallelism / FP8
# (C). benchmarks/smoke/host.py is the example host plus fault injection by environment
# variables. Usage, after ../shared/gpu/README.md's install: bash benchmarks/smoke/smoke.sh A B C
# (one device call per block or two); logs come back as $OUT/logs_*.tgz. Raw results of
# 2026-11-30: benchmarks/results/smoke-2026-11-30/.
source /tmp/gpu/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
mkdir -p /tmp/out
M="--bf16 --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 --vocab-size 1024 --log-interval 0"
TE="--transformer-impl transformer_engine"
FULL="--cuda-graph-impl local --cuda-graph-scope full_iteration"
OVL="--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce"
cleanup() { pkill -9 -f host.py 2>/dev/null; sleep 1; }
one() { # name limit nproc args...
  local name=$1 limit=$2 n=$3; shift 3
  local t0=$(date +%s%N)
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -k 5 $limit python3 benchmarks/smoke/host.py $M "$@" > /tmp/out/$name.log 2>&1
  else
    timeout -k 5 $limit python3 -m torch.distributed.run --standalone --nproc-per-node $n benchmarks/smoke/host.py $M "$@" > /tmp/out/$name.log 2>&1
  fi
  local rc=$?; local t1=$(date +%s%N)
  local left=$(pgrep -f host.py | wc -l); cleanup
  printf "%-28s rc=%-4s wall=%5ss leftovers=%s | " $name $rc $(( (t1 - t0) / 1000000000 )) $left
  grep -h -o "captured .* in [0-9.]* s\|SUMMARY.*\|shutdown (.*\|Error: .*\|error: .*\|AssertionError.*\|CudaGraphConfigError.*" /tmp/out/$name.log | sort -u | head -8 | tr '\n' ' ' | cut -c1-900
  echo
}
for block in "$@"; do
case $block in
A)
one A1_te_attn_mlp 240 1 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn,mlp --train-iters 10
MCG_NO_BUILD_STREAM=1 one A2_te_no_build_stream 240 1 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn,mlp --train-iters 10
one A3_full 240 1 $FULL --train-iters 10
one A4_te_overlap_w0 240 1 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn,mlp $OVL --cuda-graph-warmup-steps 0 --train-iters 10
one A5_te_moe 240 1 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn,moe_router,moe_preprocess --num-experts 4 --moe-token-dispatcher-type alltoall --moe-permute-fusion --train-iters 10
;;
B)
MCG_RAISE=6:1 one B1_dp2_full_rank1_raises 90 2 $FULL --train-iters 20
MCG_RAISE=6:1 one B2_dp2_te_rank1_raises 90 2 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn,mlp $OVL --train-iters 20
MCG_FAIL_CAPTURE=all one B3_tp2_capture_fails 90 2 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn --tensor-model-parallel-size 2 --sequence-parallel --train-iters 20
MCG_SIGTERM=6:1 one B4_dp2_full_sigterm_rank1 90 2 $FULL --train-iters 20
;;
C)
one C1_pp2_te_attn_mlp 200 2 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn,mlp --pipeline-model-parallel-size 2 --num-layers 4 --num-microbatches 4 --train-iters 10
one C2_pp2_vpp2_te_attn 200 2 $TE --cuda-graph-impl transformer_engine --cuda-graph-scope attn --pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1 --num-microbatches 4 --train-iters 10
one C3_pp2_full 200 2 $FULL --pipeline-model-parallel-size 2 --num-layers 4 --num-microbatches 4 --train-iters 10
one C4_fp8_te_attn_mlp 200 1 $TE --fp8-format hybrid --cuda-graph-impl transformer_engine --cuda-graph-scope attn,mlp --train-iters 10
one C5_fp8_full 200 1 $TE --fp8-format hybrid $FULL --train-iters 10
;;
E)
one E1_te_eager 200 1 $TE --train-iters 10
one E2_fp8_eager 200 1 $TE --fp8-format hybrid --train-iters 10
one E3_pp2_te_eager 200 2 $TE --pipeline-model-parallel-size 2 --num-layers 4 --num-microbatches 4 --train-iters 10
;;
esac
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
cd /tmp/out && tar czf $OUT/logs_$(date +%H%M%S).tgz *.log && rm -f /tmp/out/*.log
