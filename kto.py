"""KTO: Kahneman-Tversky optimisation, RLHF from completions labelled desirable or not, no pairs needed.

As in DPO, the policy's implicit reward of a completion is beta * log(pi(completion) / pi_ref(completion)), against the
frozen initial policy. KTO values it as prospect theory values a gain or a loss, against a reference point z: the KL
from the reference to the policy, estimated on the micro-batch from mismatched (prompt, completion) pairs (each prompt
with another example's completion), detached and at least 0. A desirable completion's loss is 1 - sigmoid(beta *
(log-ratio - z)), an undesirable one's 1 - sigmoid(beta * (z - log-ratio)), weighted by --desirable_weight and
--undesirable_weight (to balance the two kinds: KTO's paper keeps desirable_weight * desirable examples over
undesirable_weight * undesirable ones in [1, 4/3]). --loss_type apo_zero_unpaired (APO-zero, unpaired) needs no z:
1 - sigmoid(beta * log-ratio) for a desirable completion, sigmoid(beta * log-ratio) for another. Each example runs its
prompt once for its completion and its mismatched one (utils.forward_grouped).

Papers: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"
(https://arxiv.org/abs/2402.01306); D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive
Revisions" (https://arxiv.org/abs/2408.06266), APO.

Run (offline, on a CPU: SmolLM2-135M-Instruct learns the sentiment labeller's preferences, each pair unpaired):
    python kto.py --eval_dataset_name data/preferences_test.jsonl
With a hub dataset, on GPUs:
    accelerate launch kto.py --model_name_or_path path/to/sft_model --dataset_name trl-lib/kto-mix-14k
"""

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro

import infra
import utils


@dataclass
class KTOArgs:
    """KTO's own flags."""

    beta: float = 0.1
    """the weight of the KL to the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: the loss against the KL reference point z; apo_zero_unpaired: APO-zero's, without z (no KL estimate)"""
    desirable_weight: float = 1.0
    """the weight of a desirable completion's loss"""
    undesirable_weight: float = 1.0
    """the weight of an undesirable completion's loss"""
    precompute_ref_log_probs: bool = False
    """compute the reference's logprobs of every example (and its mismatched one) once before training, then free it"""
    precompute_ref_batch_size: Optional[int] = None
    """examples per forward pass of that computation, on each process (None: --eval_batch_size)"""


@dataclass
class Args(infra.ExampleArgs, infra.RefSyncArgs, KTOArgs):
    """KTO's flags, then the run's, the model's and the data's (infra/offline.py), with KTO's defaults below."""

    dataset_name: str = "data/preferences.jsonl"
    """labelled completions in TRL's unpaired format: `prompt`, `completion` (strings or chat messages) and a boolean
    `label`, true where desirable; or preference pairs (`chosen`, `rejected`), each unpaired as TRL unpairs it"""
    learning_rate: float = 1e-6
    """the AdamW learning rate at its peak (TRL's KTO default; --lr_scheduler_type)"""


def completion_logprobs(model, batch):
    """Each example's completion's log-probability and, with --loss_type kto, its mismatched one's, summed over their
    tokens: (examples, batch.group); the prompt run once"""
    width = batch.input_ids.shape[1] - batch.context_length
    logits = utils.forward_grouped(
        model,
        batch.input_ids,
        batch.attention_mask,
        context_length=batch.context_length,
        group=batch.group,
        logits_to_keep=width + 1,
    )[:, :-1]  # (group * examples, width, vocab): the logits that predict each completion token
    logprobs = utils.logprobs_from_logits(logits, batch.input_ids[:, batch.context_length :])
    # TRL's: after an empty prompt the first token is predicted by nothing (its logits read padding), left out
    return logprobs.masked_fill(~batch.logprob_mask, 0.0).sum(1).reshape(-1, batch.group)


def reference_point(partner_logratios, reduce=None):
    """KTO's reference point z, the KL from the reference to the policy, estimated from the mismatched pairs' log-ratios
    (examples,): their mean (with reduce, a mean over the processes: TRL's), detached, at least 0"""
    z = partner_logratios.mean().detach()
    return (z if reduce is None else reduce(z)).clamp(min=0)


def kto_loss(logratios, z, desirable, args):
    """Each example's loss (examples,), from its completion's log-ratio log(pi / pi_ref) (examples,), the reference
    point z (the KL estimate, detached; kto only) and whether the completion is desirable (examples,)"""
    if args.loss_type == "kto":  # KTO's equation (7): a gain above z, a loss below it
        gain, loss = 1 - torch.sigmoid(args.beta * (logratios - z)), 1 - torch.sigmoid(args.beta * (z - logratios))
    else:  # APO-zero, unpaired: a desirable completion's likelihood up, another's down, each on its own
        gain, loss = 1 - torch.sigmoid(args.beta * logratios), torch.sigmoid(args.beta * logratios)
    return torch.where(desirable, args.desirable_weight * gain, args.undesirable_weight * loss)


def main(args):
    if args.beta <= 0 or args.desirable_weight < 0 or args.undesirable_weight < 0:
        utils.die("--beta must be positive, --desirable_weight and --undesirable_weight at least 0")
    if args.desirable_weight == args.undesirable_weight == 0:
        utils.die("--desirable_weight and --undesirable_weight are both 0: the loss would be 0")
    kl = args.loss_type == "kto"  # (apo_zero_unpaired needs no reference point)
    if kl and args.per_device_train_batch_size < 2:
        utils.die("--loss_type kto estimates its KL on each micro-batch: --per_device_train_batch_size must be at least 2")
    if args.precompute_ref_log_probs and (args.eval_dataset_name or args.sync_ref_model):
        utils.die("--precompute_ref_log_probs frees the reference, which the held-out evaluation and --sync_ref_model need")
    infra.at_least(args, 1, "precompute_ref_batch_size")
    # the tokenizer and every example rendered and checked (cut to --max_length, as TRL), before anything is written;
    # each example's mismatched completion for the KL, fixed once as TRL pairs them (labelled_rows, infra/offline.py)
    rows = infra.read_examples(args, labelled=True, block=args.per_device_train_batch_size if kl else None)
    desirable = sum(bool(r["label"]) for r in rows.train)  # (TRL warns of an imbalance; here one kind is missing)
    kind = None if 0 < desirable < len(rows.train) else "desirable" if desirable else "undesirable"
    if kind is not None and getattr(args, f"{kind}_weight") == 0:
        utils.die(f"every training example is {kind} and --{kind}_weight is 0: the loss would be 0")
    run = infra.start(args, examples=len(rows.train))  # processes, seeding, batch sizes (epochs over them), output_dir
    if kind is not None and run.accelerator.is_main_process:
        print(f"note: every training example is {kind}: the loss sees one kind")
    data = infra.load_examples(run, rows)  # their batches, each example's prompt once then its completion(s)
    policy, ref_policy = infra.load_model(run, reference=True)
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(policy, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    policy, optimizer, ref_policy = infra.prepare(run, policy, optimizer, ref_policy)
    accelerator = run.accelerator

    @torch.no_grad()
    def ref_logprobs(batch):  # the reference's (examples, group): with LoRA, the policy without its adapters
        with accelerator.autocast(), utils.reference_model(accelerator.unwrap_model(policy), ref_policy) as ref:
            return completion_logprobs(ref, batch)

    cached = None
    if args.precompute_ref_log_probs:  # every example's, once, on all processes (each computes its share)
        cached = torch.zeros(len(data), 2 if kl else 1, device=run.device)
        for batch in data.all_rows(args.precompute_ref_batch_size):
            cached[batch.index] = ref_logprobs(batch)
        cached = run.reduce_sum(cached)
        ref_policy = None

    def mean(z):  # over the processes
        return run.reduce_sum(z) / args.world_size

    def step(batch, logprobs, ref, stats, reduce=None):  # the micro-batch's mean loss; TRL's metrics into stats
        logratios = logprobs - ref  # (examples, group): the completion's, and with kl its mismatched one's
        z = reference_point(logratios[:, 1], reduce) if kl else torch.zeros((), device=run.device)
        loss = kto_loss(logratios[:, 0], z, batch.label, args).mean()
        rewards, good = args.beta * logratios[:, 0].detach(), batch.label
        stats.add(**{"loss/kto": loss, "kl": z})
        stats.add_tokens(good, **{"rewards/chosen": rewards, "logps/chosen": logprobs[:, 0]})
        stats.add_tokens(~good, **{"rewards/rejected": rewards, "logps/rejected": logprobs[:, 0]})
        return loss

    @torch.no_grad()
    def evaluate():  # TRL's metrics and the loss on the held-out examples, on all processes (z: each micro-batch's)
        stats = utils.Stats()
        for batch in data.held_out():
            with accelerator.autocast():
                step(batch, completion_logprobs(policy, batch), ref_logprobs(batch), stats)
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
                    # KTO: each completion's log-ratio to the reference against the reference point
                    loss = step(batch, completion_logprobs(policy, batch), ref, stats, reduce=mean)
                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(policy)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(policy)  # --ema_beta
            # TR-DPO (TRL's sync_ref_model): every ref_model_sync_steps optimiser steps the reference moves to the policy
            if args.sync_ref_model and ((update - 1) * args.num_mini_batches + mb + 1) % args.ref_model_sync_steps == 0:
                utils.sync_reference(ref_policy, accelerator.unwrap_model(policy), args.ref_model_mixup_alpha)
        policy.eval()

        run.log_stats(stats, lr=lr)  # metrics.jsonl, TensorBoard, wandb
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="KTO")  # the model, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
