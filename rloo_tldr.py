"""RLOO on the TL;DR summarisation benchmark: a Pythia SFT policy learns to write Reddit TL;DRs that a reward model
prefers, evaluated by that reward model during training; an LLM judge compares the summaries it writes with the
reference summaries afterwards (tools/judge_tldr.py).

The algorithm is rloo.py's (k completions per prompt, leave-one-out baseline, KL penalty to the SFT policy in the
reward, clipped steps on the sequence probability ratio); this file adds the TL;DR setup (Stiennon et al. 2020) as the
N+ implementation details study (Huang et al. 2024, https://arxiv.org/abs/2403.17031) and TRL's benchmark ran it:
responses of at most 53 tokens sampled at temperature 0.7, a penalty of 1 for a summary without EOS, and evaluation of
greedy summaries on the validation split.

Reproduce the 1B run (8 GPUs; see README.md for the expected win rates):
    accelerate launch --config_file configs/deepspeed_zero2.yaml rloo_tldr.py --output_dir output/rloo_tldr \
        --eval_long_prompts truncate
    python tools/judge_tldr.py --samples output/rloo_tldr --judge_base_url https://api.openai.com/v1 \
        --judge_model gpt-4o-mini --protocol trl --num_examples 1000
On one GPU (same global batch, 8x the gradient accumulation):
    python rloo_tldr.py --gradient_accumulation_steps 128
"""

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch
import tyro

import infra
import utils


# Copied from rloo.RLOOArgs
@dataclass
class RLOOArgs:
    """RLOO's own flags."""

    rloo_k: int = 2
    """the number of completions sampled per prompt"""
    kl_coef: float = 0.05
    """the weight of the KL penalty in the reward"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """the per-token KL estimator summed into the penalty; abs: |log(p / ref)|; full: the exact KL over the whole
    vocabulary at each position, from both models' logits"""
    cliprange: float = 0.2
    """the clip range of the sequence probability ratio"""
    ratio_threshold: Optional[float] = None
    """a micro-batch whose mean sequence probability ratio exceeds this contributes no gradient (TRL)"""
    normalize_advantage: bool = False
    """normalise advantages to zero mean and unit std over the batch (all processes' completions with a baseline)"""
    normalize_advantages: bool = False
    """TRL 1.16's form of it: (A - mean) / (std + 1e-4), over the same completions"""
    num_ppo_epochs: int = 1
    """passes over each batch (1 epoch and 1 mini-batch: plain REINFORCE with the leave-one-out baseline)"""
    epsilon_high: Optional[float] = None
    """the clip's upper side, 1 + epsilon_high (TRL's; None: --cliprange)"""
    reward_clip_range: Optional[tuple[float, float]] = None
    """clamp each completion's score to [low, high] before the KL penalty (TRL's)"""
    mask_truncated_completions: bool = False
    """a completion cut off before its stop token gives no gradient and no KL, its score still in its group's baseline
    (TRL's)"""
    num_generations: Optional[int] = None
    """TRL 1.16's name for --rloo_k, which it sets"""
    beta: Optional[float] = None
    """TRL 1.16's name for --kl_coef (its RLOO too subtracts beta times the completion's summed k1 KL from the reward)"""
    epsilon: Optional[float] = None
    """TRL 1.16's name for --cliprange (its RLOO too clips the completion's probability ratio)"""
    num_iterations: Optional[int] = None
    """TRL 1.16's name for --num_ppo_epochs"""
    router_aux_loss_coef: Optional[float] = None
    """an MoE policy's router load-balancing loss times this joins the loss (TRL's; None: the model config's own)"""


# the bases last-first: a dataclass lists a base's fields after those of the bases named after it, so --help reads
# the algorithm's flags first, then the model and data, then the rest
@dataclass
class Args(infra.RunArgs, infra.DynamicSamplingArgs, infra.RolloutArgs, infra.TldrArgs, infra.RefSyncArgs, RLOOArgs):
    """rloo.py's flags with the TL;DR benchmark's defaults: RLOO's flags, then the score's shaping; the TL;DR policy,
    data, reward model and evaluation (infra.TldrArgs); the rollout; dynamic sampling; the run (the batch and learning
    rate, the experiment and its outputs, precision, LoRA, EMA, PTX)."""

    lr_per_update: ClassVar[bool] = True  # the learning rate's schedule steps per update (TRL 0.x's RLOO, its TL;DR runs)

    kl_coef: float = 0.03
    """the weight of the KL penalty in the reward"""
    num_ppo_epochs: int = 2
    """passes over each batch"""
    # summaries of at most 53 tokens; the published run's batch (8 processes, 4,096 completions per update)
    response_length: int = 53
    """the most tokens generated per summary"""
    local_rollout_forward_batch_size: int = 16
    """completions generated and scored per forward pass in the rollout"""
    total_episodes: int = 999_424
    """total completions to train on, a multiple of the batch (999,424: 244 batches of 4,096 or 1,952 of 512, TRL's
    1,000,000 rounded to a whole number of the 8-GPU batches)"""
    per_device_train_batch_size: int = 16
    """completions per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 16
    """micro-batches accumulated per optimiser step"""
    num_mini_batches: int = 2
    """optimiser steps per epoch over the batch"""
    learning_rate: float = 3e-6
    """the AdamW learning rate at its peak (--lr_scheduler_type)"""


# Copied from rloo.rloo_advantages
def rloo_advantages(rlhf_reward, k, scored):
    """RLOO: each completion's reward minus the mean reward of the other k - 1 completions of its prompt.

    rlhf_reward and scored are (prompts * k,) in rollout order (row j * k + i is the i-th completion of prompt j). A
    completion that no reward source scored (scored False) gets advantage 0 and is left out of the others' baselines;
    one whose prompt has no other scored completion has no baseline and gets 0 too."""
    rewards = rlhf_reward.reshape(-1, k)  # (prompts, k)
    valid = scored.reshape(-1, k).to(rewards.dtype)
    others = valid.sum(1, keepdim=True) - valid  # scored completions of the prompt besides this one
    baseline = ((rewards * valid).sum(1, keepdim=True) - rewards * valid) / others.clamp(min=1)
    return ((rewards - baseline) * valid * (others > 0)).flatten()


# Copied from rloo.trl_names
def trl_names(args):
    """TRL 1.16 RLOOConfig's names, where given, set the seed's, which mean the same (docs/algorithms.md)"""
    names = {"num_generations": "rloo_k", "beta": "kl_coef", "epsilon": "cliprange", "num_iterations": "num_ppo_epochs"}
    for trl, ours in names.items():
        if getattr(args, trl) is not None:
            setattr(args, ours, getattr(args, trl))
            setattr(args, trl, None)


# Copied from rloo.main
def main(args):
    trl_names(args)
    if args.rloo_k < 2:  # (the leave-one-out baseline needs another)
        utils.die(f"--rloo_k (--num_generations) must be at least 2, got {args.rloo_k}")
    if args.ratio_threshold is not None and args.ratio_threshold <= 0:
        utils.die("--ratio_threshold must be positive")
    infra.at_least(args, 0, "router_aux_loss_coef")
    epsilon_high = args.cliprange if args.epsilon_high is None else args.epsilon_high
    if args.kl_coef < 0 or args.cliprange < 0 or epsilon_high < 0 or args.num_ppo_epochs < 1:
        utils.die("--kl_coef (--beta), --cliprange (--epsilon) and --epsilon_high must be >= 0, --num_ppo_epochs "
                  "(--num_iterations) >= 1")  # fmt: skip
    if args.reward_clip_range is not None and args.reward_clip_range[0] > args.reward_clip_range[1]:
        utils.die(f"--reward_clip_range must be low high with low <= high, got {args.reward_clip_range}")
    if (args.vllm_importance_sampling_mode or "sequence").startswith("token"):
        utils.die("RLOO's ratio is the completion's: --vllm_importance_sampling_mode sequence_truncate or sequence_mask")
    k = args.rloo_k  # completions per prompt
    run = infra.start(args, k=args.rloo_k)  # processes, seeding, batch sizes, output_dir
    # the tokenizer, prompts and reward sources; the policy (LoRA, gradient checkpointing) and the frozen reference
    policy, ref_policy = infra.load_policy(run)
    router = infra.router_coef(policy, args.router_aux_loss_coef)  # 0 but for a mixture of experts
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(policy, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    # accelerate's (DDP, DeepSpeed); the reference and the reward models on the device; the EMA of --ema_beta
    policy, optimizer, ref_policy = infra.prepare(run, policy, optimizer, ref_policy)
    # the scripts' own sampler or a vLLM engine, each token drawn by the sampling rule (utils.sampling_logits:
    # --temperature, --top_k, --top_p, --min_p, --repetition_penalty)
    sampler = infra.Sampler(run, policy, rule=utils.sampling_logits)
    accelerator = run.accelerator
    # TRL's --use_score_scaling, --use_score_norm and --score_clip; a checkpoint holds the running moments
    scaler = utils.ScoreScaler(args.use_score_scaling, args.use_score_norm, args.score_clip, reduce=run.reduce_sum)
    accelerator.register_for_checkpointing(scaler)

    def keep(batch):  # --dynamic_sampling (DAPO): the groups whose scores, clipped as the advantages see them, differ
        scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)
        return utils.distinct_groups(utils.ScoreScaler(clip=args.score_clip)(scores, scored), scored, k)

    # a micro-batch of whole prompts runs each prompt once for its k completions (utils.forward_grouped)
    train_group = 1 if args.per_device_train_batch_size % k else k
    # no KL in the reward and one pass over one mini-batch: the update's own logprobs, detached, are the rollout policy's
    # (it takes its only step after reading them), so the rollout skips that forward pass (grpo.py's on_policy)
    skip_pass = args.kl_coef == 0 and args.kl_estimator != "full" and args.num_ppo_epochs == args.num_mini_batches == 1
    # the learning rate's schedule (--lr_scheduler_type, --warmup_steps: transformers'), stepping with each optimiser
    # step, as TRL 1.16's RLOOTrainer, or with each update (lr_per_update, the TL;DR script's: TRL 0.x's)
    total_steps = args.num_updates * (1 if args.lr_per_update else args.num_ppo_epochs * args.num_mini_batches)
    warmup, low = args.warmup_of(total_steps), args.min_lr_rate

    for update in run.updates():  # from the one after the newest checkpoint with --resume
        # 1. this process's share of the next prompts (draw); k completions of each (--environment: episodes), truncated
        # after the stop token, and each reward source's scores; with --dynamic_sampling, in rounds until enough groups
        # keep; with --max_staleness N, drawn N updates ago and sampled since, ahead, by the policy of then
        batch = sampler.rollout(sampler.draw, keep=keep if args.dynamic_sampling else None)
        sampled = batch.sampled  # (rows, width): True where the policy sampled the token (not padding, observations)
        # the score: the sources' weighted sum less the missing-EOS penalty (utils.score), then scaled and clipped
        raw_scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)
        scores = scaler(raw_scores, scored)
        if args.reward_clip_range is not None:  # (TRL's)
            scores = scores.clamp(*args.reward_clip_range)
        # --mask_truncated_completions: a completion without its stop token counts no token in the KL and the loss
        counted = sampled & batch.contain_eos[:, None] if args.mask_truncated_completions else sampled

        # autocast (a no-op without mixed precision) covers the reference too, which accelerate did not wrap
        with torch.no_grad(), accelerator.autocast():
            # 2. logprobs of the distribution sampled from (logits / temperature), the policy's and the reference's; the
            # policy's filled in by the update where on_policy (not for an engine's or a stale sample: its weights need them)
            unwrapped = accelerator.unwrap_model(policy)
            on_policy = skip_pass and batch.behaviour_logprobs is None
            if on_policy:
                logprobs = torch.zeros(sampled.shape, device=run.device)
            else:
                logprobs = utils.rollout_logprobs(unwrapped, batch, args.temperature)
            with utils.reference_model(unwrapped, ref_policy) as ref:  # with LoRA, the policy without its adapters
                ref_logprobs = utils.rollout_logprobs(ref, batch, args.temperature)

            # an engine sampled: each completion's probability, the trainer's over the engine's, weighs its loss
            is_weight = torch.ones_like(scores)
            if batch.behaviour_logprobs is not None:
                is_weight, vllm_stats = utils.importance_weights(
                    logprobs, batch.behaviour_logprobs, counted, **args.importance_sampling("sequence_truncate")
                )

            # 3. KL penalty: the per-token estimate (or the exact KL) against the reference, zero on padding, summed
            # over each completion and subtracted from its score
            if args.kl_estimator == "full":
                kl = utils.rollout_full_kl(unwrapped, ref_policy, batch, args.temperature)
            else:
                kl = utils.kl_estimate(logprobs, ref_logprobs, args.kl_estimator)
            kl = kl.masked_fill(~counted, 0.0)
            non_score_reward = -args.kl_coef * kl.sum(1)
            rlhf_reward = scores + non_score_reward

            # 4. RLOO: advantages from the leave-one-out baseline
            advantages = rloo_advantages(rlhf_reward, k, scored)
            if args.normalize_advantage or args.normalize_advantages:  # over the global batch's completions with a
                # baseline (TRL's: an unscored one's or one scored alone in its group is NaN, left out and then 0)
                baselined = scored & (scored.reshape(-1, k).sum(1) > 1).repeat_interleave(k)
                std_eps = 1e-4 if args.normalize_advantages else None  # (TRL's: the std plus 1e-4)
                advantages = utils.masked_whiten(advantages, baselined, reduce=run.reduce_sum, std_eps=std_eps)
                advantages = advantages.masked_fill(~baselined, 0)  # (the others keep 0)
            seq_logprobs = logprobs.masked_fill(~counted, 0.0).sum(1)

        # 5. update: epochs x mini-batches x gradient-accumulation micro-batches
        policy.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for epoch in range(args.num_ppo_epochs):
            # shuffled by prompt, keeping each prompt's k rows together (so micro-batches can run each prompt once)
            sizes = (args.local_batch_size, args.local_mini_batch_size, args.per_device_train_batch_size)
            for mb, mini_batch in enumerate(utils.minibatches(*sizes, group=k, device=run.device)):
                steps = ((update - 1) * args.num_ppo_epochs + epoch) * args.num_mini_batches + mb  # optimiser steps so far
                at = update - 1 if args.lr_per_update else steps
                lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, at, total_steps, warmup, low)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for micro in mini_batch:
                    with accelerator.accumulate(policy):
                        logits = utils.forward_grouped(
                            policy,
                            batch.query_responses[micro],
                            batch.attention_mask[micro],
                            context_length=batch.context_length,
                            group=train_group,
                            logits_to_keep=sampled.shape[1] + 1,
                            router=router != 0,  # with an MoE's router loss
                        )
                        logits, router_loss = logits if router else (logits, 0.0)
                        logits = logits[:, :-1]
                        new_logprobs, entropy = utils.logprobs_from_logits(
                            logits, batch.responses[micro], args.temperature, with_entropy=True
                        )
                        if on_policy:  # the policy has not stepped since the rollout: these are its logprobs
                            logprobs[micro] = new_logprobs.detach().masked_fill(~sampled[micro], utils.INVALID_LOGPROB)
                            seq_logprobs[micro] = new_logprobs.detach().masked_fill(~counted[micro], 0.0).sum(1)
                        new_logprobs = new_logprobs.masked_fill(~counted[micro], 0.0)
                        # the sequence-level ratio: RLOO treats a whole completion as one action
                        logprobs_diff = new_logprobs.sum(1) - seq_logprobs[micro]
                        ratio = torch.exp(logprobs_diff)
                        pg_losses = -advantages[micro] * ratio
                        pg_losses2 = -advantages[micro] * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + epsilon_high)
                        pg_loss = (torch.max(pg_losses, pg_losses2) * is_weight[micro]).mean()
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient
                        # (its backward still runs, so that every process takes part in each step)
                        skip = args.ratio_threshold is not None and ratio.mean() > args.ratio_threshold

                        # an MoE router's load-balancing loss (TRL's); LightRFT's PTX loss, 0 without --ptx_coef
                        loss = pg_loss + router * router_loss + run.ptx_loss(policy)
                        run.check_finite(loss)
                        accelerator.backward(loss * 0.0 if skip else loss)
                        run.clip_gradients(policy)  # --max_grad_norm; stops on a non-finite gradient
                        optimizer.step()
                        optimizer.zero_grad()
                        run.update_ema(policy)  # --ema_beta

                        real = sampled[micro]
                        # TRL 1.16's names: the token mean entropy; the completions whose gradient the clip removed
                        low = ((ratio < 1.0 - args.cliprange) & (advantages[micro] < 0)).float()
                        high = ((ratio > 1.0 + epsilon_high) & (advantages[micro] > 0)).float()
                        clipped = (pg_losses2 > pg_losses).float().mean()  # (the same completions as low or high)
                        stats.add_tokens(counted[micro], entropy=entropy)
                        stats.add(
                            **{
                                "clip_ratio/low_mean": low.mean(),
                                "clip_ratio/high_mean": high.mean(),
                                "clip_ratio/region_mean": clipped,
                                "policy/approxkl_avg": 0.5 * (logprobs_diff**2).mean(),
                                "policy/clipfrac_avg": clipped,
                                "loss/policy_avg": pg_loss,
                                "policy/entropy_avg": entropy.masked_fill(~real, 0.0).sum() / real.sum(),
                                "val/ratio": ratio.mean(),
                                **({"aux_loss": router_loss} if router else {}),
                            }
                        )
                        if args.ratio_threshold is not None:  # the fraction of micro-batches skipped
                            stats.add(**{"policy/skipped_ratio_threshold": float(skip)})
                if args.sync_ref_model and (steps + 1) % args.ref_model_sync_steps == 0:  # TR-DPO: the reference moves
                    utils.sync_reference(ref_policy, accelerator.unwrap_model(policy), args.ref_model_mixup_alpha)
        policy.eval()
        if on_policy:  # the KL, 0 in the reward, for the metrics
            kl = utils.kl_estimate(logprobs, ref_logprobs, args.kl_estimator).masked_fill(~counted, 0.0)
        if args.kl_coef:  # TRL's kl: per token
            stats.add_tokens(counted, kl=kl)

        # the update's statistics, averaged over the processes as they are written
        stats.add(
            **{
                "objective/kl": kl.sum(1).mean(),
                "objective/entropy": (-logprobs).masked_fill(~sampled, 0.0).sum(1).mean(),
                "objective/non_score_reward": non_score_reward.mean(),
                "objective/rlhf_reward": rlhf_reward.mean(),
                "val/response_length": sampled.sum(1).float().mean(),  # the policy's tokens (not observations)
                "val/ratio_var": stats.var("val/ratio"),
            }
        )
        if batch.behaviour_logprobs is not None:  # how far the engine's logprobs are from the trainer's
            stats.add(**vllm_stats)
        metrics = {"lr": lr, **scaler.metrics()}
        # metrics.jsonl, TensorBoard, wandb; samples, completions
        run.log(update, batch, stats, advantages, scores=raw_scores, scored=scored, **metrics)
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="RLOO")  # the model, its EMA, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
