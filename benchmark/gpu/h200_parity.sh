#!/bin/bash
# What the CPU suite cannot see of the parity waves, on one GPU in about two minutes: (1) the sampling rule under
# --cuda_graphs (decode_graphs.py: every family of tests/test_families.py, the graph against generate() with top-k,
# top-p, min-p and a repetition penalty); (2) every script and option added by them on CUDA (every new tensor on the
# run's device): kto.py, dpo.py's loss family and reference-free losses, sft.py's dft, grpo.py's losses with truncated
# sampling, rloo.py under TRL's names, ppo.py and distill.py with the sampling flags, each for 2 updates on a random
# SmolLM2-135M-shaped model, all at once (the GPU holds them; these runs time nothing).
# Usage, from the repository's root with .gpu/ as benchmark/gpu/h100_distill.sh says:
#   bash benchmark/gpu/h200_parity.sh OUT [--tiny]     (results: benchmark/results/gpu/parity)
# --tiny with CUDA_VISIBLE_DEVICES= rehearses it on the CPU (decode_graphs.py then skipped).
W=${W:-/tmp/parity}
source "$(dirname "$0")/at_once.sh"
[ -z "$TINY" ] && (timeout -k 5 ${T_GRAPHS:-150} $PY $G/decode_graphs.py > $W/logs/decode_graphs.log 2>&1; echo "decode_graphs rc=$?" > $W/graphs.rc) &
M="--model_name_or_path $W/model --no_save_model"
R="$M --total_episodes 32 --num_sample_generations 0 --reward_fn sentiment"
run kto kto.py $M --total_episodes 32
run kto_apo_bf16_pre kto.py $M --total_episodes 32 --loss_type apo_zero_unpaired --precompute_ref_log_probs --bf16
run dpo_mpo_wpo dpo.py $M --total_episodes 32 --loss_type sigmoid bco_pair --loss_weights 1 0.5 --use_weighting --ld_alpha 0.5
run dpo_fdiv_bf16 dpo.py $M --total_episodes 32 --f_divergence_type alpha_divergence --sync_ref_model --ref_model_sync_steps 1 --bf16
run dpo_simpo_bf16 dpo.py $M --total_episodes 32 --loss_type simpo --bf16
run dpo_orpo dpo.py $M --total_episodes 32 --loss_type orpo
run sft_dft_bf16 sft.py $M --total_episodes 32 --loss_type dft --bf16
run grpo_cispo_topk grpo.py $R --loss_type cispo --top_k 20 --top_p 0.9 --min_p 0.05 --repetition_penalty 1.1
run grpo_sapo_bf16 grpo.py $R --loss_type sapo --top_p 0.9 --bf16
run grpo_vespo grpo.py $R --loss_type vespo --delta 1.5 --off_policy_mask_threshold 0.5 --num_iterations 2
run rloo_trl_names rloo.py $R --num_generations 4 --beta 0.05 --epsilon 0.2 --num_iterations 2 --normalize_advantages \
  --lr_scheduler_type cosine --warmup_ratio 0.1 --top_k 20 --bf16
run ppo_topp ppo.py $R --top_p 0.9 --repetition_penalty 1.2 --bf16
run distill_topk distill.py $M --total_episodes 32 --num_sample_generations 0 --teacher_model_name_or_path $W/model \
  --top_k 20 --bf16
finish decode_graphs.log
