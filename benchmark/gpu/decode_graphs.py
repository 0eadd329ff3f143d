"""--cuda_graphs on one GPU. 1. Every model family of tests/test_families.py in miniature, sdpa and eager: the
GraphDecoder, capturing, against generate() (the same uniforms, left-padded prompts, greedy and at temperature 0.7,
twice on one graph, then with top-k, top-p, min-p and a repetition penalty): equal tokens, or refused in one line.
2. Sampling speed on a random SmolLM2-135M-shaped model (argv[1], when given): generate() against the GraphDecoder, 16
rows x 24 tokens in fp32 and 64 x 128 under bf16 autocast (as distill.py samples), the best of three calls after a first, and
how many tokens the two draw alike."""

import functools
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, utils
sys.path.insert(0, os.path.join(REPO, "tests"))  # test_families
from test_families import GRAPH_REFUSED, SUPPORTED, batch, build  # noqa: E402

import infra  # noqa: E402
import utils  # noqa: E402

# --top_p 0.9 --top_k 20 --min_p 0.05 --repetition_penalty 1.2, captured in the graph with its tokens-present buffer
truncated = functools.partial(utils.sampling_logits, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for name, attn in SUPPORTED:
    model = build(name, attn).to(dev)
    queries, qmask, *_ = (x.to(dev) for x in batch(k=2)[:2])
    decoder = infra.graphs.GraphDecoder()
    uniforms = torch.rand(len(queries), 12, generator=torch.Generator().manual_seed(1))
    verdict = []
    try:
        for rule in (0.0, 0.7, 0.7, truncated):
            expected = infra.decode.generate(model, queries, qmask, 12, rule, stop_token_id=5, uniforms=uniforms)
            got = decoder(model, queries, qmask, 12, rule, stop_token_id=5, uniforms=uniforms)
            verdict.append("equal" if got.tolist() == expected.tolist() else f"DIFFER {(got != expected).float().mean():.2f}")
    except SystemExit as e:
        verdict.append(f"refused ({'expected' if name in GRAPH_REFUSED else 'UNEXPECTED'}): {e}")
    except Exception as e:  # noqa: BLE001
        verdict.append(f"CRASH {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    print(f"{name:16} {attn:6} {' | '.join(verdict)}", flush=True)


if len(sys.argv) < 2:
    sys.exit(0)


def timeit(f, n=3):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = f()
    torch.cuda.synchronize()
    first, times = time.perf_counter() - t, []
    for _ in range(n):
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return out, first, min(times)


model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).to(dev).eval()
for rows, length, bf16 in [(16, 24, False), (64, 128, True)]:
    torch.manual_seed(0)
    q = torch.randint(100, 40000, (rows, 40), device=dev)
    qm = torch.ones_like(q)
    qm[: rows // 2, :5] = 0  # half the prompts left-padded
    u = torch.rand(rows, length, device=dev)
    decoder = infra.graphs.GraphDecoder()
    print(f"{rows} rows x {length} tokens, {'bf16 autocast' if bf16 else 'fp32'}", flush=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        plain, first, best = timeit(lambda: infra.decode.generate(model, q, qm, length, 0.7, stop_token_id=2, uniforms=u))
        print(f"  generate():     {best:.3f} s (first call {first:.1f} s)", flush=True)
        graph, first, best = timeit(lambda: decoder(model, q, qm, length, 0.7, stop_token_id=2, uniforms=u))
        print(f"  GraphDecoder:   {best:.3f} s (first call, capture and check: {first:.1f} s)", flush=True)
    n = min(plain.shape[1], graph.shape[1])
    same = (plain[:, :n] == graph[:, :n]).cumprod(1).sum(1).float().mean()
    print(f"  tokens drawn alike before the first difference, per row: {same:.1f} of {n}", flush=True)
