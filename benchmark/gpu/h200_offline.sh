#!/bin/bash
# The offline scripts' newest options on one GPU (every new tensor on the run's device: the CPU suite cannot see a
# mismatch), all at once on a random SmolLM2-135M-shaped model, in about a minute: ilql.py (fp32 and bf16, its held-out
# evaluation sampling through the value-shaped model; LoRA), sft.py --packing (bfd and wrapped, bf16) and --keep,
# reward.py --padding_free, raft.py (bf16, and LoRA).
# Usage, from the repository's root with .gpu/ as benchmark/gpu/h100_distill.sh says, and reward-labelled rows in
# .gpu/scored.jsonl and .gpu/scored_test.jsonl (data/scored*.jsonl, or any in that format):
#   bash benchmark/gpu/h200_offline.sh OUT [--tiny]      (results: benchmark/results/gpu/offline)
W=${W:-/tmp/offline}
source "$(dirname "$0")/at_once.sh"
M="--model_name_or_path $W/model --no_save_model --total_episodes 32"
I="--dataset_name .gpu/scored.jsonl --eval_dataset_name .gpu/scored_test.jsonl --response_length 16"
run ilql ilql.py $M $I
run ilql_bf16 ilql.py $M $I --bf16 --gen_beta 2
run sft_packing_bf16 sft.py $M --packing --max_length 256 --bf16
run sft_wrapped sft.py $M --packing --packing_strategy wrapped --max_length 256
run reward_padding_free_bf16 reward.py $M --padding_free --bf16 --eval_dataset_name data/preferences_test.jsonl
run ilql_lora ilql.py $M $I --use_peft
run sft_keep_best sft.py $M --dataset_name .gpu/scored.jsonl --keep best
run raft_bf16 raft.py $M --num_generations 4 --bf16 --eval_dataset_name data/preferences_test.jsonl
run raft_lora raft.py $M --num_generations 4 --use_peft --min_score 0.1
finish
