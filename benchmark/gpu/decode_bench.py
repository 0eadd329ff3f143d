"""Sampling speed on one GPU: infra.decode.generate (distill.py's sampler) against transformers' generate() with its dynamic
cache, and with a static cache compiled (torch.compile, CUDA graphs). A random SmolLM2-135M-shaped model.

    python benchmark/gpu/decode_bench.py MODEL_DIR   # from the repository's root"""

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: utils
import infra.decode  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
path = sys.argv[1]
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def timeit(name, f, rows, length, n=3):
    try:
        t = time.perf_counter()
        f()
        sync()
        first = time.perf_counter() - t
        ts = []
        for _ in range(n):
            sync()
            t = time.perf_counter()
            f()
            sync()
            ts.append(time.perf_counter() - t)
        best = min(ts)
        print(f"  {name}: {best:.3f} s ({rows * length / best:.0f} tokens/s; first call {first:.1f} s)", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


for rows, length, dtype in [(16, 24, torch.float32), (64, 128, torch.bfloat16)]:
    m = base.to(dtype)
    torch.manual_seed(0)
    q = torch.randint(100, 40000, (rows, 40), device=dev)
    qm = torch.ones_like(q)
    qm[: rows // 2, :5] = 0  # half the prompts left-padded
    print(f"{rows} rows x {length} tokens, {dtype}, {dev}", flush=True)
    timeit("infra.decode.generate", lambda: infra.decode.generate(m, q, qm, length, 0.7), rows, length)
    timeit(
        "infra.decode.generate, a stop token (a sync per step)",
        lambda: infra.decode.generate(m, q, qm, length, 0.7, 2),
        rows,
        length,
    )
    gen = dict(max_new_tokens=length, min_new_tokens=length, do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    gen.update(pad_token_id=2, eos_token_id=2)
    timeit("generate(), dynamic cache", lambda: m.generate(input_ids=q, attention_mask=qm, **gen), rows, length)
    if dev == "cuda":
        timeit(
            "generate(), static cache, compiled",
            lambda: m.generate(input_ids=q, attention_mask=qm, cache_implementation="static", **gen),
            rows,
            length,
        )
