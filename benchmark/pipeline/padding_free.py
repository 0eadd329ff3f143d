"""sft.py's --padding_free against padded micro-batches: one forward and backward pass of SmolLM2-135M-Instruct (fp32,
the CPU) over a micro-batch of 8 rows, padded (sft.nll's default: left padding, the logits of the last 41 columns) or
packed without padding (infra.offline.forward_packed: first fit into rows of the longest row's length), the logits of the last
40 tokens of each row either way. Row lengths are drawn uniformly from each case's range (token ids at random: the time
does not depend on them), with --seed; each side's time is the fastest of --repeats passes after a warm-up, the sides
alternating.

    python benchmark/pipeline/padding_free.py

Writes OUT/results.json and OUT/README.md (default benchmark/results/pipeline/padding_free)."""

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import utils  # noqa: E402
from benchmark import harness  # noqa: E402
from infra import forward_packed  # noqa: E402

CASES = {  # name -> the range of a row's tokens
    "like the shipped pairs' prompt and completion (45 to 97)": (45, 97),
    "like TL;DR (380 to 566)": (380, 566),
    "widely varying (30 to 600)": (30, 600),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "pipeline", "padding_free"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    generator = torch.Generator().manual_seed(args.seed)
    results = {}
    for name, (low, high) in CASES.items():
        lengths = torch.randint(low, high + 1, (8,), generator=generator)
        width = int(lengths.max())
        mask = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()  # left padding
        ids = torch.randint(10, 1000, mask.shape, generator=generator) * mask
        wanted = mask.bool().clone()  # the positions that predict each row's last 40 tokens
        wanted[:, :-41] = False
        wanted[:, -1] = False

        def padded():
            model.zero_grad()
            logits = utils.forward(model, ids, mask, logits_to_keep=41).logits[:, :-1]
            logits.logsumexp(-1).sum().backward()

        def packed():
            model.zero_grad()
            forward_packed(model, ids, mask, wanted).logsumexp(-1).sum().backward()

        slots = []  # the packed rows' columns, seen in a warm-up pass of each side
        hook = model.register_forward_pre_hook(lambda _, a, kw: slots.append(kw["input_ids"].numel()), with_kwargs=True)
        packed()
        hook.remove()
        padded()
        times = {"padded": [], "packed": []}
        for repeat in range(args.repeats):
            for side, fn in [("padded", padded), ("packed", packed)][:: 1 if repeat % 2 else -1]:
                start = time.perf_counter()
                fn()
                times[side].append(time.perf_counter() - start)
        results[name] = {
            "tokens": int(mask.sum()),
            "padded_columns": mask.numel(),
            "packed_columns": slots[0],
            "padded_s": min(times["padded"]),
            "packed_s": min(times["packed"]),
        }
        print(name, results[name], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"setting": vars(args), "cases": results}, f, indent=1)
    lines = [
        "# sft.py --padding_free: one pass over a micro-batch, packed against padded",
        "",
        "```bash",
        f"python benchmark/pipeline/padding_free.py --repeats {args.repeats} --seed {args.seed}",
        "```",
        "",
        "| 8 rows of tokens | real tokens | columns padded / packed | seconds padded / packed (fastest) | speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['tokens']} | {r['padded_columns']} / {r['packed_columns']} | "
            f"{r['padded_s']:.2f} / {r['packed_s']:.2f} | {r['padded_s'] / r['packed_s']:.2f}x |"
        )
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
