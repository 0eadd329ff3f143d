"""Reward modelling: a Bradley-Terry reward model learnt from preference pairs, the second step of RLHF.

A causal LM with a one-output score head (AutoModelForSequenceClassification, num_labels=1) scores a conversation at
its last token; on a pair it should score the chosen completion above the rejected one. The loss is
-log sigmoid(r_chosen - r_rejected - margin) (the margin column's, 0 without one), plus TRL's
center_rewards_coefficient * (r_chosen + r_rejected)^2 that keeps the scores near 0. Each pair runs its prompt once for
both completions (utils.forward_grouped). At the end, as the N+ details study, the mean score of the training
completions is saved with the model and subtracted in RL, so that they score 0 on average; the rule that renders a
conversation for the model is saved too, and the RL scripts score with it (docs/rewards.md).

Papers: Bradley & Terry 1952; Stiennon et al. 2020, "Learning to summarize from human feedback"; Ouyang et al. 2022.

Run (offline, on a CPU: pairs of SmolLM2 completions labelled by the sentiment score, data/make_preferences.py):
    python reward.py --eval_dataset_name data/preferences_test.jsonl --output_dir output/reward
    python rloo.py --reward_model_path output/reward
With a hub dataset, on GPUs:
    accelerate launch reward.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --dataset_name trl-lib/ultrafeedback_binarized --eval_dataset_name trl-lib/ultrafeedback_binarized
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import tyro

import infra
import utils


@dataclass
class RewardArgs:
    """The reward model's own flags."""

    center_rewards_coefficient: Optional[float] = None
    """add this times the mean of (r_chosen + r_rejected)^2 to the loss, which keeps the scores centred on 0 (TRL;
    Eisenstein et al. 2023 use 0.01)"""
    normalize_rewards: bool = True
    """after training, save the mean score of the reference completions with the model, which the RL scripts subtract:
    those completions then score 0 on average (the N+ details study)"""
    normalize_dataset_name: Optional[str] = None
    """the reference completions: a dataset in sft.py's formats (the N+ study: the SFT set's reference summaries);
    None: the training pairs' completions, chosen and rejected"""
    normalize_split: str = "train"
    """the split of --normalize_dataset_name"""
    padding_free: bool = False
    """run each completion with its prompt whole, a micro-batch's rows packed without their padding (sft.py's name):
    less compute where completions differ in length, more where long prompts are then run twice (refused where a
    packed row is not exact)"""


@dataclass
class Args(infra.ExampleArgs, RewardArgs):
    """The reward model's flags, then the run's, the model's and the data's (infra/offline.py), with its defaults below."""

    dataset_name: str = "data/preferences.jsonl"
    """preference pairs in TRL's format: `chosen` and `rejected` (strings or chat messages), an explicit `prompt` or
    the one they share, and an optional `margin`"""
    learning_rate: float = 1e-4
    """the AdamW learning rate at its peak (TRL's reward default; --lr_scheduler_type)"""
    per_device_train_batch_size: int = 8
    """pairs per forward/backward pass on each device"""


def pair_rewards(model, head, batch, padding_free=False):
    """Each completion's score (pairs, 2): chosen, rejected; read at its last token, the pair's prompt run once
    (padding_free: with each completion, the rows packed without padding)"""
    if padding_free:
        wanted = torch.zeros_like(batch.attention_mask, dtype=torch.bool)  # each row's last token
        wanted[torch.arange(len(wanted), device=wanted.device), batch.context_length + batch.lengths - 1] = True
        last = infra.forward_packed(model, batch.input_ids, batch.attention_mask, wanted, hidden=True)  # (rows, hidden)
        return head(last).float().reshape(-1, 2)
    width = batch.input_ids.shape[1] - batch.context_length
    hidden = utils.forward_grouped(
        model,
        batch.input_ids,
        batch.attention_mask,
        context_length=batch.context_length,
        group=2,
        logits_to_keep=width + 1,
        hidden=True,
    )  # (2 * pairs, width + 1, hidden): position 0 is the prompt's last token, j the completion's j-th
    last = hidden[torch.arange(len(hidden), device=hidden.device), batch.lengths]  # (2 * pairs, hidden)
    return head(last).float().reshape(-1, 2)


def last_token_rewards(model, head, batch):
    """Each left-padded row's score at its last token (rows,)"""
    out = utils.forward(model, batch.input_ids, batch.attention_mask, output_hidden_states=True)
    return head(out.hidden_states[-1][:, -1]).float().squeeze(-1)


def main(args):
    if (args.center_rewards_coefficient or 0) < 0:
        utils.die(f"--center_rewards_coefficient must be >= 0, got {args.center_rewards_coefficient}")
    # the tokenizer and every pair rendered and checked (longer than --max_length: left out, as TRL), before anything
    # is written
    rows = infra.read_examples(args, pairs=True, truncate=False)
    run = infra.start(args, examples=len(rows.train))  # processes, seeding, batch sizes (epochs over them), output_dir
    data = infra.load_examples(run, rows)  # their batches, each pair's prompt once then its two completions
    references = infra.load_references(run, args.normalize_dataset_name, args.normalize_split)  # (None: the pairs')
    model, _ = infra.load_model(run, score_head=True)
    if args.padding_free and not utils.can_pack(model.config, args.max_length or math.inf):
        utils.die(f"--padding_free: this {model.config.model_type} model's attention cannot run a packed row exactly")
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(model, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    model, optimizer, _ = infra.prepare(run, model, optimizer)
    accelerator = run.accelerator
    head = accelerator.unwrap_model(model).score  # (with LoRA, the head it trains whole)

    @torch.no_grad()
    def evaluate():  # held-out accuracy (chosen scored above rejected) and mean margin, on all processes
        totals = torch.zeros(3, device=run.device)
        for batch in data.held_out():
            with accelerator.autocast():
                rewards = pair_rewards(model, head, batch, args.padding_free)
            margin = rewards[:, 0] - rewards[:, 1]
            totals += torch.stack([(margin > 0).sum(), margin.sum(), torch.tensor(len(margin), device=run.device)])
        if data.held_out_rows is None:
            return None
        right, margins, pairs = run.reduce_sum(totals).tolist()
        return {"eval/accuracy": right / pairs, "eval/margin": margins / pairs}

    for update in run.updates(evaluate=evaluate):  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr

        model.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for mini_batch in data.update():  # this process's share of each mini-batch, in micro-batches
            for batch in mini_batch:
                with accelerator.accumulate(model):
                    rewards = pair_rewards(model, head, batch, args.padding_free)  # (pairs, 2)
                    chosen, rejected = rewards[:, 0], rewards[:, 1]
                    # Bradley-Terry: the probability that chosen is preferred is sigmoid(r_chosen - r_rejected)
                    loss = -F.logsigmoid(chosen - rejected - batch.margin).mean()
                    if args.center_rewards_coefficient is not None:
                        loss = loss + args.center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(model)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(model)  # --ema_beta

                    stats.add(
                        **{
                            "loss/reward": loss,
                            "train/accuracy": (chosen > rejected).float().mean(),
                            "train/margin": (chosen - rejected).mean(),
                            "train/reward_mean": rewards.mean(),
                        }
                    )
        model.eval()

        run.log_stats(stats, lr=lr)  # metrics.jsonl, TensorBoard, wandb
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    # the N+ details study's normalisation: the mean score of the reference completions, subtracted in RL
    offset = 0.0
    if args.normalize_rewards:
        totals = torch.zeros(2, device=run.device)
        with torch.no_grad(), accelerator.autocast():
            for batch in references.all_rows() if references else data.all_rows():
                rewards = last_token_rewards(model, head, batch) if references else pair_rewards(model, head, batch)
                totals += torch.stack([rewards.sum(), torch.tensor(rewards.numel(), device=run.device)])
        total, count = run.reduce_sum(totals).tolist()
        offset = total / count
        run.log_stats(utils.Stats(), **{"reward/offset": offset})
    infra.save_reward_input(run, model, offset)  # how the model reads a conversation, and its offset, into its config
    run.finish(__doc__, algorithm="reward modelling")  # the model, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
