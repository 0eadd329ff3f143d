"""PPO for RLHF of a causal language model: a value model, per-token rewards, GAE, clipped policy and value losses.

Every generated token is an action. Its reward is -kl_coef times the KL to the frozen initial policy, and the last real
token also gets the score (a reward model, a Python function, or the built-in sentiment score). A critic estimates
each token's value; generalised advantage estimation (GAE) turns rewards and values into advantages; the policy takes
clipped steps on per-token probability ratios and the critic regresses on the returns, with its own clipping. The KL
coefficient is fixed or follows the adaptive controller of Ziegler et al.

Papers: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences"; Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A Case Study on
TL;DR Summarization" (https://arxiv.org/abs/2403.17031).

Run (offline, on a CPU: SmolLM2-135M-Instruct learns to answer the shipped prompts more positively):
    python ppo.py
With a reward model and a hub dataset, on GPUs:
    accelerate launch ppo.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --reward_model_path path/to/reward_model --dataset_name trl-lib/tldr
"""

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro

import infra
import utils


@dataclass
class PPOArgs:
    """PPO's own flags."""

    kl_coef: float = 0.05
    """the weight of the KL penalty (the initial one with --kl_target)"""
    kl_estimator: Optional[Literal["k1", "k2", "k3", "abs", "full"]] = None
    """the per-token KL estimator; None: k1 in the reward, k2 in the loss. abs: |log(p / ref)|; full: the exact KL over
    the whole vocabulary at each position, from both models' logits (in the reward only). In the loss only its gradient
    counts: k2's is that of KL(policy || ref), k3's that of KL(ref || policy) (GRPO's choice), abs's that of twice the
    total variation distance, k1's zero in expectation (refused)"""
    kl_penalty: Literal["reward", "loss"] = "reward"
    """where the KL goes: subtracted from each token's reward, or added to the policy loss"""
    kl_target: Optional[float] = None
    """adaptive KL control (Ziegler et al.): steer the coefficient so the summed KL per completion nears this"""
    kl_horizon: int = 10000
    """the adaptive controller's horizon, in episodes"""
    whiten_rewards: bool = False
    """scale per-token rewards to unit variance over real tokens before GAE"""
    gamma: float = 1.0
    """the discount factor"""
    lam: float = 0.95
    """the GAE lambda"""
    cliprange: float = 0.2
    """the clip range of the per-token probability ratio"""
    cliprange_value: float = 0.2
    """the clip range of the value prediction around the rollout's value"""
    vf_coef: float = 0.1
    """the weight of the value loss"""
    target_kl: Optional[float] = None
    """stop an update's epochs early once the approximate KL to the rollout policy exceeds this"""
    ratio_threshold: Optional[float] = None
    """a micro-batch whose mean probability ratio exceeds this contributes no gradient, policy or value (TRL)"""
    value_model_path: Optional[str] = None
    """the critic's init: a sequence-classification model (e.g. a critic saved by an earlier run, output_dir/critic);
    None: the reward model if given (and of the policy's vocabulary), else the policy's trunk with a new head"""
    value_head_shared: bool = False
    """put the value head on the policy's trunk instead of training a separate critic"""
    critic_warmup_updates: int = 0
    """train the critic alone for this many first updates: the policy, and its optimiser state, stay as they are, so
    its first advantages come from a critic that has learnt the rewards"""
    score_position: Literal["eos", "after_eos"] = "eos"
    """the token the score is added to: the last real one (the stop token), or one past it as TRL's old PPO did"""
    num_ppo_epochs: int = 1
    """passes over each batch"""


# the bases last-first: a dataclass lists a base's fields after those of the bases named after it, so --help reads
# the algorithm's flags first, then the model and data, then the rest
@dataclass
class Args(infra.RunArgs, infra.EvalArgs, infra.RolloutArgs, infra.DataArgs, PPOArgs):
    """PPO's flags, then those every script shares (infra/*flags.py): the score's shaping; the model, data and reward
    sources; the rollout; the evaluation; the run (the batch and its optimiser, the experiment and its outputs,
    precision, LoRA, EMA, PTX)."""


def place_scores(non_score_reward, scores, lengths, score_position):
    """Per-token rewards (batch, width): the KL part on every token plus the score on one token per row.

    Returns (rewards, value_mask); value_mask is True up to the token holding the score. With "after_eos" that is one
    past the last real token (a padding position, or the last one when the row fills the width), as TRL's old PPO
    did: the policy then sees the score only through the critic's value of that position."""
    width = non_score_reward.shape[1]
    at = lengths - 1 if score_position == "eos" else lengths.clamp(max=width - 1)
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(rewards), device=rewards.device), at] += scores
    value_mask = torch.arange(width, device=rewards.device)[None, :] <= at[:, None]
    return rewards, value_mask


def compute_gae(rewards, values, gamma, lam):
    """GAE over (batch, width) rewards and values, both zero past each row's end. Returns (advantages, returns)."""
    lastgaelam = 0
    advantages_reversed = []
    width = rewards.shape[1]
    for t in reversed(range(width)):
        nextvalues = values[:, t + 1] if t < width - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def value_loss(vpred, values, returns, mask, cliprange_value):
    """PPO's clipped value loss: the worse of the plain and the clipped squared error, the clipped prediction kept
    within cliprange_value of the rollout's value. Returns (loss, clipfrac)."""
    vpredclipped = values + torch.clamp(vpred - values, -cliprange_value, cliprange_value)
    vf_losses1 = (vpred - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    loss = 0.5 * utils.masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    return loss, utils.masked_mean((vf_losses2 > vf_losses1).float(), mask)


def adaptive_kl_coef(kl_coef, kl, kl_target, kl_horizon, n_steps):
    """Ziegler et al.'s proportional controller: move the coefficient toward the one that gives kl_target."""
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / kl_horizon)


def main(args):
    # k1 sums to the sequence log-ratio, unbiased in the reward; in the loss E_p[grad log p] = 0 leaves it no gradient
    args.kl_estimator = kl_estimator = args.kl_estimator or ("k1" if args.kl_penalty == "reward" else "k2")
    if args.kl_penalty == "loss" and kl_estimator == "k1":
        utils.die("--kl_penalty loss needs --kl_estimator k2 or k3 (or abs): k1's gradient is zero in expectation")
    if args.kl_penalty == "loss" and kl_estimator == "full":  # (the update would need the reference's logits too)
        utils.die("--kl_penalty loss cannot use --kl_estimator full (it needs the reference's logits); use k2 (its gradient)")
    if (args.kl_target is not None and args.kl_target <= 0) or args.kl_horizon < 1:
        utils.die("--kl_target and --kl_horizon must be positive")
    if min(args.kl_coef, args.cliprange, args.cliprange_value, args.vf_coef) < 0 or args.num_ppo_epochs < 1:
        utils.die("--kl_coef, --cliprange, --cliprange_value and --vf_coef must be >= 0, --num_ppo_epochs >= 1")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1) or (args.target_kl is not None and args.target_kl <= 0):
        utils.die("--gamma and --lam must lie in [0, 1] and --target_kl be positive")
    if args.value_head_shared and args.value_model_path:
        utils.die("--value_model_path loads a separate critic; it cannot be used with --value_head_shared")
    if args.critic_warmup_updates and args.value_head_shared:
        utils.die("--critic_warmup_updates needs a separate critic: with --value_head_shared the value loss trains the policy")
    if args.ratio_threshold is not None and args.ratio_threshold <= 0:
        utils.die("--ratio_threshold must be positive")
    run = infra.start(args)  # processes, seeding, batch sizes, output_dir
    if not 0 <= args.critic_warmup_updates < args.num_updates:
        utils.die(
            f"--critic_warmup_updates must be >= 0 and below the run's {args.num_updates} updates: the policy must train"
        )
    # the tokenizer, prompts and reward sources; the policy and the critic in one module (LoRA, gradient
    # checkpointing); the frozen reference
    model, ref_policy = infra.load_policy_and_critic(run, args.value_model_path, shared=args.value_head_shared)
    # AdamW on the policy's and the critic's trainable weights, weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(model, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    # accelerate's (DDP, DeepSpeed); the reference and the reward models on the device; the EMA of --ema_beta
    model, optimizer, ref_policy = infra.prepare(run, model, optimizer, ref_policy)
    # one completion per prompt: the scripts' own sampler or a vLLM engine, each token drawn by the sampling rule
    # (utils.sampling_logits: --temperature, --top_k, --top_p, --min_p, --repetition_penalty)
    sampler = infra.Sampler(run, model, rule=utils.sampling_logits)
    accelerator = run.accelerator
    # TRL's --use_score_scaling, --use_score_norm and --score_clip; a checkpoint holds the running moments
    scaler = utils.ScoreScaler(args.use_score_scaling, args.use_score_norm, args.score_clip, reduce=run.reduce_sum)
    accelerator.register_for_checkpointing(scaler)
    kl_coef = infra.CheckpointedNumber(args.kl_coef)  # adapted by --kl_target; a checkpoint holds it
    accelerator.register_for_checkpointing(kl_coef)

    for update in run.updates():  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr
        warmup = update <= args.critic_warmup_updates  # only the critic learns

        # 1. this process's share of the next prompts (draw); a completion of each, truncated after the stop token, and
        # each reward source's scores; with --max_staleness N, drawn N updates ago and sampled since, by the policy of then
        batch = sampler.rollout(sampler.draw)
        sampled, width = batch.sampled, batch.sampled.shape[1]  # (rows, width): False past the end
        # the score: the sources' weighted sum less the missing-EOS penalty (utils.score), then scaled and clipped
        raw_scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)
        scores = scaler(raw_scores, scored)

        # autocast (a no-op without mixed precision) also covers the reference, which accelerate did not wrap: at the
        # first update the policy and the reference then give identical logprobs
        with torch.no_grad(), accelerator.autocast():
            # 2. logprobs of the distribution sampled from (logits / temperature), the critic's values and the
            # reference's logprobs, a chunk of rows at a time
            unwrapped = accelerator.unwrap_model(model)
            logprobs, ref_logprobs, full_kls, values = [], [], [], []
            for rows, query_response, mask, response in utils.rollout_chunks(batch, unwrapped.policy):
                logits, value = unwrapped(query_response, mask, logits_to_keep=response.shape[1] + 1)
                logits = logits[:, :-1]
                logprobs.append(utils.logprobs_from_logits(logits, response, args.temperature))
                # the value of the state before each response token, and one column more: a row that stops at the
                # chunk's last column has there its value after EOS (the critic at the stop token; --score_position
                # after_eos reads it)
                values.append(value[:, batch.context_length - 1 :])
                with utils.reference_model(unwrapped.policy, ref_policy) as ref:  # with LoRA, the policy without its adapters
                    ref_logits = utils.forward(ref, query_response, mask, logits_to_keep=response.shape[1] + 1).logits[:, :-1]
                ref_logprobs.append(utils.logprobs_from_logits(ref_logits, response, args.temperature))
                if kl_estimator == "full":  # the exact KL, while both models' logits are at hand
                    full_kls.append(utils.full_kl(logits, ref_logits, args.temperature))
                del logits, ref_logits  # (chunk, width, vocab) each: freed before the next chunk allocates its own
            # chunks may stop at different lengths: each padded to the longest
            logprobs = utils.pad_cat(logprobs, utils.INVALID_LOGPROB).masked_fill(~sampled, utils.INVALID_LOGPROB)
            ref_logprobs = utils.pad_cat(ref_logprobs, utils.INVALID_LOGPROB).masked_fill(~sampled, utils.INVALID_LOGPROB)
            # the values kept (value_mask, below) are the critic's at real tokens, the stop token at most, so they do not
            # depend on the padding and equal the update's vpred; the widest chunks' extra column lies past the batch
            values = utils.pad_cat(values, 0.0)[:, :width]

            # 3. KL penalty: per-token estimate (or exact KL) against the reference, zero on padding, in each token's reward
            if kl_estimator == "full":
                kl = utils.pad_cat(full_kls, 0.0).masked_fill(~sampled, 0.0)
            else:
                kl = utils.kl_estimate(logprobs, ref_logprobs, kl_estimator).masked_fill(~sampled, 0.0)
            non_score_reward = -kl_coef.value * kl if args.kl_penalty == "reward" else torch.zeros_like(kl)
            # PPO: the score on one token (--score_position), the KL penalty on every token
            rewards, value_mask = place_scores(non_score_reward, scores, batch.lengths, args.score_position)
            rlhf_reward = rewards.sum(1)
            # a completion that no reward source scored takes no part in the update: no value target, no advantage
            value_mask = value_mask & scored[:, None]
            loss_mask = sampled & scored[:, None]
            if args.whiten_rewards:
                rewards = utils.masked_whiten(rewards, value_mask, False, run.reduce_sum).masked_fill(~value_mask, 0.0)

            # 4. advantages: GAE over real tokens, then whitened over those of all processes
            values = values.masked_fill(~value_mask, 0.0)
            advantages, returns = compute_gae(rewards, values, args.gamma, args.lam)
            advantages = utils.masked_whiten(advantages, loss_mask, reduce=run.reduce_sum).masked_fill(~loss_mask, 0.0)

            # --use_vllm: the engine sampled; each token's (or completion's) probability under the trainer over the
            # engine's, truncated or masked (--vllm_importance_sampling_mode), weighs its policy loss
            is_weight = torch.ones_like(logprobs)
            if batch.behaviour_logprobs is not None:
                is_weight, vllm_stats = utils.importance_weights(
                    logprobs, batch.behaviour_logprobs, sampled, **args.importance_sampling("token_truncate")
                )
                is_weight = is_weight.reshape(len(is_weight), -1)  # (rows, width), or (rows, 1) for a completion's

        # 5. update: epochs x mini-batches x gradient-accumulation micro-batches
        model.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for epoch in range(args.num_ppo_epochs):
            approxkls = []  # --target_kl's measure
            sizes = (args.local_batch_size, args.local_mini_batch_size, args.per_device_train_batch_size)
            for mini_batch in utils.minibatches(*sizes, device=run.device):
                for micro in mini_batch:
                    with accelerator.accumulate(model):
                        mb_loss_mask, mb_value_mask = loss_mask[micro], value_mask[micro]
                        logits, vpred = model(batch.query_responses[micro], batch.attention_mask[micro], width + 1)
                        logits = logits[:, :-1]
                        vpred = vpred[:, batch.context_length - 1 : -1].masked_fill(~mb_value_mask, 0.0)
                        new_logprobs, entropy = utils.logprobs_from_logits(
                            logits, batch.responses[micro], args.temperature, with_entropy=True
                        )
                        new_logprobs = new_logprobs.masked_fill(~mb_loss_mask, utils.INVALID_LOGPROB)

                        # PPO: the per-token ratio, clipped; the critic's loss clipped around the rollout's values
                        logprobs_diff = new_logprobs - logprobs[micro]
                        ratio = torch.exp(logprobs_diff)
                        mb_advantage = advantages[micro]
                        pg_losses = -mb_advantage * ratio
                        pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
                        pg_loss = utils.masked_mean(torch.max(pg_losses, pg_losses2) * is_weight[micro], mb_loss_mask)
                        vf_loss, vf_clipfrac = value_loss(
                            vpred,
                            values=values[micro],
                            returns=returns[micro],
                            mask=mb_value_mask,
                            cliprange_value=args.cliprange_value,
                        )
                        # in the critic's warm-up the policy's losses count zero times: still in the graph, so DDP
                        # finds a gradient for every parameter
                        policy_weight = 0.0 if warmup else 1.0
                        loss = policy_weight * pg_loss + args.vf_coef * vf_loss
                        if args.kl_penalty == "loss":
                            kl_loss = utils.kl_estimate(new_logprobs, ref_logprobs[micro], kl_estimator)
                            loss = loss + policy_weight * kl_coef.value * utils.masked_mean(kl_loss, mb_loss_mask)
                        loss = loss + policy_weight * run.ptx_loss(model)  # LightRFT's PTX loss, 0 without --ptx_coef
                        run.check_finite(loss)
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient,
                        # to the critic either (whose loss reaches the policy's trunk with --value_head_shared); its
                        # backward still runs, so that every process takes part in each step
                        mb_ratio = utils.masked_mean(ratio, mb_loss_mask)
                        skip = args.ratio_threshold is not None and mb_ratio > args.ratio_threshold

                        accelerator.backward(loss * 0.0 if skip else loss)
                        if warmup and accelerator.sync_gradients and accelerator.state.deepspeed_plugin is None:
                            # no gradient rather than a zero one: AdamW then skips the policy, leaving its moments and
                            # step count as they were, so that its first step after the warm-up is Adam's first
                            for p in accelerator.unwrap_model(model).policy.parameters():
                                p.grad = None
                        run.clip_gradients(model)  # --max_grad_norm; stops on a non-finite gradient
                        optimizer.step()
                        optimizer.zero_grad()
                        run.update_ema(model)  # --ema_beta

                        approxkls.append(0.5 * utils.masked_mean(logprobs_diff**2, mb_loss_mask))
                        stats.add(
                            **{
                                "policy/approxkl_avg": approxkls[-1],
                                "policy/clipfrac_avg": utils.masked_mean((pg_losses2 > pg_losses).float(), mb_loss_mask),
                                "loss/policy_avg": pg_loss,
                                "loss/value_avg": vf_loss,
                                "val/clipfrac_avg": vf_clipfrac,
                                "policy/entropy_avg": utils.masked_mean(entropy, mb_loss_mask),
                                "val/ratio": mb_ratio,
                            }
                        )
                        if args.ratio_threshold is not None:  # the fraction of micro-batches skipped
                            stats.add(**{"policy/skipped_ratio_threshold": float(skip)})
            # --target_kl: every process must agree to stop, so the decision uses the mean over processes
            if args.target_kl is not None:
                if accelerator.reduce(torch.stack(approxkls).mean(), reduction="mean").item() > args.target_kl:
                    break
        model.eval()

        # the update's statistics, averaged over the processes as they are written
        with torch.no_grad():
            stats.add(
                **{
                    "objective/kl": kl.sum(1).mean(),
                    "objective/entropy": (-logprobs).masked_fill(~sampled, 0.0).sum(1).mean(),
                    "objective/non_score_reward": non_score_reward.sum(1).mean(),
                    "objective/rlhf_reward": rlhf_reward.mean(),
                    "val/response_length": batch.lengths.float().mean(),
                    "val/ratio_var": stats.var("val/ratio"),
                    "val/vpred": utils.masked_mean(values, value_mask),
                }
            )
            if batch.behaviour_logprobs is not None:  # how far the engine's logprobs are from the trainer's
                stats.add(**vllm_stats)
            # PPO: the KL coefficient this update used, and whether only the critic learnt (its warm-up)
            metrics = {"lr": lr, **scaler.metrics(), "objective/kl_coef": kl_coef.value}
            if args.critic_warmup_updates:
                metrics["policy/critic_warmup"] = float(warmup)
            completion_advantages = utils.masked_mean(advantages, loss_mask, dim=1)  # --log_completions: each one's mean
        # metrics.jsonl, TensorBoard, wandb; samples, completions
        row = run.log(update, batch, stats, completion_advantages, scores=raw_scores, scored=scored, **metrics)

        # Ziegler et al.: adapt the KL coefficient to the KL measured in this update (held while the policy is)
        if args.kl_target is not None and not warmup:
            kl_coef.value = adaptive_kl_coef(
                kl_coef.value,
                kl=row["objective/kl"],
                kl_target=args.kl_target,
                kl_horizon=args.kl_horizon,
                n_steps=args.batch_size,
            )
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="PPO")  # the policy and critic, the EMA, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
