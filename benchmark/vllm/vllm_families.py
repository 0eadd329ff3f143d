"""--use_vllm over the model families of tests/test_families.py: which run with vLLM's engine and which are refused.

    python benchmark/vllm/vllm_families.py

Each family the scripts train (the recurrent ones are refused before any engine) is built in miniature (random
weights, heads of 32), in a process of its own: infra.engine.vllm_engine starts the engine as `--use_vllm` does (it refuses,
in one line, a model vLLM cannot build or run, and one whose logprobs, after the policy's weights are synced in, differ
from the trainer's), then the engine samples 3 x 3 completions of 8 tokens at temperature 0.7 from the synced weights
and their logprobs are compared with the trainer's. Writes benchmark/results/vllm/families/results.{json,md}."""

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, utils, benchmark.harness
from benchmark import harness  # noqa: E402

OUT = os.path.join(harness.RESULTS, "vllm", "families")


def one(name):
    """The engine for one family, in this process: 'runs' with the largest logprob difference, or the refusal."""
    import types

    import torch
    import transformers as tf

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_families import vllm_config

    import infra
    import utils

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(vllm_config(name)).eval()
    model.config.architectures = [type(model).__name__]
    args = types.SimpleNamespace(bf16=False, seed=1, max_prompt_length=32, response_length=12, vllm_enforce_eager=True,
                                 vllm_gpu_memory_utilization=0.3, vllm_tensor_parallel_size=1)  # fmt: skip
    accelerator = types.SimpleNamespace(num_processes=1, local_process_index=0, is_main_process=False)
    try:
        engine = infra.engine.vllm_engine(accelerator, args, model)
    except SystemExit as e:
        return {"family": name, "runs": False, "refusal": str(e)}
    queries, mask = infra.data.left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad_token_id=0)
    responses, engine_logprobs = infra.engine.vllm_generate(engine, queries, mask, k=3, max_tokens=8, rule=0.7,
                                                     stop_token_id=None, seeds=[1, 2, 3], pad_token_id=0)  # fmt: skip
    q, m = queries.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    with torch.no_grad():
        logits = utils.forward(model, torch.cat([q, responses], 1), torch.cat([m, torch.ones_like(responses)], 1)).logits
    ours = utils.logprobs_from_logits(logits[:, q.shape[1] - 1 : -1], responses, 0.7)
    return {"family": name, "runs": True, "model_type": model.config.model_type,
            "max_logprob_diff": (ours - engine_logprobs).abs().max().item()}  # fmt: skip


def main():
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_families import FAMILIES

    rows = []
    for name, (_, packs) in FAMILIES.items():
        if packs is None:  # recurrent: infra.models.check_model refuses it before any engine
            continue
        start = time.time()
        proc = subprocess.run([sys.executable, __file__, "--family", name], capture_output=True, text=True, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"family": name, "runs": False, "refusal": "crashed: " + proc.stderr[-300:]}
        row["seconds"] = round(time.time() - start, 1)
        print(row, flush=True)
        rows.append(row)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| family | with --use_vllm | max \\|engine - trainer\\| logprob |", "|-|-|-|"]
    for row in rows:
        if row["runs"]:
            lines.append(f"| {row['family']} | runs | {row['max_logprob_diff']:.1e} |")
        else:
            lines.append(f"| {row['family']} | refused: `{row['refusal']}` | |")
    with open(os.path.join(OUT, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    if "--family" in sys.argv:
        print(json.dumps(one(sys.argv[sys.argv.index("--family") + 1])))
    else:
        main()
