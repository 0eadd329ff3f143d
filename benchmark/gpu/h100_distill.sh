#!/bin/bash
# distill.py beside TRL's DistillationTrainer on one GPU: random SmolLM2-135M-shaped student and teacher (no hub there).
# Run from the repository's root with .gpu/ there: .gpu/whl the wheels of transformers, datasets (dill, multiprocess),
# tyro (docstring_parser, typeguard), tokenizers and trl==1.16.0; .gpu/smollm2_cfg made by benchmark/gpu/extract_cfg.py.
# Usage: bash benchmark/gpu/h100_distill.sh OUT [--tiny]   (results: benchmark/results/gpu/h100_distill)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
O=$1; TINY=${2:-}; PY=${PY:-python3}; W=${W:-/tmp/gd}; mkdir -p $W; S=$O/summary.txt
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S 2>&1
$PY -c "import torch, transformers, trl, datasets, accelerate; print(torch.__version__, torch.cuda.is_available(), transformers.__version__, trl.__version__, datasets.__version__, accelerate.__version__)" >> $S 2>&1
timeout 60 $PY benchmark/gpu/build_model.py .gpu/smollm2_cfg $W/student --seed 0 $TINY >> $S 2>&1
timeout 60 $PY benchmark/gpu/build_model.py .gpu/smollm2_cfg $W/teacher --seed 1 $TINY >> $S 2>&1
run() {
  n=$1; t=$2; shift 2; s=$(date +%s)
  timeout $t $PY benchmark/distill/distill_trl.py --model $W/student --teacher $W/teacher --trl_python $PY --output $W/$n "$@" > $O/$n.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - s ))s" >> $S
  cp $W/$n/seed1/summary.json $O/$n.json 2>/dev/null; tail -14 $O/$n.log >> $S
}
run fp32_8x2x24 ${T1:-150} --updates 24 --no_eval
run bf16_8x2x24 ${T1:-150} --updates 24 --no_eval --bf16
run bf16_32x2x128 ${T2:-200} --updates 12 --no_eval --bf16 --per_device 32 --length 128
cat $S
