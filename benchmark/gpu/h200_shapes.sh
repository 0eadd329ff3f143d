#!/bin/bash
# One GPU at a real shape, beside TRL 1.16: random models of Qwen2.5-0.5B's and 1.5B's shapes (no hub on the lent
# machine; build_model.py --shape), 64 completions of up to 512 tokens per update (16 prompts x 4, micro-batches of 8),
# bf16 on both sides, --cuda_graphs at its default (on), TRL without gradient checkpointing (the same work; its default
# would add a recomputation). Per run: episodes per second after the first update (which holds the start-up and the
# graphs' capture), peak GPU memory (nvidia-smi, sampled twice a second), and decode_bound.py's step against its bound.
# In order of what matters most, each step cut to the budget left (BUDGET_S, default 420):
#   0.5B: the decoding step, rloo.py | RLOOTrainer, grpo.py | GRPOTrainer;  1.5B: the decoding step, rloo.py |
#   RLOOTrainer;  then distill.py | DistillationTrainer at 0.5B (distill_trl.py, both sides); then grpo.py | GRPOTrainer
#   at 1.5B.
# Usage, from the repository's root with .gpu/ as benchmark/gpu/h100_distill.sh says (its wheels and vaderSentiment's):
#   bash benchmark/gpu/h200_shapes.sh OUT [--tiny]     (results: benchmark/results/gpu/shapes)
# SHAPES="qwen2.5-1.5b" runs only that shape's steps (then distill.py's pair); UPDATES (default 3) updates a run;
# RLOO_FLAGS are added to rloo.py's runs (--local_rollout_forward_batch_size 8: its rollout passes' memory and time).
# --tiny with CUDA_VISIBLE_DEVICES= rehearses it on the CPU (tiny models, 8 tokens).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false
O=$(mkdir -p "$1" && cd "$1" && pwd); TINY=${2:-}; PY=${PY:-python3}; W=${W:-/tmp/shapes}; rm -rf $W; mkdir -p $W/logs
G=$(cd "$(dirname "$0")" && pwd); S=$O/summary.txt; : > $S
BUDGET=${BUDGET_S:-420}; U=${UPDATES:-3}; L=$([ -n "$TINY" ] && echo 8 || echo 512)
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
GPU=$([ -n "$TINY" ] || echo --gpu); BF16=$([ -n "$TINY" ] || echo --bf16)
step() {  # step NAME TIMEOUT_S CMD...: cut to the budget left, skipped under 30 s; its status, time and peak memory
  local n=$1 to=$2; shift 2; local left=$((BUDGET - SECONDS))
  if ((left < 30)); then echo "SKIP $n (at ${SECONDS}s)" >> $S; return; fi
  ((to > left)) && to=$left
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > $W/logs/$n.mem 2>/dev/null &
  local smi=$! s=$SECONDS
  timeout -k 5 $to "$@" > $W/logs/$n.log 2>&1; local rc=$?
  kill $smi 2>/dev/null
  local mem=$(sort -n $W/logs/$n.mem 2>/dev/null | tail -n 1)
  echo "$n rc=$rc wall=$((SECONDS - s))s peak_gpu_mib=${mem:-?}" >> $S
  [ $rc -ne 0 ] && grep -E "Error|error" $W/logs/$n.log | tail -n 3 >> $S
}
rate() {  # rate NAME METRICS: episodes per second after the first update, from either side's rows
  $PY - $2 $1 >> $S 2>&1 <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
t = [r["seconds"] if "seconds" in r else r["episode"] / r["eps"] for r in rows]  # (ours log eps since the start)
print(f"  {sys.argv[2]}: updates={len(rows)} eps_after_update1={(rows[-1]['episode'] - rows[0]['episode']) / (t[-1] - t[0]):.2f} first_update_s={t[0]:.1f} mean_length={rows[-1].get('val/response_length', rows[-1].get('completions/mean_length', '?'))}")
EOF
}
ours() {  # ours NAME SCRIPT MODEL TIMEOUT FLAGS...
  local n=$1 script=$2 m=$3 to=$4; shift 4
  step $n $to $PY $script --model_name_or_path $m --reward_fn sentiment --per_device_train_batch_size 8 \
    --gradient_accumulation_steps 8 --response_length $L --total_episodes $((64 * U)) --num_sample_generations 0 \
    --no_save_model $BF16 --output_dir $W/$n "$@"
  rate $n $W/$n/metrics.jsonl
}
peer() {  # peer NAME ALGO MODEL TIMEOUT
  local n=$1 algo=$2 m=$3 to=$4
  step $n $to $PY benchmark/curves/trl_real.py $algo $W/$n --model $m --reward sentiment --updates $U --k 4 \
    --per_device_train_batch_size 8 --gradient_accumulation_steps 8 --response_length $L $GPU
  rate $n $W/$n/metrics.jsonl
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $S 2>&1
for shape in ${SHAPES:-qwen2.5-0.5b qwen2.5-1.5b}; do
  [ $shape = qwen2.5-1.5b ] && ((BUDGET - SECONDS < 200)) && { echo "SKIP 1.5B (at ${SECONDS}s)" >> $S; break; }
  m=$W/$shape
  step build_$shape 90 $PY $G/build_model.py .gpu/smollm2_cfg $m --shape $shape $TINY
  step decode_$shape 60 $PY $G/decode_bound.py $m 64 $L
  grep -E "measured|parameters|a step|peak" $W/logs/decode_$shape.log >> $S
  t=$([ $shape = qwen2.5-0.5b ] && echo 1 || echo 2)
  ours rloo_$shape rloo.py $m $((75 * t)) --rloo_k 4 ${RLOO_FLAGS:-}
  peer rloo_trl_$shape rloo $m $((110 * t))
  [ $shape = qwen2.5-1.5b ] && break
  ours grpo_$shape grpo.py $m 75 --num_generations 4
  peer grpo_trl_$shape grpo $m 110
done
[ -d $W/qwen2.5-0.5b ] || step build_qwen2.5-0.5b 90 $PY $G/build_model.py .gpu/smollm2_cfg $W/qwen2.5-0.5b \
  --shape qwen2.5-0.5b $TINY
step distill_qwen2.5-0.5b 240 $PY benchmark/distill/distill_trl.py --model $W/qwen2.5-0.5b --teacher $W/qwen2.5-0.5b \
  --trl_python $PY --output $W/distill --updates $U --no_eval $BF16 --per_device 8 --accumulation 8 --length $L
tail -n 14 $W/logs/distill_qwen2.5-0.5b.log >> $S
if [ -d $W/qwen2.5-1.5b ]; then  # grpo.py's pair at 1.5B last, in what time is left
  ours grpo_qwen2.5-1.5b grpo.py $W/qwen2.5-1.5b 150 --num_generations 4
  peer grpo_trl_qwen2.5-1.5b grpo $W/qwen2.5-1.5b 220
fi
tar -czf $O/logs.tgz -C $W logs $(cd $W && ls -d */metrics.jsonl distill/*/summary.json 2>/dev/null) 2>/dev/null
cat $S
