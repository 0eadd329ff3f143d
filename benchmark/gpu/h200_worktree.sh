#!/bin/bash
# the working tree on CUDA: rloo.py, grpo.py with a multi-turn environment, ppo.py (64 episodes each, a random
# SmolLM2-135M-sized model), then the multi-turn learning test. From the repository's root, with .gpu/ as
# h100_distill.sh says: bash benchmark/gpu/h200_worktree.sh OUT   (results: benchmark/results/gpu/h200)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
O=$1; W=/tmp/g; mkdir -p $W; S=$O/summary.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $S
timeout 60 python3 benchmark/gpu/build_model.py .gpu/smollm2_cfg $W/m >> $S 2>&1
C="--model_name_or_path $W/m --total_episodes 64 --num_sample_generations 0 --no_save_model"
run() {
  n=$1; shift; s=$(date +%s)
  timeout 70 python3 "$@" > $O/$n.log 2>&1; rc=$?
  echo "$n rc=$rc $(( $(date +%s) - s ))s" >> $S
  python3 - "$W/$n/metrics.jsonl" >> $S 2>&1 <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bad = [k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
keep = [k for k in rows[-1] if k in ("episode", "eps", "reward", "objective/scores", "env/turns", "env/policy_token_fraction", "objective/kl")]
print("  rows", len(rows), "non-finite", bad, {k: rows[-1][k] for k in keep})
PY
  [ $rc -ne 0 ] && grep -E "Error|error" $O/$n.log | tail -4 >> $S
}
run rloo rloo.py $C --output_dir $W/rloo
run grpo_env grpo.py $C --environment examples/environments/user_simulator.py:UserSimulator --max_turns 2 \
  --stop_token None --output_dir $W/grpo_env
run ppo ppo.py $C --output_dir $W/ppo
timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_environments.py -k learns > $O/tests.log 2>&1
echo "test learns_through_a_later_turn rc=$?" >> $S; tail -2 $O/tests.log >> $S
cat $S
