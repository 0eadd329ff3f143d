#!/bin/bash
# One device command: build a random SmolLM2-135M-sized model, run rloo/grpo/ppo fp32 and bf16, then a test subset.
# Usage (from the repository's root, the wheels installed and .gpu/smollm2_cfg made as h100_distill.sh says):
#   bash benchmark/gpu/h200_scripts.sh OUTDIR PYTHON MODELFLAG EPISODES BUDGET_S   (results: benchmark/results/gpu/h200)
# MODELFLAG: "" (full 135M config) or "--tiny" (CPU rehearsal). Steps that would not fit BUDGET_S are skipped.
OUTD=$(mkdir -p "$1" && cd "$1" && pwd); PY=$2; TINY=$3; EP=$4; BUDGET=$5
G=$(cd "$(dirname "$0")" && pwd)
W=/tmp/gpuwork; rm -rf $W; mkdir -p $W/logs $W/runs
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false HF_HOME=$W/hf
SUM=$OUTD/summary.txt; : > $SUM
pack() { tar -czf $OUTD/logs.tgz --exclude='*.safetensors' -C $W logs runs 2>/dev/null; }
step() {  # step NAME TIMEOUT_S CMD...  (cut to the budget left; skipped when under 45 s are left)
  local name=$1 to=$2; shift 2; local left=$((BUDGET - SECONDS))
  if (( left < 45 )); then echo "SKIP $name (elapsed ${SECONDS}s)" | tee -a $SUM; return; fi
  (( to > left )) && to=$left
  echo "=== $name: $*" ; local t0=$(date +%s.%N)
  timeout -k 5 $to "$@" > $W/logs/$name.log 2>&1; local rc=$?
  local wall=$(python3 -c "print(f'{$(date +%s.%N)-$t0:.1f}')" 2>/dev/null || echo ?)
  echo "$name rc=$rc wall=${wall}s timeout=${to}s" | tee -a $SUM; tail -n 4 $W/logs/$name.log
  if [[ $name == rloo* || $name == grpo* || $name == ppo* ]]; then
    $PY $G/summarize.py $name $W/runs/$name/metrics.jsonl $wall | tee -a $SUM; fi
  if [ $rc -ne 0 ]; then grep -n -E "Error|error|Traceback" $W/logs/$name.log | tail -n 8 | tee -a $SUM; fi
  pack
}
echo "--- env"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a $SUM
$PY -c "import torch,transformers,accelerate,datasets,tyro,tokenizers;print('torch',torch.__version__,'cuda',torch.cuda.is_available(),torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-','transformers',transformers.__version__,'accelerate',accelerate.__version__,'datasets',datasets.__version__,'tyro',tyro.__version__,'tokenizers',tokenizers.__version__)" 2>&1 | tail -n 3 | tee -a $SUM
$PY -m pip list 2>/dev/null | grep -iE "^(pyarrow|fsspec|pandas|huggingface.hub|typing.extensions|peft|tensorboard|rich|safetensors|dill|multiprocess) " | tr -s ' ' | tr '\n' ';' | tee -a $SUM; echo | tee -a $SUM
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 1 > $W/logs/smi.csv 2>/dev/null &
SMI=$!
M=$W/model
step build 90 $PY $G/build_model.py .gpu/smollm2_cfg $M $TINY
cd $G/../..  # the repository's root
C="--model_name_or_path $M --total_episodes $EP --num_sample_generations 0"
step rloo      90 $PY rloo.py $C --output_dir $W/runs/rloo
step grpo      90 $PY grpo.py $C --no_save_model --output_dir $W/runs/grpo
step ppo       120 $PY ppo.py  $C --no_save_model --output_dir $W/runs/ppo
step rloo_bf16 80 $PY rloo.py $C --no_save_model --bf16 --output_dir $W/runs/rloo_bf16
step grpo_bf16 80 $PY grpo.py $C --no_save_model --bf16 --output_dir $W/runs/grpo_bf16
step ppo_bf16  100 $PY ppo.py  $C --no_save_model --bf16 --output_dir $W/runs/ppo_bf16
step test_utils 60 $PY -m pytest -q -x -p no:cacheprovider tests/test_utils.py
step test_rloo 100 $PY -m pytest -q -p no:cacheprovider tests/test_rloo.py -k "end_to_end or score_rises or reward_model_with"
step rloo_bf16_b64 70 $PY rloo.py $C --total_episodes $((EP * 4)) --no_save_model --bf16 --per_device_train_batch_size 64 \
  --gradient_accumulation_steps 1 --rloo_k 4 --output_dir $W/runs/rloo_bf16_b64
kill $SMI 2>/dev/null
echo "--- done in ${SECONDS}s" | tee -a $SUM; pack
cat $SUM
