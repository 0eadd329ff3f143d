"""DPO: direct preference optimisation, RLHF from preference pairs without a reward model or sampling.

The policy's implicit reward of a completion is beta * log(pi(completion) / pi_ref(completion)), against the frozen
initial policy; the loss makes the chosen completion's exceed the rejected one's. --loss_type is TRL 1.16's whole
family (dpo_loss: one branch each): DPO's -log sigmoid of their difference (sigmoid), IPO, the hinge, EXO, NCA, the
robust and conservative DPO losses against flipped labels (--label_smoothing), BCO, SPPO, AOT, APO, DiscoPOP, and SFT's
loss on the chosen completions; and without a reference (none is loaded), SimPO, CPO and ORPO. Several at once are
weighted and summed (--loss_weights: MPO). --f_divergence_type swaps the
log-ratio for another f-divergence's (f-DPO), --ld_alpha down-weights the tokens past the shorter completion's length
(LD-DPO), --use_weighting weighs each pair by how likely the policy finds both completions (WPO). Each pair runs its
prompt once for both completions (utils.forward_grouped); the reference's logprobs are computed live, or once before
training (--precompute_ref_log_probs, which frees the reference).

Papers: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(https://arxiv.org/abs/2305.18290); Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
Human Preferences" (IPO); Mitchell 2023, "A note on DPO with noisy preferences" (conservative DPO); docs/pipeline.md
has every loss's paper.

Run (offline, on a CPU: SmolLM2-135M-Instruct learns the sentiment labeller's preferences, data/make_preferences.py):
    python dpo.py --eval_dataset_name data/preferences_test.jsonl
With a hub dataset, on GPUs:
    accelerate launch dpo.py --model_name_or_path path/to/sft_model \
        --dataset_name trl-lib/ultrafeedback_binarized --eval_dataset_name trl-lib/ultrafeedback_binarized
"""

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
import tyro

import infra
import utils

LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
          "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "cdpo", "simpo", "cpo", "orpo")  # fmt: skip
REFERENCE_FREE = ("simpo", "cpo", "orpo", "sft")  # (with these alone no reference is loaded)
SMOOTHED = ("cdpo", "robust", "exo_pair", "aot", "aot_unpaired", "simpo", "cpo")  # the losses --label_smoothing enters
F_DIVERGENCE = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft", "cdpo")


@dataclass
class DPOArgs:
    """DPO's own flags."""

    beta: float = 0.1
    """the weight of the KL to the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: tuple[Literal[LOSSES], ...] = ("sigmoid",)
    """the loss, TRL 1.16's (dpo_loss; docs/pipeline.md), or several, summed with --loss_weights (MPO); cdpo is the
    conservative DPO that TRL's sigmoid was before it dropped --label_smoothing from it; simpo, cpo, orpo (TRL's
    experimental trainers') need no reference"""
    loss_weights: Optional[tuple[float, ...]] = None
    """each --loss_type's weight in the sum (None: 1 each)"""
    label_smoothing: float = 0.0
    """the assumed fraction of flipped labels, in [0, 0.5): cdpo, robust, aot, aot_unpaired, simpo, cpo (TRL's);
    exo_pair's epsilon, which must then be positive (EXO's paper: 1e-3)"""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    """f-DPO: the log-ratio in the losses replaced by the divergence's f'(pi / pi_ref) (reverse_kl: the log-ratio)"""
    f_alpha_divergence_coef: float = 0.5
    """alpha_divergence's alpha"""
    ld_alpha: Optional[float] = None
    """LD-DPO: in each pair's logprobs (the policy's and the reference's), a token past the shorter completion's length
    counts this much, in [0, 1] (None: 1, DPO)"""
    use_weighting: bool = False
    """WPO: each pair's loss weighted by its completions' mean per-token probabilities, each aligned by the policy's
    sum of squared token probabilities (detached)"""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature, which mixes its logistic and exponential parts"""
    simpo_gamma: float = 0.5
    """SimPO's target margin between the chosen and rejected per-token log-probabilities, times beta"""
    cpo_alpha: float = 1.0
    """the weight of CPO's NLL term on the chosen completions"""
    precompute_ref_log_probs: bool = False
    """compute the reference's logprobs of every pair once before training, then free the reference"""
    precompute_ref_batch_size: Optional[int] = None
    """examples per forward pass of that computation, on each process (None: --eval_batch_size)"""


@dataclass
class Args(infra.ExampleArgs, infra.RefSyncArgs, DPOArgs):
    """DPO's flags, then the run's, the model's and the data's (infra/offline.py), with DPO's defaults below."""

    dataset_name: str = "data/preferences.jsonl"
    """preference pairs in TRL's format: `chosen` and `rejected` (strings or chat messages), an explicit `prompt` or
    the one they share"""
    learning_rate: float = 1e-6
    """the AdamW learning rate at its peak (TRL's DPO default; --lr_scheduler_type)"""
    per_device_train_batch_size: int = 8
    """pairs per forward/backward pass on each device"""


def pair_logprobs(model, batch, ld_alpha=None, wpo=False):
    """Each completion's log-probability (pairs, 2): chosen, rejected, summed over its tokens (the prompt run once), a
    token past the shorter completion's length counting ld_alpha (LD-DPO; None: 1); then the plain sums, and with wpo
    each pair's WPO weight (pairs,), else None"""
    width = batch.input_ids.shape[1] - batch.context_length
    logits = utils.forward_grouped(
        model,
        batch.input_ids,
        batch.attention_mask,
        context_length=batch.context_length,
        group=2,
        logits_to_keep=width + 1,
    )[:, :-1]  # (2 * pairs, width, vocab): the logits that predict each completion token
    # TRL's: after an empty prompt the first token is predicted by nothing (its logits read padding), left out
    mask = batch.logprob_mask
    per_token = utils.logprobs_from_logits(logits, batch.input_ids[:, batch.context_length :]).masked_fill(~mask, 0.0)
    weight = torch.ones_like(per_token)
    if ld_alpha is not None:  # the tokens past the shorter completion's count (of tokens a logprob sums)
        shorter = mask.sum(1).reshape(-1, 2).min(1).values.repeat_interleave(2)  # (2 * pairs,)
        weight = torch.where(mask.cumsum(1) > shorter[:, None], ld_alpha, 1.0)
    weights = None
    if wpo:  # WPO: exp of the mean over a completion's tokens of log p - log sum_v p_v^2, the pair's two multiplied
        with torch.no_grad():
            aligned = (per_token - torch.logsumexp(2 * logits.float().log_softmax(-1), -1)).masked_fill(~mask, 0.0)
            weights = (aligned.sum(1) / mask.sum(1).clamp(min=1)).exp().reshape(-1, 2).prod(1)
    return (per_token * weight).sum(1).reshape(-1, 2), per_token.sum(1).reshape(-1, 2), weights


def sequence_nll(model, batch):
    """ORPO's NLL as TRL's ORPOTrainer computes it: over each chosen row's every token, prompt and completion (each but
    the row's first, predicted by the one before it), the mean over the micro-batch's chosen rows"""
    ids, mask = batch.input_ids[::2], batch.attention_mask[::2]
    logprobs = utils.logprobs_from_logits(utils.forward(model, ids, mask).logits[:, :-1], ids[:, 1:])
    counted = mask[:, 1:].bool() & mask[:, :-1].bool()
    return -(logprobs * counted).sum() / counted.sum().clamp(min=1)


def f_scores(logratios, kind, alpha):
    """f-DPO (Wang et al. 2023): f'(pi / pi_ref) of each log-ratio for the f-divergence `kind` (reverse_kl: itself)"""
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:  # (alpha 1: the reverse KL)
        return (torch.exp(((alpha - 1.0) * logratios).clamp(max=80.0)) - 1.0) / (alpha - 1.0)
    return logratios


def dpo_loss(loss_type, logps, ref_logps, tokens, args, sft_nll=None, counts=None):
    """Each pair's loss (pairs,) by one --loss_type, as TRL 1.16 computes it (simpo, cpo: its experimental CPOTrainer;
    orpo: its ORPOTrainer), from the completions' log-probabilities logps and the reference's ref_logps, (pairs, 2)
    chosen then rejected; tokens: their token counts (the first included), counts: those a logprob sums, (pairs, 2);
    sft_nll: the micro-batch's mean NLL of the chosen tokens (orpo: of the chosen rows, prompt too, sequence_nll). c, r:
    the chosen and rejected log-ratios; d: their f-scores' difference (c - r with the reverse KL); e: --label_smoothing."""
    b, e = args.beta, args.label_smoothing
    logratios = logps - ref_logps
    c, r = logratios[:, 0], logratios[:, 1]
    scores = f_scores(logratios, args.f_divergence_type, args.f_alpha_divergence_coef)
    d = scores[:, 0] - scores[:, 1]
    if loss_type == "sigmoid":  # DPO
        return -F.logsigmoid(b * d)
    if loss_type == "cdpo":  # conservative DPO: labels flipped with probability e
        return -(1 - e) * F.logsigmoid(b * d) - e * F.logsigmoid(-b * d)
    if loss_type == "robust":  # robust DPO (Chowdhury et al. 2024): unbiased under flips
        return (-(1 - e) * F.logsigmoid(b * d) + e * F.logsigmoid(-b * d)) / (1 - 2 * e)
    if loss_type == "hinge":  # SLiC (Zhao et al. 2023)
        return torch.relu(1 - b * d)
    if loss_type in ("ipo", "sigmoid_norm"):  # on per-token scores: IPO (TRL's normalisation, its authors confirmed)
        per_token = scores / tokens.clamp(min=1)
        d = per_token[:, 0] - per_token[:, 1]
        return (d - 1 / (2 * b)) ** 2 if loss_type == "ipo" else -F.logsigmoid(b * d)
    if loss_type == "exo_pair":  # EXO (Ji et al. 2024): KL of the pair's softmax to (1 - e, e)
        chosen, rejected = torch.sigmoid(b * d), torch.sigmoid(-b * d)
        return chosen * (F.logsigmoid(b * d) - math.log1p(-e)) + rejected * (F.logsigmoid(-b * d) - math.log(e))
    if loss_type == "nca_pair":  # NCA (Chen et al. 2024)
        return -F.logsigmoid(b * c) - 0.5 * F.logsigmoid(-b * c) - 0.5 * F.logsigmoid(-b * r)
    if loss_type == "bco_pair":  # BCO (Jung et al. 2024), paired
        return -F.logsigmoid(b * c) - F.logsigmoid(-b * r)
    if loss_type == "sppo_hard":  # SPPO (Wu et al. 2024), the winner's probability 1
        return (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2
    if loss_type in ("aot", "aot_unpaired"):  # AOT (Melnyk et al. 2024): sorted over the micro-batch
        if loss_type == "aot":
            gap = (logps[:, 0] - logps[:, 1]).sort().values - (ref_logps[:, 0] - ref_logps[:, 1]).sort().values
        else:
            gap = c.sort().values - r.sort().values
        return -(1 - e) * F.logsigmoid(b * gap) - e * F.logsigmoid(-b * gap)
    if loss_type == "apo_zero":  # APO (D'Oosterlinck et al. 2024): chosen up, rejected down
        return 1 - torch.sigmoid(b * c) + torch.sigmoid(b * r)
    if loss_type == "apo_down":  # APO: both down, rejected more
        return torch.sigmoid(b * c) + 1 - torch.sigmoid(b * (c - r))
    if loss_type == "discopop":  # DiscoPOP (Chris Lu et al. 2024): logistic and exponential, mixed by the margin
        mix = torch.sigmoid(b * d / args.discopop_tau)
        return -F.logsigmoid(b * d) * (1 - mix) + torch.exp(-b * d) * mix
    if loss_type == "sft":  # the chosen completions' negative log-likelihood, per token over the micro-batch
        return sft_nll.expand(len(c))
    # reference-free: the policy's log-probabilities alone
    if loss_type in ("simpo", "cpo"):  # SimPO (Meng et al. 2024): per-token, less a margin; CPO (Xu et al. 2024): summed
        margin = logps / counts.clamp(min=1) if loss_type == "simpo" else logps
        x = b * (margin[:, 0] - margin[:, 1]) - (args.simpo_gamma if loss_type == "simpo" else 0.0)
        smoothed = -(1 - e) * F.logsigmoid(x) - e * F.logsigmoid(-x)
        return smoothed if loss_type == "simpo" else smoothed + args.cpo_alpha * sft_nll
    if loss_type == "orpo":  # ORPO (Hong et al. 2024): the chosen NLL less beta log sigmoid of the odds ratio's log
        mean = (logps / counts.clamp(min=1)).float()  # log(1 - p) stable for p near 0 and near 1:
        log1mexp = torch.where(mean < -math.log(2), torch.log1p(-torch.exp(mean)), torch.log(-torch.expm1(mean)))
        log_odds = (mean[:, 0] - mean[:, 1]) - (log1mexp[:, 0] - log1mexp[:, 1])
        return sft_nll - b * F.logsigmoid(log_odds)
    raise ValueError(f"unknown loss type {loss_type!r}")


def main(args):
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5:
        utils.die("--beta must be positive and --label_smoothing in [0, 0.5)")
    types, weights = args.loss_type, args.loss_weights or (1.0,) * len(args.loss_type)
    if len(weights) != len(types) or not types:
        utils.die(f"--loss_weights gives {len(weights)} weights for {len(types)} --loss_type values")
    if "exo_pair" in types and not args.label_smoothing:
        utils.die("--loss_type exo_pair needs a positive --label_smoothing (its epsilon; EXO's paper: 1e-3)")
    if args.use_weighting and set(types) & {"aot", "aot_unpaired"}:
        utils.die("--use_weighting weighs each pair, which aot and aot_unpaired sort apart")
    infra.at_least(args, 0, "ld_alpha", at_most=1)
    infra.at_least(args, 0, "discopop_tau", "f_alpha_divergence_coef", strict=True)
    infra.at_least(args, 0, "cpo_alpha", "simpo_gamma")
    reference = not set(types) <= set(REFERENCE_FREE)  # (SimPO, CPO, ORPO and SFT read the policy alone)
    # flags set away from their defaults that these losses would not read (ld_alpha: only the logged metrics)
    free = " (it loads no reference)"  # (label_smoothing: TRL 1.16's sigmoid ignores it; simpo: TRL's CPO at alpha 0)
    unread = [f"--{flag} is not read by --loss_type {' '.join(types)}{why}" for flag, given, read, why in [
        ("label_smoothing", args.label_smoothing, set(types) & set(SMOOTHED), f" (only {', '.join(SMOOTHED)})"),
        ("f_divergence_type", args.f_divergence_type != "reverse_kl", set(types) <= set(F_DIVERGENCE),
         f" (only {', '.join(F_DIVERGENCE)})"),
        ("sync_ref_model", args.sync_ref_model, reference, free),
        ("ld_alpha", args.ld_alpha is not None, reference, free),
        ("precompute_ref_log_probs", args.precompute_ref_log_probs, reference, free),
        ("simpo_gamma", args.simpo_gamma != 0.5, "simpo" in types, ""),
        ("cpo_alpha", args.cpo_alpha != 1.0, "cpo" in types or ("simpo" in types and args.cpo_alpha == 0),
         f": CPO-SimPO is --loss_type simpo sft --loss_weights 1 {args.cpo_alpha}" if "simpo" in types else ""),
    ] if given and not read]  # fmt: skip
    if unread:
        utils.die(unread[0])
    if args.precompute_ref_log_probs and (args.eval_dataset_name or args.sync_ref_model):
        utils.die("--precompute_ref_log_probs frees the reference, which the held-out evaluation and --sync_ref_model need")
    infra.at_least(args, 1, "precompute_ref_batch_size")
    # the tokenizer and every pair rendered and checked (cut to --max_length, as TRL), before anything is written
    rows = infra.read_examples(args, pairs=True, truncate=True)
    run = infra.start(args, examples=len(rows.train))  # processes, seeding, batch sizes (epochs over them), output_dir
    data = infra.load_examples(run, rows)  # their batches, each pair's prompt once then its two completions
    policy, ref_policy = infra.load_model(run, reference=reference)
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(policy, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    policy, optimizer, ref_policy = infra.prepare(run, policy, optimizer, ref_policy)
    accelerator = run.accelerator

    @torch.no_grad()
    def ref_logprobs(batch):  # the reference's (pairs, 2): with LoRA, the policy without its adapters; none: 0
        if not reference:
            return torch.zeros(len(batch.lengths) // 2, 2, device=run.device)
        with accelerator.autocast(), utils.reference_model(accelerator.unwrap_model(policy), ref_policy) as ref:
            return pair_logprobs(ref, batch, args.ld_alpha)[0]

    cached = None
    if args.precompute_ref_log_probs and reference:  # every pair's, once, on all processes (each computes its share)
        cached = torch.zeros(len(data), 2, device=run.device)
        for batch in data.all_rows(args.precompute_ref_batch_size):
            cached[batch.index] = ref_logprobs(batch)
        cached = run.reduce_sum(cached)
        ref_policy = None

    def policy_pass(batch):  # the policy's logprobs (pairs, 2), plainly summed too, WPO's weights, ORPO's NLL
        logps, plain, wpo = pair_logprobs(policy, batch, args.ld_alpha, args.use_weighting)
        return logps, plain, wpo, sequence_nll(policy, batch) if "orpo" in types else None

    def dpo(batch, passed, ref):  # the micro-batch's loss: each --loss_type's pair mean, weighted and summed
        logps, plain, wpo, whole_nll = passed  # (policy_pass's)
        # SFT's: the chosen completions' mean NLL over their tokens (those a logprob sums), without LD-DPO's weights
        sft_nll = -plain[:, 0].sum() / batch.logprob_mask[::2].sum().clamp(min=1)
        tokens = batch.lengths.reshape(-1, 2)  # (each completion's, its first token included: TRL's IPO)
        counts = batch.logprob_mask.sum(1).reshape(-1, 2)  # (the tokens a logprob sums: SimPO's and ORPO's means)
        loss = 0.0
        for kind, weight in zip(types, weights):
            if kind in REFERENCE_FREE:  # (TRL's CPO and ORPO trainers have no LD-DPO: their plain sums)
                losses = dpo_loss(kind, plain, ref, tokens, args, whole_nll if kind == "orpo" else sft_nll, counts)
            else:
                losses = dpo_loss(kind, logps, ref, tokens, args, sft_nll, counts)
            loss = loss + weight * (losses * wpo if wpo is not None else losses).mean()
        return loss

    def metrics(batch, logprobs, ref):  # TRL's: the implicit rewards, their accuracy and margin
        rewards = args.beta * (logprobs - ref).detach()  # (pairs, 2)
        return {
            "rewards/chosen": rewards[:, 0].mean(),
            "rewards/rejected": rewards[:, 1].mean(),
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().mean(),
            "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean(),
            "logps/chosen": logprobs[:, 0].detach().mean(),
            "logps/rejected": logprobs[:, 1].detach().mean(),
        }

    @torch.no_grad()
    def evaluate():  # TRL's metrics and the loss on the held-out pairs, on all processes
        stats = utils.Stats()
        for batch in data.held_out():
            with accelerator.autocast():
                passed, ref = policy_pass(batch), ref_logprobs(batch)
            stats.add(**{"loss/dpo": dpo(batch, passed, ref), **metrics(batch, passed[0], ref)})
        if data.held_out_rows is None:
            return None
        return {f"eval/{name}": value for name, value in run.reduce_stats(stats).items()}

    for update in run.updates(evaluate=evaluate):  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr

        policy.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for mb, mini_batch in enumerate(data.update()):  # this process's share of each mini-batch, in micro-batches
            for batch in mini_batch:
                ref = cached[batch.index] if cached is not None else ref_logprobs(batch)
                with accelerator.accumulate(policy):
                    passed = policy_pass(batch)  # (pairs, 2), ...
                    # DPO: the log-ratios to the reference are the implicit rewards (over beta)
                    loss = dpo(batch, passed, ref)
                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(policy)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(policy)  # --ema_beta

                    stats.add(**{"loss/dpo": loss, **metrics(batch, passed[0], ref)})
            # TR-DPO (TRL's sync_ref_model): every ref_model_sync_steps optimiser steps the reference moves to the policy
            if args.sync_ref_model and ((update - 1) * args.num_mini_batches + mb + 1) % args.ref_model_sync_steps == 0:
                utils.sync_reference(ref_policy, accelerator.unwrap_model(policy), args.ref_model_mixup_alpha)
        policy.eval()

        run.log_stats(stats, lr=lr)  # metrics.jsonl, TensorBoard, wandb
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="DPO")  # the model, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
