"""GRPO: group-relative policy optimisation, for RLHF of a causal language model, with its published fixes.

Each prompt is answered num_generations (k) times; a completion's advantage is its score minus the mean score of the
k completions of its prompt, divided by their standard deviation (`--scale_rewards group`), by the whole batch's
(`batch`), or not at all (`none`, Dr. GRPO's fix: dividing by the group's std up-weights prompts that are too easy or
too hard). The advantage is given to every token of the completion, and the policy takes clipped steps on each
token's probability ratio to the rollout policy, clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher when
epsilon_high > epsilon), for num_iterations passes over each rollout. The KL to the frozen initial policy (the k3
estimator, per token) is added to the loss with weight beta; `--beta 0` (the default, as TRL's) loads no reference.
The per-token loss and its aggregation are TRL 1.16's --loss_type (policy_loss, aggregate_loss): grpo (DeepSeekMath),
bnpo, dr_grpo (Dr. GRPO), dapo (DAPO, the default), luspo, cispo (MiniMax-M1), sapo, vespo; with
--importance_sampling_level sequence (GSPO) a completion has one ratio, clipped as a whole. docs/algorithms.md has
each, its corrections (--delta, --off_policy_mask_threshold, the bias-corrected KL) and its paper.

Papers: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models"
(https://arxiv.org/abs/2402.03300), GRPO; Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
Perspective" (https://arxiv.org/abs/2503.20783), Dr. GRPO; Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale" (https://arxiv.org/abs/2503.14476); Zheng et al. 2025, "Group Sequence Policy Optimization"
(https://arxiv.org/abs/2507.18071), GSPO.

Run (offline, on a CPU: SmolLM2-135M-Instruct learns to answer the shipped prompts more positively):
    python grpo.py
With a reward model and a hub dataset, on GPUs:
    accelerate launch grpo.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --reward_model_path path/to/reward_model --dataset_name trl-lib/tldr --num_generations 8
"""

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
import tyro

import infra
import utils


@dataclass
class GRPOArgs:
    """GRPO's own flags."""

    num_generations: int = 4
    """the number of completions sampled per prompt (k; TRL's default is 8)"""
    scale_rewards: Union[Literal["group", "batch", "none"], bool] = "group"
    """divide advantages by the std of the prompt's k scores (group), of the global batch's scores (batch), or not (none:
    Dr. GRPO); the std is the unbiased one, as TRL's, plus 1e-4. TRL's True and False: group and none"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """the per-token loss and its aggregation (TRL 1.16's; docs/algorithms.md); GSPO's paper: grpo"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """several reward sources: their weighted sum's advantage, or GDPO's (normalized_sum, TRL's)"""
    entropy_coef: float = 0.0
    """minus this times the mean entropy of the tokens that get a policy gradient joins the loss (TRL 1.16's)"""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive --entropy_coef (TRL's: adapted_entropy_coef), the bonus on while below the target"""
    entropy_coef_min: float = 0.0
    """the adaptive coefficient's lower bound"""
    entropy_coef_max: float = 1.0
    """the adaptive coefficient's upper bound"""
    entropy_coef_delta: float = 0.005
    """the adaptive coefficient's step"""
    entropy_target: float = 0.2
    """the mean token entropy (nats) the adaptive coefficient holds the policy at"""
    top_entropy_quantile: float = 1.0
    """only the tokens in this top fraction of the micro-batch's entropies get a policy gradient (Wang et al. 2025)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: each token's own ratio to the rollout policy; sequence: one per completion, clipped whole (GSPO)"""
    epsilon: float = 0.2
    """the lower clip range of the per-token probability ratio: 1 - epsilon"""
    epsilon_high: Optional[float] = None
    """the upper clip range: 1 + epsilon_high (None: epsilon; DAPO: 0.28); cispo: the ratio's cap (ScaleRL: 5)"""
    delta: Optional[float] = None
    """two-sided clipping (INTELLECT-2): the ratio also capped at delta, above 1 + epsilon_high (None: off)"""
    sapo_temperature_pos: float = 1.0
    """sapo's gate temperature for the tokens of a positive advantage"""
    sapo_temperature_neg: float = 1.05
    """sapo's gate temperature for the others"""
    vespo_k_pos: float = 2.0
    """vespo's gamma weight's power for a non-negative advantage"""
    vespo_lambda_pos: float = 3.0
    """vespo's gamma weight's decay for a non-negative advantage"""
    vespo_k_neg: float = 3.0
    """vespo's gamma weight's power for a negative advantage"""
    vespo_lambda_neg: float = 2.0
    """vespo's gamma weight's decay for a negative advantage"""
    off_policy_mask_threshold: Optional[float] = None
    """DeepSeek-V3.2's off-policy mask: no loss from a negative advantage's completion this far (mean per-token KL) from
    the policy that sampled it (off_policy_keep; None: off)"""
    ratio_threshold: Optional[float] = None
    """a micro-batch whose mean probability ratio exceeds this contributes no gradient (TRL)"""
    beta: float = 0.0
    """the weight of the per-token k3 KL to the reference in the loss; 0 (TRL's) loads no reference (DeepSeekMath: 0.04)"""
    use_bias_correction_kl: bool = True
    """weigh each token's KL by its ratio to the rollout policy, so that its gradient is unbiased off it (TRL 1.16's)"""
    mask_truncated_completions: bool = False
    """completions that never produced the stop token contribute nothing to the loss (DAPO)"""
    num_iterations: int = 1
    """optimisation passes over each rollout (GRPO's mu); the rollout's logprobs are the old policy's throughout"""
    router_aux_loss_coef: Optional[float] = None
    """an MoE policy's router load-balancing loss times this joins the loss (TRL's; None: the model config's own)"""


# the bases last-first: a dataclass lists a base's fields after those of the bases named after it, so --help reads
# the algorithm's flags first, then the model and data, then the rest
@dataclass
class Args(
    infra.RunArgs, infra.EvalArgs, infra.EnvArgs, infra.DynamicSamplingArgs, infra.RolloutArgs, infra.DataArgs,
    infra.RefSyncArgs, GRPOArgs
):  # fmt: skip
    """GRPO's flags, then those every script shares (infra/*flags.py): the score's shaping; the model, data and reward
    sources; the rollout; dynamic sampling; the environment (multi-turn episodes); the evaluation; the run (the batch
    and its optimiser, the experiment and its outputs, precision, LoRA, EMA, PTX)."""


def batch_moments(values, reduce=None):
    """The mean and the unbiased standard deviation of values (n,) over the global batch: reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the statistics over processes."""
    sums = torch.stack([values.sum(), torch.tensor(float(values.numel()), device=values.device)])
    if reduce is not None:
        sums = reduce(sums)
    mean, n = sums[0] / sums[1], sums[1]
    squares = ((values - mean) ** 2).sum()
    if reduce is not None:
        squares = reduce(squares)
    return mean, (squares / (n - 1).clamp(min=1.0)).sqrt()  # (one value: std 0, as a group of one)


def group_advantages(scores, k, scale_rewards, scored=None, reduce=None):
    """GRPO: each completion's score minus the mean score of its prompt's k completions, over the std of those k
    scores (group), of the global batch's (batch; reduce: see batch_moments) or nothing (none), plus 1e-4; both stds
    unbiased, as TRL's nanstd. scores, scored: (prompts * k,), row j * k + i the i-th completion of prompt j; a
    completion no source scored (scored False; None: all scored) is left out of the means and stds, with advantage 0.
    Returns the advantages and, per row, whether its group's scored completions are all equal or fewer than two (then
    exactly 0, not the group mean's rounding error over 1e-4), both (prompts * k,)."""
    grouped = scores.reshape(-1, k)  # (prompts, k)
    valid = torch.ones_like(grouped, dtype=torch.bool) if scored is None else scored.reshape(-1, k)
    w = valid.to(grouped.dtype)
    n = w.sum(1, keepdim=True)
    mean = (grouped * w).sum(1, keepdim=True) / n.clamp(min=1.0)
    zero_std = ~utils.distinct_groups(scores, valid.flatten(), k)[:, None]  # (prompts, 1)
    advantages = grouped - mean
    if scale_rewards == "group":
        std = ((advantages**2 * w).sum(1, keepdim=True) / (n - 1).clamp(min=1.0)).sqrt()
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_moments(scores[valid.flatten()], reduce)[1] + 1e-4)
    advantages = advantages.masked_fill(zero_std | ~valid, 0.0)
    return advantages.flatten(), zero_std.expand_as(grouped).flatten()


def normalized_sum(per_source, weights, k, reduce=None):
    """GDPO's advantages (--multi_objective_aggregation normalize_then_sum, as TRL 1.16's): each source's group-relative
    advantage (group_advantages over the completions it scored), weighted and summed over the sources that scored the
    completion, less the global batch's mean, over its unbiased std + 1e-4 (reduce: a sum over processes). per_source
    (sources, prompts * k), NaN where a source gave none. Returns (prompts * k,); a completion no source scored gets 0."""
    valid = ~per_source.isnan()
    summed = sum(w * group_advantages(r.nan_to_num(), k, "group", v)[0] for w, r, v in zip(weights, per_source, valid))
    scored = valid.any(0)
    mean, std = batch_moments(summed[scored], reduce)
    advantages = (summed - mean) / (std + 1e-4)
    return advantages.masked_fill(~scored, 0.0)


def adapted_entropy_coef(coef, entropy, args):
    """Skywork-OR1's adaptive entropy coefficient (TRL 1.16's) after an optimiser step of mean token entropy `entropy`
    (all processes'): --entropy_coef_delta up if at most --entropy_target, else down, within its bounds"""
    if entropy <= args.entropy_target:
        return min(coef + args.entropy_coef_delta, args.entropy_coef_max)
    return max(coef - args.entropy_coef_delta, args.entropy_coef_min)


def sequence_log_ratio(log_ratio, mask):
    """GSPO: each completion's mean log probability ratio over its tokens that count (mask), given to every one of its
    tokens: (rows, width) -> (rows, width). The gradient flows to each token's log-probability, weighted 1 / its
    completion's token count. A completion without a token that counts gets 0 (ratio 1)."""
    m = mask.to(log_ratio.dtype)
    return ((log_ratio * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)).expand_as(log_ratio)


def high_entropy_mask(entropy, mask, quantile, pool):
    """The tokens that count (mask, (rows, width)) whose entropy is at least the (1 - quantile) quantile of pool, the
    micro-batch's on all processes (torch.quantile's interpolation, as TRL). No pool, no token."""
    if pool.numel() == 0:
        return torch.zeros_like(mask)
    return mask & (entropy >= torch.quantile(pool.float(), 1.0 - quantile))


def policy_loss(loss_type, ratio, log_ratio, logprobs, advantages, mask, is_weight, epsilon, epsilon_high, delta, sapo,
                vespo):  # fmt: skip
    """Each token's policy loss (rows, width) by --loss_type, as TRL 1.16 computes it. ratio: each token's probability
    ratio to the rollout policy (GSPO: its completion's), log_ratio the token's log of it, logprobs the policy's (with
    their gradient), advantages (rows, 1), mask the tokens that count:
        grpo, bnpo, dr_grpo, dapo, luspo  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r first capped at delta
               (two-sided GRPO)
        cispo  -min(r, epsilon_high) A log p, the weight detached (MiniMax-M1: the clip scales the gradient, never
               removes it)
        sapo   -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo[0] for A > 0 else sapo[1] (SAPO: a soft gate for the clip)
        vespo  -phi(w) A log p, w the completion's ratio (its tokens' log-ratios, each in [-20, 20], summed; with an
               engine, times its importance weights is_weight), phi(w) = exp(lambda + k log w - lambda w), detached,
               (k, lambda) = vespo[:2] for A >= 0, else vespo[2:] (VESPO: a gamma weight instead of the clip)"""
    if loss_type == "cispo":
        return -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logprobs
    if loss_type == "sapo":
        tau = torch.where(advantages > 0, sapo[0], sapo[1])
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    if loss_type == "vespo":
        with torch.no_grad():
            low = math.log(1e-8)
            log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(1, keepdim=True)
            if is_weight is not None:
                log_w = log_w + torch.log(is_weight).clamp(low, 20.0).sum(1, keepdim=True)
            log_w = log_w.clamp(low, 20.0)
            k = torch.where(advantages >= 0, vespo[0], vespo[2])
            lam = torch.where(advantages >= 0, vespo[1], vespo[3]).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return -phi * advantages * logprobs
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return torch.max(-advantages * ratio, -advantages * clipped)


def aggregate_loss(per_token_loss, mask, loss_type, response_length, dapo_tokens):
    """One micro-batch's loss from its per-token losses and mask (rows, width), True where a token counts. grpo (and
    sapo): mean over each row's tokens, then over rows; bnpo: mean over the tokens; dr_grpo: sum / (rows x
    response_length); dapo (and cispo, vespo): sum / dapo_tokens, the optimiser step's global batch's tokens over
    (processes x accumulation steps), as accelerate averages the gradients over both; luspo: sum over each row's
    tokens, then mean over rows. A row or micro-batch without a token counts zero."""
    m = mask.to(per_token_loss.dtype)
    total = (per_token_loss * m).sum()
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * m).sum(1) / m.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return total / (per_token_loss.shape[0] * response_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        return total / dapo_tokens
    if loss_type == "luspo":
        return (per_token_loss * m).sum(1).mean()
    raise ValueError(f"unknown loss type {loss_type!r}")


def off_policy_keep(advantages, logprobs, behaviour_logprobs, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (rows, 1): 1 where a completion's loss is kept, a non-negative advantage
    or a mean KL estimate log(behaviour / policy) over its counted tokens (NaN as 0) at most threshold"""
    kl = torch.nan_to_num(behaviour_logprobs - logprobs.detach(), nan=0.0)
    m = mask.to(kl.dtype)
    mean_kl = (kl * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(kl.dtype)


def main(args):
    infra.at_least(args, 2, "num_generations")  # (a group's std needs two samples)
    args.scale_rewards = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)  # (TRL's booleans)
    infra.at_least(args, 1, "num_iterations")
    infra.at_least(args, 0, "epsilon", "epsilon_high", "beta", "off_policy_mask_threshold", "entropy_target")
    infra.at_least(args, 0, "vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg")
    infra.at_least(args, 0, "entropy_coef_min", "entropy_coef_delta", "router_aux_loss_coef")
    infra.at_least(args, 0, "ratio_threshold", "delta", "sapo_temperature_pos", "sapo_temperature_neg", strict=True)
    infra.at_least(args, 0, "top_entropy_quantile", at_most=1)
    if not args.entropy_coef_min <= args.entropy_coef_max:
        utils.die("--entropy_coef_max must be at least --entropy_coef_min")
    if args.use_adaptive_entropy and not args.entropy_coef_min <= args.entropy_coef <= args.entropy_coef_max:
        utils.die("--use_adaptive_entropy: --entropy_coef must be in [--entropy_coef_min, --entropy_coef_max]")
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    loss_type = args.loss_type
    # GSPO (Zheng et al. 2025) averages the sequence loss over completions; a token sum (TRL's default) weighs each
    # completion by its length, which TRL warns of
    token_sum = loss_type in ("bnpo", "dr_grpo", "dapo", "cispo") and args.importance_sampling_level == "sequence"
    gdpo = args.multi_objective_aggregation == "normalize_then_sum"
    if gdpo and (args.missing_eos_penalty is not None or args.use_score_scaling or args.score_clip is not None):
        utils.die("--missing_eos_penalty, --use_score_scaling and --score_clip shape the sources' sum, which "
                  "--multi_objective_aggregation normalize_then_sum does not use")  # fmt: skip
    k = args.num_generations  # completions per prompt
    run = infra.start(args, k=args.num_generations)  # processes, seeding, batch sizes, output_dir
    if token_sum and run.accelerator.is_main_process:
        print(f"note: --loss_type {loss_type} sums GSPO's sequence loss over tokens; the paper's mean: --loss_type grpo")
    # the tokenizer, prompts and reward sources; the policy (LoRA, ...) and with --beta the frozen initial policy
    policy, ref_policy = infra.load_policy(run, reference=args.beta > 0)
    router = infra.router_coef(policy, args.router_aux_loss_coef)  # 0 but for a mixture of experts
    # AdamW (LoRA: on the adapters), no weight decay on biases and norms (transformers'); fused: 4x faster on a CPU
    params = utils.decay_groups(policy, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    # accelerate's (DDP, DeepSpeed); the reference and the reward models on the device; the EMA of --ema_beta
    policy, optimizer, ref_policy = infra.prepare(run, policy, optimizer, ref_policy)
    # our sampler or a vLLM engine, each token drawn by the rule utils.sampling_logits (--temperature, --top_p, ...)
    sampler = infra.Sampler(run, policy, rule=utils.sampling_logits)
    accelerator = run.accelerator
    # TRL's --use_score_scaling, --use_score_norm and --score_clip; a checkpoint holds the running moments
    scaler = utils.ScoreScaler(args.use_score_scaling, args.use_score_norm, args.score_clip, reduce=run.reduce_sum)
    accelerator.register_for_checkpointing(scaler)
    # the entropy bonus's coefficient and the last optimiser step's entropy (--use_adaptive_entropy; none yet)
    entropy_ctl = infra.CheckpointedNumber((args.entropy_coef, math.inf))
    if args.use_adaptive_entropy:
        accelerator.register_for_checkpointing(entropy_ctl)

    def keep(batch):  # --dynamic_sampling (DAPO): the groups whose scores, clipped as the advantages see them, differ
        if gdpo:  # (GDPO's advantages: those where any one source's scores differ)
            return torch.stack([utils.distinct_groups(r.nan_to_num(), ~r.isnan(), k) for r in batch.per_source]).any(0)
        scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)
        return utils.distinct_groups(utils.ScoreScaler(clip=args.score_clip)(scores, scored), scored, k)

    # --loss_type's constants (policy_loss)
    sapo, vespo = (args.sapo_temperature_pos, args.sapo_temperature_neg), (args.vespo_k_pos, args.vespo_lambda_pos)
    clip = dict(epsilon=args.epsilon, epsilon_high=epsilon_high, delta=args.delta, sapo=sapo)
    clip["vespo"] = vespo + (args.vespo_k_neg, args.vespo_lambda_neg)
    # a micro-batch of whole prompts runs each prompt once for its k completions (utils.forward_grouped)
    train_group = 1 if args.per_device_train_batch_size % k else k
    # one pass over one mini-batch: the policy takes its only step after reading every micro-batch, so the update's
    # own logprobs, detached, are the rollout policy's, and the rollout skips that forward pass (as TRL's GRPOTrainer
    # without vLLM; the ratio is then exactly 1). With --use_vllm too: the engine's samples are weighed micro-batch by
    # micro-batch, once their trainer logprobs are known (TRL runs the pass for them)
    on_policy = args.num_iterations == 1 and args.num_mini_batches == 1
    # the learning rate's schedule over the optimiser steps, TRL's (--lr_scheduler_type, --warmup_steps: transformers')
    total_steps = args.num_updates * args.num_iterations * args.num_mini_batches
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

        # autocast (a no-op without mixed precision) also covers the reference, which accelerate did not wrap
        with torch.no_grad(), accelerator.autocast():
            # 2. the rollout policy's logprobs (of logits / temperature), unless the update's own pass gives them
            # (on_policy: placeholders, filled in micro-batch by micro-batch); the reference's with --beta
            unwrapped = accelerator.unwrap_model(policy)
            if on_policy:
                logprobs = torch.full(sampled.shape, utils.INVALID_LOGPROB, device=run.device)
            else:
                logprobs = utils.rollout_logprobs(unwrapped, batch, args.temperature)
            if args.beta:
                with utils.reference_model(unwrapped, ref_policy) as ref:  # with LoRA, the policy without its adapters
                    ref_logprobs = utils.rollout_logprobs(ref, batch, args.temperature)

            # 3. the tokens that count in the loss: real ones, and with --mask_truncated_completions (DAPO's overlong
            # filter) none of a completion cut off before the stop token
            # (a completion no reward source scored counts too, with advantage 0: in the KL, the entropy, the token count)
            loss_mask = sampled & batch.contain_eos[:, None] if args.mask_truncated_completions else sampled

            # 4. GRPO: group-relative advantages, one per completion, given to each of its tokens; GDPO: of each source's
            advantages, zero_std = group_advantages(scores, k, args.scale_rewards, scored=scored, reduce=run.reduce_sum)
            if gdpo:
                advantages = normalized_sum(batch.per_source, run.weights, k, reduce=run.reduce_sum)

        # 5. update: iterations x mini-batches x gradient-accumulation micro-batches, against the rollout's logprobs
        policy.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for epoch in range(args.num_iterations):
            # shuffled by prompt, keeping each prompt's k rows together (so micro-batches can run each prompt once)
            sizes = (args.local_batch_size, args.local_mini_batch_size, args.per_device_train_batch_size)
            mini_batches = utils.minibatches(*sizes, group=k, device=run.device)
            # DAPO: the loss tokens of each optimiser step on all processes, spread over its micro-batches (below)
            step_tokens = torch.stack([loss_mask[torch.cat(micros)].sum() for micros in mini_batches]).float()
            dapo_tokens = run.reduce_sum(step_tokens).clamp(min=1.0) / (args.world_size * args.gradient_accumulation_steps)
            for mb, mini_batch in enumerate(mini_batches):
                steps = ((update - 1) * args.num_iterations + epoch) * args.num_mini_batches + mb  # optimiser steps so far
                lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, steps, total_steps, warmup, low)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                window = 0.0  # --use_adaptive_entropy: the optimiser step's (entropy sum, token count)
                for micro in mini_batch:
                    with accelerator.accumulate(policy):
                        mb_sampled, mb_loss_mask = sampled[micro], loss_mask[micro]
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
                        # padding as in the rollout's logprobs: ratio 1 and KL 0 there, never an overflow
                        new_logprobs = new_logprobs.masked_fill(~mb_sampled, utils.INVALID_LOGPROB)
                        if on_policy:  # the policy has not stepped since the rollout: these are its logprobs
                            logprobs[micro] = new_logprobs.detach()
                        # the token-level ratio: GRPO treats each token as an action sharing its completion's advantage;
                        # GSPO gives every token its completion's (length-normalised) sequence ratio
                        logprobs_diff = new_logprobs - logprobs[micro]
                        if args.importance_sampling_level == "sequence":
                            ratio = torch.exp(sequence_log_ratio(logprobs_diff, mb_loss_mask))
                        else:
                            ratio = torch.exp(logprobs_diff)
                        mb_advantage = advantages[micro][:, None]
                        is_weight = None
                        if batch.behaviour_logprobs is not None:  # the engine sampled: each token's (or completion's)
                            # probability under the rollout policy over the engine's, truncated or masked, weighs its loss
                            weighing = args.importance_sampling("token_truncate")
                            behaviour = batch.behaviour_logprobs[micro]
                            is_weight, _ = utils.importance_weights(logprobs[micro], behaviour, mb_sampled, **weighing)
                            is_weight = is_weight.reshape(len(is_weight), -1)  # sequence_*: (rows, 1)
                        # the policy loss of --loss_type (policy_loss: TRL 1.16's table)
                        per_token_loss = policy_loss(
                            loss_type, ratio, logprobs_diff, new_logprobs, mb_advantage, mb_loss_mask, is_weight, **clip
                        )
                        if args.off_policy_mask_threshold is not None:  # against the policy that sampled
                            behaviour = logprobs[micro] if batch.behaviour_logprobs is None else behaviour
                            per_token_loss = per_token_loss * off_policy_keep(
                                mb_advantage, new_logprobs, behaviour, mb_loss_mask, args.off_policy_mask_threshold
                            )
                        if is_weight is not None and loss_type != "vespo":  # (vespo's gamma weight holds it)
                            per_token_loss = per_token_loss * is_weight
                        trained = mb_loss_mask  # the tokens whose policy loss counts
                        if args.top_entropy_quantile < 1.0:  # only the highest-entropy tokens (Wang et al. 2025)
                            pool = accelerator.pad_across_processes(entropy[mb_loss_mask].detach(), pad_index=-1.0)
                            pool = accelerator.gather(pool)
                            trained = high_entropy_mask(entropy, mb_loss_mask, args.top_entropy_quantile, pool[pool >= 0])
                            per_token_loss = per_token_loss * trained
                        if args.beta:  # k3, whose gradient in expectation is that of KL(ref || policy)
                            kl = utils.kl_estimate(new_logprobs, ref_logprobs[micro], "k3")
                            if args.use_bias_correction_kl:  # weighed by the ratio: unbiased off the rollout policy
                                kl = kl * ratio
                            per_token_loss = per_token_loss + args.beta * kl
                        pg_loss = aggregate_loss(
                            per_token_loss,
                            mb_loss_mask,
                            loss_type=loss_type,
                            # not max_length: one token weight every update; an episode's: its budget, as TRL's
                            # max_completion_length covers every turn
                            response_length=args.max_episode_tokens if args.environment else args.response_length,
                            dapo_tokens=dapo_tokens[mb],
                        )
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient
                        # (its backward still runs, so that every process takes part in each step); the mean ratio of
                        # the loss tokens, as val/ratio (a micro-batch without a loss token has none, and no gradient)
                        skip = args.ratio_threshold is not None and ratio[mb_loss_mask].mean() > args.ratio_threshold

                        # an MoE router's load-balancing loss (TRL's); LightRFT's PTX loss, 0 without --ptx_coef
                        loss = pg_loss + router * router_loss + run.ptx_loss(policy)
                        if args.entropy_coef or args.use_adaptive_entropy:  # TRL's entropy bonus: the mean entropy
                            counted = trained.to(entropy.dtype)  # of the tokens that get a policy gradient
                            coef, last = entropy_ctl.value  # (adaptive: only while the last step's was on target)
                            coef = coef if not args.use_adaptive_entropy or last <= args.entropy_target else 0.0
                            loss = loss - coef * (entropy * counted).sum() / counted.sum().clamp(min=1.0)
                            window = window + torch.stack([(entropy.detach() * counted).sum(), counted.sum()])
                        run.check_finite(loss)
                        accelerator.backward(loss * 0.0 if skip else loss)
                        run.clip_gradients(policy)  # --max_grad_norm; stops on a non-finite gradient
                        optimizer.step()
                        optimizer.zero_grad()
                        run.update_ema(policy)  # --ema_beta
                        if args.use_adaptive_entropy and accelerator.sync_gradients:  # the next step's coefficient
                            total, count = run.reduce_sum(window).tolist()
                            last = total / max(count, 1.0)
                            entropy_ctl.value = (adapted_entropy_coef(entropy_ctl.value[0], last, args), last)
                            window = 0.0

                        # token means over the whole update, on all processes; TRL's clip ratios: the tokens whose
                        # gradient the clip removed, below (ratio < 1 - epsilon with a negative advantage) or above
                        low = ((ratio < 1.0 - args.epsilon) & (mb_advantage < 0)).float()
                        high = ((ratio > 1.0 + epsilon_high) & (mb_advantage > 0)).float()
                        clipped = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high}
                        clipped["clip_ratio/region_mean"] = low + high
                        stats.add_tokens(
                            mb_loss_mask, entropy=entropy, **{"policy/approxkl_avg": 0.5 * logprobs_diff**2}, **clipped
                        )
                        if args.beta:
                            stats.add_tokens(mb_loss_mask, kl=kl)
                        if args.top_entropy_quantile < 1.0:  # the share of tokens that got a policy gradient, and theirs
                            stats.add_tokens(mb_loss_mask, **{"entropy/trained_fraction": trained.float()})
                            stats.add_tokens(trained, **{"entropy/trained": entropy})
                        mb_ratio = ratio[mb_loss_mask].mean() if mb_loss_mask.any() else 1.0
                        stats.add(**{"loss/policy_avg": pg_loss, "val/ratio": mb_ratio})
                        if router:  # (TRL's name)
                            stats.add(aux_loss=router_loss)
                        if args.ratio_threshold is not None:  # the fraction of micro-batches skipped
                            stats.add(**{"policy/skipped_ratio_threshold": float(skip)})

                # TR-DPO (TRL's sync_ref_model): every ref_model_sync_steps optimiser steps, the reference moves to the
                # policy by alpha (the next rollout's reference logprobs are the new one's)
                if args.sync_ref_model and (steps + 1) % args.ref_model_sync_steps == 0:
                    utils.sync_reference(ref_policy, accelerator.unwrap_model(policy), args.ref_model_mixup_alpha)
        policy.eval()

        # the update's statistics, averaged over the processes as they are written; a completion's length is the
        # tokens the policy sampled (an episode's observations not counted, as TRL)
        lengths = sampled.sum(1)
        with torch.no_grad():
            stats.add(
                **{
                    "frac_reward_zero_std": zero_std.float().mean(),
                    "objective/entropy": (-logprobs).masked_fill(~sampled, 0.0).sum(1).mean(),
                    "completions/mean_length": lengths.float().mean(),
                    "val/ratio_var": stats.var("val/ratio"),
                }
            )
            if batch.behaviour_logprobs is not None:  # how far the engine's logprobs are from the trainer's (the rollout's)
                weighing = args.importance_sampling("token_truncate")
                stats.add(**utils.importance_weights(logprobs, batch.behaviour_logprobs, sampled, **weighing)[1])
            if args.beta:  # the rollout's KL to the reference, k3 summed over each completion
                rollout_kl = utils.kl_estimate(logprobs, ref_logprobs, "k3").masked_fill(~sampled, 0.0)
                stats.add(**{"objective/kl": rollout_kl.sum(1).mean()})
            # TRL's names: the std of the batch's scored completions' scores (their mean: reward), the lengths' range
            lengths = accelerator.gather(lengths)
            metrics = {"lr": lr, **scaler.metrics(), "reward_std": batch_moments(raw_scores[scored], run.reduce_sum)[1].item()}
            metrics.update({"completions/min_length": lengths.min().item(), "completions/max_length": lengths.max().item()})
            if args.entropy_coef or args.use_adaptive_entropy:
                metrics["entropy_coef"] = entropy_ctl.value[0]
        # metrics.jsonl, TensorBoard, wandb; samples, completions
        run.log(update, batch, stats, advantages, scores=raw_scores, scored=scored, **metrics)
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="GRPO")  # the model, its EMA, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
