#!/usr/bin/env bash
# RLHF from preferences, end to end on a CPU (docs/pipeline.md): reward.py learns the sentiment labeller's preferences
# (data/preferences.jsonl, made by data/make_preferences.py), then rloo.py trains on that reward model; dpo.py learns
# from the same pairs, as do kto.py (unpaired), SimPO and ORPO (dpo.py). All against rloo.py on the true score (the VADER sentiment the pairs were labelled with). Every
# run is evaluated on the 64 held-out prompts by the true score (eval/rewards/sentiment, greedy). The RM runs log the
# true score beside the learnt one (--reward_fn sentiment with weight 0: it is measured, not trained on).
#   bash benchmark/pipeline/rlhf_offline.sh            (about 40 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pipeline}
RES=benchmark/results/pipeline/rlhf_offline
SEEDS=${SEEDS:-"1 2 3"}
EVAL="--eval_dataset_name data/preferences_test.jsonl --eval_every 96"
mkdir -p "$RES"
source benchmark/pipeline/keep.sh

model rm rloo_rm_long_1 $(for seed in $SEEDS; do echo "rloo_rm_$seed"; done)
run rm python reward.py --num_train_epochs 2 --eval_dataset_name data/preferences_test.jsonl
for seed in $SEEDS; do
    run "rloo_rm_$seed" python rloo.py --seed "$seed" --reward_model_path "$OUT/rm" --reward_fn sentiment \
        --reward_weights 1 0 $EVAL --no_save_model
    run "rloo_true_$seed" python rloo.py --seed "$seed" $EVAL --no_save_model
    model "dpo_$seed" "dpo_eval_$seed"
    run "dpo_$seed" python dpo.py --seed "$seed" --num_train_epochs 1 --learning_rate 1e-5 \
        --eval_dataset_name data/preferences_test.jsonl
    # the DPO model's true score on the held-out prompts: the evaluation an RL run makes before its first update
    run "dpo_eval_$seed" python rloo.py --model_name_or_path "$OUT/dpo_$seed" --seed "$seed" $EVAL --total_episodes 16 \
        --no_save_model
done
# the other preference losses on the same pairs, each evaluated as dpo.py's model is: kto.py on them unpaired,
# SimPO (its paper's beta 2 and gamma 0.5) and ORPO without a reference; the learning rate dpo.py's
for seed in $SEEDS; do
    for method in kto simpo orpo; do
        case $method in
            kto) train=(python kto.py) ;;
            simpo) train=(python dpo.py --loss_type simpo --beta 2 --simpo_gamma 0.5) ;;
            orpo) train=(python dpo.py --loss_type orpo) ;;
        esac
        model "${method}_$seed" "${method}_eval_$seed"
        run "${method}_$seed" "${train[@]}" --seed "$seed" --num_train_epochs 1 --learning_rate 1e-5 \
            --eval_dataset_name data/preferences_test.jsonl
        run "${method}_eval_$seed" python rloo.py --model_name_or_path "$OUT/${method}_$seed" --seed "$seed" $EVAL \
            --total_episodes 16 --no_save_model
    done
done
# over-optimisation: the learnt reward's run two and a half times as long (its own schedule), seed 1
run rloo_rm_long_1 python rloo.py --seed 1 --reward_model_path "$OUT/rm" --reward_fn sentiment --reward_weights 1 0 \
    $EVAL --total_episodes 960 --no_save_model
