#!/bin/bash
# --cuda_graphs on one GPU: decode_graphs.py (every family captured against generate(); sampling speed), then
# distill.py --cuda_graphs beside TRL's DistillationTrainer (benchmark/distill/distill_trl.py --no_eval), random
# SmolLM2-135M-shaped student and teacher (no hub there). Needs .gpu/ as h100_distill.sh says.
# Usage: bash benchmark/gpu/h100_graphs.sh OUT   (results: benchmark/results/gpu/h100_graphs)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
O=$1; PY=${PY:-python3}; W=${W:-/tmp/gd}; mkdir -p $W; S=$O/summary.txt; D=$(dirname "$0")
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S 2>&1
timeout 60 $PY $D/build_model.py .gpu/smollm2_cfg $W/student --seed 0 >> $S 2>&1
timeout 60 $PY $D/build_model.py .gpu/smollm2_cfg $W/teacher --seed 1 >> $S 2>&1
timeout ${T0:-150} $PY $D/decode_graphs.py $W/student > $O/decode.txt 2>&1; echo "decode rc=$?" >> $S
run() {
  n=$1; t=$2; shift 2; s=$(date +%s)
  timeout $t $PY benchmark/distill/distill_trl.py --model $W/student --teacher $W/teacher --trl_python $PY --output $W/$n "$@" > $O/$n.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - s ))s" >> $S
  cp $W/$n/seed1/summary.json $O/$n.json 2>/dev/null; tail -14 $O/$n.log >> $S
}
run graphs_fp32_8x2x24 ${T1:-150} --updates 24 --no_eval --ours=--cuda_graphs
run graphs_bf16_32x2x128 ${T2:-200} --updates 12 --no_eval --bf16 --per_device 32 --length 128 --ours=--cuda_graphs
cat $S
