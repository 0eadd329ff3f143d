#!/bin/bash
# One device command for sft.py, reward.py and dpo.py on a GPU (every new tensor on the run's device: the CPU suite
# cannot see a mismatch): a random SmolLM2-135M-sized model, each script for 2 updates in fp32 and bf16, reward.py's
# model then read by rloo.py (--reward_model_path), and dpo.py with --precompute_ref_log_probs.
# Usage (from the repository's root, the wheels installed and .gpu/smollm2_cfg made as h100_distill.sh says):
#   bash benchmark/gpu/pipeline_gpu.sh OUTDIR PYTHON MODELFLAG      (results: benchmark/results/gpu/pipeline)
# MODELFLAG: "" (the full 135M config) or "--tiny" (a CPU rehearsal: CUDA_VISIBLE_DEVICES= runs it on the CPU).
OUTD=$(mkdir -p "$1" && cd "$1" && pwd); PY=$2; TINY=$3
G=$(cd "$(dirname "$0")" && pwd); W=/tmp/pipelinegpu; rm -rf $W; mkdir -p $W/logs
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false
SUM=$OUTD/summary.txt; : > $SUM
step() {  # step NAME CMD...: its exit status, wall time and last metrics row
  local name=$1; shift; local t0=$SECONDS
  timeout -k 5 ${STEP_T:-300} "$@" > $W/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(tail -n 1 $W/$name/metrics.jsonl 2>/dev/null | cut -c1-240)" | tee -a $SUM
  [ $rc -ne 0 ] && grep -n -E "Error|error|Traceback" $W/logs/$name.log | tail -n 6 | tee -a $SUM
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a $SUM
step build $PY $G/build_model.py .gpu/smollm2_cfg $W/model $TINY
cd $G/../..
M="--model_name_or_path $W/model --total_episodes 32"
P="--eval_dataset_name data/preferences_test.jsonl"
step sft $PY sft.py $M --chat_template examples/environments/chatml_tools.jinja --assistant_only_loss --output_dir $W/sft
step sft_bf16 $PY sft.py $M --chat_template examples/environments/chatml_tools.jinja --bf16 --no_save_model \
  --output_dir $W/sft_bf16
step sft_padding_free $PY sft.py $M --chat_template examples/environments/chatml_tools.jinja --bf16 --padding_free \
  --no_save_model --output_dir $W/sft_padding_free
step reward $PY reward.py $M $P --output_dir $W/reward
step reward_bf16 $PY reward.py $M $P --bf16 --no_save_model --output_dir $W/reward_bf16
step dpo $PY dpo.py $M $P --no_save_model --output_dir $W/dpo
step dpo_bf16_precomputed $PY dpo.py $M --bf16 --precompute_ref_log_probs --no_save_model --output_dir $W/dpo_bf16_precomputed
step rloo_on_reward $PY rloo.py --model_name_or_path $W/model --reward_model_path $W/reward --total_episodes 32 \
  --num_sample_generations 0 --no_save_model --output_dir $W/rloo_on_reward
tar -czf $OUTD/logs.tgz -C $W logs $(cd $W && ls -d */metrics.jsonl 2>/dev/null) 2>/dev/null
cat $SUM
