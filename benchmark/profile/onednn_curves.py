"""The curves of three seeds with --onednn against the committed curves of the same seeds before it (torch's MKL).

    python benchmark/curves/curves.py rloo --task sentiment --seeds 1 2 3 --systems rloo.py --out NEW/rloo_sentiment
    python benchmark/curves/curves.py grpo --task sentiment --seeds 1 2 3 --systems grpo.py --out NEW/grpo_sentiment
    python benchmark/profile/onednn_curves.py NEW OUT.md

For each figure (NEW/<figure>, against every seed of benchmark/results/curves/<figure>): each seed's final score
(the mean of the last 4 updates) on both and Welch's t of the two sets, the score by quarter of the run (mean over
seeds), and at how many updates the new seeds' mean score lies within the old seeds' lowest to highest (above it,
below it). Writes the table to OUT.md."""

import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD = os.path.join(REPO, "benchmark", "results", "curves")


def scores(figure, system):
    """[seed][update] objective/scores, every seed of the figure"""
    out = []
    seeds = sorted(int(d[4:]) for d in os.listdir(os.path.join(figure, system)) if d.startswith("seed"))
    for seed in seeds:
        with open(os.path.join(figure, system, f"seed{seed}", "metrics.jsonl")) as f:
            out.append([json.loads(line)["objective/scores"] for line in f])
    return out


def mean(values):
    return sum(values) / len(values)


def main():
    new, out = sys.argv[1], sys.argv[2]
    lines = [
        "| figure | final score per seed: --onednn; before (Welch's t) | quarters, mean over seeds: --onednn; before | "
        "updates where the new mean lies within the old seeds' range (above, below) |",
        "| --- | --- | --- | --- |",
    ]
    for figure, system in (("rloo_sentiment", "rloo"), ("grpo_sentiment", "grpo")):
        if not os.path.isdir(os.path.join(new, figure)):
            continue
        a, b = scores(os.path.join(new, figure), system), scores(os.path.join(OLD, figure), system)
        ends = [[mean(s[-4:]) for s in runs] for runs in (a, b)]
        finals = [", ".join(f"{x:.2f}" for x in e) for e in ends]
        spread = (statistics.variance(ends[0]) / len(ends[0]) + statistics.variance(ends[1]) / len(ends[1])) ** 0.5
        t = (mean(ends[0]) - mean(ends[1])) / spread
        n = len(a[0])
        quarters = [
            ", ".join(f"{mean([mean(s[q * n // 4 : (q + 1) * n // 4]) for s in runs]):.2f}" for q in range(4))
            for runs in (a, b)
        ]
        above = sum(mean([s[u] for s in a]) > max(s[u] for s in b) for u in range(n))
        below = sum(mean([s[u] for s in a]) < min(s[u] for s in b) for u in range(n))
        inside = f"{n - above - below} of {n} ({above}, {below})"
        lines.append(f"| {figure} | {finals[0]}; {finals[1]} ({t:.1f}) | {quarters[0]}; {quarters[1]} | {inside} |")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
