"""Datasets and prompts: where a model or dataset argument is (a local path refused at once where it is missing),
reading a dataset (a file that does not parse named by its line), rendering prompts (chat templates, tools' schemas)
and dataset completions, the prompts' draw and its noise (Shuffled, draw_prompts), the held-out set, the PTX texts,
and the helpers that pad, cut and gather a batch's rows (and distill.py's teacher_view: a batch with another column's
prompts)."""

import dataclasses
import glob
import importlib.util
import json
import os

import torch
from transformers.utils import cached_file, find_adapter_config_file

from utils import INVALID_LOGPROB, die, logprobs_from_logits, pad_cat

from .render import is_chat, template_ids

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {}  # a hub dataset's configuration by the dataset's name (TRL's --dataset_config), as the flags set it
FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv", ".gguf", ".safetensors", ".bin", ".jinja", ".py")


def optional_file(path, name):
    """the local path of the file `name` in a folder or a hub repository, None where it has none (or none is reachable)"""
    quiet = dict(_raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    return cached_file(path, name, _raise_exceptions_for_gated_repo=False, **quiet)


def is_adapters(path):
    """adapter_config.json of path (a folder or a hub id) where it holds LoRA adapters alone, without a whole model's
    config.json (a --use_peft output without --merge_lora, the policy's or reward.py's), else None"""
    try:
        found = find_adapter_config_file(path)
        whole = found and optional_file(path, "config.json")
    except OSError:  # (a hub id that does not exist: its loading call says so in one line)
        return None
    return None if whole else found


def looks_local(name):
    """Whether a model or dataset argument can only mean a local path, so that one that does not exist is refused at
    once rather than looked up on the hub (a minute of retries without a network): it starts with '.', '/' or '~',
    has more than one '/' (a hub id is 'name' or 'owner/name'), ends with a file type, or starts with one of this
    repository's folders (output/, where the scripts write, data/, examples/)."""
    local = name.startswith((".", "/", "~", "output/", "data/", "examples/")) or name.lower().endswith(FILE_TYPES)
    return local or name.count("/") > 1


def check_paths(args, *flags):
    """These flags' values (a name, or a tuple of names), each one that can only be local (looks_local(), a chat
    template, the file of a 'file.py:name' spec) found here, or, given relative, in this repository (its data/ and
    examples/, so that the README's commands run from any folder) and then made that file's path; else one line."""
    for flag in flags:
        value = getattr(args, flag)
        names = [found(flag, name) for name in (value if isinstance(value, tuple) else (value,))]
        setattr(args, flag, tuple(names) if isinstance(value, tuple) else names[0])


def found(flag, name):
    if not name or os.path.exists(name):
        return name
    spec = ":" in name and not flag.endswith("path")  # (--reward_fn 'file.py:name', --environment '[key=]file.py:Class')
    key, rest = name.split("=", 1) if flag == "environment" and "=" in name.split(":")[0] else (None, name)
    where = rest.rsplit(":", 1)[0] if spec else rest
    if (spec and not where.endswith(".py")) or os.path.exists(where):
        return name  # (or a module's name)
    if where.startswith(("data/", "examples/")) and os.path.exists(os.path.join(REPO, where)):
        note(f"--{flag} {where!r} is not in the working directory: this repository's {os.path.join(REPO, where)}")
        rest = os.path.join(REPO, where) + rest[len(where) :]
        return rest if key is None else f"{key}={rest}"
    near = [p for p in sorted(glob.glob(glob.escape(where) + ".*")) if p.endswith(FILE_TYPES)][:1]
    hint = "".join(f" (did you mean {p!r}?)" for p in near)
    if spec:
        die(f"--{flag} {name!r}: the file {where!r} does not exist{hint}")
    if flag == "chat_template" or looks_local(name) or near:  # (a local file of that name and a type: that was meant)
        die(f"--{flag} {name!r} does not exist (a local path, not a hub id){hint}")
    return name


def note(msg):
    """One line, once: on the main process (RANK 0, which accelerate's launchers set before the script starts)"""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {msg}", flush=True)


def read_dataset(dataset_name, split):
    """A non-empty datasets.Dataset from a hub id or a local .jsonl/.json/.parquet/.csv file or folder (or a folder
    written by save_to_disk: a Dataset, of the split asked if it names one, or a DatasetDict's split), or one line."""
    import datasets

    datasets.disable_progress_bars()
    # the JSON builder logs the parser's error before raising it: the error is said once, below, with its line
    datasets.utils.logging.get_logger("datasets.packaged_modules.json.json").setLevel("CRITICAL")
    if not os.path.exists(dataset_name) and looks_local(dataset_name):
        die(f"dataset path {dataset_name!r} does not exist (a local path, not a hub id)")
    try:
        if os.path.isfile(dataset_name):
            builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
            builder = builders.get(os.path.splitext(dataset_name)[1])
            if builder is None:
                die(f"dataset file {dataset_name!r} is not .jsonl, .json, .parquet or .csv")
            if os.path.getsize(dataset_name) == 0:
                die(f"dataset {dataset_name!r} is empty")
            ds = datasets.load_dataset(builder, data_files={split: dataset_name}, split=split)
        elif os.path.isfile(os.path.join(dataset_name, "state.json")):  # a Dataset's save_to_disk: one split, its own
            ds = datasets.load_from_disk(dataset_name)
            if ds.split is not None and str(ds.split) != split:
                die(f"dataset {dataset_name!r} holds the split {str(ds.split)!r} alone, not {split!r}")
        else:
            ds = datasets.load_dataset(dataset_name, CONFIGS.get(dataset_name), split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        why = str(e).strip().splitlines()
        hint = f" {why[1]} (--dataset_config)" if "Config name is missing" in why[0] and len(why) > 1 else ""
        die(f"cannot load dataset {dataset_name!r} (split {split!r}): {why[0]}{hint}")
    except datasets.exceptions.DatasetGenerationError as e:  # a file that does not parse: where, in one line
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        die(f"cannot read dataset {dataset_name!r}: {malformed(dataset_name) or cause}")
    if len(ds) == 0:
        die(f"dataset {dataset_name!r} (split {split!r}) is empty")
    return ds


def malformed(name):
    """Where a local .json or .jsonl file (or a folder's) first fails to parse, as "file, line N: the parser's message
    (column C)"; None where each parses, or cannot be read here (the caller then says what datasets said)."""
    files = [name] if os.path.isfile(name) else sorted(glob.glob(os.path.join(name, "**", "*.json*"), recursive=True))
    for path in [p for p in files if p.endswith((".json", ".jsonl"))]:
        try:
            error = json_error(path)
        except (OSError, ValueError):
            continue
        if error:
            return f"{path}, {error}"


def json_error(path):
    """A JSON file's first error, "line N: message (column C)": a .json file as one document or else (several) as JSON
    Lines, as datasets reads it; a .jsonl file line by line, each a JSON object. None: it parses."""
    with open(path, encoding="utf-8", errors="replace") as f:
        if path.endswith(".json"):
            try:
                json.load(f)
                return None
            except json.JSONDecodeError as e:
                if not e.msg.startswith("Extra data"):
                    return f"line {e.lineno}: {e.msg} (column {e.colno})"
            f.seek(0)
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line.rstrip("\r\n")) if line.strip() else {}
            except json.JSONDecodeError as e:
                return f"line {n}: {e.msg} (column {e.colno})"
            if not isinstance(row, dict):
                return f"line {n}: a row must be a JSON object, got {type(row).__name__}"
    return None


def load_prompts(dataset_name, split, prompt_field, tokenizer, max_prompt_length, reference_field=None, long_prompts="drop",
                 raw=None, env=None):  # fmt: skip
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
        kinds = env.row_kinds(names, len(ds), f"dataset {dataset_name!r} (split {split!r})", ds.column_names, prompt_field)
    queries, texts, refs, kept = [], [], [], []
    for row, (value, ref, kind) in enumerate(zip(ds[prompt_field], references, kinds)):
        tools = env.schemas(kind) if kind is not None else None
        if tools and not isinstance(value, list):
            die(f"{kind['name']}'s tools reach the model through the chat template: the prompts must be chat messages")
        ids, text = prompt_ids(tokenizer, value, prompt_field, tools, f"dataset {dataset_name!r} (split {split!r}), row {row}")
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
    dropped = f"empty or longer than --max_prompt_length {max_prompt_length} tokens"
    if not queries:
        die(f"every prompt in {dataset_name!r} is {dropped}")
    if len(kept) < len(ds):  # (said: TRL 1.16's RL trainers keep every prompt whole)
        note(f"{len(ds) - len(kept)} of the {len(ds)} prompts in {dataset_name!r} (split {split!r}) are {dropped}: left out")
    columns = {name: [ds[name][row] for row in kept] for name in ds.column_names if name != prompt_field}
    return queries, texts, refs, columns


def prompt_ids(tokenizer, value, field, tools=None, where="a row"):
    """A prompt's (token ids, text): chat messages through the tokenizer's chat template with the generation prompt
    (and the tools' schemas; the text: the last message's), a string tokenized as it is. where: the row, for errors."""
    if is_chat(value):  # (no chat template: template_ids says so)
        ids = template_ids(tokenizer, value, tools, add_generation_prompt=True, where=where)
        return ids, value[-1].get("content", "") if value else ""
    if isinstance(value, str):
        return tokenizer(value, add_special_tokens=False)["input_ids"], value
    die(f"{where}: `{field}` must be a string or chat messages, got {type(value).__name__}")


def completion_ids(tokenizer, value, field, stop_token_id):
    """A dataset completion's token ids as the policy would have sampled them: a string (or an assistant message's
    content: TRL's prompt-completion format) tokenized as it is, then the stop token."""
    if isinstance(value, list):  # [{"role": "assistant", "content": ...}]
        value = "".join(m["content"] for m in value if m.get("role") == "assistant")
    if not isinstance(value, str):
        die(f"column {field!r} must hold strings or assistant messages, got {type(value).__name__}")
    return tokenizer(value, add_special_tokens=False)["input_ids"] + ([stop_token_id] if stop_token_id is not None else [])


def draw_prompts(data, args, k, process_index, index=None):
    """This process's share of the next global batch of prompts, drawn from `data` (a Shuffled) and its generator, or
    index (the global batch's dataset rows, as a caller picked them): (the prompts' indices, the uniforms (prompts * k,
    response_length) that pick every sampled token, this update's most tokens per completion, the vLLM engine's seeds
    (prompts,) or None). The noise is drawn for the global batch, so a completion depends on the seed and its place in
    that batch, not on the process that samples it; the same on every process and again in a resumed run."""
    n = args.local_prompts * args.world_size
    if index is not None and len(index) != n:
        die(f"a batch draws {n} prompts (on all processes), not {len(index)}")
    idx = data.take(n) if index is None else [int(i) for i in index]
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
    which the scripts also draw the sampling noise from). shuffle False: the items in their order, pass after pass."""

    def __init__(self, n, seed, shuffle=True):
        self.n, self.rng, self.shuffle = n, torch.Generator().manual_seed(seed), shuffle
        self.order, self.cursor = self.permutation(), 0

    def permutation(self):
        return torch.randperm(self.n, generator=self.rng) if self.shuffle else torch.arange(self.n)

    def take(self, count):
        idx = []
        while len(idx) < count:
            if self.cursor == self.n:
                self.order, self.cursor = self.permutation(), 0
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
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as e:  # (an error the file's own code raises keeps its traceback: it is the user's to debug)
            die(f"{flag} file {where!r}, line {e.lineno}: {e.msg}")
        except (OSError, ImportError) as e:
            die(f"{flag} file {where!r} cannot be read or imported: {e}")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            die(f"{flag} module {where!r} cannot be imported: {e}")
    obj = getattr(module, name, None)
    if not callable(obj):
        die(f"{flag} {spec!r}: {where!r} has no function or class {name!r}")
    return obj


def load_ptx(args, tokenizer):
    """The PTX texts (--ptx_text_field of --ptx_dataset) as token-id lists, cut to --ptx_max_length tokens (default
    max_prompt_length + response_length); texts under two tokens are dropped."""
    ds = read_dataset(args.ptx_dataset, args.ptx_split)
    if args.ptx_text_field not in ds.column_names:
        where = f"dataset {args.ptx_dataset!r} (split {args.ptx_split!r})"
        die(f"{where} has no column {args.ptx_text_field!r} (columns: {ds.column_names}); set --ptx_text_field")
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


def load_eval(args, tokenizer, columns, env=None):
    """The held-out set as (queries, texts, references or None, columns, the prompts as the dataset holds them), or
    None without one: --eval_dataset_name's --eval_split read as the training prompts are (a set without a column the
    reward functions read is refused by rewards.load_reward_fn; with --environment, whose episodes may read any, one
    without a training column here). The TL;DR scripts' is tldr.load_eval's."""
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
    missing = sorted(set(columns) - set(eval_columns)) if env is not None else []
    if missing:
        die(f"--eval_dataset_name {args.eval_dataset_name!r} lacks the training set's column(s) {missing}")
    return queries, texts, references, eval_columns, raw


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


def select_groups(keep, n):
    """DAPO's dynamic sampling: of the groups generated so far, in order, the first n that keep (a list of bools) marks;
    if fewer are marked, all of them and then the earliest unmarked ones, in generation order. Returns the chosen
    groups' positions, ascending, and how many unmarked ones filled the batch."""
    marked = [i for i, x in enumerate(keep) if x][:n]
    filled = [i for i, x in enumerate(keep) if not x][: n - len(marked)]
    return sorted(marked + filled), len(filled)
