"""The model card every saved model gets (output_dir/README.md) and --push_to_hub, with huggingface_hub's HfApi
patched to record its calls (the hub is unreachable here)."""

import json
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO
from test_rloo import VOWELS, check_ok, read_metrics

sys.path.insert(0, REPO)
import infra  # noqa: E402

# runs a script in-process with HfApi's two methods replaced by recorders, as the hub would be called
DRIVER = """
import json, os, runpy, sys
import huggingface_hub
calls = []
def recorder(name):
    def method(self, *args, **kwargs):
        folder = kwargs.get("folder_path")
        out = sys.argv[sys.argv.index("--output_dir") + 1]  # (what the run had written by then)
        seen = sorted(os.listdir(out)) if os.path.isdir(out) else []
        calls.append({"method": name, "args": list(args), "kwargs": kwargs, "seen": seen, "files": sorted(
            os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs) if folder else None})
    return method
huggingface_hub.HfApi.create_repo = recorder("create_repo")
huggingface_hub.HfApi.upload_folder = recorder("upload_folder")
sys.argv = sys.argv[1:]  # the script and its flags
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
print("HUB " + json.dumps(calls, default=str))
"""


def read_card(path):
    """(front matter as a dict, {section title: its text}); the text before the first section is under ""."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)  # as the hub reads it
    sections, title = {"": []}, ""
    for line in card.text.splitlines():
        if line.startswith("## "):
            title = line[3:]
            sections[title] = []
        else:
            sections[title].append(line)
    return card.data.to_dict(), {k: "\n".join(v).strip() for k, v in sections.items()}


def table(text):
    """The rows of a markdown table, as lists of cells, header and rule left out."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return rows[2:]


def fenced(text):
    """The body of the first fenced block of text."""
    return text.split("```")[1].split("\n", 1)[1]


def main_metrics(row):
    return {k: v for k, v in row.items() if k in infra.outputs.CARD_METRICS or k.startswith(infra.outputs.CARD_PREFIXES)}


def test_rloo_card_and_upload(tmp_path, tiny_model_dir, tiny_reward_model_dir, tiny_prompts_file):
    """One tiny run with three reward sources and --push_to_hub: the card names each source with its weight, lists the
    last metrics row, every argument and the command; transformers loads the folder; the repo is created before the run
    trains (as transformers' Trainer creates it); the upload gets that folder and repo id and leaves the checkpoints and
    run state out."""
    (tmp_path / "reward.py").write_text(VOWELS)
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    script = os.path.join(REPO, "rloo.py")
    flags = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --reward_model_path {tiny_reward_model_dir}"
        f" --reward_fn {tmp_path}/reward.py:vowels --reward_fn sentiment --reward_weights 1.0 2.0 0.5 --total_episodes 16"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --response_length 6 --num_sample_generations 0"
        f" --checkpoint_every 1 --push_to_hub --hub_model_id me/tiny-rloo --output_dir {out}"
    ).split()
    cmd = [sys.executable, str(tmp_path / "driver.py"), script, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    check_ok(proc)

    meta, sections = read_card(out / "README.md")
    assert meta == {"library_name": "transformers", "tags": ["rlhf", "rloo"]}  # local model and data: no hub ids
    head = sections[""]
    assert head.startswith("# me/tiny-rloo\n\nRLOO: REINFORCE with a leave-one-out baseline")
    assert "- **Algorithm:** RLOO (`rloo.py`)" in head and f"- **Base model:** `{tiny_model_dir}`" in head
    assert f"- **Prompts:** `{tiny_prompts_file}` (split `train`)" in head
    assert table(sections["Reward sources"]) == [
        [os.path.basename(tiny_reward_model_dir), f"reward model `{tiny_reward_model_dir}`", "1"],
        ["vowels", f"function `{tmp_path}/reward.py:vowels`", "2"],
        ["sentiment", "function `sentiment`", "0.5"],
    ]
    last = read_metrics(out)[-1]
    metrics = {key: float(value) for key, value in table(sections["Final metrics"])}
    expected = main_metrics(last)
    assert {"rewards/vowels/mean", "rewards/sentiment/mean", "objective/scores", "objective/kl"} <= set(expected)
    assert metrics == pytest.approx(expected, rel=1e-5) and metrics["episode"] == 16
    with open(out / "args.json") as f:
        assert json.loads(fenced(sections["Hyperparameters"])) == json.load(f)
    assert shlex.split(fenced(sections["Command"])) == ["python", script, *flags]
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-rloo")' in sections["Usage"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(AutoTokenizer.from_pretrained(out))

    create, upload = json.loads(proc.stdout.split("HUB ")[-1])
    assert create["method"] == "create_repo" and create["args"] == ["me/tiny-rloo"]
    assert create["kwargs"] == {"private": False, "exist_ok": True, "repo_type": "model"}
    assert "metrics.jsonl" not in create["seen"] and "metrics.jsonl" in upload["seen"]  # (created before any work)
    assert upload["method"] == "upload_folder"
    assert upload["kwargs"]["repo_id"] == "me/tiny-rloo" and upload["kwargs"]["folder_path"] == str(out)
    # what the upload sends of the folder as it was then: huggingface_hub's own filter with the patterns passed
    from huggingface_hub.utils import filter_repo_objects

    sent = set(filter_repo_objects(upload["files"], ignore_patterns=upload["kwargs"]["ignore_patterns"]))
    assert "checkpoint-0000002/state.pt" in upload["files"] and any(f.startswith("runs/") for f in upload["files"])
    assert {"README.md", "model.safetensors", "config.json", "tokenizer.json", "args.json", "metrics.jsonl"} <= sent
    assert not any(f.startswith(("checkpoint-", "runs/")) for f in sent)


def card_args(tmp_path, **changes):
    args = dict(
        output_dir=str(tmp_path),
        hub_model_id=None,
        dataset_name="trl-lib/tldr",
        dataset_split="train",
        use_peft=False,
        merge_lora=False,
        world_size=1,
        seed=1,
    )
    return SimpleNamespace(**{**args, **changes})


def test_card_metadata_metrics_and_launcher(tmp_path, monkeypatch):
    """Hub ids go into the metadata (base_model, datasets); adapters make it a peft card; the final metrics are the
    latest value of each key (a TL;DR run's last rows: training, then evaluation); accelerate launch is named."""
    rows = [
        {"episode": 16, "objective/scores": 0.1, "loss/policy_avg": 3.0},
        {"episode": 32, "objective/scores": 0.25, "loss/policy_avg": 2.0, "rewards/rm/mean": 0.5},
        {"episode": 32, "eval/scores": -1.5, "eval/response_length": 11.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = [
        {"name": "rm", "weight": 1.0, "path": "org/rm", "model": None},
        {"name": "judge", "weight": -0.25, "fn": None, "spec": "examples/reward_server.py:server"},
    ]
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sys, "argv", ["ppo_tldr.py", "--reward_model_path", "org/rm", "--kl_coef", "0.1"])
    args = card_args(tmp_path, use_peft=True, world_size=4)
    infra.outputs.write_model_card(
        args, script="/x/ppo_tldr.py", algorithm="PPO", doc="PPO on TL;DR.\n\nMore.", base_model="org/sft", sources=sources
    )
    meta, sections = read_card(tmp_path / "README.md")
    assert meta == {
        "library_name": "peft",
        "base_model": "org/sft",
        "tags": ["rlhf", "ppo", "ppo_tldr"],
        "datasets": ["trl-lib/tldr"],
    }
    assert sections[""].startswith(f"# {tmp_path.name}\n\nPPO on TL;DR.\n\n")
    assert "- **Saved:** LoRA adapters of the base model" in sections[""]
    assert "AutoPeftModelForCausalLM" in sections["Usage"]
    assert table(sections["Reward sources"]) == [
        ["rm", "reward model `org/rm`", "1"],
        ["judge", "function `examples/reward_server.py:server`", "-0.25"],
    ]
    # the latest value of each main key; loss/policy_avg is not one
    assert table(sections["Final metrics"]) == [
        ["episode", "32"],
        ["objective/scores", "0.25"],
        ["rewards/rm/mean", "0.5"],
        ["eval/scores", "-1.5"],
        ["eval/response_length", "11"],
    ]
    assert json.loads(fenced(sections["Hyperparameters"])) == vars(args)
    assert "`accelerate launch` (or torchrun) on 4 process(es)" in sections["Command"]
    assert fenced(sections["Command"]).strip() == "python ppo_tldr.py --reward_model_path org/rm --kl_coef 0.1"

    # a local base model and dataset are not hub ids; merged adapters are a plain transformers model
    monkeypatch.delenv("LOCAL_RANK")
    infra.outputs.write_model_card(
        card_args(tmp_path, dataset_name=str(tmp_path), use_peft=True, merge_lora=True, hub_model_id="me/m"),
        script="rloo.py",
        algorithm="RLOO",
        doc=None,
        base_model=str(tmp_path),
        sources=[],
    )
    meta, sections = read_card(tmp_path / "README.md")
    assert meta == {"library_name": "transformers", "tags": ["rlhf", "rloo"]}
    assert "(LoRA adapters merged into its weights)" in sections[""] and "launch" not in sections["Command"]


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, "--push_to_hub needs --hub_model_id"),
        ({"hub_model_id": "me/m", "save_model": False}, "--push_to_hub uploads the saved model; drop --no_save_model"),
        ({"hub_model_id": "me/m/extra"}, "--hub_model_id 'me/m/extra' is not a hub repo id"),
        ({"hub_model_id": "me/m", "no_hub": True}, "--push_to_hub needs the huggingface_hub package"),
        ({"hub_model_id": "me/m"}, None),
        ({"push_to_hub": False, "save_model": False}, None),
    ],
)
def test_check_hub_args(changes, expected, monkeypatch):
    """The hub flags are checked as the arguments are parsed (RunArgs.__post_init__)."""
    if changes.pop("no_hub", False):
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if it were not installed
        monkeypatch.setitem(sys.modules, "huggingface_hub.utils", None)
    args = {"push_to_hub": True, "hub_model_id": None, "save_model": True, **changes}
    if expected is None:
        infra.RunArgs(**args)
    else:
        with pytest.raises(SystemExit, match="^error: " + expected.replace("(", r"\(")):
            infra.RunArgs(**args)


RUN_ALL = """
import json, os, runpy, sys
sys.path.insert(0, os.path.dirname(json.loads(sys.argv[1])[0][0]))
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        print("EXIT " + json.dumps(str(e)))
"""


def test_every_script_checks_the_hub_flags_before_loading(tmp_path):
    """All six scripts, in one interpreter: --push_to_hub without --hub_model_id stops with its line right after
    parsing, before the (missing) model is looked for."""
    (tmp_path / "run_all.py").write_text(RUN_ALL)
    argvs = []
    for script in ["rloo.py", "ppo.py", "grpo.py", "rloo_tldr.py", "ppo_tldr.py", "distill.py"]:
        model = "--sft_model_path" if "tldr" in script else "--model_name_or_path"
        flags = f"{model} {tmp_path} --gradient_accumulation_steps 1 --push_to_hub --output_dir {tmp_path}/{script}"
        argvs.append([os.path.join(REPO, script), *flags.split()])
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run_all.py"), json.dumps(argvs)], capture_output=True, text=True, cwd=tmp_path
    )
    check_ok(proc)
    exits = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("EXIT ")]
    assert exits == ["error: --push_to_hub needs --hub_model_id, the repo to upload to (e.g. your-name/rloo-smollm2)"] * 6
    assert not any(os.path.exists(tmp_path / script) for script in ["rloo.py", "ppo.py", "grpo.py"])


def test_a_hub_repo_that_cannot_be_created_stops_the_run_before_it_trains(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--push_to_hub creates its repo as the run starts (transformers' Trainer does): offline, as here, that fails,
    and the run stops in one line with nothing written (not after training, at the upload)"""
    out = tmp_path / "out"
    flags = f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --total_episodes 16"
    proc = run(f"rloo.py {flags} --push_to_hub --hub_model_id me/tiny --output_dir {out}", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --push_to_hub cannot create 'me/tiny': ")
    assert not out.exists()
