"""A latency-bound task: grpo.py at --max_staleness 1 against 0 (the synchronous loop), episodes per second in one
sitting, where the reward is a judge that takes a fixed --delay seconds per completion, one call at a time (an LLM
judge or a sandbox stands in: time.sleep, which takes no CPU).

    python benchmark/async/latency.py                   # SmolLM2-135M-Instruct, 8 updates of 16 completions, 2 repeats

Each repeat runs both sides one after the other, the order alternating. Episodes per second are the script's own
(`eps` of the last row: episodes since the loop began over seconds since). The synchronous run's update waits for
16 x delay seconds of judging; the share of its time that was, and at staleness 1 how long each update still waited
for its batch (`async/wait_s`), go in the table. Writes OUT/results.json and OUT/README.md (default
benchmark/results/async/latency)."""

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from benchmark import harness  # noqa: E402

JUDGE = """import time

from infra.rewards import sentiment_reward


def slow_judge(prompts, completions, **kwargs):
    # one call per completion, each taking DELAY seconds, then the sentiment (the default run's reward)
    for _ in completions:
        time.sleep(DELAY)
    return sentiment_reward(prompts, completions)
"""

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=0.3, help="seconds per judged completion")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=harness.SMOLLM2)
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "async", "latency"))
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = tempfile.mkdtemp(prefix="latency_")
    judge = os.path.join(work, "judge.py")
    with open(judge, "w") as f:
        f.write(JUDGE.replace("DELAY", repr(args.delay)))
    runs = {0: [], 1: []}
    for repeat in range(args.repeats):
        for staleness in [0, 1] if repeat % 2 == 0 else [1, 0]:
            out = os.path.join(work, f"s{staleness}_r{repeat}")
            cmd = [sys.executable, os.path.join(REPO, "grpo.py"), "--model_name_or_path", args.model]
            cmd += ["--reward_fn", f"{judge}:slow_judge", "--total_episodes", str(16 * args.updates)]
            cmd += ["--max_staleness", str(staleness), "--num_sample_generations", "0", "--no_save_model"]
            cmd += ["--output_dir", out]
            wall, _ = harness.run(cmd, out + ".log")
            rows = harness.read(os.path.join(out, "metrics.jsonl"))
            waits = [r["async/wait_s"] for r in rows[1:] if "async/wait_s" in r]  # (the first: the whole first batch)
            wait = statistics.mean(waits) if waits else None
            runs[staleness].append({"eps": rows[-1]["eps"], "wall_s": wall, "wait_s": wait})
            print(f"repeat {repeat} staleness {staleness}: {runs[staleness][-1]}", flush=True)
    eps0 = [r["eps"] for r in runs[0]]
    eps1 = [r["eps"] for r in runs[1]]
    ratios = [b / a for a, b in zip(eps0, eps1)]
    seconds_per_update = 16 / statistics.mean(eps0)
    judged = 16 * args.delay
    results = {
        "setting": {"delay_s": args.delay, "updates": args.updates, "completions_per_update": 16, "model": args.model},
        "staleness0": runs[0],
        "staleness1": runs[1],
        "ratio": ratios,
        "sync_seconds_per_update": seconds_per_update,
        "judging_seconds_per_update": judged,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    wait1 = statistics.mean(r["wait_s"] for r in runs[1])
    lines = [
        "# Sampling ahead on a latency-bound task",
        "",
        f"grpo.py's default run (SmolLM2-135M-Instruct, 16 completions per update, fp32 on the CPU) with a judge that takes "
        f"{args.delay} s per completion, one call at a time, {args.updates} updates, {args.repeats} repeats of each side "
        "in one sitting, the order alternating:",
        "",
        "```bash",
        f"python benchmark/async/latency.py --delay {args.delay} --updates {args.updates} --repeats {args.repeats}",
        "```",
        "",
        "| | episodes/s, mean (lowest to highest) |",
        "| --- | --- |",
        f"| `--max_staleness 0` (sample, judge, update in turn) | {harness.spread(eps0, 2)} |",
        f"| `--max_staleness 1` (sampled and judged in a thread while the policy updates) | {harness.spread(eps1, 2)} |",
        f"| ratio, run by run | {harness.spread(ratios, 2)} |",
        "",
        f"In the synchronous run an update took {seconds_per_update:.1f} s, of which {judged:.1f} s "
        f"({100 * judged / seconds_per_update:.0f}%) was the judge's waiting. At staleness 1 an update waited "
        f"{wait1:.1f} s for its batch on average (after the first).",
    ]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
