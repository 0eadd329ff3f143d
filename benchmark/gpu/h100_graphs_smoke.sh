#!/bin/bash
# --cuda_graphs in the other scripts, on one GPU: rloo.py with and without it (its first update's figures should agree:
# the same tokens), grpo.py with LoRA in bf16, ppo.py in bf16; random SmolLM2-135M-shaped policy, 2 updates each.
# Needs .gpu/ as h100_distill.sh says. Usage: bash benchmark/gpu/h100_graphs_smoke.sh OUT [--tiny]
# (results: benchmark/results/gpu/h100_graphs/smoke.txt)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
O=$1; TINY=${2:-}; PY=${PY:-python3}; W=${W:-/tmp/gs}; mkdir -p $W; S=$O/smoke.txt
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site
fi
timeout 60 $PY benchmark/gpu/build_model.py .gpu/smollm2_cfg $W/policy --seed 0 $TINY > $S 2>&1
C="--model_name_or_path $W/policy --total_episodes 32 --per_device_train_batch_size 8 --gradient_accumulation_steps 2
   --num_sample_generations 0 --no_save_model"
for r in "rloo_plain rloo.py --rloo_k 4" "rloo_graphs rloo.py --rloo_k 4 --cuda_graphs" \
         "grpo_lora_bf16 grpo.py --cuda_graphs --use_peft --bf16" "ppo_bf16 ppo.py --cuda_graphs --bf16"; do
  set -- $r; n=$1; shift; s=$(date +%s)
  timeout ${T:-60} $PY "$@" $C --output_dir $W/$n > $O/$n.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - s ))s: $(tail -c 300 $O/$n.log | tr '\n\r' '  ' | tail -c 200)" >> $S
  $PY -c "
import json, sys
for l in open('$W/$n/metrics.jsonl'):
    r = json.loads(l)
    print('  ', {k: round(v, 5) for k, v in r.items() if k in ('episode', 'eps', 'objective/scores', 'val/response_length', 'loss/policy_avg', 'objective/kl', 'completions/mean_length', 'reward')})
" >> $S 2>&1
done
cat $S
