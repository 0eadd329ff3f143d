"""RLOO on the TL;DR summarisation benchmark: a Pythia SFT policy learns to write Reddit TL;DRs that a reward model
prefers, evaluated by that reward model during training; an LLM judge compares the summaries it writes with the
reference summaries afterwards (benchmark/judge_tldr.py).

The algorithm is rloo.py's (k completions per prompt, leave-one-out baseline, KL penalty to the SFT policy in the
reward, clipped steps on the sequence probability ratio); this file adds the TL;DR setup (Stiennon et al. 2020) as the
N+ implementation details study (Huang et al. 2024, https://arxiv.org/abs/2403.17031) and TRL's benchmark ran it:
responses of at most 53 tokens sampled at temperature 0.7, a penalty of 1 for a summary without EOS, and evaluation of
greedy summaries on the validation split.

Reproduce the 1B run (8 GPUs; see README.md for the expected win rates):
    accelerate launch --config_file configs/deepspeed_zero2.yaml rloo_tldr.py --output_dir output/rloo_tldr \
        --eval_long_prompts truncate
    python benchmark/judge_tldr.py --samples output/rloo_tldr --judge_base_url https://api.openai.com/v1 \
        --judge_model gpt-4o-mini --protocol trl --num_examples 1000
On one GPU (same global batch, 8x the gradient accumulation):
    python rloo_tldr.py --gradient_accumulation_steps 128
"""

import copy
import glob
import json
import os
import random
import secrets
import shutil
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from rich.pretty import pprint
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from utils import (
    INVALID_LOGPROB,
    RunArgs,
    Shuffled,
    check_accelerate_config,
    check_model,
    die,
    disable_dropout,
    evaluate,
    forward,
    forward_grouped,
    full_kl,
    generate,
    get_scores,
    kl_estimate,
    left_pad,
    lm_loss,
    load_pretrained,
    load_prompts,
    load_ptx,
    load_reward_sources,
    load_tokenizer,
    logprobs_from_logits,
    moments_std,
    new_moments,
    pad_cat,
    prepare_frozen,
    print_samples,
    process_group_kwargs,
    ptx_batch,
    push_to_hub,
    record_eval,
    reference_model,
    reward_stats,
    transform_scores,
    truncate_response,
    weighted_scores,
    write_completions,
    write_eval_json,
    write_model_card,
    zero3,
)

ALGORITHM = "RLOO"


@dataclass
class Args(RunArgs):  # RunArgs (utils.py): the flags every script shares (seed, outputs, LoRA, EMA, PTX)
    # algorithm
    rloo_k: int = 2
    """the number of completions sampled per prompt"""
    kl_coef: float = 0.03
    """the weight of the KL penalty in the reward"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """the per-token KL estimator summed into the penalty; abs: |log(p / ref)|; full: the exact KL over the whole
    vocabulary at each position, from both models' logits"""
    cliprange: float = 0.2
    """the clip range of the sequence probability ratio"""
    ratio_threshold: Optional[float] = None
    """a micro-batch whose mean sequence probability ratio exceeds this contributes no gradient (TRL)"""
    normalize_advantage: bool = False
    """normalise advantages to zero mean and unit std over the batch"""
    # copy: score transforms
    use_score_scaling: bool = False
    """divide each score (the missing-EOS penalty included) by the running std of all scores so far (TRL)"""
    use_score_norm: bool = False
    """with --use_score_scaling, also subtract the running mean of the scores first (TRL)"""
    score_clip: Optional[float] = None
    """clip each score to [-score_clip, score_clip], after any scaling (TRL)"""
    # end copy
    missing_eos_penalty: Optional[float] = 1.0
    """subtracted from the score of a summary that never produced the stop token"""

    # rollout
    response_length: int = 53
    """the most tokens generated per summary"""
    response_length_min: Optional[int] = None
    """draw each update's most tokens per summary uniformly from [response_length_min, response_length], both included
    (TRL's LengthSampler excludes the upper bound); None: always response_length. The evaluation allows response_length"""
    temperature: float = 0.7
    """sampling temperature; logprobs are recomputed from logits / temperature, the distribution sampled from"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """stop generating at the tokenizer's EOS token ('eos') or never (None)"""
    stop_token_id: Optional[int] = None
    """stop generating at this token id (overrides --stop_token)"""
    local_rollout_forward_batch_size: int = 16
    """completions generated and scored per forward pass in the rollout"""

    # copy: tldr model and data
    # model and data
    sft_model_path: str = "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT policy (init and reference): a hub id or a folder"""
    reward_model_path: str = "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr"
    """the reward model, a sequence-classification model with num_labels=1: a hub id or a folder"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """reward functions besides the reward model: 'sentiment', 'accuracy', 'path/to/file.py:function' or
    'package.module:function', called as fn(prompts, completions, **columns) (examples/reward_server.py asks an HTTP
    server); repeatable"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward source, in the order: the reward model, then functions (each as given); default all 1"""
    dataset_name: str = "trl-lib/tldr"
    """a hub dataset id, or a local folder of split files (train.parquet, validation.jsonl, ...) or a single file"""
    dataset_split: str = "train"
    """the split to train on"""
    eval_split: str = "validation"
    """the split to evaluate on"""
    prompt_field: str = "prompt"
    """the column holding the prompts ("SUBREDDIT: r/... TITLE: ... POST: ... TL;DR:")"""
    reference_field: str = "completion"
    """the column holding the reference summaries the judge compares against"""
    max_prompt_length: int = 512
    """prompts longer than this many tokens are dropped"""
    # end copy

    # optimisation (the published run: 8 processes, 4,096 completions per update)
    total_episodes: int = 999_424
    """total completions to train on, a multiple of the batch (999,424: 244 batches of 4,096 or 1,952 of 512, TRL's
    1,000,000 rounded to a whole number of the 8-GPU batches)"""
    per_device_train_batch_size: int = 16
    """completions per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 16
    """micro-batches accumulated per optimiser step"""
    num_mini_batches: int = 2
    """optimiser steps per epoch over the batch"""
    num_ppo_epochs: int = 2
    """passes over each batch"""
    learning_rate: float = 3e-6
    """the AdamW learning rate, annealed linearly to zero"""

    # evaluation: greedy summaries of the first eval_examples prompts of --eval_split
    eval_every: int = 100_000
    """evaluate every this many episodes, besides before training and at the end (0: only then)"""
    eval_examples: int = 1000
    """how many eval-split prompts to summarise (the published win rates use the first 1,000)"""
    eval_batch_size: int = 64
    """summaries generated per forward pass in the evaluation, per process"""
    eval_long_prompts: Literal["drop", "truncate"] = "drop"
    """eval prompts longer than --max_prompt_length: drop them (the N+ study's filter), or keep their last
    max_prompt_length tokens (TRL's evaluation takes the first eval_examples prompts, none dropped)"""

    # to be filled in at runtime (RunArgs holds the other sizes)
    local_prompts: tyro.conf.Suppress[int] = 0
    """prompts per update on each process"""


# copy: resumable
# flags a resumed run may change: they do not change what the run computes
RESUMABLE = {
    "resume", "output_dir", "exp_name", "track", "wandb_project_name", "wandb_entity", "checkpoint_every",
    "keep_checkpoints", "save_model", "num_sample_generations", "trust_remote_code", "local_rollout_forward_batch_size",
    "gradient_checkpointing", "eval_batch_size", "push_to_hub", "hub_model_id", "hub_private",
}  # fmt: skip
# end copy


# copy: rloo advantages
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


# end copy


if __name__ == "__main__":
    # copy: setup
    args = tyro.cli(Args, use_underscores=True)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision="bf16" if args.bf16 else None,
        kwargs_handlers=process_group_kwargs(),
    )
    check_accelerate_config(
        accelerator, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_grad_norm
    )
    args.distributed_type = accelerator.distributed_type.value
    args.world_size = accelerator.num_processes
    args.local_mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.local_batch_size = args.local_mini_batch_size * args.num_mini_batches
    args.batch_size = args.local_batch_size * args.world_size
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1 or args.total_episodes % args.batch_size:
        below = args.num_updates * args.batch_size
        die(
            f"--total_episodes {args.total_episodes} must be a positive multiple of the batch of {args.batch_size} "
            f"completions (processes x per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches): "
            f"try {f'{below} or ' if below else ''}{below + args.batch_size}"
        )
    if args.temperature <= 0 or args.response_length < 1 or args.local_rollout_forward_batch_size < 1:
        die("--temperature, --response_length and --local_rollout_forward_batch_size must be positive")
    if args.response_length_min is not None and not 1 <= args.response_length_min <= args.response_length:
        die(f"--response_length_min must be in [1, --response_length {args.response_length}], got {args.response_length_min}")
    if args.use_score_norm and not args.use_score_scaling:
        die("--use_score_norm needs --use_score_scaling: it subtracts the running mean of the scores it scales")
    if any(x is not None and x <= 0 for x in (args.score_clip, args.ratio_threshold)):
        die("--score_clip and --ratio_threshold must be positive")
    # every process would need the whole policy to average it
    if args.ema_beta is not None and zero3(accelerator):
        die("--ema_beta does not work under DeepSpeed ZeRO-3 (the weights are sharded); use ZeRO-2")
    if zero3(accelerator) and args.use_peft:
        die("--use_peft does not work under DeepSpeed ZeRO-3 yet; use ZeRO-2")
    # end copy
    if args.rloo_k < 2:
        die(f"--rloo_k must be at least 2 (the leave-one-out baseline needs another sample), got {args.rloo_k}")
    if args.local_batch_size % args.rloo_k:
        die(
            f"per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches = {args.local_batch_size} "
            f"must be a multiple of --rloo_k {args.rloo_k}"
        )
    if args.eval_every < 0 or args.eval_examples < 1 or args.eval_batch_size < 1:
        die("--eval_every must be >= 0, --eval_examples and --eval_batch_size >= 1")
    k = args.rloo_k  # completions per prompt
    args.local_prompts = args.local_batch_size // k

    # copy: output_dir and resume
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("output", run_name)
    # a checkpoint is a folder checkpoint-NNNNNNN: complete, since it is written as .tmp and renamed
    checkpoints = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*[0-9]")))
    if args.resume and not checkpoints:
        die(f"--resume: no complete checkpoint in --output_dir {args.output_dir!r}")
    if not args.resume and os.path.exists(os.path.join(args.output_dir, "metrics.jsonl")):
        die(f"--output_dir {args.output_dir!r} already holds a run (metrics.jsonl); choose another or add --resume")
    if args.resume and os.path.exists(os.path.join(args.output_dir, "args.json")):
        with open(os.path.join(args.output_dir, "args.json")) as f:
            saved, now = json.load(f), json.loads(json.dumps(vars(args)))  # (as JSON has them: tuples as lists)
        changed = [key for key in now if key not in RESUMABLE and key in saved and saved[key] != now[key]]
        if changed:
            changes = ", ".join(f"{key} {saved[key]} -> {now[key]}" for key in changed)
            die(f"--resume with arguments that change the run: {changes}")
    # end copy

    # copy: seeding
    # a stream of its own on each process (mini-batch shuffles); the prompts and the sampling noise come from a
    # generator every process shares (below)
    local_seed = args.seed + accelerator.process_index * 100003
    random.seed(local_seed)
    np.random.seed(local_seed)
    torch.manual_seed(local_seed)
    device = accelerator.device
    # end copy

    # copy: tldr prompts and rewards
    # tokenizer, prompts (and the eval split's, with their reference summaries) and rewards
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)
    stop_token_id = args.stop_token_id
    if stop_token_id is None and args.stop_token == "eos":
        stop_token_id = tokenizer.eos_token_id
        if stop_token_id is None:
            die(f"tokenizer of {args.sft_model_path!r} has no EOS token; set --stop_token_id or --stop_token None")
    load = partial(load_prompts, args.dataset_name, prompt_field=args.prompt_field, tokenizer=tokenizer)
    queries_all, prompt_texts, _, columns = load(split=args.dataset_split, max_prompt_length=args.max_prompt_length)
    eval_queries, eval_texts, eval_refs, _ = load(
        split=args.eval_split,
        max_prompt_length=args.max_prompt_length,
        reference_field=args.reference_field,
        long_prompts=args.eval_long_prompts,
    )
    eval_set = (eval_queries[: args.eval_examples], eval_texts[: args.eval_examples], eval_refs[: args.eval_examples])
    # the reward sources, in --reward_weights' order: the TL;DR reward model (also the evaluation's), then functions
    sources = load_reward_sources(args, tokenizer, columns=columns, reward_model_paths=[args.reward_model_path])
    ptx_texts = load_ptx(args, tokenizer) if args.ptx_coef > 0 else None
    # end copy

    # copy: policy and reference (model_name_or_path->sft_model_path)
    policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args.trust_remote_code)
    check_model(policy)  # a family the scripts cannot run stops here, with one line
    # the frozen initial policy; none with LoRA (the policy with its adapters switched off). Under ZeRO-3 the
    # weights are sharded as they load, so the reference is loaded anew rather than copied
    if args.use_peft:
        ref_policy = None
    elif zero3(accelerator):
        ref_policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args.trust_remote_code)
    else:
        ref_policy = copy.deepcopy(policy)
    if ref_policy is not None:
        ref_policy.eval().requires_grad_(False)
    if args.use_peft:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            die("--use_peft needs the peft package: pip install peft")
        policy = get_peft_model(policy, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear"))
    policy.eval()  # no dropout: the sampling policy and the one being trained must be the same function
    if args.gradient_checkpointing:
        # Transformers checkpoints only in train mode, so the update runs in train mode with every dropout at zero
        disable_dropout(policy)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # end copy

    # copy: optimiser and state
    if accelerator.is_main_process:
        pprint(args)
        os.makedirs(args.output_dir, exist_ok=True)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    # fused: one kernel updates every parameter (about 4x the default's speed on a 2-core CPU), as transformers' Trainer
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=1e-5, weight_decay=0.0, fused=True)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    # the frozen models on the device; under ZeRO-3 sharded over the processes as inference engines instead
    ref_policy = prepare_frozen(accelerator, ref_policy)
    for source in sources:
        if "model" in source:
            source["model"] = prepare_frozen(accelerator, source["model"])
    # the prompts, drawn without replacement from a reshuffle per pass, the same on every process (each takes its own
    # slice), and the sampling noise drawn from the same generator; the PTX texts have a stream of their own, so the
    # prompts are the same with or without them
    data = Shuffled(len(queries_all), args.seed)
    accelerator.register_for_checkpointing(data)
    if ptx_texts is not None:
        ptx_stream = Shuffled(len(ptx_texts), args.seed)
        accelerator.register_for_checkpointing(ptx_stream)
    ema = None
    if args.ema_beta is not None:  # LightRFT: an exponential moving average of the weights, after each optimiser step
        ema = AveragedModel(
            accelerator.unwrap_model(policy),
            device="cpu" if args.ema_cpu else None,
            multi_avg_fn=get_ema_multi_avg_fn(args.ema_beta),
        )
        ema.update_parameters(accelerator.unwrap_model(policy))  # the first call copies: the average starts here
        accelerator.register_for_checkpointing(ema)
    reduce_sum = partial(accelerator.reduce, reduction="sum")  # batch statistics over all processes
    score_moments = new_moments()  # --use_score_scaling: every score so far, on all processes
    start_update, episode, last_checkpoint = 1, 0, None
    if args.resume:  # the weights, optimiser, every process's random state and the streams above, then the counters
        last_checkpoint = checkpoints[-1]
        accelerator.load_state(last_checkpoint)
        state = torch.load(os.path.join(last_checkpoint, "state.pt"), weights_only=True)
        score_moments, start_update, episode = state["score_moments"], state["update"] + 1, state["episode"]
        if accelerator.is_main_process:  # the rows past the checkpoint (and a torn one) go: they are written again
            for name in ["metrics.jsonl", "completions.jsonl"]:
                path = os.path.join(args.output_dir, name)
                if os.path.exists(path):
                    with open(path) as f:
                        rows = []
                        for line in f:
                            if not line.endswith("\n") or json.loads(line)["episode"] > episode:
                                break
                            rows.append(line)
                    with open(path + ".tmp", "w") as f:
                        f.writelines(rows)
                    os.replace(path + ".tmp", path)
            print(f"resuming from {last_checkpoint} (update {state['update']}, episode {episode})")
    # end copy

    # copy: logs
    # TensorBoard under output_dir (a resumed run drops what the killed one logged past its checkpoint), and with
    # --track wandb synced from it, resuming the run whose id is in output_dir/wandb_id
    writer = None
    if accelerator.is_main_process:
        if not args.resume:
            with open(os.path.join(args.output_dir, "args.json"), "w") as f:
                json.dump(vars(args), f, indent=1)
        if args.track:
            import wandb

            id_file = os.path.join(args.output_dir, "wandb_id")
            # (secrets, not random: the run's random streams stay as seeded)
            run_id = open(id_file).read().strip() if args.resume and os.path.exists(id_file) else secrets.token_hex(8)
            with open(id_file, "w") as f:
                f.write(run_id)
            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=vars(args),
                name=run_name,
                id=run_id,
                resume="allow",
                save_code=True,
            )
        writer = SummaryWriter(os.path.join(args.output_dir, "runs"), purge_step=episode + 1 if args.resume else None)
        if not args.resume:
            writer.add_text(
                "hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
            )
    sample_every = max(1, args.num_updates // args.num_sample_generations) if args.num_sample_generations else 0
    # end copy

    def evaluate_and_record(episode):
        """greedy summaries of the eval prompts scored by the reward model: a metrics row, and the samples that
        benchmark/judge_tldr.py judges after the run"""
        eval_metrics, samples = evaluate(
            accelerator,
            policy=accelerator.unwrap_model(policy),
            tokenizer=tokenizer,
            reward_model=sources[0]["model"],
            rm_tokenizer=sources[0]["tokenizer"],
            eval_set=eval_set,
            response_length=args.response_length,
            stop_token_id=stop_token_id,
            batch_size=args.eval_batch_size,
        )
        if accelerator.is_main_process:
            record_eval(args.output_dir, episode=episode, metrics=eval_metrics, samples=samples, writer=writer)

    if args.resume and accelerator.is_main_process:  # the eval rows past the checkpoint went with metrics.jsonl's
        write_eval_json(args.output_dir)
    if not args.resume:  # the SFT policy's evaluation, the baseline of the curves
        evaluate_and_record(episode)

    # copy: rloo loop
    stats_shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
    # a prompt's k completions run the prompt once (utils.forward_grouped) where every chunk of rows holds whole prompts
    rollout_group = args.rloo_k if args.local_rollout_forward_batch_size % args.rloo_k == 0 else 1
    train_group = 1 if args.per_device_train_batch_size % args.rloo_k else args.rloo_k
    start_episode, start_time = episode, time.time()
    for update in tqdm(
        range(start_update, args.num_updates + 1),
        initial=start_update - 1,
        total=args.num_updates,
        disable=not accelerator.is_local_main_process,
    ):
        episode += args.batch_size
        lr = (1.0 - (update - 1.0) / args.num_updates) * args.learning_rate
        for group in optimizer.param_groups:
            group["lr"] = lr

        # copy: draw prompts
        idx = data.take(args.local_prompts * args.world_size)
        # the random numbers that pick every sampled token, for the global batch: a completion depends on the seed and
        # its place in the global batch, not on the process that samples it
        uniforms = torch.rand((len(idx), k, args.response_length), generator=data.rng)
        # TRL's LengthSampler: this update's most tokens per completion, drawn after the uniforms (whose first columns
        # it uses), the same on every process and again in a resumed run
        max_length = args.response_length
        if args.response_length_min is not None:
            max_length = torch.randint(args.response_length_min, args.response_length + 1, (), generator=data.rng).item()
        mine = slice(accelerator.process_index * args.local_prompts, (accelerator.process_index + 1) * args.local_prompts)
        idx = idx[mine]
        uniforms = uniforms[mine].reshape(-1, args.response_length)  # (prompts * k, response_length), as the queries
        queries, query_mask = left_pad([queries_all[i] for i in idx], tokenizer.pad_token_id)
        # (prompts * k, query_len): row j * k + i is the i-th completion of prompt j; a prompt's k rows are adjacent,
        # so the forward passes can run each prompt once (utils.forward_grouped)
        queries = queries.repeat_interleave(k, 0).to(device)
        query_mask = query_mask.repeat_interleave(k, 0).to(device)
        texts = [prompt_texts[i] for i in idx for _ in range(k)]
        batch_columns = {name: [values[i] for i in idx for _ in range(k)] for name, values in columns.items()}
        context_length = queries.shape[1]
        # end copy

        # autocast (a no-op without mixed precision) also covers the reference and reward models, which prepare() did not
        # wrap: at the first update the policy and the reference then give identical logprobs
        with torch.no_grad(), accelerator.autocast():
            unwrapped = accelerator.unwrap_model(policy)
            responses, logprobs, ref_logprobs, full_kls, per_source, lengths = [], [], [], [], [], []
            # copy: generate a chunk
            for i in range(0, len(queries), args.local_rollout_forward_batch_size):
                query = queries[i : i + args.local_rollout_forward_batch_size]
                qmask = query_mask[i : i + args.local_rollout_forward_batch_size]
                response = generate(
                    model=unwrapped,
                    queries=query,
                    query_mask=qmask,
                    response_length=max_length,
                    temperature=args.temperature,
                    stop_token_id=stop_token_id,
                    uniforms=uniforms[i : i + args.local_rollout_forward_batch_size],
                    group=rollout_group,
                    synced=zero3(accelerator),
                )

                # 1. truncate after the stop token; everything after it is padding
                response, length = truncate_response(response, stop_token_id, tokenizer.pad_token_id)
                rmask = (torch.arange(response.shape[1], device=device)[None, :] < length[:, None]).long()
                query_response, mask = torch.cat([query, response], 1), torch.cat([qmask, rmask], 1)
                # end copy
                # logprobs of the distribution sampled from: logits / temperature
                grouped = partial(forward_grouped, context_length=context_length, group=rollout_group)
                logits = grouped(unwrapped, query_response, mask, logits_to_keep=response.shape[1] + 1)[:, :-1]
                logprobs.append(logprobs_from_logits(logits, response, args.temperature))
                with reference_model(unwrapped, ref_policy) as ref:  # with LoRA, the policy without its adapters
                    ref_logits = grouped(ref, query_response, mask, logits_to_keep=response.shape[1] + 1)[:, :-1]
                ref_logprobs.append(logprobs_from_logits(ref_logits, response, args.temperature))
                if args.kl_estimator == "full":  # the exact KL, while both models' logits are at hand
                    full_kls.append(full_kl(logits, ref_logits, args.temperature))
                del logits, ref_logits  # (chunk, width, vocab) each: freed before the next chunk allocates its own

                # copy: score a chunk
                # 2. scores: each reward source's (sources, chunk), NaN where one returned None; reward models read the
                # last real token, functions the decoded text and the rows' dataset columns
                per_source.append(
                    get_scores(
                        sources,
                        tokenizer=tokenizer,
                        query_responses=query_response,
                        mask=mask,
                        context_length=context_length,
                        lengths=length,
                        prompts=texts[i : i + len(query)],
                        columns={name: values[i : i + len(query)] for name, values in batch_columns.items()},
                        stop_token_id=stop_token_id,
                    )
                )
                responses.append(response)
                lengths.append(length)
                # end copy

            # copy: gather the rollout
            # chunks may stop at different lengths: each padded to the longest
            responses = pad_cat(responses, tokenizer.pad_token_id)
            lengths, width = torch.cat(lengths), responses.shape[1]
            padding_mask = torch.arange(width, device=device)[None, :] >= lengths[:, None]  # True on padding
            logprobs = pad_cat(logprobs, INVALID_LOGPROB).masked_fill(padding_mask, INVALID_LOGPROB)
            query_responses = torch.cat([queries, responses], 1)
            attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
            # the weighted sum over the sources that scored each completion; one that none scored takes no part below
            per_source = torch.cat(per_source, 1)  # (sources, local batch)
            scores, scored = weighted_scores(per_source, sources)

            # penalise completions cut off before the stop token (subtracted, not replacing the score as TRL's old
            # trainers did, so the reward still ranks them)
            contain_eos = torch.ones_like(scores, dtype=torch.bool)  # without a stop token every completion is complete
            if stop_token_id is not None:
                contain_eos = (responses == stop_token_id).any(1)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~contain_eos).float()
            # TRL's score scaling and clipping of the final score (the penalty included), of the scored completions;
            # the moments take this batch in before they scale it. objective/scores stays the unscaled score
            raw_scores = scores
            scores, score_moments = transform_scores(scores, scored, score_moments, args, reduce=reduce_sum)
            # end copy

            # 3. KL penalty: the per-token estimate (or the exact KL) against the reference, zero on padding, summed
            # over each completion and subtracted from its score
            ref_logprobs = pad_cat(ref_logprobs, INVALID_LOGPROB).masked_fill(padding_mask, INVALID_LOGPROB)
            if args.kl_estimator == "full":
                kl = pad_cat(full_kls, 0.0).masked_fill(padding_mask, 0.0)
            else:
                kl = kl_estimate(logprobs, ref_logprobs, args.kl_estimator).masked_fill(padding_mask, 0.0)
            non_score_reward = -args.kl_coef * kl.sum(1)
            rlhf_reward = scores + non_score_reward

            # 4. RLOO: advantages from the leave-one-out baseline
            advantages = rloo_advantages(rlhf_reward, args.rloo_k, scored)
            if args.normalize_advantage:  # over the scored completions; the others keep 0
                mean, std = advantages[scored].mean(), advantages[scored].std()
                advantages = ((advantages - mean) / (std + 1e-8)).nan_to_num(0.0).masked_fill(~scored, 0.0)
            seq_logprobs = logprobs.masked_fill(padding_mask, 0.0).sum(1)

        # 5. update: epochs x mini-batches x gradient-accumulation micro-batches
        policy.train(args.gradient_checkpointing)
        approxkl_stats = torch.zeros(stats_shape, device=device)
        clipfrac_stats = torch.zeros(stats_shape, device=device)
        pg_loss_stats = torch.zeros(stats_shape, device=device)
        entropy_stats = torch.zeros(stats_shape, device=device)
        ratio_stats = torch.zeros(stats_shape, device=device)
        ptx_stats = torch.zeros(stats_shape, device=device)
        skipped_stats = torch.zeros(stats_shape, device=device)
        for epoch in range(args.num_ppo_epochs):
            # shuffled by prompt, keeping each prompt's k rows together (so micro-batches can run each prompt once)
            b_inds = torch.randperm(args.local_prompts, device=device)[:, None] * args.rloo_k
            b_inds = (b_inds + torch.arange(args.rloo_k, device=device)).flatten()
            for mb, mb_start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
                mb_inds = b_inds[mb_start : mb_start + args.local_mini_batch_size]
                for ga, micro_start in enumerate(range(0, args.local_mini_batch_size, args.per_device_train_batch_size)):
                    with accelerator.accumulate(policy):
                        micro_inds = mb_inds[micro_start : micro_start + args.per_device_train_batch_size]
                        mb_padding = padding_mask[micro_inds]
                        logits = forward_grouped(
                            policy,
                            query_responses[micro_inds],
                            attention_mask[micro_inds],
                            context_length=context_length,
                            group=train_group,
                            logits_to_keep=width + 1,
                        )[:, :-1]
                        new_logprobs, entropy = logprobs_from_logits(
                            logits, responses[micro_inds], args.temperature, with_entropy=True
                        )
                        new_logprobs = new_logprobs.masked_fill(mb_padding, 0.0)
                        # the sequence-level ratio: RLOO treats a whole completion as one action
                        logprobs_diff = new_logprobs.sum(1) - seq_logprobs[micro_inds]
                        ratio = torch.exp(logprobs_diff)
                        mb_advantage = advantages[micro_inds]
                        pg_losses = -mb_advantage * ratio
                        pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
                        pg_loss = torch.max(pg_losses, pg_losses2).mean()
                        loss = pg_loss
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient
                        # (its backward still runs, so that every process takes part in each step)
                        skip = args.ratio_threshold is not None and ratio.mean() > args.ratio_threshold

                        # copy: ptx, backward and step
                        if ptx_texts is not None:  # LightRFT's PTX loss: next-token prediction on the PTX texts
                            ptx_ids, ptx_mask = ptx_batch(
                                ptx_texts, ptx_stream, args.per_device_train_batch_size, accelerator, tokenizer.pad_token_id
                            )
                            ptx_loss = lm_loss(forward(policy, ptx_ids, ptx_mask).logits, ptx_ids, ptx_mask)
                            loss = loss + args.ptx_coef * ptx_loss
                            ptx_stats[epoch, mb, ga] = ptx_loss.detach()
                        if not torch.isfinite(loss):
                            die(f"non-finite loss at update {update}; last good checkpoint: {last_checkpoint}")
                        accelerator.backward(loss * 0.0 if skip else loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                            # (None under DeepSpeed versions that clip inside their own step)
                            if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                                die(f"non-finite gradient at update {update}; last good checkpoint: {last_checkpoint}")
                        optimizer.step()
                        optimizer.zero_grad()
                        if ema is not None and accelerator.sync_gradients:  # after each optimiser step
                            ema.update_parameters(accelerator.unwrap_model(policy))
                        # end copy

                        with torch.no_grad():
                            approxkl_stats[epoch, mb, ga] = 0.5 * (logprobs_diff**2).mean()
                            clipfrac_stats[epoch, mb, ga] = (pg_losses2 > pg_losses).float().mean()
                            pg_loss_stats[epoch, mb, ga] = pg_loss
                            entropy_stats[epoch, mb, ga] = entropy.masked_fill(mb_padding, 0.0).sum() / (~mb_padding).sum()
                            ratio_stats[epoch, mb, ga] = ratio.mean()
                            skipped_stats[epoch, mb, ga] = float(skip)
        policy.eval()

        # logging: local statistics averaged over processes, written once
        with torch.no_grad():
            stats = {
                "objective/kl": kl.sum(1).mean(),
                "objective/entropy": (-logprobs).masked_fill(padding_mask, 0.0).sum(1).mean(),
                "objective/non_score_reward": non_score_reward.mean(),
                "objective/rlhf_reward": rlhf_reward.mean(),
                "val/response_length": lengths.float().mean(),
                "policy/approxkl_avg": approxkl_stats.mean(),
                "policy/clipfrac_avg": clipfrac_stats.mean(),
                "loss/policy_avg": pg_loss_stats.mean(),
                "policy/entropy_avg": entropy_stats.mean(),
                "val/ratio": ratio_stats.mean(),
                "val/ratio_var": ratio_stats.var(unbiased=False),
            }
            if ptx_texts is not None:
                stats["loss/ptx"] = ptx_stats.mean()
            if args.ratio_threshold is not None:  # the fraction of micro-batches skipped
                stats["policy/skipped_ratio_threshold"] = skipped_stats.mean()

        # copy: log the update
        means = accelerator.reduce(torch.stack(list(stats.values())), reduction="mean").tolist()
        num_eos = accelerator.reduce(contain_eos.float().sum(), reduction="sum").item()
        # the weighted score over the completions some source scored; each source's own statistics
        source_stats = reward_stats(accelerator, per_source, sources, scores=raw_scores, scored=scored)
        metrics = {"episode": episode, "eps": (episode - start_episode) / (time.time() - start_time), "lr": lr}
        metrics.update(zip(stats.keys(), means))
        metrics["val/num_eos_tokens"] = num_eos
        metrics.update(source_stats)
        if args.use_score_scaling:  # the running moments this update's scores were scaled with
            metrics["objective/score_mean_running"] = score_moments["mean"]
            metrics["objective/score_std_running"] = moments_std(score_moments)
        if args.response_length_min is not None:
            metrics["completions/max_length_allowed"] = max_length
        # end copy

        # copy: write the metrics
        if accelerator.is_main_process:
            with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")
            for key, value in metrics.items():
                writer.add_scalar(key, value, episode)
            if sample_every and (update - 1) % sample_every == 0:
                print_samples(
                    f"update {update}",
                    prompts=texts[:4],
                    completions=tokenizer.batch_decode(responses[:4], skip_special_tokens=True),
                    per_source=per_source,
                    sources=sources,
                    scores=raw_scores,
                    scored=scored,
                )
        if args.log_completions:
            write_completions(
                accelerator,
                args,
                episode=episode,
                update=update,
                prompts=texts,
                completions=tokenizer.batch_decode(responses, skip_special_tokens=True),
                per_source=per_source,
                sources=sources,
                scores=raw_scores.masked_fill(~scored, float("nan")),
                advantages=advantages,
            )
        # end copy
        # end copy

        # evaluate every eval_every episodes and at the end, before the checkpoint (which then follows every row)
        crossed = args.eval_every and episode // args.eval_every > (episode - args.batch_size) // args.eval_every
        if update == args.num_updates or crossed:
            evaluate_and_record(episode)

        # copy: checkpoint
        # after the metrics row, so a resumed run never repeats or loses one; written whole to a .tmp folder (accelerate
        # writes the weights, the optimiser, every process's random state, the registered streams, and under DeepSpeed
        # each process's shards), then renamed
        if args.checkpoint_every and update % args.checkpoint_every == 0:
            finite = all(torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in policy.parameters())  # (ZeRO-3: shard)
            if accelerator.reduce(torch.tensor(float(finite), device=device), reduction="sum") < args.world_size:
                die(f"non-finite weights at update {update}; no checkpoint written")
            last_checkpoint = os.path.join(args.output_dir, f"checkpoint-{update:07d}")
            if accelerator.is_main_process:
                shutil.rmtree(last_checkpoint + ".tmp", ignore_errors=True)
            accelerator.wait_for_everyone()
            accelerator.save_state(last_checkpoint + ".tmp")
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                state = {"update": update, "episode": episode, "score_moments": score_moments}
                torch.save(state, os.path.join(last_checkpoint + ".tmp", "state.pt"))
                shutil.rmtree(last_checkpoint, ignore_errors=True)
                os.replace(last_checkpoint + ".tmp", last_checkpoint)
                for old in sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*[0-9]")))[: -args.keep_checkpoints]:
                    shutil.rmtree(old, ignore_errors=True)
            accelerator.wait_for_everyone()
        # end copy

    if args.save_model:
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(policy)
        if args.use_peft:  # the adapters alone (peft's PeftModel.from_pretrained(base, output_dir)), or merged
            unwrapped = unwrapped.merge_and_unload() if args.merge_lora else unwrapped
            unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process)
        else:
            unwrapped.save_pretrained(
                args.output_dir,
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict=accelerator.get_state_dict(policy),
            )

    # copy: save (model_name_or_path->sft_model_path)
    # the average's weights in the trained policy's place (its training is over; there is no LoRA with an EMA, so
    # `unwrapped` is the policy itself), saved alike
    if args.save_model and ema is not None:
        with torch.no_grad():
            for p, average in zip(unwrapped.parameters(), ema.module.parameters()):
                p.copy_(average)
        unwrapped.save_pretrained(
            os.path.join(args.output_dir, "ema"),
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
        )
    if accelerator.is_main_process:
        writer.close()
        if args.save_model:
            tokenizer.save_pretrained(args.output_dir)
            if ema is not None:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "ema"))
            write_model_card(
                args, script=__file__, algorithm=ALGORITHM, doc=__doc__, base_model=args.sft_model_path, sources=sources
            )
        if args.push_to_hub:  # last of all: a failed upload leaves the saved model as it is
            push_to_hub(args.output_dir, repo_id=args.hub_model_id, private=args.hub_private)
    # every process leaves the process group together, once the main process has written everything: a two-process
    # ZeRO-3 run sometimes aborted in the other process as it exited while the main one was still saving
    accelerator.wait_for_everyone()
    accelerator.end_training()
    # end copy
    if accelerator.is_main_process:
        print(
            f"judge the final summaries against the references: python benchmark/judge_tldr.py --samples {args.output_dir}"
            " --judge_base_url https://api.openai.com/v1 --judge_model gpt-4o-mini"
        )
