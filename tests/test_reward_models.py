"""Reward models as RL reads them: one trained with a `tools` column reads the tools in RL, reward.py's LoRA adapters
load as a reward model, a checkpoint without a trained score head (a causal LM) is refused before the policy loads, and
a score head that reward.py or PPO's critic knowingly starts raises no loading report. Each reward checked against plain
transformers (or peft)."""

import json
import logging
import os
import re
import shutil

import pytest
import torch
from conftest import REPO, with_chat_template
from test_pipeline import TEMPLATE, pairs, write
from test_rloo import check_ok, read_metrics

# the tools as the chat template's first line, as SmolLM2's template writes them into its system message
TOOLS_TEMPLATE = "{% if tools %}{{ 'tools: ' + (tools | tojson) + '<|endoftext|>\n' }}{% endif %}" + TEMPLATE
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


@pytest.fixture(scope="session")
def tools_model_dir(tiny_model_dir, tmp_path_factory):
    """the tiny GPT-NeoX with a chat template that renders tools"""
    return with_chat_template(tiny_model_dir, str(tmp_path_factory.mktemp("tools_model")), TOOLS_TEMPLATE)


@pytest.fixture(scope="session")
def chat_pairs(tmp_path_factory):
    return write(tmp_path_factory.mktemp("reward_models_data") / "chat_pairs.jsonl", pairs(48, chat=True))


def reward_py(model, pairs_file, out, extra=""):
    return (
        f"reward.py --model_name_or_path {model} --dataset_name {pairs_file} --total_episodes 16"
        f" --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 3e-3 --output_dir {out} {extra}"
    )


def rloo_py(model, rm, prompts, out):
    return (
        f"rloo.py --model_name_or_path {model} --reward_model_path {rm} --dataset_name {prompts} --rloo_k 2"
        f" --total_episodes 16 --response_length 8 --log_completions --output_dir {out}"
    )


def logged_against(out, rm_name, score_of, offset):
    """each reward completions.jsonl logged for the reward model rm_name against score_of(prompt, completion) - offset"""
    logged = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert len(logged) == 16
    for row in logged:
        with torch.no_grad():
            expected = score_of(row["prompt"], row["completion"]) - offset
        assert row[f"rewards/{rm_name}"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_a_reward_model_trained_with_tools_reads_them_in_rl(run, tmp_path, tools_model_dir):
    """reward.py on chat pairs with a `tools` column (a list), then rloo.py on prompts with the same tools (a JSON
    string, TRL's other form): each logged reward is plain transformers' score of the conversation rendered with the
    tools, less the offset reward.py saved (TRL's RLOO and GRPO trainers render the reward model's input without them)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = [{**row, "tools": TOOLS} for row in pairs(48, chat=True)]
    rm = tmp_path / "rm"
    check_ok(run(reward_py(tools_model_dir, write(tmp_path / "pairs.jsonl", rows), rm), cwd=tmp_path))
    prompts = write(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"], "tools": json.dumps(TOOLS)} for r in rows])
    out = tmp_path / "rl"
    check_ok(run(rloo_py(tools_model_dir, rm, prompts, out), cwd=tmp_path))

    model, tok = AutoModelForSequenceClassification.from_pretrained(rm).eval(), AutoTokenizer.from_pretrained(rm)

    def score(prompt, completion):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        ids = tok.apply_chat_template(chat, tools=TOOLS, tokenize=True, return_dict=False)
        assert tok.decode(ids).startswith("tools: [{")  # (the template renders them)
        return model(torch.tensor([ids])).logits[0, 0].item()

    logged_against(out, rm.name, score, model.config.reward_input["offset"])


def test_a_reward_model_reads_an_episode_with_the_tools_its_environment_offered(run, tmp_path, caller_model_dir, chat_pairs):
    """With --environment, a reward model of reward.py reads each episode's whole conversation rendered with the tools
    its environment offered the policy (a method of the live instance, which the chat template turns into its schema):
    each logged reward is plain transformers' score of the logged conversation rendered with that tool, less the
    offset."""
    from test_environments import ENVS
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    template = os.path.join(REPO, "examples", "environments", "chatml_tools.jinja")
    rm = tmp_path / "rm"
    check_ok(run(reward_py(caller_model_dir, chat_pairs, rm, f"--chat_template {template}"), cwd=tmp_path))
    (tmp_path / "envs.py").write_text(ENVS)
    out = tmp_path / "rl"
    check_ok(run(
        f"grpo.py --model_name_or_path {caller_model_dir} --dataset_name {chat_pairs} --chat_template {template}"
        f" --environment {tmp_path}/envs.py:Tools --reward_model_path {rm} --max_turns 2 --response_length 6"
        " --max_episode_tokens 160 --total_episodes 16 --per_device_train_batch_size 8 --gradient_accumulation_steps 2"
        f" --max_prompt_length 512 --log_completions --num_sample_generations 0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    ))  # fmt: skip

    model, tok = AutoModelForSequenceClassification.from_pretrained(rm).eval(), AutoTokenizer.from_pretrained(rm)
    scope = {}
    exec(ENVS, scope)
    logged = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert any(m["role"] == "tool" for row in logged for m in row["completion"])  # (the model called its tool)
    for row in logged:
        ids = tok.apply_chat_template(row["completion"], tools=[scope["Tools"]().add], tokenize=True, return_dict=False)
        assert '"name": "add"' in tok.decode(ids)
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0, 0].item() - model.config.reward_input["offset"]
        assert row[f"rewards/{rm.name}"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_reward_py_lora_adapters_load_as_a_reward_model(run, tmp_path, tools_model_dir, chat_pairs):
    """reward.py --use_peft without --merge_lora saves adapters (the score head trained whole with them), their base
    named by its absolute path (the run named it relative to its folder) and its reading rule beside them; the run's last
    line gives the call that loads them and the offset; rloo.py, run from another folder, loads them as a reward model:
    each logged reward is peft's own load of the folder's score of the rendered conversation, less that offset."""
    import peft
    import transformers
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    rm = tmp_path / "rm"
    base = os.path.relpath(tools_model_dir, tmp_path)
    trained = run(reward_py(base, chat_pairs, rm, "--use_peft --lora_r 4"), cwd=tmp_path)
    check_ok(trained)
    assert not (rm / "config.json").exists() and not (rm / "model.safetensors").exists()  # adapters alone
    assert json.load(open(rm / "adapter_config.json"))["base_model_name_or_path"] == os.path.abspath(tools_model_dir)
    offset = [r for r in read_metrics(rm) if "reward/offset" in r][-1]["reward/offset"]
    assert json.load(open(rm / "reward_input.json")) == {"rendering": "conversation", "offset": pytest.approx(offset)}

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    prompts = write(tmp_path / "prompts.jsonl", [{"prompt": json.loads(line)["prompt"]} for line in open(chat_pairs)])
    out = tmp_path / "rl"
    proc = run(rloo_py(tools_model_dir, rm, prompts, out), cwd=elsewhere)
    check_ok(proc)
    assert "LOAD REPORT" not in proc.stderr  # (the base's new head, which the adapters' trained one replaces)

    model = AutoPeftModelForSequenceClassification.from_pretrained(rm, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(rm)

    def score(prompt, completion):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return model(torch.tensor([tok.apply_chat_template(chat, tokenize=True, return_dict=False)])).logits[0, 0].item()

    assert abs(score("Tell me about the river", "sunny") - score("Tell me about the river", "dark")) > 1e-3  # it learnt
    logged_against(out, rm.name, score, offset)

    found = re.search(r"LoRA adapters: (peft\..*\)), its score less (\S+) as", trained.stdout.strip().splitlines()[-1])
    assert found, trained.stdout[-3000:]
    call, less = found.groups()
    assert float(less) == pytest.approx(offset, abs=1e-4)
    loaded = eval(call, {"peft": peft, "transformers": transformers}).eval()  # (the line's own call)
    chat = [{"role": "user", "content": "Tell me about the river"}, {"role": "assistant", "content": "sunny"}]
    ids = torch.tensor([tok.apply_chat_template(chat, tokenize=True, return_dict=False)])
    assert loaded(ids).logits[0, 0].item() == pytest.approx(model(ids).logits[0, 0].item(), abs=1e-6)

    # the same folder starts PPO's critic (--value_model_path): at learning rate 0 the saved critic is peft's merge
    critic = tmp_path / "ppo"
    command = rloo_py(tools_model_dir, rm, prompts, critic).replace("rloo.py", "ppo.py", 1).replace(" --rloo_k 2", "")
    command = command.replace(f"--reward_model_path {rm}", f"--reward_model_path {rm} --value_model_path {rm}")
    check_ok(run(f"{command} --learning_rate 0", cwd=elsewhere))
    saved = transformers.AutoModelForSequenceClassification.from_pretrained(critic / "critic").eval()
    assert saved(ids).logits[0, 0].item() == pytest.approx(model(ids).logits[0, 0].item(), abs=1e-5)

    # and reward.py's own --model_name_or_path, without --use_peft: the merge, its trained head too, trained whole
    again = tmp_path / "again"
    check_ok(run(reward_py(base, chat_pairs, again, "--learning_rate 0").replace(f" {base} ", f" {rm} "), cwd=tmp_path))
    saved = transformers.AutoModelForSequenceClassification.from_pretrained(again).eval()
    assert saved(ids).logits[0, 0].item() == pytest.approx(model(ids).logits[0, 0].item(), abs=1e-5)


def test_a_value_model_of_another_vocabulary_is_refused_before_it_loads(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """PPO's critic reads the policy's tokens: --value_model_path of another width (a saved critic holds no tokenizer to
    compare) stops in one line"""
    from transformers import AutoModelForCausalLM

    value = tmp_path / "value"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(model.config.vocab_size - 8)
    model.save_pretrained(value)
    out = tmp_path / "out"
    command = f"ppo.py --model_name_or_path {tiny_model_dir} --value_model_path {value} --dataset_name {tiny_prompts_file}"
    proc = run(f"{command} --output_dir {out}", cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(f"error: value model '{value}' is 504 tokens wide, the policy 512"), last
    assert not out.exists() and "Traceback" not in proc.stderr


@pytest.fixture(scope="session")
def causal_lm_dirs(tiny_model_dir, tiny_llama_dir, tmp_path_factory):
    """Causal LMs given as reward models: the tiny GPT-NeoX saved by AutoModelForCausalLM with num_labels=1 in its
    config (loaded as it is, its head would be random), and the tiny Llama whose config names no labels, as SmolLM2's;
    and a policy folder without weights, which a run that loads its policy cannot start with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("causal_lms")
    neox = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    neox.config.num_labels = 1
    neox.save_pretrained(root / "neox")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root / "neox")
    shutil.copytree(tiny_llama_dir, root / "llama")
    shutil.copytree(tiny_model_dir, root / "no_weights")
    os.remove(root / "no_weights" / "model.safetensors")
    return {name: str(root / name) for name in ("neox", "llama", "no_weights")}


@pytest.mark.parametrize(
    "script, model",
    [
        ("rloo.py", "neox"),
        ("rloo.py", "llama"),
        ("ppo.py", "neox"),
        ("grpo.py", "llama"),
        ("distill.py", "neox"),
        ("rloo_tldr.py", "neox"),
        ("ppo_tldr.py", "llama"),
    ],
)
def test_a_causal_lm_is_refused_as_a_reward_model(script, model, run, tmp_path, causal_lm_dirs, tiny_prompts_file, tldr_dir):
    """A reward model whose checkpoint has no trained score head is refused in one line, before the policy loads (it has
    no weights here), and nothing is written."""
    path, policy, out = causal_lm_dirs[model], causal_lm_dirs["no_weights"], tmp_path / "out"
    if script.endswith("_tldr.py"):
        command = f"{script} --sft_model_path {policy} --reward_model_path {path} --dataset_name {tldr_dir}"
        command += " --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --num_mini_batches 2"
    else:
        command = f"{script} --model_name_or_path {policy} --reward_model_path {path} --dataset_name {tiny_prompts_file}"
        command += f" --teacher_model_name_or_path {policy}" if script == "distill.py" else ""
    proc = run(f"{command} --total_episodes 16 --output_dir {out}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    why = "has no trained score head (a causal LM or its adapters?): train one with reward.py"
    assert last == f"error: reward model {path!r} {why}"
    assert "Traceback" not in proc.stderr and "LOAD REPORT" not in proc.stderr
    assert not out.exists()


def test_a_causal_lm_starts_ppos_critic_with_a_new_head(run, tmp_path, causal_lm_dirs, tiny_model_dir, tiny_prompts_file):
    """--value_model_path a causal LM (an SFT model, say): its trunk starts the critic with a new head, as the critic
    from the policy's trunk does, said in a note (a reward model without a trained head is refused: its scores are the
    signal, a critic's head is trained). With the learning rate at 0 the saved critic is that start: the causal LM's
    trunk, and the head initialised as the scripts initialise one."""
    from safetensors.torch import load_file

    from utils import init_value_head

    value, out = causal_lm_dirs["llama"], tmp_path / "out"
    command = f"ppo.py --model_name_or_path {tiny_model_dir} --value_model_path {value} --dataset_name {tiny_prompts_file}"
    proc = run(f"{command} --total_episodes 16 --learning_rate 0 --response_length 6 --output_dir {out}", cwd=tmp_path)
    check_ok(proc)
    assert f"note: value model {value!r} has no trained score head: its trunk starts the critic" in proc.stdout
    critic, trunk = load_file(out / "critic" / "model.safetensors"), load_file(os.path.join(value, "model.safetensors"))
    for key, weight in trunk.items():
        if key.startswith("model."):
            assert torch.equal(critic[key], weight), key
    head = torch.nn.Linear(critic["score.weight"].shape[1], 1, bias=False)
    init_value_head(head, 0.02, 1)
    assert torch.equal(critic["score.weight"], head.weight)


def test_reward_py_starts_its_new_score_head_without_a_loading_report(run, tmp_path, tools_model_dir, chat_pairs):
    """reward.py from a causal LM starts a new score head, as it should: transformers' report of the head missing from
    the checkpoint (and of the causal LM's output layer left unused) is not shown."""
    proc = run(reward_py(tools_model_dir, chat_pairs, tmp_path / "rm"), cwd=tmp_path)
    check_ok(proc)
    assert "MISSING" not in proc.stderr and "LOAD REPORT" not in proc.stderr


def test_only_the_expected_loading_report_is_held_back(tmp_path, tiny_model_dir, tiny_reward_model_dir):
    """infra.models.load_scorer: a causal LM's checkpoint gives the new head's keys and no report; a reward model's
    none; a checkpoint that also lacks a weight of the trunk gives the report, as transformers writes it."""
    import transformers
    from safetensors.torch import load_file, save_file

    from infra.models import load_scorer

    seen, verbosity = [], transformers.logging.get_verbosity()
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    transformers.logging.set_verbosity_warning()  # (as a script runs; another test file may have set it to errors)
    try:
        model, new = load_scorer(tiny_model_dir, num_labels=1)
        assert new == {"score.weight"} and model.score.out_features == 1 and not seen
        assert load_scorer(tiny_reward_model_dir)[1] == set() and not seen
        shutil.copytree(tiny_model_dir, tmp_path / "holed")
        weights = load_file(tmp_path / "holed" / "model.safetensors")
        del weights["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"]
        save_file(weights, tmp_path / "holed" / "model.safetensors", metadata={"format": "pt"})
        assert load_scorer(str(tmp_path / "holed"), num_labels=1)[1] == {"score.weight"}
        assert len(seen) == 1 and "LOAD REPORT" in seen[0] and "dense_h_to_4h.weight" in seen[0]
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
