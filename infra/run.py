"""The run: start() makes the processes and the batch sizes, Run holds each step's plumbing (data, the updates and
resume, the learning rate, PTX, clipping, EMA, logging, evaluation and checkpoints, the end).
"""

import math
import os
import random
import sys
import time

import numpy as np
import torch
from accelerate import Accelerator

from utils import PolicyAndValue, die, forward

from . import onednn, tldr
from .data import Shuffled, lm_loss, load_eval, load_prompts, load_ptx, note, ptx_batch
from .environments import Environments
from .evaluation import evaluate, record_eval
from .flags import json_object
from .hooks import notify
from .models import load_tokenizer, save_policy, zero3
from .outputs import (
    checkpoint,
    finish,
    log_metrics,
    open_logs,
    open_output_dir,
    print_samples,
    reduce_stats,
    resume,
    reward_stats,
    saved_line,
    update_line,
    write_completions,
)
from .rewards import load_reward_sources


class Run:
    """A training run's plumbing, one call at each point of use: built by start(), it holds the processes
    (accelerator) and, once load_policy() has loaded them, the tokenizer, the prompts and their draw, the reward
    sources, the held-out set and the PTX texts; updates() resumes a run and counts the updates; log(),
    evaluate_and_checkpoint() and finish() write everything."""

    def __init__(self, args, accelerator, run_name, k, default_reward="sentiment", columns=None, held_out_columns=None):
        self.args, self.accelerator, self.run_name, self.k = args, accelerator, run_name, k
        self.device = accelerator.device
        self.episode, self.update, self.start_update, self.last_checkpoint, self.printed = 0, 0, 1, None, None
        self.model = self.ema = self.sampler = self.writer = self.measure = None
        self.ptx_losses, self.default_reward, self.held_out = [], default_reward, None
        self.reads = [("the dataset", columns or {}), ("--eval_dataset_name", held_out_columns or {})]  # (start's)

    def load_data(self):
        """The tokenizer, the stop token, the prompts (token ids, texts, the other columns), the held-out set, the reward
        sources (in --reward_weights' order: reward models, then functions) and the PTX texts; then their draws."""
        args, accelerator = self.args, self.accelerator
        self.tokenizer = load_tokenizer(
            args.model_name_or_path,
            args.trust_remote_code,
            chat_template=getattr(args, "chat_template", None),
            template_kwargs=json_object(args, "chat_template_kwargs"),
            revision=json_object(args, "model_init_kwargs").get("revision"),
        )
        self.stop_token_id = args.stop_token_id
        if self.stop_token_id is None and args.stop_token == "eos":
            self.stop_token_id = self.tokenizer.eos_token_id
            if self.stop_token_id is None:
                die(f"tokenizer of {args.model_name_or_path!r} has no EOS token; set --stop_token_id or --stop_token None")
        self.prompts, self.env = [], None  # the prompts as the dataset holds them; --environment's environments
        if getattr(args, "environment", None):
            self.env = Environments(args.environment, self.tokenizer, self.stop_token_id)
        self.queries, self.texts, _, self.columns = load_prompts(
            args.dataset_name,
            split=args.dataset_split,
            prompt_field=args.prompt_field,
            tokenizer=self.tokenizer,
            max_prompt_length=args.max_prompt_length,
            raw=self.prompts,
            env=self.env,
        )
        if isinstance(args, tldr.TldrArgs):
            self.eval_set = tldr.load_eval(args, self.tokenizer)
        else:
            self.eval_set = load_eval(args, self.tokenizer, self.columns, env=self.env)
        held_out = self.eval_set[3] if self.eval_set is not None and not isinstance(args, tldr.TldrArgs) else None
        for (where, reads), has in zip(self.reads, [self.columns, held_out]):  # the columns the script reads
            for column, flag in reads.items():
                if has is not None and column not in has:
                    die(f"{where} has no column {column!r} for {flag}; its columns: {sorted(has)}")
        self.sources = load_reward_sources(
            args, self.tokenizer, self.columns, env=self.env, default=self.default_reward, held_out=held_out
        )
        self.weights = [source["weight"] for source in self.sources]  # each source's weight in the score (utils.score)
        self.ptx_texts = load_ptx(args, self.tokenizer) if args.ptx_coef > 0 else None
        # the prompts, drawn without replacement from a reshuffle per pass, the same on every process (each takes its
        # own slice), and the sampling noise drawn from the same generator; the PTX texts have a stream of their own,
        # so the prompts are the same with or without them. accelerate's checkpoints hold every object registered
        self.data = Shuffled(len(self.queries), args.seed, shuffle=getattr(args, "shuffle_dataset", True))
        accelerator.register_for_checkpointing(self.data)
        if self.ptx_texts is not None:
            self.ptx_stream = Shuffled(len(self.ptx_texts), args.seed)
            accelerator.register_for_checkpointing(self.ptx_stream)

    def updates(self, evaluate=None):
        """The run's updates, 1 to num_updates, or from the one after the newest checkpoint with --resume (the weights,
        the optimiser, every process's random state, every registered object and the counters come back first); the
        logs open, and a new run evaluates before training. Counts the episodes. evaluate: the script's own held-out
        evaluation (sft.py, reward.py, dpo.py), a function returning {"eval/...": number}."""
        args, self.held_out = self.args, evaluate
        if args.resume:
            state = resume(self.accelerator, args)
            self.start_update, self.episode, self.last_checkpoint = state["update"] + 1, state["episode"], state["checkpoint"]
        self.writer = open_logs(self.accelerator, args, self.run_name, self.episode)  # args.json, TensorBoard and wandb
        if not args.resume:  # before training: the curves' first point
            self.evaluate()
        self.start_episode, self.start_time = self.episode, time.time()
        for update in range(self.start_update, args.num_updates + 1):
            self.episode += args.batch_size
            self.update = update
            yield update

    def reduce_sum(self, tensor):
        """tensor summed over all processes (a batch statistic of the global batch)"""
        return self.accelerator.reduce(tensor, reduction="sum")

    # the optimiser step's extras

    def ptx_loss(self, model):
        """LightRFT's PTX loss, ptx_coef times the policy's next-token loss on this process's next PTX texts (0 without
        --ptx_coef); model: the policy as prepared (PPO's PolicyAndValue: its policy, through the wrapper)."""
        if self.ptx_texts is None:
            return 0.0
        ids, mask = ptx_batch(
            self.ptx_texts,
            self.ptx_stream,
            self.args.per_device_train_batch_size,
            self.accelerator,
            self.tokenizer.pad_token_id,
        )
        if isinstance(self.accelerator.unwrap_model(model), PolicyAndValue):
            logits = model(ids, mask, 0, policy_only=True)
        else:
            logits = forward(model, ids, mask).logits
        loss = lm_loss(logits, ids, mask)
        self.ptx_losses.append(loss.detach())
        return self.args.ptx_coef * loss

    def check_finite(self, loss):
        """Stop the run in one line on a non-finite loss, naming the last good checkpoint."""
        if not torch.isfinite(torch.as_tensor(loss)):
            die(f"non-finite loss at update {self.update}; last good checkpoint: {self.last_checkpoint}", code=1)

    def clip_gradients(self, model):
        """At each optimiser step, the gradients clipped to --max_grad_norm; a non-finite norm stops the run."""
        if self.accelerator.sync_gradients:
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm or math.inf)  # (0: none)
            # (None under DeepSpeed versions that clip inside their own step)
            if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                die(f"non-finite gradient at update {self.update}; last good checkpoint: {self.last_checkpoint}", code=1)

    def update_ema(self, model):
        """--ema_beta: the EMA of the policy's weights takes in each optimiser step (and the step hook's watchers see
        it)."""
        if self.ema is not None and self.accelerator.sync_gradients:
            unwrapped = self.accelerator.unwrap_model(model)
            self.ema.update_parameters(getattr(unwrapped, "policy", unwrapped))
        notify("step", self, model)

    # what an update writes

    def log(self, update, batch, stats, advantages, scores, scored, **metrics):
        """The update's metrics row (metrics.jsonl, TensorBoard, wandb): its statistics (utils.Stats) over all
        processes, the rewards' (each source's, and the score's: scores, over the completions scored marks), episodes
        per second, the rollout's, the script's metrics (the learning rate, ...); then a table of samples every
        num_updates / num_sample_generations updates, and with --log_completions every completion with its rewards and
        advantage (advantages: one per completion). Returns the row."""
        args, accelerator = self.args, self.accelerator
        if self.ptx_losses:
            stats.add(**{"loss/ptx": torch.stack(self.ptx_losses).mean()})
            self.ptx_losses = []
        rollout = {"val/num_eos_tokens": accelerator.reduce(batch.contain_eos.float().sum(), reduction="sum").item()}
        # the weighted score over the completions some source scored; each source's own statistics
        if self.sources:
            rollout.update(reward_stats(accelerator, batch.per_source, self.sources, scores=scores, scored=scored))
        if args.response_length_min is not None:
            rollout["completions/max_length_allowed"] = batch.max_length
        rollout.update(batch.stats)  # --dynamic_sampling: its rounds and groups
        row = self.log_stats(stats, **{**rollout, **metrics})
        tables = args.num_sample_generations if not args.quiet else 0
        every = max(1, args.num_updates // tables) if tables else 0
        if accelerator.is_main_process and every and (update - 1) % every == 0:
            print_samples(
                f"update {update}",
                prompts=batch.texts[: args.num_completions_to_print],
                completions=self.tokenizer.batch_decode(
                    batch.responses[: args.num_completions_to_print], skip_special_tokens=True
                ),
                per_source=batch.per_source,
                sources=self.sources,
                scores=scores,
                scored=scored,
            )
        if args.log_completions:
            write_completions(
                accelerator,
                args,
                episode=self.episode,
                update=update,
                prompts=batch.texts,
                # an episode: its whole conversation
                completions=batch.conversations or self.tokenizer.batch_decode(batch.responses, skip_special_tokens=True),
                per_source=batch.per_source,
                sources=self.sources,
                scores=scores.masked_fill(~scored, float("nan")),
                advantages=advantages,
            )
        return row

    def reduce_stats(self, stats):
        """statistics (utils.Stats) over all processes: {name: float}"""
        return reduce_stats(self.accelerator, stats)

    def log_stats(self, stats, **metrics):
        """A metrics row: the update's statistics (utils.Stats) over all processes, episodes (examples, pairs) per
        second, then the metrics given (log's rollout and score statistics; a script's own). Returns the row."""
        row = {"episode": self.episode, "eps": (self.episode - self.start_episode) / (time.time() - self.start_time)}
        row.update(reduce_stats(self.accelerator, stats))
        row.update(metrics)
        log_metrics(self.accelerator, self.writer, self.args, row)
        if self.accelerator.is_main_process and not self.args.quiet and self.update != self.printed:  # (once an update)
            print(update_line(row, self.update, self.args.num_updates), flush=True)
            self.printed = self.update
        return row

    def evaluate(self):
        """The held-out evaluation (with --eval_dataset_name, or the TL;DR scripts' eval split): greedy (and
        --num_eval_generations sampled) completions scored by the reward sources (the TL;DR scripts': the reward model
        alone, tldr.TldrArgs.eval_sources); a metrics row, and the samples in output_dir/eval_samples."""
        args = self.args
        if self.held_out is not None:
            metrics = self.held_out()
            if metrics and self.accelerator.is_main_process:
                record_eval(args.output_dir, episode=self.episode, metrics=metrics, samples=[], writer=self.writer)
            return
        if self.eval_set is None:
            return
        if self.sampler is not None and self.sampler.ahead is not None:  # (--max_staleness: the sampler ahead is done
            self.sampler.ahead.settle()  # with the environment and reward models, which the evaluation shares)
        metrics, samples = evaluate(
            self.accelerator,
            model=self.model,
            tokenizer=self.tokenizer,
            sources=self.sources[: args.eval_sources],
            eval_set=self.eval_set,
            response_length=args.response_length,
            stop_token_id=self.stop_token_id,
            batch_size=args.eval_batch_size,
            k=args.num_eval_generations,
            rule=self.sampler.rule if self.sampler is not None else args.temperature,
            seed=args.seed + self.episode,  # the same samples in a resumed run
            sampler=self.sampler,
            measure=self.measure,
        )
        if self.accelerator.is_main_process:
            record_eval(args.output_dir, episode=self.episode, metrics=metrics, samples=samples, writer=self.writer)

    def evaluate_and_checkpoint(self, update, state=None):
        """Every --eval_every episodes and at the end, the held-out evaluation; then every --checkpoint_every updates a
        checkpoint (after the metrics rows, so that a resumed run neither repeats nor loses one; complete or absent),
        with the script's state (a dict of numbers and tensors) beside the registered objects."""
        args = self.args
        crossed = args.eval_every and self.episode // args.eval_every > (self.episode - args.batch_size) // args.eval_every
        ahead = self.sampler.ahead if self.sampler is not None else None  # --max_staleness's batches in flight
        if update == args.num_updates or crossed:
            if ahead is not None and self.eval_set is not None:  # (evaluate() waits for the batches in flight:
                ahead.settle()  # sampling them is training, waited for before the clock stops)
            began = time.time()
            self.evaluate()
            self.start_time += time.time() - began  # eps: the rate of training, the evaluations' time aside
        if args.checkpoint_every and update % args.checkpoint_every == 0:
            state = {"update": update, "episode": self.episode, **(state or {})}
            if ahead is not None:  # (sampled before the random states are saved: an environment swaps Python's)
                ahead.settle()
            extra = ahead.save if ahead is not None else None
            self.last_checkpoint = checkpoint(self.accelerator, self.model, args, update, state=state, extra=extra)

    def finish(self, doc, algorithm):
        """The end of the run: the trained policy saved to output_dir (LoRA: the adapters, or merged with
        --merge_lora; PPO: the critic to output_dir/critic too, or its value head), the EMA's weights, the tokenizer,
        the model card (doc: the script's docstring), the hub upload; the engine shut down, the processes left."""
        args, accelerator = self.args, self.accelerator
        if args.save_model:
            save_policy(accelerator, self.model, args)
        card = dict(script=sys.argv[0], algorithm=algorithm, doc=doc, base_model=args.model_name_or_path, sources=self.sources)
        engine = self.sampler.engine if self.sampler is not None else None
        finish(accelerator, args, writer=self.writer, tokenizer=self.tokenizer, ema=self.ema, card=card, engine=engine)
        if accelerator.is_main_process:
            print(saved_line(args, accelerator.unwrap_model(self.model)), flush=True)
        if accelerator.is_main_process and isinstance(args, tldr.TldrArgs):
            print(tldr.JUDGE.format(output_dir=args.output_dir))


def check_accelerate_config(accelerator, per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm):
    """Make an accelerate/DeepSpeed config agree with the script's flags, or stop with one line."""
    if accelerator.num_processes > 1 and accelerator.distributed_type.value == "NO":  # (each would train alone)
        die(f"accelerate started {accelerator.num_processes} processes that would not share their gradients (a GPU "
            "config, no GPU?); on a CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N")  # fmt: skip
    if accelerator.gradient_accumulation_steps != gradient_accumulation_steps:
        # accelerate lets a config's gradient_accumulation_steps silently override the one passed to Accelerator
        die(
            f"the accelerate config sets gradient_accumulation_steps={accelerator.gradient_accumulation_steps}; "
            "remove it and use --gradient_accumulation_steps"
        )
    if accelerator.state.deepspeed_plugin is not None:
        # no dataloader goes through prepare(), so DeepSpeed learns the micro-batch size and the clipping norm here
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        if ds_config.get("gradient_accumulation_steps", "auto") not in ("auto", gradient_accumulation_steps):
            die("the DeepSpeed config sets gradient_accumulation_steps; remove it and use --gradient_accumulation_steps")
        ds_config["train_micro_batch_size_per_gpu"] = per_device_train_batch_size
        ds_config["gradient_clipping"] = max_grad_norm


def process_group_kwargs():
    """Accelerator's kwargs_handlers: gloo for processes launched without a GPU, where accelerate would pick no backend
    and count one process while DeepSpeed counts them all (on GPUs accelerate picks NCCL itself)."""
    if "LOCAL_RANK" in os.environ and not torch.cuda.is_available():
        from accelerate.utils import InitProcessGroupKwargs

        return [InitProcessGroupKwargs(backend="gloo")]
    return []


def start(args, k=1, default_reward="sentiment", examples=None, columns=None, held_out_columns=None):
    """The run: the processes (accelerate), the batch sizes (into args; k completions per prompt; examples: the rows
    sft.py, reward.py or dpo.py keep, which --num_train_epochs counts; default_reward: the reward source without
    --reward_fn or --reward_model_path, None: none; columns, held_out_columns: {column: the flag naming it} the script
    reads from the prompts' rows and from the held-out set's, checked as they load), the checks that need them, a random stream
    of its own on each process (its mini-batch shuffles; the prompts and the sampling noise come from a generator every
    process shares, Shuffled), output_dir (a --resume that would change the run is refused), then the tokenizer, the
    prompts, the reward sources, the held-out set and the PTX texts."""
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision="bf16" if args.bf16 else None,
        kwargs_handlers=process_group_kwargs(),
    )
    check_accelerate_config(
        accelerator, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_grad_norm
    )
    args.distributed_type = accelerator.distributed_type.value
    onednn.switch(args.onednn and accelerator.device.type == "cpu" and not zero3(accelerator))  # the models loaded next
    args.world_size = accelerator.num_processes
    # TRL's generation_batch_size (a rollout's completions) and steps_per_generation (its micro-batches): the mini-batches
    steps, micro = getattr(args, "steps_per_generation", None), args.per_device_train_batch_size * args.world_size
    if getattr(args, "generation_batch_size", None) is not None:
        if args.generation_batch_size % micro:
            die(f"--generation_batch_size {args.generation_batch_size} must be a multiple of the {micro} completions of "
                "a micro-batch on all processes (--per_device_train_batch_size x processes)")  # fmt: skip
        steps = args.generation_batch_size // micro
    if steps is not None:
        if steps % args.gradient_accumulation_steps:
            die(f"a rollout of {steps} micro-batches (--steps_per_generation or --generation_batch_size) must be a multiple"
                f" of --gradient_accumulation_steps {args.gradient_accumulation_steps}: whole optimiser steps")  # fmt: skip
        args.num_mini_batches = steps // args.gradient_accumulation_steps
    args.local_mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.local_batch_size = args.local_mini_batch_size * args.num_mini_batches
    args.batch_size = args.local_batch_size * args.world_size
    if args.total_episodes is None:  # (sft.py, reward.py, dpo.py) --num_train_epochs passes over the examples they keep
        passes = int(args.num_train_epochs * examples)
        args.total_episodes = max(1, passes // args.batch_size) * args.batch_size
        if args.num_train_epochs * examples < args.batch_size:
            note(f"{examples} examples make less than a batch of {args.batch_size}: one batch, each about "
                 f"{args.batch_size / examples:.1f} times")  # fmt: skip
        elif passes > args.total_episodes:  # (TRL: a last, smaller batch)
            note(f"{passes} examples (--num_train_epochs over {examples}) make {args.total_episodes // args.batch_size} "
                 f"whole batches of {args.batch_size}: {passes - args.total_episodes} left out")  # fmt: skip
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1 or args.total_episodes % args.batch_size:
        below = args.num_updates * args.batch_size
        die(
            f"--total_episodes {args.total_episodes} must be a positive multiple of the batch of {args.batch_size} "
            f"{'completions' if examples is None else 'examples'} (processes x per_device_train_batch_size x "
            f"gradient_accumulation_steps x num_mini_batches): "
            f"try {f'{below} or ' if below else ''}{below + args.batch_size}"
        )
    if args.local_batch_size % k:
        die(
            f"per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches = {args.local_batch_size} "
            f"must be a multiple of the {k} completions per prompt"
        )
    args.local_prompts = args.local_batch_size // k
    # every process would need the whole policy to average it
    if args.ema_beta is not None and zero3(accelerator):
        die("--ema_beta does not work under DeepSpeed ZeRO-3 (the weights are sharded); use ZeRO-2")
    if getattr(args, "cast_lm_head_to_fp32", False) and zero3(accelerator):  # (the projection sharded as it loads)
        die("--cast_lm_head_to_fp32 does not work under DeepSpeed ZeRO-3 yet; use ZeRO-2")
    if getattr(args, "sync_ref_model", False) and zero3(accelerator):  # (the policy's and reference's shards differ)
        die("--sync_ref_model does not work under DeepSpeed ZeRO-3 yet; use ZeRO-2")
    if zero3(accelerator) and args.use_peft:
        die("--use_peft does not work under DeepSpeed ZeRO-3 yet; use ZeRO-2")
    if getattr(args, "max_staleness", 0) and (zero3(accelerator) or getattr(args, "dynamic_sampling", False)):
        # ZeRO-3's decoding needs every process at each step, dynamic sampling's rounds draw more prompts as they go
        die("--max_staleness samples ahead on a whole copy of the policy, in a fixed order: not under ZeRO-3 or with "
            "--dynamic_sampling")  # fmt: skip
    if getattr(args, "use_vllm", False) and args.vllm_tensor_parallel_size > 1 and accelerator.num_processes > 1:
        die("--vllm_tensor_parallel_size > 1 needs one training process (each process has an engine of its own)")
    seed = (args.seed + accelerator.process_index * 100003) % 2**32  # (numpy's seeds are below 2**32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # (nothing loaded yet: the script checks its flags first)
    return Run(args, accelerator, open_output_dir(args), k, default_reward, columns, held_out_columns)


class CheckpointedNumber:
    """A number the run changes as it goes (PPO's adaptive KL coefficient), which accelerate's checkpoints hold once
    registered (accelerator.register_for_checkpointing), so that a resumed run goes on with the one it had."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]
