"""DPO: direct preference optimisation, RLHF from preference pairs without a reward model or sampling.

The policy's implicit reward of a completion is beta * log(pi(completion) / pi_ref(completion)), against the frozen
initial policy; the loss makes the chosen completion's exceed the rejected one's: -log sigmoid of their difference
(sigmoid), or IPO's squared distance to 1 / (2 beta) on per-token log-ratios, or the hinge. --label_smoothing assumes
that many labels are flipped (conservative DPO). Each pair runs its prompt once for both completions
(utils.forward_grouped); the reference's logprobs are computed live, or once before training
(--precompute_ref_log_probs, which frees the reference).

Papers: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(https://arxiv.org/abs/2305.18290); Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
Human Preferences" (IPO); Mitchell 2023, "A note on DPO with noisy preferences" (conservative DPO).

Run (offline, on a CPU: SmolLM2-135M-Instruct learns the sentiment labeller's preferences, data/make_preferences.py):
    python dpo.py --eval_dataset_name data/preferences_test.jsonl
With a hub dataset, on GPUs:
    accelerate launch dpo.py --model_name_or_path path/to/sft_model \
        --dataset_name trl-lib/ultrafeedback_binarized --eval_dataset_name trl-lib/ultrafeedback_binarized
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
import tyro

import infra
import utils


@dataclass
class DPOArgs:
    """DPO's own flags."""

    beta: float = 0.1
    """the weight of the KL to the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * delta); ipo: (delta / tokens - 1 / (2 beta))^2 on per-token log-ratios (as
    TRL); hinge: max(0, 1 - beta * delta) (SLiC); delta: chosen's log-ratio minus rejected's"""
    label_smoothing: float = 0.0
    """the assumed fraction of flipped labels, in [0, 0.5): sigmoid's loss is then (1 - e) * loss(delta) +
    e * loss(-delta) (conservative DPO)"""
    precompute_ref_log_probs: bool = False
    """compute the reference's logprobs of every pair once before training, then free the reference"""


@dataclass
class Args(infra.ExampleArgs, DPOArgs):
    """DPO's flags, then the run's, the model's and the data's (infra/offline.py), with DPO's defaults below."""

    dataset_name: str = "data/preferences.jsonl"
    """preference pairs in TRL's format: `chosen` and `rejected` (strings or chat messages), an explicit `prompt` or
    the one they share"""
    learning_rate: float = 1e-6
    """the AdamW learning rate at its peak (TRL's DPO default; --lr_scheduler_type)"""
    per_device_train_batch_size: int = 8
    """pairs per forward/backward pass on each device"""


def pair_logprobs(model, batch):
    """Each completion's log-probability (pairs, 2): chosen, rejected, summed over its tokens; the prompt run once"""
    width = batch.input_ids.shape[1] - batch.context_length
    logits = utils.forward_grouped(
        model,
        batch.input_ids,
        batch.attention_mask,
        context_length=batch.context_length,
        group=2,
        logits_to_keep=width + 1,
    )[:, :-1]  # (2 * pairs, width, vocab): the logits that predict each completion token
    logprobs = utils.logprobs_from_logits(logits, batch.input_ids[:, batch.context_length :])
    # TRL's: after an empty prompt the first token is predicted by nothing (its logits read padding), left out
    return logprobs.masked_fill(~batch.logprob_mask, 0.0).sum(1).reshape(-1, 2)


def dpo_loss(logratios, tokens, beta, loss_type, label_smoothing):
    """Each pair's loss (pairs,), from its completions' log-ratios log(pi / pi_ref) and token counts, both (pairs, 2)"""
    if loss_type == "ipo":  # IPO on per-token log-ratios (TRL's normalisation, which its authors confirmed)
        per_token = logratios / tokens
        delta = per_token[:, 0] - per_token[:, 1]
        return (delta - 1 / (2 * beta)) ** 2
    delta = logratios[:, 0] - logratios[:, 1]
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    return -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)


def main(args):
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5:
        utils.die("--beta must be positive and --label_smoothing in [0, 0.5)")
    if args.label_smoothing and args.loss_type != "sigmoid":
        utils.die("--label_smoothing smooths the sigmoid loss: use it with --loss_type sigmoid")
    if args.precompute_ref_log_probs and args.eval_dataset_name:
        utils.die("--precompute_ref_log_probs frees the reference, which the held-out evaluation needs")
    # the tokenizer and every pair rendered and checked (cut to --max_length, as TRL), before anything is written
    rows = infra.read_examples(args, pairs=True, truncate=True)
    run = infra.start(args, examples=len(rows.train))  # processes, seeding, batch sizes (epochs over them), output_dir
    data = infra.load_examples(run, rows)  # their batches, each pair's prompt once then its two completions
    policy, ref_policy = infra.load_model(run, reference=True)
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(policy, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    policy, optimizer, ref_policy = infra.prepare(run, policy, optimizer, ref_policy)
    accelerator = run.accelerator

    @torch.no_grad()
    def ref_logprobs(batch):  # the reference's (pairs, 2): with LoRA, the policy without its adapters
        with accelerator.autocast(), utils.reference_model(accelerator.unwrap_model(policy), ref_policy) as ref:
            return pair_logprobs(ref, batch)

    cached = None
    if args.precompute_ref_log_probs:  # every pair's, once, on all processes (each computes its share)
        cached = torch.zeros(len(data), 2, device=run.device)
        for batch in data.all_rows():
            cached[batch.index] = ref_logprobs(batch)
        cached = run.reduce_sum(cached)
        ref_policy = None

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
                logprobs, ref = pair_logprobs(policy, batch), ref_logprobs(batch)
            tokens = batch.lengths.reshape(-1, 2)
            loss = dpo_loss(logprobs - ref, tokens, args.beta, args.loss_type, args.label_smoothing)
            stats.add(**{"loss/dpo": loss.mean(), **metrics(batch, logprobs, ref)})
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
        for mini_batch in data.update():  # this process's share of each mini-batch, in micro-batches
            for batch in mini_batch:
                ref = cached[batch.index] if cached is not None else ref_logprobs(batch)
                with accelerator.accumulate(policy):
                    logprobs = pair_logprobs(policy, batch)  # (pairs, 2)
                    tokens = batch.lengths.reshape(-1, 2)  # (each completion's, its first token included: TRL's IPO)
                    # DPO: the log-ratios to the reference are the implicit rewards (over beta)
                    loss = dpo_loss(logprobs - ref, tokens, args.beta, args.loss_type, args.label_smoothing).mean()
                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(policy)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(policy)  # --ema_beta

                    stats.add(**{"loss/dpo": loss, **metrics(batch, logprobs, ref)})
        policy.eval()

        run.log_stats(stats, lr=lr)  # metrics.jsonl, TensorBoard, wandb
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="DPO")  # the model, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
