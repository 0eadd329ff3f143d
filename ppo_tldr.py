"""PPO on the TL;DR summarisation benchmark: a Pythia SFT policy learns to write Reddit TL;DRs that a reward model
prefers, evaluated by that reward model during training; an LLM judge compares the summaries it writes with the
reference summaries afterwards (benchmark/judge_tldr.py).

The algorithm is ppo.py's (a critic initialised from the reward model, per-token KL penalty, the score on one token,
GAE, clipped policy and value losses); this file adds the TL;DR setup (Stiennon et al. 2020) as the N+ implementation
details study (Huang et al. 2024, https://arxiv.org/abs/2403.17031) and TRL's benchmark ran it: responses of at most
53 tokens sampled at temperature 0.7, a penalty of 1 for a summary without EOS, the score one token past EOS as TRL's
PPOTrainer placed it, and evaluation of greedy summaries on the validation split.

Reproduce the 1B run (8 GPUs; see README.md for the expected win rates):
    accelerate launch --config_file configs/deepspeed_zero2.yaml ppo_tldr.py --output_dir output/ppo_tldr \
        --eval_long_prompts truncate
    python benchmark/judge_tldr.py --samples output/ppo_tldr --judge_base_url https://api.openai.com/v1 \
        --judge_model gpt-4o-mini --protocol trl --num_examples 1000
On one GPU (same global batch, 8x the gradient accumulation):
    python ppo_tldr.py --gradient_accumulation_steps 32
"""

import copy
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import torch
import tyro
from safetensors.torch import save_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import infra
import utils

ALGORITHM = "PPO"


@dataclass
class Args(infra.RunArgs):  # RunArgs (infra.py): the flags every script shares (seed, outputs, LoRA, EMA, PTX)
    # algorithm
    # copy: ppo algorithm
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
    # end copy
    score_position: Literal["eos", "after_eos"] = "after_eos"
    """the token the score is added to: the last real one (the stop token), or one past it as TRL's PPOTrainer did in
    the published run"""
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

    # optimisation (the published run: 8 processes, 512 completions per update)
    total_episodes: int = 999_424
    """total completions to train on, a multiple of the batch (999,424: 244 batches of 4,096 or 1,952 of 512, TRL's
    1,000,000 rounded to a whole number of the 8-GPU batches)"""
    per_device_train_batch_size: int = 16
    """completions per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 4
    """micro-batches accumulated per optimiser step"""
    num_mini_batches: int = 1
    """optimiser steps per epoch over the batch"""
    num_ppo_epochs: int = 4
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
    """prompts per update on each process (one completion each)"""


# copy: ppo functions
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


class KLCoef:
    """The KL coefficient, which --kl_target adapts after each update: state_dict and load_state_dict let accelerate's
    checkpoints hold it (register_for_checkpointing), so that a resumed run goes on with the one it had."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


# end copy


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    accelerator = infra.setup(args)  # the processes, the batch sizes (into args), the shared flags' checks, seeding

    # copy: ppo checks
    # k1 sums to the sequence log-ratio, unbiased in the reward; in the loss E_p[grad log p] = 0 leaves it no gradient
    if args.kl_estimator is None:
        args.kl_estimator = "k1" if args.kl_penalty == "reward" else "k2"
    if args.kl_penalty == "loss" and args.kl_estimator == "k1":
        utils.die("--kl_penalty loss needs --kl_estimator k2 or k3 (or abs): k1's gradient is zero in expectation")
    if args.kl_penalty == "loss" and args.kl_estimator == "full":
        # the update would need the reference's logits too; k2's gradient is the exact KL's in expectation anyway
        utils.die(
            "--kl_penalty loss cannot use --kl_estimator full (it needs the reference's logits); use k2 (the same gradient)"
        )
    if args.kl_target is not None and (args.kl_target <= 0 or args.kl_horizon <= 0):
        utils.die("--kl_target and --kl_horizon must be positive")
    if args.value_head_shared and args.value_model_path:
        utils.die("--value_model_path loads a separate critic; it cannot be used with --value_head_shared")
    if not 0 <= args.critic_warmup_updates < args.num_updates:
        utils.die(
            f"--critic_warmup_updates must be >= 0 and below the run's {args.num_updates} updates, or the policy never trains"
        )
    if args.critic_warmup_updates and args.value_head_shared:
        utils.die("--critic_warmup_updates needs a separate critic: with --value_head_shared the value loss trains the policy")
    k = 1  # PPO: one completion per prompt (rloo.py's prompt draw with k = 1)
    args.local_prompts = args.local_batch_size
    # end copy
    if args.eval_every < 0 or args.eval_examples < 1 or args.eval_batch_size < 1:
        utils.die("--eval_every must be >= 0, --eval_examples and --eval_batch_size >= 1")

    run_name = infra.open_output_dir(args)  # refuses a --resume that would change the run
    device = accelerator.device

    # copy: tldr prompts and rewards
    # tokenizer, prompts (and the eval split's, with their reference summaries) and rewards
    tokenizer = infra.load_tokenizer(args.sft_model_path, args.trust_remote_code)
    stop_token_id = args.stop_token_id
    if stop_token_id is None and args.stop_token == "eos":
        stop_token_id = tokenizer.eos_token_id
        if stop_token_id is None:
            utils.die(f"tokenizer of {args.sft_model_path!r} has no EOS token; set --stop_token_id or --stop_token None")
    load = partial(infra.load_prompts, args.dataset_name, prompt_field=args.prompt_field, tokenizer=tokenizer)
    queries_all, prompt_texts, _, columns = load(split=args.dataset_split, max_prompt_length=args.max_prompt_length)
    eval_queries, eval_texts, eval_refs, _ = load(
        split=args.eval_split,
        max_prompt_length=args.max_prompt_length,
        reference_field=args.reference_field,
        long_prompts=args.eval_long_prompts,
    )
    first = slice(args.eval_examples)
    eval_set = (eval_queries[first], eval_texts[first], eval_refs[first], {})  # the reward model reads no columns
    # the reward sources, in --reward_weights' order: the TL;DR reward model (also the evaluation's), then functions
    sources = infra.load_reward_sources(args, tokenizer, columns=columns, reward_model_paths=[args.reward_model_path])
    ptx_texts = infra.load_ptx(args, tokenizer) if args.ptx_coef > 0 else None
    # end copy

    # copy: policy, reference and critic (model_name_or_path->sft_model_path)
    policy = infra.load_pretrained(AutoModelForCausalLM, args.sft_model_path, args.trust_remote_code)
    # PPO: the critic starts from --value_model_path, else as the N+ details study from the (first) reward model if it
    # reads the policy's tokens, else from the policy's trunk with a new head; none with --value_head_shared
    rm_critic = not args.value_model_path and "model" in sources[0] and sources[0]["tokenizer"] is None
    # a family the scripts cannot run (or whose trunk cannot carry a critic) stops here, with one line
    utils.check_model(policy, critic=not (args.value_head_shared or args.value_model_path or rm_critic))
    # the frozen initial policy; none with LoRA (the policy with its adapters switched off). Under ZeRO-3 the
    # weights are sharded as they load, so the reference is loaded anew rather than copied
    if args.use_peft:
        ref_policy = None
    elif infra.zero3(accelerator):
        ref_policy = infra.load_pretrained(AutoModelForCausalLM, args.sft_model_path, args.trust_remote_code)
    else:
        ref_policy = copy.deepcopy(policy)
    if ref_policy is not None:
        ref_policy.eval().requires_grad_(False)
    # PPO: the critic, a sequence-classification model whose score head reads every position (under ZeRO-3 loaded
    # anew, as the reference)
    critic = None
    if args.value_model_path:
        critic = infra.load_pretrained(AutoModelForSequenceClassification, args.value_model_path, args.trust_remote_code)
    elif not args.value_head_shared and rm_critic:
        if infra.zero3(accelerator):
            critic = infra.load_pretrained(AutoModelForSequenceClassification, sources[0]["path"], args.trust_remote_code)
        else:
            critic = copy.deepcopy(sources[0]["model"]).requires_grad_(True)
    elif not args.value_head_shared:
        if infra.zero3(accelerator):
            critic = infra.load_pretrained(
                AutoModelForSequenceClassification, args.sft_model_path, args.trust_remote_code, num_labels=1
            )
        else:
            config = copy.deepcopy(policy.config)
            config.num_labels = 1
            critic = AutoModelForSequenceClassification.from_config(config)
            getattr(critic, critic.base_model_prefix).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
        utils.init_value_head(critic.score, getattr(critic.config, "initializer_range", 0.02), args.seed)  # as transformers
    if critic is not None and critic.config.num_labels != 1:
        utils.die(f"value model {args.value_model_path!r} has num_labels={critic.config.num_labels}; it must be 1")
    if args.use_peft:  # after the critic took a copy of the trunk
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            utils.die("--use_peft needs the peft package: pip install peft")
        policy = get_peft_model(policy, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear"))
    # one module, so that one optimiser and one DDP or DeepSpeed wrapper hold both; no dropout: the sampling policy and
    # the one being trained must be the same function
    model = utils.PolicyAndValue(policy, critic, args.seed).eval()
    if args.gradient_checkpointing:
        # Transformers checkpoints only in train mode, so the update runs in train mode with every dropout at zero
        utils.disable_dropout(model)
        for module in (policy, critic):
            if module is not None:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # end copy

    # copy: ppo optimiser and state
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters and the critic
    # fused: one kernel updates every parameter (about 4x the default's speed on a 2-core CPU), as transformers' Trainer
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=1e-5, weight_decay=0.0, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # the frozen models on the device; under ZeRO-3 sharded over the processes as inference engines instead
    ref_policy = infra.prepare_frozen(accelerator, ref_policy)
    for source in sources:
        if "model" in source:
            source["model"] = infra.prepare_frozen(accelerator, source["model"])
    # the prompts, drawn without replacement from a reshuffle per pass, the same on every process (each takes its own
    # slice), and the sampling noise drawn from the same generator; the PTX texts have a stream of their own, so the
    # prompts are the same with or without them. accelerate's checkpoints hold every object registered here
    data = infra.Shuffled(len(queries_all), args.seed)
    accelerator.register_for_checkpointing(data)
    if ptx_texts is not None:
        ptx_stream = infra.Shuffled(len(ptx_texts), args.seed)
        accelerator.register_for_checkpointing(ptx_stream)
    ema = None
    if args.ema_beta is not None:  # LightRFT: an exponential moving average of the policy's weights (not the critic's)
        ema = AveragedModel(
            accelerator.unwrap_model(model).policy,
            device="cpu" if args.ema_cpu else None,
            multi_avg_fn=get_ema_multi_avg_fn(args.ema_beta),
        )
        ema.update_parameters(accelerator.unwrap_model(model).policy)  # the first call copies: the average starts here
        accelerator.register_for_checkpointing(ema)
    kl_coef = KLCoef(args.kl_coef)
    accelerator.register_for_checkpointing(kl_coef)
    reduce_sum = partial(accelerator.reduce, reduction="sum")  # batch statistics over all processes
    # --use_vllm: a vLLM engine in this process samples the rollouts, given the policy's weights before each one
    engine = infra.vllm_engine(accelerator, args, accelerator.unwrap_model(model).policy) if args.use_vllm else None
    score_moments = utils.new_moments()  # --use_score_scaling: every score so far, on all processes
    start_update, episode, last_checkpoint = 1, 0, None
    if args.resume:  # the weights, optimiser, every process's random state and the objects above, then the counters
        state = infra.resume(accelerator, args)
        score_moments, start_update, episode = state["score_moments"], state["update"] + 1, state["episode"]
        last_checkpoint = state["checkpoint"]
    # end copy

    # copy: tldr logs and evaluation (policy->model)
    writer = infra.open_logs(accelerator, args, run_name, episode)  # args.json, TensorBoard and wandb
    sample_every = max(1, args.num_updates // args.num_sample_generations) if args.num_sample_generations else 0

    def evaluate_and_record(episode):
        """greedy summaries of the eval prompts scored by the reward model: a metrics row, and the samples that
        benchmark/judge_tldr.py judges after the run"""
        eval_metrics, samples = infra.evaluate(
            accelerator,
            model=model,
            tokenizer=tokenizer,
            sources=sources[:1],  # the reward model
            eval_set=eval_set,
            response_length=args.response_length,
            stop_token_id=stop_token_id,
            batch_size=args.eval_batch_size,
        )
        if accelerator.is_main_process:
            infra.record_eval(args.output_dir, episode=episode, metrics=eval_metrics, samples=samples, writer=writer)

    if not args.resume:  # the SFT model's evaluation, the baseline of the curves
        evaluate_and_record(episode)
    # end copy

    # copy: rows, sampling and scoring
    # a prompt's k completions run the prompt once (utils.generate, utils.forward_grouped) where every chunk of rows
    # holds whole prompts
    rollout_group = k if args.local_rollout_forward_batch_size % k == 0 else 1

    def prompt_rows(idx):
        """The rows of the prompts idx: queries and their mask (prompts * k, query_len), left-padded, where row j * k + i
        is the i-th completion of prompt j (a prompt's k rows adjacent, so the forward passes can run each prompt once),
        and the rows' prompt texts and dataset columns"""
        queries, query_mask = utils.left_pad([queries_all[i] for i in idx], tokenizer.pad_token_id)
        texts = [prompt_texts[i] for i in idx for _ in range(k)]
        row_columns = {name: [values[i] for i in idx for _ in range(k)] for name, values in columns.items()}
        return queries.repeat_interleave(k, 0).to(device), query_mask.repeat_interleave(k, 0).to(device), texts, row_columns

    def sample(model, queries, query_mask, uniforms, seeds, max_length):
        """the rows' completions, and the vLLM engine's logprobs of them with --use_vllm (utils.sample_completions)"""
        return utils.sample_completions(
            model,
            engine,
            queries,
            query_mask,
            k=k,
            max_length=max_length,
            temperature=args.temperature,
            stop_token_id=stop_token_id,
            pad_token_id=tokenizer.pad_token_id,
            uniforms=uniforms,
            seeds=seeds,
            chunk=args.local_rollout_forward_batch_size,
            group=rollout_group,
            synced=infra.zero3(accelerator),
        )

    def score(queries, query_mask, completions, texts, row_columns):
        """the completions truncated after the stop token, their lengths and every source's scores (sources, rows)"""
        return utils.score_completions(
            sources,
            tokenizer,
            queries,
            query_mask,
            completions,
            prompts=texts,
            columns=row_columns,
            stop_token_id=stop_token_id,
            chunk=args.local_rollout_forward_batch_size,
        )

    # end copy

    # copy: ppo loop
    stats_shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
    start_episode, start_time = episode, time.time()
    for update in tqdm(
        range(start_update, args.num_updates + 1),
        initial=start_update - 1,
        total=args.num_updates,
        disable=not accelerator.is_local_main_process,
    ):
        episode += args.batch_size
        lr = (1.0 - (update - 1.0) / args.num_updates) * args.learning_rate
        warmup = update <= args.critic_warmup_updates  # only the critic learns
        for group in optimizer.param_groups:
            group["lr"] = lr
        # end copy

        # copy: draw prompts
        # this process's share of the next global batch of prompts, and the noise that samples their completions
        idx, uniforms, max_length, seeds = infra.draw_prompts(data, args, k, accelerator.process_index)
        # end copy
        if engine is not None:  # --use_vllm: the engine samples with the policy's weights of now
            utils.vllm_sync(engine, accelerator.unwrap_model(model).policy)

        # copy: prompt rows
        queries, query_mask, texts, batch_columns = prompt_rows(idx)  # (prompts * k, query_len), a prompt's k adjacent
        context_length = queries.shape[1]
        # end copy

        # copy: ppo rollout
        # autocast (a no-op without mixed precision) also covers the reference and reward models, which prepare() did not
        # wrap: at the first update the policy and the reference then give identical logprobs
        with torch.no_grad(), accelerator.autocast():
            unwrapped = accelerator.unwrap_model(model)
            # 1. completions: the vLLM engine's (--use_vllm), else sampled here
            sampled, engine_logprobs = sample(unwrapped.policy, queries, query_mask, uniforms, seeds, max_length)

            # 2. truncated after the stop token (everything after it is padding) and scored: each reward source's
            # (sources, rows), NaN where one returned None; reward models read the last real token, functions the
            # decoded text and the rows' dataset columns
            responses, lengths, per_source = score(queries, query_mask, sampled, texts, batch_columns)

            # copy: rollout masks
            width = responses.shape[1]
            padding_mask = torch.arange(width, device=device)[None, :] >= lengths[:, None]  # True on padding
            query_responses = torch.cat([queries, responses], 1)
            attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
            # end copy

            logprobs, ref_logprobs, full_kls, values = [], [], [], []
            for i in range(0, len(queries), args.local_rollout_forward_batch_size):
                # copy: a chunk of the rollout
                # a chunk of rows, only as wide as its longest completion
                rows = slice(i, i + args.local_rollout_forward_batch_size)
                end = context_length + int(lengths[rows].max())
                query_response, mask = query_responses[rows, :end], attention_mask[rows, :end]
                response = query_response[:, context_length:]
                # end copy
                # logprobs of the distribution sampled from (logits / temperature), and the critic's values
                logits, value = unwrapped(query_response, mask, logits_to_keep=response.shape[1] + 1)
                logits = logits[:, :-1]
                logprobs.append(utils.logprobs_from_logits(logits, response, args.temperature))
                # the value of the state before each response token, and one column more: a row that stops at the
                # chunk's last column has there its value after EOS (the critic at the stop token; --score_position
                # after_eos reads it)
                values.append(value[:, context_length - 1 :])
                with utils.reference_model(unwrapped.policy, ref_policy) as ref:  # with LoRA, the policy without its adapters
                    ref_logits = utils.forward(ref, query_response, mask, logits_to_keep=response.shape[1] + 1).logits[:, :-1]
                ref_logprobs.append(utils.logprobs_from_logits(ref_logits, response, args.temperature))
                if args.kl_estimator == "full":  # the exact KL, while both models' logits are at hand
                    full_kls.append(utils.full_kl(logits, ref_logits, args.temperature))
                del logits, ref_logits  # (chunk, width, vocab) each: freed before the next chunk allocates its own
            # end copy

            # copy: gather the rollout
            # chunks may stop at different lengths: each padded to the longest
            logprobs = utils.pad_cat(logprobs, utils.INVALID_LOGPROB).masked_fill(padding_mask, utils.INVALID_LOGPROB)
            # the weighted sum over the sources that scored each completion; one that none scored takes no part below
            scores, scored = utils.weighted_scores(per_source, sources)

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
            scores, score_moments = utils.transform_scores(scores, scored, score_moments, args, reduce=reduce_sum)
            # end copy

            # copy: ppo advantages
            # the values kept (value_mask, below) are the critic's at real tokens, the stop token at most, so they do not
            # depend on the padding and equal the update's vpred; the widest chunks' extra column lies past the batch
            values = utils.pad_cat(values, 0.0)[:, :width]

            # 3. KL penalty: per-token estimate (or exact KL) against the reference, zero on padding, in each token's reward
            ref_logprobs = utils.pad_cat(ref_logprobs, utils.INVALID_LOGPROB).masked_fill(padding_mask, utils.INVALID_LOGPROB)
            if args.kl_estimator == "full":
                kl = utils.pad_cat(full_kls, 0.0).masked_fill(padding_mask, 0.0)
            else:
                kl = utils.kl_estimate(logprobs, ref_logprobs, args.kl_estimator).masked_fill(padding_mask, 0.0)
            non_score_reward = -kl_coef.value * kl if args.kl_penalty == "reward" else torch.zeros_like(kl)
            # PPO: the score on one token (--score_position), the KL penalty on every token
            rewards, value_mask = place_scores(non_score_reward, scores, lengths, args.score_position)
            rlhf_reward = rewards.sum(1)
            # a completion that no reward source scored takes no part in the update: no value target, no advantage
            value_mask = value_mask & scored[:, None]
            train_mask = ~padding_mask & scored[:, None]
            if args.whiten_rewards:
                rewards = utils.masked_whiten(rewards, value_mask, False, reduce_sum).masked_fill(~value_mask, 0.0)

            # 4. advantages: GAE over real tokens, then whitened over those of all processes
            values = values.masked_fill(~value_mask, 0.0)
            advantages, returns = compute_gae(rewards, values, args.gamma, args.lam)
            advantages = utils.masked_whiten(advantages, train_mask, reduce=reduce_sum).masked_fill(~train_mask, 0.0)

            # --use_vllm: the engine sampled; each token's (or completion's) probability under the trainer over the
            # engine's, truncated or masked (--vllm_importance_sampling_mode), weighs its policy loss
            is_weight = torch.ones_like(logprobs)
            if engine is not None:
                is_weight, vllm_stats = utils.importance_weights(
                    logprobs,
                    engine_logprobs,
                    padding_mask,
                    mode=args.vllm_importance_sampling_mode or "token_truncate",
                    clip_min=args.vllm_importance_sampling_clip_min,
                    clip_max=args.vllm_importance_sampling_clip_max,
                )
                is_weight = is_weight.reshape(len(is_weight), -1)  # (rows, width), or (rows, 1) for a completion's
            # end copy

        # copy: ppo update
        # 5. update: epochs x mini-batches x gradient-accumulation micro-batches
        model.train(args.gradient_checkpointing)
        approxkl_stats = torch.zeros(stats_shape, device=device)
        pg_clipfrac_stats = torch.zeros(stats_shape, device=device)
        pg_loss_stats = torch.zeros(stats_shape, device=device)
        vf_loss_stats = torch.zeros(stats_shape, device=device)
        vf_clipfrac_stats = torch.zeros(stats_shape, device=device)
        entropy_stats = torch.zeros(stats_shape, device=device)
        ratio_stats = torch.zeros(stats_shape, device=device)
        ptx_stats = torch.zeros(stats_shape, device=device)
        skipped_stats = torch.zeros(stats_shape, device=device)
        for epoch in range(args.num_ppo_epochs):
            b_inds = torch.randperm(args.local_batch_size, device=device)
            for mb, mb_start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
                mb_inds = b_inds[mb_start : mb_start + args.local_mini_batch_size]
                for ga, micro_start in enumerate(range(0, args.local_mini_batch_size, args.per_device_train_batch_size)):
                    with accelerator.accumulate(model):
                        micro_inds = mb_inds[micro_start : micro_start + args.per_device_train_batch_size]
                        mb_mask, mb_value_mask = train_mask[micro_inds], value_mask[micro_inds]
                        logits, vpred = model(query_responses[micro_inds], attention_mask[micro_inds], width + 1)
                        logits = logits[:, :-1]
                        vpred = vpred[:, context_length - 1 : -1].masked_fill(~mb_value_mask, 0.0)
                        new_logprobs, entropy = utils.logprobs_from_logits(
                            logits, responses[micro_inds], args.temperature, with_entropy=True
                        )
                        new_logprobs = new_logprobs.masked_fill(~mb_mask, utils.INVALID_LOGPROB)

                        # PPO: the per-token ratio, clipped; the critic's loss clipped around the rollout's values
                        logprobs_diff = new_logprobs - logprobs[micro_inds]
                        ratio = torch.exp(logprobs_diff)
                        mb_advantage = advantages[micro_inds]
                        pg_losses = -mb_advantage * ratio
                        pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
                        pg_loss = utils.masked_mean(torch.max(pg_losses, pg_losses2) * is_weight[micro_inds], mb_mask)
                        vf_loss, vf_clipfrac = value_loss(
                            vpred,
                            values=values[micro_inds],
                            returns=returns[micro_inds],
                            mask=mb_value_mask,
                            cliprange_value=args.cliprange_value,
                        )
                        # in the critic's warm-up the policy's losses count zero times: still in the graph, so DDP
                        # finds a gradient for every parameter
                        policy_weight = 0.0 if warmup else 1.0
                        loss = policy_weight * pg_loss + args.vf_coef * vf_loss
                        if args.kl_penalty == "loss":
                            kl_loss = utils.kl_estimate(new_logprobs, ref_logprobs[micro_inds], args.kl_estimator)
                            loss = loss + policy_weight * kl_coef.value * utils.masked_mean(kl_loss, mb_mask)

                        if ptx_texts is not None:  # LightRFT's PTX loss: next-token prediction on the PTX texts
                            ptx_ids, ptx_mask = infra.ptx_batch(
                                ptx_texts, ptx_stream, args.per_device_train_batch_size, accelerator, tokenizer.pad_token_id
                            )
                            # the policy's logits alone, through the wrapper that DDP or DeepSpeed runs
                            ptx_loss = utils.lm_loss(model(ptx_ids, ptx_mask, 0, policy_only=True), ptx_ids, ptx_mask)
                            loss = loss + policy_weight * args.ptx_coef * ptx_loss
                            ptx_stats[epoch, mb, ga] = ptx_loss.detach()
                        if not torch.isfinite(loss):
                            utils.die(f"non-finite loss at update {update}; last good checkpoint: {last_checkpoint}")
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient,
                        # to the critic either (whose loss reaches the policy's trunk with --value_head_shared); its
                        # backward still runs, so that every process takes part in each step
                        skip = args.ratio_threshold is not None and utils.masked_mean(ratio, mb_mask) > args.ratio_threshold
                        accelerator.backward(loss * 0.0 if skip else loss)
                        if accelerator.sync_gradients:
                            if warmup and accelerator.state.deepspeed_plugin is None:
                                # no gradient rather than a zero one: AdamW then skips the policy, leaving its moments
                                # and step count as they were, so that its first step after the warm-up is Adam's first
                                for p in accelerator.unwrap_model(model).policy.parameters():
                                    p.grad = None
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            # (None under DeepSpeed versions that clip inside their own step)
                            if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                                utils.die(f"non-finite gradient at update {update}; last good checkpoint: {last_checkpoint}")
                        optimizer.step()
                        optimizer.zero_grad()
                        if ema is not None and accelerator.sync_gradients:  # after each optimiser step
                            ema.update_parameters(accelerator.unwrap_model(model).policy)

                        with torch.no_grad():
                            approxkl_stats[epoch, mb, ga] = 0.5 * utils.masked_mean(logprobs_diff**2, mb_mask)
                            pg_clipfrac_stats[epoch, mb, ga] = utils.masked_mean((pg_losses2 > pg_losses).float(), mb_mask)
                            pg_loss_stats[epoch, mb, ga] = pg_loss
                            vf_loss_stats[epoch, mb, ga] = vf_loss
                            vf_clipfrac_stats[epoch, mb, ga] = vf_clipfrac
                            entropy_stats[epoch, mb, ga] = utils.masked_mean(entropy, mb_mask)
                            ratio_stats[epoch, mb, ga] = utils.masked_mean(ratio, mb_mask)
                            skipped_stats[epoch, mb, ga] = float(skip)
            # --target_kl: every process must agree to stop, so the decision uses the mean over processes
            if args.target_kl is not None:
                if accelerator.reduce(approxkl_stats[epoch].mean(), reduction="mean").item() > args.target_kl:
                    break
        model.eval()

        # logging: local statistics averaged over processes, written once
        with torch.no_grad():
            done = slice(0, epoch + 1)  # the epochs that ran
            stats = {
                "objective/kl": kl.sum(1).mean(),
                "objective/entropy": (-logprobs).masked_fill(padding_mask, 0.0).sum(1).mean(),
                "objective/non_score_reward": non_score_reward.sum(1).mean(),
                "objective/rlhf_reward": rlhf_reward.mean(),
                "val/response_length": lengths.float().mean(),
                "policy/approxkl_avg": approxkl_stats[done].mean(),
                "policy/clipfrac_avg": pg_clipfrac_stats[done].mean(),
                "loss/policy_avg": pg_loss_stats[done].mean(),
                "loss/value_avg": vf_loss_stats[done].mean(),
                "val/clipfrac_avg": vf_clipfrac_stats[done].mean(),
                "policy/entropy_avg": entropy_stats[done].mean(),
                "val/ratio": ratio_stats[done].mean(),
                "val/ratio_var": ratio_stats[done].var(unbiased=False),
                "val/vpred": utils.masked_mean(values, value_mask),
            }
            if ptx_texts is not None:
                stats["loss/ptx"] = ptx_stats[done].mean()
            if args.ratio_threshold is not None:  # the fraction of micro-batches skipped
                stats["policy/skipped_ratio_threshold"] = skipped_stats[done].mean()
            if engine is not None:  # how far the engine's logprobs are from the trainer's
                stats.update(vllm_stats)
            # end copy

        # copy: log the update
        num_eos = accelerator.reduce(contain_eos.float().sum(), reduction="sum").item()
        # the weighted score over the completions some source scored; each source's own statistics
        source_stats = infra.reward_stats(accelerator, per_source, sources, scores=raw_scores, scored=scored)
        metrics = {"episode": episode, "eps": (episode - start_episode) / (time.time() - start_time), "lr": lr}
        metrics.update(infra.reduce_stats(accelerator, stats))  # means over the processes (maxima: their max)
        metrics["val/num_eos_tokens"] = num_eos
        metrics.update(source_stats)
        if args.use_score_scaling:  # the running moments this update's scores were scaled with
            metrics["objective/score_mean_running"] = score_moments["mean"]
            metrics["objective/score_std_running"] = utils.moments_std(score_moments)
        if args.response_length_min is not None:
            metrics["completions/max_length_allowed"] = max_length
        # end copy

        # copy: ppo metrics
        # PPO: the KL coefficient this update used, and whether only the critic learnt (its warm-up)
        metrics["objective/kl_coef"] = kl_coef.value
        if args.critic_warmup_updates:
            metrics["policy/critic_warmup"] = float(warmup)
        completion_advantages = utils.masked_mean(advantages, train_mask, dim=1)  # --log_completions: each completion's mean
        # end copy

        # copy: write the metrics (advantages=advantages->advantages=completion_advantages)
        infra.log_metrics(accelerator, writer, args, metrics)
        if accelerator.is_main_process and sample_every and (update - 1) % sample_every == 0:
            infra.print_samples(
                f"update {update}",
                prompts=texts[:4],
                completions=tokenizer.batch_decode(responses[:4], skip_special_tokens=True),
                per_source=per_source,
                sources=sources,
                scores=raw_scores,
                scored=scored,
            )
        if args.log_completions:
            infra.write_completions(
                accelerator,
                args,
                episode=episode,
                update=update,
                prompts=texts,
                completions=tokenizer.batch_decode(responses, skip_special_tokens=True),
                per_source=per_source,
                sources=sources,
                scores=raw_scores.masked_fill(~scored, float("nan")),
                advantages=completion_advantages,
            )
        # end copy

        # copy: ppo adaptive kl
        # Ziegler et al.: adapt the KL coefficient to the KL measured in this update (held while the policy is)
        if args.kl_target is not None and not warmup:
            kl_coef.value = adaptive_kl_coef(
                kl_coef.value,
                kl=metrics["objective/kl"],
                kl_target=args.kl_target,
                kl_horizon=args.kl_horizon,
                n_steps=args.batch_size,
            )
        # end copy

        # evaluate every eval_every episodes and at the end, before the checkpoint (which then follows every row)
        crossed = args.eval_every and episode // args.eval_every > (episode - args.batch_size) // args.eval_every
        if update == args.num_updates or crossed:
            evaluate_and_record(episode)

        # after the metrics row, so that a resumed run neither repeats nor loses one; complete or absent (written,
        # then renamed)
        if args.checkpoint_every and update % args.checkpoint_every == 0:
            state = {"update": update, "episode": episode, "score_moments": score_moments}
            last_checkpoint = infra.checkpoint(accelerator, model, args, update, state=state)

    # copy: ppo save
    if args.save_model:
        accelerator.wait_for_everyone()
        # PPO: the policy's and the critic's weights from the one module (under ZeRO-3 gathered on the main process only)
        state_dict = accelerator.get_state_dict(model) or {}
        unwrapped, critic = accelerator.unwrap_model(model).policy, accelerator.unwrap_model(model).critic
        if args.use_peft:  # the adapters alone (peft's PeftModel.from_pretrained(base, output_dir)), or merged
            unwrapped = unwrapped.merge_and_unload() if args.merge_lora else unwrapped
            unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process)
        else:
            unwrapped.save_pretrained(
                args.output_dir,
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict={k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")},
            )
        if critic is not None:  # a sequence-classification model, which --value_model_path loads
            critic.save_pretrained(
                os.path.join(args.output_dir, "critic"),
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict={k[len("critic.") :]: v for k, v in state_dict.items() if k.startswith("critic.")},
            )
        elif accelerator.is_main_process:  # --value_head_shared: the head alone
            head = {k: v.contiguous() for k, v in state_dict.items() if k.startswith("value_head.")}
            save_file(head, os.path.join(args.output_dir, "value_head.safetensors"))
    # end copy

    # the EMA, the tokenizer, the model card, the hub
    card = dict(script=__file__, algorithm=ALGORITHM, doc=__doc__, base_model=args.sft_model_path, sources=sources)
    infra.finish(accelerator, args, writer=writer, tokenizer=tokenizer, ema=ema, card=card, engine=engine)
    if accelerator.is_main_process:
        print(
            f"judge the final summaries against the references: python benchmark/judge_tldr.py --samples {args.output_dir}"
            " --judge_base_url https://api.openai.com/v1 --judge_model gpt-4o-mini"
        )
