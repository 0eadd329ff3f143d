# Sourced by h200_parity.sh and h200_offline.sh (after OUT [--tiny] and W, the work folder): the environment, the
# wheels installed (SKIP_PIP: not), a random SmolLM2-135M-shaped model built into $W/model, and run(), which starts one
# script in the background and writes its status, time and last metrics row to $W/NAME.rc; finish() gathers them.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false
O=$(mkdir -p "$1" && cd "$1" && pwd); TINY=${2:-}; PY=${PY:-python3}; rm -rf $W; mkdir -p $W/logs
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); S=$O/summary.txt; : > $S
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $S 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $S 2>&1
timeout 60 $PY $G/build_model.py .gpu/smollm2_cfg $W/model $TINY > $W/logs/build.log 2>&1
run() {  # run NAME SCRIPT FLAGS...
  local n=$1; shift
  (s=$SECONDS; timeout -k 5 ${T_RUN:-150} $PY "$@" --output_dir $W/$n > $W/logs/$n.log 2>&1; rc=$?
    { echo "$n rc=$rc $((SECONDS - s))s $(tail -n 1 $W/$n/metrics.jsonl 2>/dev/null | cut -c1-260)"
      [ $rc -ne 0 ] && grep -E "Error|error" $W/logs/$n.log | tail -n 3; } > $W/$n.rc) &
}
finish() {  # wait for the runs, then their lines (and any log named in $@) into the summary, the logs packed
  wait
  cat $W/*.rc >> $S
  for log in "$@"; do grep -v "^Loading\|Writing" $W/logs/$log >> $S 2>/dev/null; done
  tar -czf $O/logs.tgz -C $W logs 2>/dev/null
  cat $S
}
