"""A decoding step against its bound on one GPU: ROWS completions of LENGTH tokens from the model in argv[1] (40-token
prompts, temperature 0.7, no stop), decoded by --cuda_graphs' GraphDecoder as the scripts decode under --bf16 (fp32
weights, bf16 autocast, so each step casts every weight anew) and with the weights held in bf16. The bound of a step is
the larger of its bytes over the measured copy bandwidth and its FLOPs over the measured bf16 matrix-product peak; the
bytes are the weights' reads (8 per parameter under autocast: the fp32 read, the bf16 cast written and read; 2 in bf16)
and the KV cache's reads at the mean length. Usage: python decode_bound.py MODEL [ROWS] [LENGTH]"""

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import infra  # noqa: E402

path, rows, length = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64, int(sys.argv[3]) if len(sys.argv) > 3 else 512
cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")


def timed(f, repeats=3):
    f()  # warm-up (and the graphs' capture)
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def machine():
    """(bytes/s of a device-to-device copy, read and written; FLOP/s of a bf16 matrix product)"""
    n = 1 << 28 if cuda else 1 << 22  # 1 GiB of fp32 on the GPU
    x = torch.empty(n, device=dev)
    side = 8192 if cuda else 512
    a = torch.randn(side, side, device=dev, dtype=torch.bfloat16)
    return 2 * 4 * n / timed(lambda: x.clone()), 2 * side**3 / timed(lambda: a @ a)


bandwidth, peak = machine()
print(f"measured: copy {bandwidth / 1e12:.2f} TB/s, bf16 matrix product {peak / 1e12:.0f} TFLOP/s", flush=True)

model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
cfg = model.config
params = sum(p.numel() for p in model.parameters())
head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16
torch.manual_seed(0)
queries = torch.randint(100, 40000, (rows, 40), device=dev)
mask = torch.ones_like(queries)
uniforms = torch.rand(rows, length, device=dev)
mean_kv = rows * (40 + length / 2) * kv_per_token
flops = 2 * params * rows  # the matrix products of one step (attention's own is small at these lengths)
decoder = infra.graphs.GraphDecoder(capture=cuda)
print(f"{os.path.basename(path)}: {params / 1e9:.3f}B parameters, {rows} rows x {length} tokens", flush=True)
for name, weight_bytes in [("fp32 weights, bf16 autocast (as --bf16 runs)", 8), ("bf16 weights", 2)]:
    if weight_bytes == 2:
        model.to(torch.bfloat16)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=weight_bytes == 8):
        seconds = timed(lambda: decoder(model, queries, mask, length, 0.7, stop_token_id=None, uniforms=uniforms), 2)
    step = seconds / length
    bound = max((weight_bytes * params + mean_kv) / bandwidth, flops / peak)
    print(
        f"  {name}: {step * 1e3:.2f} ms a step ({rows * length / seconds:.0f} tokens/s); bound {bound * 1e3:.2f} ms "
        f"(bytes {(weight_bytes * params + mean_kv) / 1e9:.2f} GB, {flops / 1e9:.0f} GFLOP): {step / bound:.2f}x the bound",
        flush=True,
    )
    decoder = infra.graphs.GraphDecoder(capture=cuda)  # (a graph per dtype)
if cuda:
    print(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
