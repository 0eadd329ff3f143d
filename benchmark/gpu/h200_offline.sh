#!/bin/bash
# The offline scripts' newest options on one GPU (every new tensor on the run's device: the CPU suite cannot see a
# mismatch), all at once on a random SmolLM2-135M-shaped model, in about a minute: ilql.py (fp32 and bf16, its held-out
# evaluation sampling through the value-shaped model), sft.py --packing (bfd and wrapped, bf16), reward.py --padding_free.
# Usage, from the repository's root with .gpu/ as benchmark/gpu/h100_distill.sh says, and reward-labelled rows in
# .gpu/scored.jsonl and .gpu/scored_test.jsonl (data/scored*.jsonl, or any in that format):
#   bash benchmark/gpu/h200_offline.sh OUT [--tiny]      (results: benchmark/results/gpu/offline)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false
O=$(mkdir -p "$1" && cd "$1" && pwd); TINY=${2:-}; PY=${PY:-python3}; W=${W:-/tmp/offline}; rm -rf $W; mkdir -p $W/logs
G=$(cd "$(dirname "$0")" && pwd); S=$O/summary.txt; : > $S
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $S 2>&1
timeout 60 $PY $G/build_model.py .gpu/smollm2_cfg $W/model $TINY > $W/logs/build.log 2>&1
M="--model_name_or_path $W/model --no_save_model --total_episodes 32"
I="--dataset_name .gpu/scored.jsonl --eval_dataset_name .gpu/scored_test.jsonl --response_length 16"
run() {  # run NAME SCRIPT FLAGS...: in the background; its status, time and last metrics row in the summary
  local n=$1; shift
  (s=$SECONDS; timeout -k 5 ${T_RUN:-150} $PY "$@" --output_dir $W/$n > $W/logs/$n.log 2>&1; rc=$?
    { echo "$n rc=$rc $((SECONDS - s))s $(tail -n 1 $W/$n/metrics.jsonl 2>/dev/null | cut -c1-260)"
      [ $rc -ne 0 ] && grep -E "Error|error" $W/logs/$n.log | tail -n 3; } > $W/$n.rc) &
}
run ilql ilql.py $M $I
run ilql_bf16 ilql.py $M $I --bf16 --gen_beta 2
run sft_packing_bf16 sft.py $M --packing --max_length 256 --bf16
run sft_wrapped sft.py $M --packing --packing_strategy wrapped --max_length 256
run reward_padding_free_bf16 reward.py $M --padding_free --bf16 --eval_dataset_name data/preferences_test.jsonl
wait
cat $W/*.rc >> $S
tar -czf $O/logs.tgz -C $W logs 2>/dev/null
cat $S
