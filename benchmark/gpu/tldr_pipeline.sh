#!/usr/bin/env bash
# The whole TL;DR pipeline of summarize_from_feedback_details (Huang et al. 2024, "The N+ Implementation Details of
# RLHF with PPO: A Case Study on TL;DR Summarization", arXiv 2403.17031; the recipe's commands are its
# sbatches/{sft,reward,ppo}.sbatch) with this repository's scripts, on one machine with 8 GPUs:
#   1. sft.py       on trl-lib/tldr (the filtered TL;DR SFT set, prompt/completion)          -> $OUT/sft
#   2. reward.py    from the SFT model, on trl-lib/tldr-preference (prompt/chosen/rejected)   -> $OUT/reward
#   3. ppo_tldr.py  policy and reference $OUT/sft, reward model (and critic init) $OUT/reward -> $OUT/ppo
#   4. rloo_tldr.py the same SFT and reward model (RLOO is not in the recipe: TRL's settings)  -> $OUT/rloo
#   5. (only with OPENAI_API_KEY set) the LLM judge: win rates against the reference summaries.
# What it should reach, with sources, and every way it differs from the recipe: benchmark/gpu/tldr_pipeline.md.
# Not run yet: no GPU has been available to this project.
#
# Usage (from anywhere):  MODEL=EleutherAI/pythia-2.8b-deduped SEED=44413 bash benchmark/gpu/tldr_pipeline.sh
#   MODEL   EleutherAI/pythia-1b-deduped (default), EleutherAI/pythia-2.8b-deduped or EleutherAI/pythia-6.9b-deduped
#   SEED    1 by default; the recipe's four seeds are 44413 55513 66613 77713
#   OUT     output folder, output/tldr_pipeline/<model>_seed<SEED> by default (each step refuses a folder it has
#           already written a metrics.jsonl to: rerun a failed step by hand with --resume, see the .md)
#   MICRO, RL_MICRO, ROLLOUT, ACCEL_CONFIG  override the per-size choices below
# Batch sizes are per GPU and assume 8 processes (configs/*.yaml have num_processes: 8), as the recipe's 8xH100 box.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-EleutherAI/pythia-1b-deduped}
SEED=${SEED:-1}
OUT=${OUT:-output/tldr_pipeline/$(basename "$MODEL")_seed${SEED}}

# Per model size, as the recipe's sbatches: micro-batch (the recipe: 16, 4, 1 for PPO), rollout forward batch
# (--local_rollout_forward_batch_size: 64, 32, 4) and the DeepSpeed stage. The recipe runs every step under ZeRO-2 and,
# at 6.9B, puts PPO's frozen reference and reward model in ZeRO-3 engines with their weights offloaded to the CPU; here
# the 6.9B runs use ZeRO-3 throughout (the scripts then shard the frozen models too; no CPU offload flag exists).
case "$MODEL" in
    *6.9b*) d_micro=1; d_rl_micro=1;  d_rollout=4;  d_config=configs/deepspeed_zero3.yaml ;;
    *2.8b*) d_micro=4; d_rl_micro=4;  d_rollout=32; d_config=configs/deepspeed_zero2.yaml ;;
    *)      d_micro=8; d_rl_micro=16; d_rollout=64; d_config=configs/deepspeed_zero2.yaml ;;
esac
MICRO=${MICRO:-$d_micro}            # SFT and RM micro-batch per GPU (must divide 8)
RL_MICRO=${RL_MICRO:-$d_rl_micro}   # PPO and RLOO micro-batch per GPU (must divide 64)
ROLLOUT=${ROLLOUT:-$d_rollout}
ACCEL_CONFIG=${ACCEL_CONFIG:-$d_config}
launch=(accelerate launch --config_file "$ACCEL_CONFIG")
mkdir -p "$OUT"

# Every step passes --bf16: the recipe's accelerate config (deepspeed.yaml) has mixed_precision: bf16. (TRL's published
# ppo/rloo TL;DR runs were fp32, which is what ppo_tldr.py and rloo_tldr.py do without it.)
# Gradient clipping: the recipe's scripts never clip, but under its DeepSpeed config accelerate fills DeepSpeed's
# gradient_clipping "auto" with 1.0, the scripts' --max_grad_norm default, so it is not passed.
# Optimiser: AdamW eps 1e-5 in both; the recipe's torch AdamW keeps the default weight_decay 0.01, the scripts use 0.0
# (no flag).

# 1. SFT. Recipe (sft.py): lr 3e-6 (sbatch LR), cosine to 0 with no warm-up, 1 epoch, 128 sequences per step
#    (1 x 16 accumulation x 8 GPUs), the loss over every non-pad token of prompt + reference summary + EOS.
#    Here: the same lr, epoch and batch (16 per GPU); --completion_only_loss False for the prompt-and-summary loss; the
#    lr decays LINEARLY (sft.py has no scheduler flag). The recipe's prompts are OpenAI's preprocessed queries (post
#    cut at a newline to fit 512 tokens); trl-lib/tldr has the raw posts, and rows over --max_length (1024) tokens are
#    cut from the end.
"${launch[@]}" sft.py --model_name_or_path "$MODEL" --dataset_name trl-lib/tldr \
    --eval_dataset_name trl-lib/tldr --eval_split validation --completion_only_loss False \
    --learning_rate 3e-6 --num_train_epochs 1 --per_device_train_batch_size "$MICRO" \
    --gradient_accumulation_steps $((16 / MICRO)) --bf16 --seed "$SEED" --output_dir "$OUT/sft"

# 2. Reward model, from the SFT model. Recipe (reward.py): lr 3e-6 cosine to 0, 1 epoch over the 92,858 training pairs
#    (1,450 steps), 64 pairs per step (1 x 8 x 8), a new scalar head (std 1/sqrt(hidden+1)), and after training the
#    mean score of the SFT set's reference summaries subtracted, so that they score 0. Validation accuracy on the TL;DR
#    validation pairs and, apart, on the CNN/DM ones.
#    Here: the same lr, epoch, batch (8 pairs per GPU), linear decay; the saved offset is the mean score of the SFT
#    set's reference summaries (--normalize_dataset_name trl-lib/tldr, as the recipe); the head starts at std 0.02
#    (initializer_range, as transformers and TRL) with no bias. trl-lib/tldr-preference's validation split holds the TL;DR and
#    the CNN/DM pairs together (86,086 in all, a few thousand of them CNN/DM), so eval/accuracy mixes both.
"${launch[@]}" reward.py --model_name_or_path "$OUT/sft" --dataset_name trl-lib/tldr-preference \
    --eval_dataset_name trl-lib/tldr-preference --eval_split validation --normalize_dataset_name trl-lib/tldr \
    --learning_rate 3e-6 --num_train_epochs 1 --per_device_train_batch_size "$MICRO" \
    --gradient_accumulation_steps $((8 / MICRO)) --bf16 --seed "$SEED" --output_dir "$OUT/reward"

# 3. PPO. ppo_tldr.py's defaults already are the recipe's (ppo.py): lr 3e-6 linear to 0, 4 epochs x 1 mini-batch of 512
#    (64 per GPU), kl_coef 0.05, gamma 1, lam 0.95, clip 0.2 / 0.2, vf_coef 0.1, no reward whitening, temperature 0.7,
#    53 tokens, critic from the reward model, ~1M episodes (999,424 = 1,952 updates; the recipe 1,953).
#    Differs: a summary without EOS gets score - 1 (--missing_eos_penalty), the recipe replaces its score by -1 (no
#    flag); the policy flag is --sft_model_path (these scripts have no --model_name_or_path).
#    --eval_examples 10000 takes the whole validation split (6,447 prompts less those over 512 tokens), as the recipe
#    judged its whole validation set; episode 0's evaluation is the SFT model's.
"${launch[@]}" ppo_tldr.py --sft_model_path "$OUT/sft" --reward_model_path "$OUT/reward" \
    --per_device_train_batch_size "$RL_MICRO" --gradient_accumulation_steps $((64 / RL_MICRO)) \
    --local_rollout_forward_batch_size "$ROLLOUT" --eval_examples 10000 --checkpoint_every 100 \
    --bf16 --seed "$SEED" --output_dir "$OUT/ppo"

# 4. RLOO: rloo_tldr.py's defaults (TRL's published RLOO run: k 2, kl_coef 0.03, 2 epochs x 2 mini-batches, 512
#    completions per GPU per update, lr 3e-6, 999,424 episodes = 244 updates); only the micro-batch split differs.
"${launch[@]}" rloo_tldr.py --sft_model_path "$OUT/sft" --reward_model_path "$OUT/reward" \
    --per_device_train_batch_size "$RL_MICRO" --gradient_accumulation_steps $((256 / RL_MICRO)) \
    --local_rollout_forward_batch_size "$ROLLOUT" --eval_examples 10000 --checkpoint_every 25 \
    --bf16 --seed "$SEED" --output_dir "$OUT/rloo"

# 5. Win rates against the reference summaries (the paper's judge was gpt-3.5-turbo-0125 with its own prompt, which
#    tools/judge_tldr.py does not have: its figures are comparable in kind, not to the digit). Episode 0 is the SFT model.
if [[ -n "${OPENAI_API_KEY:-}" ]]; then
    judge=(python tools/judge_tldr.py --judge_base_url https://api.openai.com/v1 --judge_model "${JUDGE_MODEL:-gpt-3.5-turbo-0125}")
    "${judge[@]}" --samples "$OUT/ppo/eval_samples/episode_0.jsonl"   # SFT
    "${judge[@]}" --samples "$OUT/ppo"                                # PPO, last evaluation
    "${judge[@]}" --samples "$OUT/rloo"                               # RLOO, last evaluation
fi
