"""Multi-turn environments (--environment): one instance per episode from a pool, text environments and TRL's tool
environments (tool-call parsing, async tools), each episode's random stream, the observations' tokens, the
episodes' rewards and metrics. The episode loop itself is utils.episodes.
"""

import asyncio
import copy
import inspect
import json
import math
import random
import re
import threading
from contextlib import contextmanager

import torch

from utils import die

from .data import load_object


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

    def row_kinds(self, names, n, where, columns=None, prompt_field="prompt"):
        """The environment kind of each of n rows: with several, named by the rows' `environment` column (names; None:
        the rows have none), a row without a known name stopping the run in one line naming `where`; so does a kind
        whose reset() names a parameter (reset(self, secret, **row)) that the columns reset gets lack (columns: the
        dataset's, checked where given, but prompt_field's, which reset gets as `prompt`)"""
        if self.multi and names is None:
            die(f"{where} has no `environment` column to pick each row's environment from {sorted(self.kinds)}")
        unknown = sorted(set(map(str, names)) - set(self.kinds)) if self.multi else []
        if unknown:
            die(f"{where}'s `environment` column names {unknown}, not among the environments {sorted(self.kinds)}")
        kinds = [self.kinds[name] for name in names] if self.multi else [self.kinds[None]] * n
        for kind in [] if columns is None else {id(kind): kind for kind in kinds}.values():
            try:  # (the probe's bound method: an instance's own reset, a static one)
                params = inspect.signature(kind["pool"][0].reset).parameters.values()
            except (TypeError, ValueError):  # (one inspect cannot read: left to the episode)
                params = []
            needed = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            missing = sorted(set(needed) - (set(columns) - {prompt_field}) - {"prompt"})
            if missing:
                die(f"{kind['name']}.reset needs the dataset column(s) {missing}; {where} has {sorted(columns)}")
        return kinds

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
