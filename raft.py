"""RAFT: reward-ranked fine-tuning, filtered fine-tuning online (rejection sampling's loop, expert iteration).

Each prompt is answered num_generations times by the policy and the completions are scored; the best-scored one of
each prompt is kept (with --min_score, only if it scores at least that, as expert iteration keeps what solved its
task), and the policy is fine-tuned on what was kept: the mean negative log-likelihood of the kept completions'
tokens, as sft.py's loss. The next prompts are then answered by the policy so improved: sample, rank, keep,
fine-tune, repeat. No reference model, no KL, no ratio, no advantage: a supervised step on the policy's own best
samples (ReST and expert iteration keep every completion above a threshold instead, and ReST-EM restarts from the
base model each round). Offline, from a fixed set of reward-labelled completions, the selection is sft.py's --keep.

Papers: Dong et al. 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment"
(https://arxiv.org/abs/2304.06767); Gulcehre et al. 2023, "Reinforced Self-Training (ReST) for Language Modeling".

Run (on a CPU: SmolLM2-135M-Instruct learns to answer the shipped prompts more positively):
    python raft.py --num_generations 4
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import tyro

import infra
import utils


@dataclass
class RAFTArgs:
    """RAFT's own flags."""

    num_generations: int = 4
    """the completions sampled per prompt, among which the best is kept"""
    min_score: Optional[float] = None
    """a prompt's best completion is learnt only if it scores at least this (None: always)"""
    num_epochs: int = 1
    """passes over each batch's kept completions (--per_device_train_batch_size counts the rollout's completions, of
    which each micro-batch of the step holds the kept: one in num_generations)"""
    mask_truncated_completions: bool = False
    """a best completion cut off before its stop token is not learnt (TRL's name, rloo.py's flag)"""
    router_aux_loss_coef: Optional[float] = None
    """an MoE policy's router load-balancing loss times this joins the loss (sft.py's; None: the model config's own)"""


@dataclass
class Args(
    infra.RunArgs, infra.EvalArgs, infra.EnvArgs, infra.DynamicSamplingArgs, infra.RolloutArgs, infra.DataArgs, RAFTArgs
):  # fmt: skip
    """RAFT's flags, then those every script shares (infra/*flags.py): the score's shaping; the model, data and reward
    sources; the rollout; dynamic sampling; the environment (multi-turn episodes); the evaluation; the run (the batch
    and its optimiser, the experiment and its outputs, precision, LoRA, EMA, PTX)."""


def best_of_group(scores, scored, k, min_score=None):
    """The row of each prompt's best-scored completion (ties: the first), and whether it is learnt: some completion of
    the prompt was scored, and the best scores at least min_score. scores, scored (prompts * k,) in rollout order (row
    j * k + i is the i-th completion of prompt j) -> (prompts,) each."""
    ranked = scores.masked_fill(~scored, -torch.inf).reshape(-1, k)  # (prompts, k)
    first = torch.arange(len(ranked), device=scores.device) * k
    best, learnt = first + ranked.argmax(1), scored.reshape(-1, k).any(1)
    return best, learnt & (scores[best] >= min_score) if min_score is not None else learnt


def main(args):
    k = args.num_generations
    infra.at_least(args, 1, "num_generations", "num_epochs")
    infra.at_least(args, 0, "router_aux_loss_coef")
    if args.min_score is not None and not math.isfinite(args.min_score):
        utils.die(f"--min_score must be a finite number, got {args.min_score}")
    if args.use_score_scaling or args.use_score_norm or args.score_clip is not None:
        utils.die("raft.py ranks each prompt's completions by their scores, which --use_score_scaling, --use_score_norm "
                  "and --score_clip would not reorder (a clip only ties them): not offered")  # fmt: skip
    if args.per_device_train_batch_size % k:  # (each micro-batch keeps one completion of each of its prompts)
        utils.die(f"--per_device_train_batch_size must be a multiple of --num_generations {k}")
    run = infra.start(args, k=k)  # processes, seeding, batch sizes, output_dir
    # the tokenizer, prompts and reward sources; the policy (LoRA, gradient checkpointing), no reference
    policy, _ = infra.load_policy(run, reference=False)
    router = infra.router_coef(policy, args.router_aux_loss_coef)  # 0 but for a mixture of experts
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(policy, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    policy, optimizer, _ = infra.prepare(run, policy, optimizer)  # accelerate's (DDP, DeepSpeed); --ema_beta
    # the scripts' own sampler or a vLLM engine, each token drawn by the sampling rule (utils.sampling_logits:
    # --temperature, --top_k, --top_p, --min_p, --repetition_penalty)
    sampler = infra.Sampler(run, policy, rule=utils.sampling_logits)
    accelerator = run.accelerator

    def keep(batch):  # --dynamic_sampling: the prompts whose best completion is learnt (a scored one, --min_score)
        scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)
        return best_of_group(scores, scored, k, args.min_score)[1]

    for update in run.updates():  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # 1. this process's share of the next prompts; k completions of each (--environment: episodes), truncated after
        # the stop token, and each reward source's scores (with --max_staleness N: sampled ahead by the policy of then)
        batch = sampler.rollout(sampler.draw, keep=keep if args.dynamic_sampling else None)
        sampled = batch.sampled  # (rows, width): True where the policy sampled the token (not padding, observations)
        scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)

        # 2. the ranking: each prompt's best completion, learnt where it was scored and reaches --min_score (and with
        # --mask_truncated_completions, where it ended with its stop token)
        best, learnt = best_of_group(scores, scored, k, args.min_score)  # (prompts,) each
        learnt = learnt & batch.contain_eos[best] if args.mask_truncated_completions else learnt
        mask = sampled[best] & learnt[:, None]  # (prompts, width): the tokens the loss covers

        # 3. fine-tune on the kept completions: epochs x mini-batches x gradient-accumulation micro-batches, each
        # mini-batch one prompt's best completion per k rows of the rollout's
        policy.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for epoch in range(args.num_epochs):
            sizes = (len(best), args.local_mini_batch_size // k, args.per_device_train_batch_size // k)
            for mini_batch in utils.minibatches(*sizes, device=run.device):
                # the mean over every learnt token of the mini-batch on all processes (sft.py's, TRL's SFT)
                tokens = run.reduce_sum(sum(mask[micro].sum() for micro in mini_batch))
                if tokens == 0:  # nothing kept on any process: no step (AdamW's momentum would still move the weights)
                    continue
                for micro in mini_batch:
                    rows = best[micro]
                    with accelerator.accumulate(policy):
                        out = utils.forward(
                            policy,
                            batch.query_responses[rows],
                            batch.attention_mask[rows],
                            logits_to_keep=sampled.shape[1] + 1,
                            **({"output_router_logits": True} if router else {}),  # (an MoE's router loss)
                        )
                        logits = out.logits[:, :-1]
                        losses = -utils.logprobs_from_logits(logits, batch.responses[rows]).masked_fill(~mask[micro], 0.0)
                        # the sum over that count, times what accelerate divides by (the micro-batches, the processes)
                        loss = losses.sum() / tokens * args.gradient_accumulation_steps * args.world_size
                        # an MoE router's load-balancing loss (sft.py's); LightRFT's PTX loss, 0 without --ptx_coef
                        loss = loss + (router * out.aux_loss if router else 0.0) + run.ptx_loss(policy)
                        run.check_finite(loss)
                        accelerator.backward(loss)
                        run.clip_gradients(policy)  # --max_grad_norm; stops on a non-finite gradient
                        optimizer.step()
                        optimizer.zero_grad()
                        run.update_ema(policy)  # --ema_beta

                        stats.add_tokens(mask[micro], **{"loss/sft": losses})
                        stats.add(**({"aux_loss": out.aux_loss} if router else {}))
        policy.eval()

        # the update's statistics, averaged over the processes as they are written
        stats.add(
            **{
                "raft/kept_fraction": learnt.float().mean(),  # of the prompts
                "val/response_length": sampled.sum(1).float().mean(),  # the policy's tokens (not observations)
            }
        )
        kept = {"raft/kept_score": scores[best], "val/kept_response_length": mask.sum(1).float()}
        stats.add_tokens(learnt[:, None], **{name: value[:, None] for name, value in kept.items()})  # (over all processes)
        # metrics.jsonl, TensorBoard, wandb; samples, completions (a kept completion's advantage 1, the others' 0)
        advantages = torch.zeros_like(scores).index_fill(0, best[learnt], 1.0)
        run.log(update, batch, stats, advantages, scores=scores, scored=scored, lr=lr)
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="RAFT")  # the model, its EMA, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
