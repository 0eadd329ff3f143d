#!/bin/bash
# One device command, about 8 minutes on one GPU: rloo.py and grpo.py as they run by default on a GPU (--cuda_graphs on),
# with --no_cuda_graphs, and with --max_staleness 1, beside TRL 1.16's RLOOTrainer and GRPOTrainer at their defaults
# (benchmark/curves/trl_real.py: gradient checkpointing on), in one sitting; both sides bf16, the shipped prompts and
# the VADER reward, 16 completions of 24 tokens per update, on a random SmolLM2-135M-shaped model (no hub there).
# Usage, from the repository's root with .gpu/ as benchmark/gpu/h100_distill.sh says (its wheels and vaderSentiment's):
#   bash benchmark/gpu/async_gpu.sh OUT [--tiny]        (results: benchmark/results/gpu/async)
# --tiny with CUDA_VISIBLE_DEVICES= rehearses it on the CPU (the graphs then off).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false
O=$(mkdir -p "$1" && cd "$1" && pwd); TINY=${2:-}; PY=${PY:-python3}; W=${W:-/tmp/asyncgpu}; rm -rf $W; mkdir -p $W
G=$(cd "$(dirname "$0")" && pwd); S=$O/summary.txt; : > $S
UPDATES=${UPDATES:-12}; T=${T:-75}
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $S 2>&1
timeout 60 $PY $G/build_model.py .gpu/smollm2_cfg $W/model $TINY >> $S 2>&1
GPU=$([ -n "$TINY" ] || echo --gpu)
BF16=$([ -n "$TINY" ] || echo --bf16)
ONLY=${ONLY:-}  # the runs to make (names, space-separated; default: all)
ours() {  # ours NAME SCRIPT FLAGS...
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]] && return
  local n=$1 script=$2; shift 2; local s=$(date +%s)
  timeout -k 5 $T $PY $script --model_name_or_path $W/model --reward_fn sentiment --total_episodes $((16 * UPDATES)) \
    --num_sample_generations 0 --no_save_model $BF16 --output_dir $W/$n "$@" > $O/$n.log 2>&1
  echo "$n rc=$? wall=$(( $(date +%s) - s ))s $(grep -m1 -o 'note: the plain sampler.*' $O/$n.log)" >> $S
  $PY $G/summarize.py $n $W/$n/metrics.jsonl 0 >> $S 2>&1
  cp $W/$n/metrics.jsonl $O/$n.metrics.jsonl 2>/dev/null
}
peer() {  # peer NAME ALGO FLAGS...
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]] && return
  local n=$1 algo=$2; shift 2; local s=$(date +%s)
  timeout -k 5 $T $PY benchmark/curves/trl_real.py $algo $W/$n --model $W/model --reward sentiment \
    --updates $UPDATES --k 4 --gradient_checkpointing $GPU "$@" > $O/$n.log 2>&1
  echo "$n rc=$? wall=$(( $(date +%s) - s ))s" >> $S
  $PY - $W/$n/metrics.jsonl $n >> $S 2>&1 <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[0], rows[-1]  # (the first step holds the warm-up)
print(f"{sys.argv[2]}: rows={len(rows)} eps_after_update1={(last['episode'] - first['episode']) / (last['seconds'] - first['seconds']):.2f} eps_final={last['episode'] / last['seconds']:.2f}")
EOF
  cp $W/$n/metrics.jsonl $O/$n.metrics.jsonl 2>/dev/null
}
ours rloo_default rloo.py --rloo_k 4
ours rloo_no_graphs rloo.py --rloo_k 4 --no_cuda_graphs
ours rloo_stale1 rloo.py --rloo_k 4 --max_staleness 1
peer rloo_trl rloo --beta 0.05
ours grpo_default grpo.py --num_generations 4
ours grpo_no_graphs grpo.py --num_generations 4 --no_cuda_graphs
ours grpo_stale1 grpo.py --num_generations 4 --max_staleness 1
peer grpo_trl grpo --beta 0.0
cat $S
