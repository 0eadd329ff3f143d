"""The tables and curves of the pipeline's two demonstrations, from the metrics their scripts kept
(benchmark/results/pipeline/{rlhf_offline,calculator}/<run>/metrics.jsonl), written to each folder's README.md and
curves.png; the seeds that finished are reported, each named.

    python benchmark/pipeline/report.py
"""

import glob
import gzip
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from benchmark import harness  # noqa: E402

RESULTS = os.path.join(REPO, "benchmark", "results", "pipeline")


def runs(folder, prefix):
    """{seed: rows} of the runs folder/prefix_<seed>"""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, f"{prefix}_[0-9]*"))):
        if os.path.exists(os.path.join(path, "metrics.jsonl")):
            found[int(path.rsplit("_", 1)[1])] = harness.read(os.path.join(path, "metrics.jsonl"))
    return found


def evals(rows, key):
    return [r for r in rows if key in r]


def cell(values, digits=3):
    return harness.spread(values, digits) if len(values) > 1 else (f"{values[0]:.{digits}f}" if values else "n/a")


def rlhf():
    folder = os.path.join(RESULTS, "rlhf_offline")
    rm = harness.read(os.path.join(folder, "rm", "metrics.jsonl"))
    rm_evals = evals(rm, "eval/accuracy")
    lines = [
        "# RLHF from preferences, end to end on a CPU",
        "",
        "`bash benchmark/pipeline/rlhf_offline.sh`, then `python benchmark/pipeline/report.py`. SmolLM2-135M-Instruct;",
        "the preference pairs of data/preferences.jsonl (the VADER sentiment score as the labeller). The true score is the",
        "sentiment of the greedy completion of each of the 64 held-out prompts (`eval/rewards/sentiment`).",
        "",
        f"reward.py (2 epochs of 256 pairs): held-out accuracy {rm_evals[0]['eval/accuracy']:.3f} before training,"
        f" {rm_evals[-1]['eval/accuracy']:.3f} after; margin {rm_evals[-1]['eval/margin']:.3f}.",
        "",
    ]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    rl = {name: runs(folder, name) for name in ("rloo_rm", "rloo_true")}
    keys = {"rloo_rm": "eval/rewards/sentiment", "rloo_true": "eval/scores"}  # (the true score alone: eval/scores)
    # the furthest evaluation every RL run reached (a run cut short is compared there too)
    common = min((evals(rows, keys[n])[-1]["episode"] for n, got in rl.items() for rows in got.values()), default=0)
    lines += [
        f"| run | seeds | true score before | true score at episode {common} | true score at the end"
        " | learnt reward at the end (its own score) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in [("rloo_rm", "rloo.py on reward.py's model"), ("rloo_true", "rloo.py on the true score")]:
        got, key = rl[name], keys[name]
        if not got:
            continue
        before = [evals(rows, key)[0][key] for rows in got.values()]
        at = [next(r[key] for r in evals(rows, key) if r["episode"] == common) for rows in got.values()]
        after = [evals(rows, key)[-1][key] for rows in got.values()]
        learnt = [evals(rows, key)[-1].get("eval/rewards/rm", float("nan")) for rows in got.values()]
        own = cell(learnt) if name == "rloo_rm" else ""
        done = max(r["episode"] for rows in got.values() for r in rows)
        lines.append(
            f"| {label} | {' '.join(map(str, got))} | {cell(before)} | {cell(at)} | {cell(after)} (episode {done}) | {own} |"
        )
        train = [[r["rewards/sentiment/mean"] for r in rows if "rewards/sentiment/mean" in r] for rows in got.values()]
        width = min(map(len, train))
        episodes = [r["episode"] for r in next(iter(got.values())) if "rewards/sentiment/mean" in r][:width]
        harness.band(ax[0], episodes, [t[:width] for t in train], label)
        if name == "rloo_rm":
            learnt_curve = [[r["rewards/rm/mean"] for r in rows if "rewards/rm/mean" in r][:width] for rows in got.values()]
            harness.band(ax[1], episodes, learnt_curve, "learnt reward (its offset subtracted)")
            harness.band(ax[1], episodes, [t[:width] for t in train], "true score", linestyle="--")
    offline = [  # (run, the table's label, the name its sentence gives it)
        ("dpo", "dpo.py on the same pairs (1 epoch)", "dpo.py"),
        ("kto", "kto.py on them unpaired (1 epoch)", "kto.py"),
        ("simpo", "dpo.py --loss_type simpo (SimPO, no reference)", "SimPO"),
        ("orpo", "dpo.py --loss_type orpo (ORPO, no reference)", "ORPO"),
    ]
    for name, label, _ in offline:
        got = runs(folder, f"{name}_eval")
        if got:  # (the sentiment its one source: eval/scores)
            after = [evals(rows, "eval/scores")[0]["eval/scores"] for rows in got.values()]
            lines.append(f"| {label} | {' '.join(map(str, got))} | (as above) | | {cell(after)} | |")
    for name, _, short in offline:
        trained = runs(folder, name)
        if name == "kto" and trained:  # (labelled completions: no pair to rank)
            last = [evals(rows, "eval/rewards/chosen")[-1] for rows in trained.values()]
            gap = [r["eval/rewards/chosen"] - r["eval/rewards/rejected"] for r in last]
            lines += ["", f"{short}'s held-out implicit reward, desirable less undesirable: {cell(gap)}."]
        elif trained:
            last = [evals(rows, "eval/rewards/margins")[-1] for rows in trained.values()]
            margins, accuracy = [r["eval/rewards/margins"] for r in last], [r["eval/rewards/accuracies"] for r in last]
            lines += ["", f"{short}'s held-out implicit-reward accuracy {cell(accuracy)}, margin {cell(margins)}."]
    lines += ["", *overoptimisation(folder, rl["rloo_rm"], ax[2])]
    ax[0].set(xlabel="episodes", ylabel="true sentiment of the training completions", title="the true score")
    ax[1].set(xlabel="episodes", title="rloo.py on the learnt reward")
    for a in ax:
        a.legend(fontsize=8)
    harness.save_figure(fig, os.path.join(folder, "curves.png"))
    lines += ["", "![curves](curves.png)", ""]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def overoptimisation(folder, seeds, ax):
    """The RM runs' held-out evaluations: the true score against the learnt reward, per evaluation (the seeds' mean
    and range), and the longer run's; drawn on ax."""
    lines = [
        "The learnt reward against the true score on the held-out prompts, at each evaluation of the RM runs:",
        "",
        "| run | episode | true score | learnt reward |",
        "| --- | --- | --- | --- |",
    ]
    long = os.path.join(folder, "rloo_rm_long_1", "metrics.jsonl")
    shown = [(f"rloo_rm, seeds {' '.join(map(str, seeds))}", list(seeds.values()))] if seeds else []
    shown += [("rloo_rm_long_1 (960 episodes)", [harness.read(long)])] if os.path.exists(long) else []
    for label, got in shown:
        points = [evals(rows, "eval/rewards/rm") for rows in got]
        width = min(map(len, points))
        for i in range(width):
            true = [p[i]["eval/rewards/sentiment"] for p in points]
            learnt = [p[i]["eval/rewards/rm"] for p in points]
            lines.append(f"| {label} | {points[0][i]['episode']} | {cell(true)} | {cell(learnt)} |")
        x = [r["episode"] for r in points[0][:width]]
        true = harness.band(ax, x, [[r["eval/rewards/sentiment"] for r in p[:width]] for p in points], f"{label}: true")
        harness.band(
            ax,
            x,
            [[r["eval/rewards/rm"] for r in p[:width]] for p in points],
            f"{label}: learnt",
            linestyle="--",
            color=true.get_color(),
        )
    ax.set(xlabel="episodes", ylabel="held-out, greedy", title="the learnt reward against the true score")
    return lines


def samples(path):
    """the held-out samples an evaluation wrote, as calculator.sh keeps them (gzipped)"""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def by_operator(rows):
    """pass@1 of an evaluation's samples on the words task: over all, then for each operator word"""
    found = {"all": rows}
    found.update({word: [r for r in rows if f" {word} " in r["prompt"]] for word in ("plus", "minus", "times")})
    return {key: sum(r["score"] for r in got) / len(got) for key, got in found.items()}


def mean_over_updates(rows, key):
    got = [r[key] for r in rows if key in r]
    return sum(got) / len(got)


def calculator():
    folder = os.path.join(RESULTS, "calculator")
    lines = [
        "# A model that learns to use its tool",
        "",
        "`bash benchmark/pipeline/calculator.sh`, then `python benchmark/pipeline/report.py`. SmolLM2-135M-Instruct;",
        "sft.py on 256 synthetic calculator traces, then grpo.py with the calculator environment on sums of 3- to",
        "5-digit numbers, from the SFT model and from the model without it. The held-out evaluation: 200 such sums, greedy,",
        "before training and at the end (`eval/scores` is pass@1). Each row is one run, named by its folder; the updates it",
        "finished are counted.",
        "",
        "| run | updates | evaluations: episode, pass@1 | training: tool calls per episode, accuracy (first, last update) |",
        "| --- | --- | --- | --- |",
    ]
    for path in sorted(p for p in glob.glob(os.path.join(folder, "grpo_*_[0-9]*")) if "words" not in p):  # (below)
        rows = harness.read(os.path.join(path, "metrics.jsonl"))
        ev = [f"{r['episode']}: {r['eval/scores']:.3f}" for r in evals(rows, "eval/scores")]
        train = [r for r in rows if "env/tool_calls" in r]
        seen = (
            f"{train[0]['env/tool_calls']:.2f} to {train[-1]['env/tool_calls']:.2f};"
            f" {train[0]['rewards/accuracy/mean']:.3f} to {train[-1]['rewards/accuracy/mean']:.3f}"
            if train
            else ""
        )
        lines.append(f"| {os.path.basename(path)} | {len(train)} | {'; '.join(ev)} | {seen} |")
    lines += ["", "Over the seeds (mean, then the lowest to the highest):", ""]
    lines += [
        "| start | seeds | pass@1 before | pass@1 at the end | tool calls per episode (last update)"
        " | groups without a spread in reward (no gradient), over the updates |"
    ]
    lines += ["| --- | --- | --- | --- | --- | --- |"]
    for start, label in [("calc_sft", "after sft.py"), ("base", "SmolLM2-135M-Instruct")]:
        got = runs(folder, f"grpo_{start}")
        if got:
            before = [evals(rows, "eval/scores")[0]["eval/scores"] for rows in got.values()]
            after = [evals(rows, "eval/scores")[-1]["eval/scores"] for rows in got.values()]
            calls = [[r for r in rows if "env/tool_calls" in r][-1]["env/tool_calls"] for rows in got.values()]
            flat = [mean_over_updates(rows, "frac_reward_zero_std") for rows in got.values()]
            seeds = " ".join(map(str, got))
            lines.append(f"| {label} | {seeds} | {cell(before)} | {cell(after)} | {cell(calls, 2)} | {cell(flat, 2)} |")
    for name in ("calc_sft", "calc_sft_48"):
        lines.append("")
        sft = harness.read(os.path.join(folder, name, "metrics.jsonl"))
        lines.append(
            f"sft.py on {sft[-1]['episode']} traces ({name}): loss per learnt token {sft[0]['loss/sft']:.3f} at the first"
            f" update, {sft[-1]['loss/sft']:.5f} at the last; next-token accuracy {sft[-1]['train/mean_token_accuracy']:.3f}."
        )
    lines += [
        "",
        "The harder task: 200 held-out questions with the operator in words (data/calculator_words_test.jsonl), greedy",
        "pass@1 by operator of each SFT model (the traces show sums only), and after grpo.py on the task.",
        "",
        "| model | pass@1 | plus | minus | times |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(label, got):  # got: [(run folder, episode)] over seeds
        paths = [os.path.join(folder, run, "eval_samples", f"episode_{episode}.jsonl.gz") for run, episode in got]
        if got and all(map(os.path.exists, paths)):
            ops = [by_operator(samples(path)) for path in paths]
            lines.append(f"| {label} | " + " | ".join(cell([o[key] for o in ops]) for key in ops[0]) + " |")

    row("calc_sft", [("calc_sft_words", 0)])
    row("calc_sft_48", [("calc_sft_48_words", 0)])
    words = runs(folder, "grpo_calc_sft_words")
    ends = {seed: evals(rows, "eval/scores")[-1]["episode"] for seed, rows in words.items()}
    row(
        f"calc_sft, then grpo.py on the task for {max(ends.values(), default=0)} episodes (seeds {' '.join(map(str, words))})",
        [(f"grpo_calc_sft_words_{seed}", end) for seed, end in ends.items()],
    )
    if words:
        flat = [mean_over_updates(rows, "frac_reward_zero_std") for rows in words.values()]
        train = [[r for r in rows if "rewards/accuracy/mean" in r] for rows in words.values()]
        first, last = [t[0]["rewards/accuracy/mean"] for t in train], [t[-1]["rewards/accuracy/mean"] for t in train]
        lines += [
            "",
            f"grpo.py on the task: {cell(flat, 2)} of its groups had no spread in reward (no gradient), over its updates;"
            f" the training accuracy {cell(first)} at the first update, {cell(last)} at the last.",
        ]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if os.path.exists(os.path.join(RESULTS, "rlhf_offline", "rm", "metrics.jsonl")):
        rlhf()
    if os.path.isdir(os.path.join(RESULTS, "calculator")):
        calculator()
