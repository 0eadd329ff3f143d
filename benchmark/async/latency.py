"""A latency-bound task: grpo.py at --max_staleness 1 and 2 against 0 (the synchronous loop), episodes per second in
one sitting, where the reward is a judge that takes a fixed --delay seconds per completion, one call at a time (an LLM
judge or a sandbox stands in: time.sleep, which takes no CPU).

    python benchmark/async/latency.py                   # SmolLM2-135M-Instruct, 8 updates of 16 completions, 2 repeats

Each repeat runs every side one after the other, the order alternating. Episodes per second are the script's own
(`eps` of the last row: episodes since the loop began over seconds since). The synchronous run's update waits for
16 x delay seconds of judging; the share of its time that was, and how long each update still waited for its batch
when sampling ahead (`async/wait_s`), go in the table. Writes OUT/results.json and OUT/README.md (default
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
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2], help="the sides sampling ahead, beside 0")
    parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "async", "latency"))
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = tempfile.mkdtemp(prefix="latency_")
    judge = os.path.join(work, "judge.py")
    with open(judge, "w") as f:
        f.write(JUDGE.replace("DELAY", repr(args.delay)))
    sides = [0, *args.staleness]
    runs = {n: [] for n in sides}
    for repeat in range(args.repeats):
        for staleness in sides if repeat % 2 == 0 else sides[::-1]:
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
    eps = {n: [r["eps"] for r in runs[n]] for n in sides}
    ratios = {n: [b / a for a, b in zip(eps[0], eps[n])] for n in args.staleness}
    seconds_per_update = 16 / statistics.mean(eps[0])
    judged = 16 * args.delay
    results = {
        "setting": {"delay_s": args.delay, "updates": args.updates, "completions_per_update": 16, "model": args.model},
        **{f"staleness{n}": runs[n] for n in sides},
        "ratio": {str(n): ratios[n] for n in args.staleness},
        "sync_seconds_per_update": seconds_per_update,
        "judging_seconds_per_update": judged,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    flags = " ".join(map(str, args.staleness))
    lines = [
        "# Sampling ahead on a latency-bound task",
        "",
        f"grpo.py's default run (SmolLM2-135M-Instruct, 16 completions per update, fp32 on the CPU) with a judge that takes "
        f"{args.delay} s per completion, one call at a time, {args.updates} updates, {args.repeats} repeats of each side "
        "in one sitting, the order alternating:",
        "",
        "```bash",
        f"python benchmark/async/latency.py --delay {args.delay} --updates {args.updates} --repeats {args.repeats} "
        f"--staleness {flags}",
        "```",
        "",
        "| | episodes/s, mean (lowest to highest) | against staleness 0, run by run | an update's wait for its batch (s) |",
        "| --- | --- | --- | --- |",
        f"| `--max_staleness 0` (sample, judge, update in turn) | {harness.spread(eps[0], 2)} | | |",
    ]
    for n in args.staleness:
        wait = statistics.mean(r["wait_s"] for r in runs[n])
        lines.append(
            f"| `--max_staleness {n}` (sampled, then judged, in two threads while the policy updates) | "
            f"{harness.spread(eps[n], 2)} | {harness.spread(ratios[n], 2)}x | {wait:.1f} |"
        )
    lines += [
        "",
        f"In the synchronous run an update took {seconds_per_update:.1f} s, of which {judged:.1f} s "
        f"({100 * judged / seconds_per_update:.0f}%) was the judge's waiting. The wait is the mean after the first update "
        "(which waits for a whole batch).",
    ]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
