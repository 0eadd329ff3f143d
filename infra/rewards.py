"""Reward sources: functions (built-in, from files, TRL's keyword convention, async) and reward models (read on the
policy's tokens or re-encoded), loaded and called; each source's scores of a batch. Their weighted sum and what a script
does to it are the script's method (utils.score, utils.ScoreScaler).
"""

import inspect
import math
import numbers
import os
import re

import numpy as np
import torch

from utils import die, scalar_forward

from .data import left_pad, load_object, truncate_response
from .environments import awaited
from .models import load_reward_model, load_tokenizer, same_vocabulary
from .render import is_chat, render, template_ids, tools_of

INJECTED = ("completion_ids", "messages", "environments")  # what a function may read besides the dataset's columns


def load_reward_fn(spec, columns, held_out=None):
    """`sentiment`, `accuracy`, `path/to/file.py:function` or `package.module:function` -> the function, after
    checking that it can be called as call_reward_fn calls it and that the dataset has every column it names (columns:
    the dataset's other column names, and INJECTED's where a run passes them). held_out: the held-out set's columns,
    which must hold those the function reads (those it names, or, for one of the user's taking **kwargs, every one)."""
    if spec in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[spec]
    elif ":" not in spec:
        die(f"--reward_fn {spec!r} must be {', '.join(map(repr, BUILTIN_REWARDS))}, 'file.py:function' or 'module:function'")
    else:
        fn = load_object(spec, "--reward_fn")
    # the parameters that have no default, besides the prompts and completions, must be columns
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    params = [p for p in params if p.name not in ("prompts", "completions")] if by_keyword(fn) else params[2:]
    missing = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [name for name in missing if name not in columns]
    if missing:
        has = sorted(c for c in columns if c not in INJECTED)
        die(f"reward function {spec!r} needs the dataset column(s) {missing}; the dataset has {has}")
    marker = object()  # (the completions, which the call must pass)
    args, kwargs = reward_arguments(fn, [], [marker], dict.fromkeys(columns))
    try:
        bound = signature.bind(*args, **kwargs)
        problem = None if [marker] in [*bound.args, *bound.kwargs.values()] else "it would get no completions"
    except TypeError as e:
        problem = str(e)
    if problem:
        die(f"reward function {spec!r} cannot be called as f(prompts, completions, **columns) or, as TRL calls it, "
            f"f(prompts=..., completions=..., **columns): {problem}")  # fmt: skip
    if held_out is not None:
        any_column = any(p.kind == p.VAR_KEYWORD for p in params) and spec not in BUILTIN_REWARDS
        reads = set(columns) if any_column else set(signature.parameters) & set(columns)
        lacking = sorted(reads - set(held_out) - set(INJECTED))
        if lacking:
            die(f"--eval_dataset_name lacks the column(s) {lacking}, which reward function {spec!r} reads")
    return fn


def load_reward_sources(args, tokenizer, columns, env=None, default="sentiment", held_out=None):
    """The reward sources in --reward_weights' order: reward models, then --reward_fn functions; none given: `default` (None:
    no source). Each a dict {"name", "weight"} with "model" + "tokenizer" (None: the policy's vocabulary) + "path", or "fn" +
    "spec"; names are the function's, or the model's last path part. Every flag is checked, and the functions loaded (and
    checked against the held-out set's columns, held_out), before any reward model loads."""
    reward_model_paths = args.reward_model_paths
    models = [{"name": os.path.basename(os.path.normpath(p)) or "reward_model", "path": p} for p in reward_model_paths]
    fns = []
    rewarded = reward_model_paths or (env is not None and env.rewarded)
    columns = {**columns, "completion_ids": None}  # (each completion's token ids, as TRL passes them)
    if env is not None:  # in an episode the functions may also read the whole conversation and the live environments
        columns = {**columns, "messages": None, "environments": None}
    for spec in list(args.reward_fn) or ([] if rewarded or default is None else [default]):
        fn = load_reward_fn(spec, columns, held_out=held_out)
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
    for source in models:  # (one without a trained score head, a causal LM, stops the run here, before the policy loads)
        model = load_reward_model(source["path"], args.trust_remote_code)
        rm_tokenizer = load_tokenizer(source["path"], args.trust_remote_code)
        source["model"] = model.eval().requires_grad_(False)
        # how reward.py's models read a conversation (infra.offline.save_reward_input): rendered as in training
        source["rule"] = getattr(model.config, "reward_input", None)
        source["same_vocabulary"] = same_vocabulary(tokenizer, rm_tokenizer)  # (PPO's critic can start from it)
        same = source["same_vocabulary"] and source["rule"] is None
        source["tokenizer"] = None if same else rm_tokenizer  # None: our tokens, read as they are
        source["environments"] = env  # (an episode's reward model input renders the tools its environment offered)
    if env is not None:  # each environment class's reward, with weight 1 (as TRL), named after the class
        sources += [{"name": name, "weight": 1.0, "env": j} for j, name in enumerate(env.names)]
    return sources


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


def reward_arguments(fn, prompts, completions, columns):
    """(args, kwargs) of fn's call: prompts=..., completions=... and the columns by keyword (positionally,
    (prompts, completions), where it names neither); to a function without **kwargs, only the names it takes."""
    params = inspect.signature(fn).parameters
    if by_keyword(fn):
        args, kwargs = (), {"prompts": list(prompts), "completions": list(completions), **columns}
    else:  # (a column named as one of the first two parameters would give it twice: they are the positional ones)
        first = list(params)[:2]
        args, kwargs = (list(prompts), list(completions)), {k: v for k, v in columns.items() if k not in first}
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return args, kwargs


def call_reward_fn(fn, prompts, completions, columns):
    """fn(prompts=..., completions=..., **columns) (positionally, fn(prompts, completions, **columns), where it names
    neither): every column to a function taking **kwargs, else the columns it names. An async function is awaited."""
    args, kwargs = reward_arguments(fn, prompts, completions, columns)
    return awaited(fn(*args, **kwargs))


def check_rewards(values, n, source):
    """A source's rewards -> n floats or None ("cannot judge"), or one line naming the source and the bad value."""
    if torch.is_tensor(values) or isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        die(f"reward {source} must return a list of numbers (or None), got {str(values)[:80]}", code=1)
    if len(values) != n:
        die(f"reward {source} returned {len(values)} scores for {n} completions", code=1)
    for v in values:
        if v is not None and (isinstance(v, str) or not isinstance(v, numbers.Real)):
            die(f"reward {source} must return a list of numbers (or None), got {v!r}", code=1)
        if v is not None and not math.isfinite(v):
            die(f"reward {source} returned {v}; NaN or inf is not a reward (None means it cannot judge a completion)", code=1)
    return [None if v is None else float(v) for v in values]


def rm_scores(
    reward_model, rm_tokenizer, tokenizer, query_responses, mask, context_length, lengths, stop_token_id, raw=None,
    rule=None, conversations=None, tools=None,
):  # fmt: skip
    """A reward model's scores (batch,) read at the last real token of query_responses (left-padded queries of
    context_length columns, then responses of `lengths` tokens). With a tokenizer of its own (rm_tokenizer not None),
    a model of reward.py (rule: its config's reward_input) or a chat prompt (raw: the prompts as the dataset holds
    them) is given the prompt and the decoded completion rendered as reward.py renders a pair in training
    (infra.offline.render: one conversation through its own chat template, with each row's tools; conversations: an
    episode's whole, as messages), less the rule's offset; any other reads the text re-encoded, a stop token that
    decoding drops (EOS) becoming the reward model's EOS token."""
    chat = raw is not None and is_chat(raw[0])
    if rm_tokenizer is None:  # the policy's tokens as they are: nothing to decode
        ids, last = query_responses, context_length + lengths - 1
    else:
        completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        if rule is not None or chat or conversations is not None:  # rendered as reward.py renders a pair
            # (reward.py's models read each row's tools, as in training; TRL renders another's input without them)
            seqs = reward_input(rm_tokenizer, raw, completions, conversations, tools=tools if rule is not None else None)
        else:
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
        die(f"reward model {reward_model.name_or_path!r} returned NaN or inf", code=1)
    return scores - (rule or {}).get("offset", 0.0)


def reward_input(rm_tokenizer, raw, completions, conversations=None, tools=None):
    """The token ids a reward model of reward.py reads for each (prompt as the dataset holds it, completion text): the
    two rendered as reward.py renders a pair (infra.offline.render), a chat prompt's completion as the assistant's
    message; conversations: an episode's every message, rendered whole. tools: each row's, as reward.py passes a pair's
    `tools` column to the chat template (JSON schemas, a list or a JSON string; None: none)."""
    n = len(conversations) if conversations is not None else len(raw)
    tools = [tools_of({"tools": t}) for t in tools] if tools is not None else [None] * n
    if conversations is not None:
        return [template_ids(rm_tokenizer, c, t) for c, t in zip(conversations, tools)]
    replies = [[{"role": "assistant", "content": c}] if is_chat(p) else c for p, c in zip(raw, completions)]
    return [sum(render(rm_tokenizer, p, c, t), []) for p, c, t in zip(raw, replies, tools)]  # prompt ids + completion ids


def rm_tools(env, columns):
    """The tools each row's reward model input renders, as reward.py rendered a pair with its row's `tools` column: the
    row's (columns: the rows' other columns), or in an episode (env: --environment's Environments) those its
    environment offered the policy; None where no row has any. (TRL's GRPO and RLOO trainers render a reward model's
    input without tools, though its RewardTrainer trains with them: a model is read here as it was trained.)"""
    tools = columns.get("tools")
    if env is not None:  # each episode's environment's tools (their schemas, as load_prompts offers them), else the row's
        offered = [env.schemas(kind, live) for kind, live in zip(env.episode_kinds, env.live)]
        tools = [o or t for o, t in zip(offered, tools or [None] * len(offered))]
    return tools


def get_scores(
    sources, tokenizer, query_responses, mask, context_length, lengths, prompts, columns, stop_token_id, completions=None,
    env_rewards=None, raw=None,
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
                raw=raw,
                rule=source.get("rule"),
                conversations=columns.get("messages") if env_rewards is not None else None,
                tools=rm_tools(source.get("environments") if env_rewards is not None else None, columns),
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


def score_completions(sources, tokenizer, queries, query_mask, responses, *, prompts, columns, stop_token_id, chunk, raw=None):
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
                raw=raw[rows] if raw is not None else None,
            )
        )
    return responses, lengths, torch.cat(per_source, 1)
