"""What a run writes: output_dir and --resume, checkpoints (complete or absent), the logs (metrics.jsonl, TensorBoard,
wandb, completions, sample tables), the model card and the hub upload, and the end of a run.
"""

import glob
import json
import logging
import math
import os
import secrets
import shlex
import shutil
import sys
import time

import torch
from accelerate.utils import gather_object
from rich.pretty import pprint
from torch.utils.tensorboard import SummaryWriter

from utils import die

from .data import is_adapters
from .evaluation import write_eval_json
from .models import resolve_pretrained


def reward_stats(accelerator, per_source, sources, scores, scored):
    """rewards/<name>/mean and /std of each source over the completions it scored, objective/scores (the weighted score
    of the scored completions, NaN where none was: TRL's nanmean reward) and objective/unscored, over all processes in one
    reduction."""
    valid = ~per_source.isnan()
    values = per_source.nan_to_num(0.0)
    sums = torch.stack([values.sum(1), (values * values).sum(1), valid.sum(1).float()], 1)  # (sources, 3)
    weighted = torch.stack(
        [scores.masked_fill(~scored, 0.0).sum(), scored.float().sum(), torch.tensor(len(scored), device=scores.device)]
    )
    sums = accelerator.reduce(torch.cat([sums, weighted.to(sums)[None]]), reduction="sum")  # (sources + 1, 3)
    (total, square, count), (scored_sum, num_scored, n) = sums[:-1].unbind(1), sums[-1].tolist()
    mean = total / count.clamp(min=1)
    std = ((square - count * mean**2).clamp(min=0) / (count - 1)).sqrt()  # unbiased, as TRL's nanstd (one value: NaN)
    mean_score = scored_sum / num_scored if num_scored else math.nan
    stats = {"objective/scores": mean_score, "reward": mean_score, "objective/unscored": n - num_scored}
    for source, m, sd, c in zip(sources, mean.tolist(), std.tolist(), count.tolist()):
        if c:  # (a source that scored no completion has no mean: TRL's nanmean is NaN, not 0)
            stats[f"rewards/{source['name']}/mean"], stats[f"rewards/{source['name']}/std"] = m, sd
    return stats


# the update's line on the console: (label, metric), those the row has, in this order
CONSOLE = [
    ("score", "objective/scores"), ("loss", "loss/sft"), ("loss", "loss/reward"), ("loss", "loss/dpo"),
    ("loss", "loss/kto"), ("loss", "loss/ilql"), ("loss", "distill/loss"), ("accuracy", "train/mean_token_accuracy"),
    ("accuracy", "train/accuracy"), ("accuracy", "rewards/accuracies"), ("margin", "rewards/margins"), ("kl", "objective/kl"),
    ("length", "val/response_length"), ("length", "completions/mean_length"), ("lr", "lr"),
]  # fmt: skip


def update_line(row, update, num_updates):
    """The console's line for an update's metrics row: "update 3/24  episode 48  score 0.3675  kl 1.702 ..." """
    parts = [f"update {update}/{num_updates}", f"episode {row['episode']}"]
    parts += [f"{label} {row[key]:.4g}" for label, key in CONSOLE if key in row]
    return "  ".join(parts + [f"{row['eps']:.3g} episodes/s"])


def load_call(name, head):
    """The call that loads the model `name` as the scripts do: a package's .gguf file, LoRA adapters merged into
    their base (models.load_pretrained)"""
    path, gguf = resolve_pretrained(name)
    path = os.path.abspath(path) if os.path.exists(path) else path
    if not gguf and (config := is_adapters(path)):
        with open(config) as f:
            base = load_call(json.load(f)["base_model_name_or_path"], head)
        return f"peft.PeftModel.from_pretrained({base}, {path!r}).merge_and_unload()"
    extra = (f", gguf_file={gguf!r}" if gguf else "") + (", num_labels=1" if head == "SequenceClassification" else "")
    return f"transformers.AutoModelFor{head}.from_pretrained({path!r}{extra})"


def saved_line(args, model):
    """The console's last line: where the run wrote, and how the saved model loads."""
    out = args.output_dir
    logs = f"metrics in {os.path.join(out, 'metrics.jsonl')}, TensorBoard: tensorboard --logdir {os.path.join(out, 'runs')}"
    if not args.save_model:
        return f"done: {logs} (no model saved: --no_save_model)"
    model = getattr(model, "policy", model)  # (PPO: the policy beside its critic)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # (LoRA: the model under it)
    head = "SequenceClassification" if type(model).__name__.endswith("ForSequenceClassification") else "CausalLM"
    if args.use_peft and not args.merge_lora:  # the base model as it loads here, then them
        load = f"LoRA adapters: peft.PeftModel.from_pretrained({load_call(args.model_name_or_path, head)}, {out!r})"
    else:
        load = f"transformers.AutoModelFor{head}.from_pretrained({out!r})"
    rule = getattr(model.config, "reward_input", None)  # (reward.py's: the RL scripts subtract the offset)
    load += f", its score less {rule['offset']:.4g} as the RL scripts read it" if rule else ""
    return f"done: the model in {out}, {load}; {logs}"


def print_samples(title, prompts, completions, per_source, sources, scores, scored):
    """A table of sample completions, each source's reward (nan: it could not judge) and the score ("-": none did)."""
    from rich.console import Console
    from rich.table import Table

    table = Table("query", "response", *[source["name"] for source in sources], "score", title=title, show_lines=True)
    for j, (prompt, completion) in enumerate(zip(prompts, completions)):
        rewards = [f"{v:.3f}" for v in per_source[:, j].tolist()]
        table.add_row(prompt, completion, *rewards, f"{scores[j].item():.3f}" if scored[j] else "-")
    Console().print(table)


def write_completions(accelerator, args, episode, update, prompts, completions, per_source, sources, scores, advantages):
    """--log_completions: one row per completion of every process (episode, update, prompt, completion, each source's
    reward and the weighted score, None where there is none, and the advantage), appended to
    output_dir/completions.jsonl by the main process; with --track also a wandb table of this update's rows."""
    rows = []
    for j, (prompt, completion) in enumerate(zip(prompts, completions)):
        row = {"episode": episode, "update": update, "prompt": prompt, "completion": completion}
        for source, value in zip(sources, per_source[:, j].tolist()):
            row[f"rewards/{source['name']}"] = None if math.isnan(value) else value
        row["score"] = None if math.isnan(scores[j].item()) else scores[j].item()
        row["advantage"] = advantages[j].item()
        rows.append(row)
    rows = gather_object(rows)
    if not accelerator.is_main_process:
        return
    with open(os.path.join(args.output_dir, "completions.jsonl"), "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    if args.track:
        import wandb

        names = list(rows[0])
        if args.log_unique_prompts:  # (completions.jsonl keeps them all)
            first = {}
            rows = [first.setdefault(row["prompt"], row) for row in rows if row["prompt"] not in first]
        wandb.log({"completions": wandb.Table(columns=names, data=[[row[n] for n in names] for row in rows])})


# accelerate's checkpoints leave out a tensor that shares its storage with another (tied input and output embeddings)
# and warn at every save; a resume loads them into the same module, whose tied weights share that storage again
logging.getLogger("accelerate.utils.other").addFilter(lambda record: "Removed shared tensor" not in record.getMessage())

HUB_IGNORE = ["checkpoint-*", "runs/*", "wandb_id", "*.tmp", "completions.jsonl"]
# the metrics a model card lists: a script's own diagnostics (clip fractions, ratios, losses) stay in metrics.jsonl
CARD_METRICS = ("episode", "reward", "kl", "val/response_length", "completions/mean_length")
CARD_PREFIXES = ("objective/", "rewards/", "eval/")


def is_hub_id(name):
    """True when a model or dataset argument names a hub repo: not a local file or folder, nor an installed package."""
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return False
    return resolve_pretrained(name) == (name, None)


def write_model_card(args, script, algorithm, doc, base_model, sources):
    """Write output_dir/README.md, the Hugging Face model card of the saved model: YAML metadata (base model and
    dataset when they are hub ids), the algorithm and script, the base model, each reward source with its weight, the
    latest value of each main metric in metrics.jsonl, every argument (as args.json has them) and the command line
    that ran. doc is the script's docstring, whose first paragraph describes it. Main process only, after the save
    (peft writes a card of its own with the adapters, which this one replaces)."""
    adapters = args.use_peft and not args.merge_lora
    meta = ["library_name: peft" if adapters else "library_name: transformers"]
    if is_hub_id(base_model):
        meta.append(f"base_model: {json.dumps(base_model)}")
    tags = dict.fromkeys(["rlhf", algorithm.lower(), os.path.splitext(os.path.basename(script))[0]])  # rloo.py: rloo once
    meta += ["tags:", *[f"- {tag}" for tag in tags]]
    if is_hub_id(args.dataset_name):
        meta += ["datasets:", f"- {json.dumps(args.dataset_name)}"]

    name = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
    gguf_file = resolve_pretrained(base_model)[1]  # the default: a package shipping SmolLM2's GGUF file
    summary = " ".join((doc or "").split("\n\n")[0].split())
    saved = "LoRA adapters of the base model" if adapters else "the whole policy"
    if args.use_peft and args.merge_lora:
        saved += " (LoRA adapters merged into its weights)"
    lines = ["---", *meta, "---", "", f"# {name}", "", summary, ""]
    lines += [
        f"- **Algorithm:** {algorithm} (`{os.path.basename(script)}`)",
        f"- **Base model:** `{base_model}`" + (f" (`{gguf_file}`)" if gguf_file else ""),
        f"- **Prompts:** `{args.dataset_name}` (split `{args.dataset_split}`)",
        f"- **Saved:** {saved}",
        "",
        "## Reward sources",
        "",
        "A completion's score is the weighted sum of the sources that scored it.",
        "",
        "| source | kind | weight |",
        "|-|-|-|",
    ]
    for source in sources:
        kind = f"reward model `{source['path']}`" if "model" in source else f"function `{source.get('spec')}`"
        kind = f"environment `{' '.join(args.environment)}`" if "env" in source else kind
        lines.append(f"| {source['name']} | {kind} | {source['weight']:g} |")

    # the latest value of each metric: the last row, and with a held-out evaluation the last evaluation's too
    latest = {}
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                latest.update(json.loads(line))
    lines += ["", "## Final metrics", "", "| metric | value |", "|-|-|"]
    for key, value in latest.items():
        if key in CARD_METRICS or key.startswith(CARD_PREFIXES):
            lines.append(f"| {key} | {value:.6g} |")

    lines += ["", "## Hyperparameters", "", "Every argument of the run, as in `args.json`:", "", "```json"]
    lines += [json.dumps(vars(args), indent=1), "```", "", "## Command", ""]
    if "LOCAL_RANK" in os.environ:  # set by accelerate launch and torchrun, which ran this command on each process
        lines += [f"Launched by `accelerate launch` (or torchrun) on {args.world_size} process(es), each running:", ""]
    lines += ["```bash", shlex.join(["python", *sys.argv]), "```", "", "## Usage", "", "```python"]
    if adapters:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "",
            f"model = AutoPeftModelForCausalLM.from_pretrained({json.dumps(name)})",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"model = AutoModelForCausalLM.from_pretrained({json.dumps(name)})",
            f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(name)})",
        ]
    lines += ["```", ""]
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def create_repo(repo_id, private):
    """--push_to_hub's repo, created if missing as the run starts (as transformers' Trainer does), so that no token or
    no network stops the run in one line before any work rather than after it (a read-only token on a repo that exists
    passes here: huggingface_hub finds the repo)"""
    from huggingface_hub import HfApi

    try:
        HfApi().create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as e:  # no network, no token, ...
        die(f"--push_to_hub cannot create {repo_id!r}: {hub_reason(e)}")


def hub_reason(e):
    """a hub call's failure in a few words: its message's first line (or its type), at most 200 characters"""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def push_to_hub(output_dir, repo_id, private):
    """Upload output_dir (the model, tokenizer, card, args.json, metrics.jsonl, ...; not HUB_IGNORE's run state) to the
    hub model repo repo_id (create_repo made it). Main process only, at the very end; a failure is one line, the model
    staying saved in output_dir."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.upload_folder(
            repo_id=repo_id,
            folder_path=output_dir,
            repo_type="model",
            ignore_patterns=HUB_IGNORE,
            commit_message=f"upload {os.path.basename(os.path.normpath(output_dir))}",
        )
    except Exception as e:  # no network, no token, no write access, ...
        die(f"--push_to_hub to {repo_id!r} failed ({hub_reason(e)}); the model is saved in {output_dir}")
    print(f"uploaded {output_dir} to https://huggingface.co/{repo_id}")


# flags a resumed run may change: they do not change what the run computes
RESUMABLE = {
    "resume", "output_dir", "exp_name", "track", "wandb_project_name", "wandb_entity", "checkpoint_every",
    "keep_checkpoints", "save_model", "num_sample_generations", "trust_remote_code", "local_rollout_forward_batch_size",
    "gradient_checkpointing", "eval_batch_size", "push_to_hub", "hub_model_id", "hub_private", "cuda_graphs", "onednn",
    "quiet",
}  # fmt: skip
# the files a resumed run cuts back to its checkpoint: their rows past it are written again
LOGS = ["metrics.jsonl", "completions.jsonl"]


def checkpoints(output_dir):
    """The complete checkpoints in output_dir, oldest first (one being written ends in .tmp)."""
    return sorted(glob.glob(os.path.join(output_dir, "checkpoint-*[0-9]")))


def open_output_dir(args):
    """The run's name, and args.output_dir (default output/{run_name}). Refuses a --resume without a complete
    checkpoint or with arguments that change what the run computes, and a new run into a folder that holds one or a
    model."""
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("output", run_name)
    if args.resume and not checkpoints(args.output_dir):
        die(f"--resume: no complete checkpoint in --output_dir {args.output_dir!r} (runs write them with --checkpoint_every)")
    if not args.resume and os.path.exists(os.path.join(args.output_dir, "metrics.jsonl")):
        resumable = " or add --resume to continue it" if checkpoints(args.output_dir) else ""
        die(f"--output_dir {args.output_dir!r} already holds a run (metrics.jsonl): choose another folder{resumable}")
    held = [f for f in ("config.json", "adapter_config.json") if os.path.exists(os.path.join(args.output_dir, f))]
    if not args.resume and held:  # (a model's folder, --model_name_or_path's perhaps: the run would write over it)
        die(f"--output_dir {args.output_dir!r} holds a model ({held[0]}), not a run: choose another folder")
    if args.resume and os.path.exists(os.path.join(args.output_dir, "args.json")):
        with open(os.path.join(args.output_dir, "args.json")) as f:
            saved, now = json.load(f), json.loads(json.dumps(vars(args)))  # (as JSON has them: tuples as lists)
        if saved.get("use_peft") and "lora_target_modules" not in saved:  # (a LoRA run from before the flag: all-linear)
            saved["lora_target_modules"] = ["all-linear"]
        changed = [key for key in now if key not in RESUMABLE and key in saved and saved[key] != now[key]]
        if changed:
            die(f"--resume with arguments that change the run: {', '.join(f'{k} {saved[k]} -> {now[k]}' for k in changed)}")
    if getattr(args, "push_to_hub", False):  # (every process: each stops alike where it cannot)
        create_repo(args.hub_model_id, args.hub_private)
    return run_name


def resume(accelerator, args):
    """Loads the newest complete checkpoint in output_dir (accelerate: the weights, the optimiser, every process's
    random state, every object registered for checkpointing) and cuts the logs back to it. Returns the state the
    script saved with it, plus its path under "checkpoint"."""
    path = checkpoints(args.output_dir)[-1]
    accelerator.load_state(path)
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
    log_sizes = state.pop("log_sizes")
    if accelerator.is_main_process:  # the rows written past the checkpoint (and a torn last one) go
        for name, size in log_sizes.items():
            if os.path.exists(os.path.join(args.output_dir, name)):
                os.truncate(os.path.join(args.output_dir, name), size)
        if os.path.exists(os.path.join(args.output_dir, "eval.json")):  # its rows past the checkpoint went too
            write_eval_json(args.output_dir)
        print(f"resuming from {path} (update {state['update']}, episode {state['episode']})")
    return {**state, "checkpoint": path}


def checkpoint(accelerator, model, args, update, state, extra=None):
    """A checkpoint of the run at this update, output_dir/checkpoint-NNNNNNN, and its path: accelerate's state
    (under DeepSpeed each process's shards), what extra(folder) writes on each process (--max_staleness: its batches in
    flight) and the script's `state` (a dict of tensors and numbers), written whole to a .tmp folder and then renamed,
    so that a folder without .tmp is complete. Written after the update's metrics row, so that a resumed run neither
    repeats nor loses one. Only the newest keep_checkpoints are kept."""
    finite = all(torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in model.parameters())  # (ZeRO-3: the shard)
    if accelerator.reduce(torch.tensor(float(finite), device=accelerator.device), reduction="sum") < args.world_size:
        die(f"non-finite weights at update {update}; no checkpoint written", code=1)
    path = os.path.join(args.output_dir, f"checkpoint-{update:07d}")
    if accelerator.is_main_process:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(path + ".tmp")
    if extra is not None:
        extra(path + ".tmp")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        logs = {name: os.path.join(args.output_dir, name) for name in LOGS}
        log_sizes = {name: os.path.getsize(log) if os.path.exists(log) else 0 for name, log in logs.items()}
        torch.save({**state, "log_sizes": log_sizes}, os.path.join(path + ".tmp", "state.pt"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)
        for old in checkpoints(args.output_dir)[: -args.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def open_logs(accelerator, args, run_name, episode):
    """The main process prints the arguments, writes output_dir/args.json (a new run) and opens TensorBoard under
    output_dir/runs (a resumed run drops what the killed one logged past its checkpoint); with --track, wandb is
    synced from it, resuming the run whose id is in output_dir/wandb_id. Returns the SummaryWriter (None on the other
    processes)."""
    if not accelerator.is_main_process:
        return None
    if not args.quiet:
        pprint(args)
    model = ", the model at the end" if getattr(args, "save_model", True) else ""
    print(f"writing to {args.output_dir}: metrics.jsonl, TensorBoard logs (runs/){model}", flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    if not args.resume:
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
    if args.track:
        import wandb

        id_file = os.path.join(args.output_dir, "wandb_id")
        # (secrets, not random: the run's random streams stay as seeded)
        run_id = open(id_file).read().strip() if args.resume and os.path.exists(id_file) else secrets.token_hex(8)
        with open(id_file, "w") as f:
            f.write(run_id)
        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            sync_tensorboard=True,
            config=vars(args),
            name=run_name,
            id=run_id,
            resume="allow",
            save_code=True,
        )
    writer = SummaryWriter(os.path.join(args.output_dir, "runs"), purge_step=episode + 1 if args.resume else None)
    if not args.resume:
        table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer


def log_metrics(accelerator, writer, args, metrics):
    """The main process appends the metrics row to output_dir/metrics.jsonl and to TensorBoard, at its episode."""
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for key, value in metrics.items():
            writer.add_scalar(key, value, metrics["episode"])


def finish(accelerator, args, writer, tokenizer, ema, card, engine=None):
    """The end of a run, once the script saved its model: the EMA's weights to output_dir/ema, the tokenizer beside
    each, the model card (card: write_model_card's arguments), the hub upload last of all (a failed upload leaves the
    saved model as it is); then every process leaves the process group together, once the main process has written
    everything (a vLLM engine is shut down first: it holds a process group of its own). The other processes then exit
    at once (os._exit), without the interpreter's teardown: they write nothing, and in that teardown the second process
    of a finished two-process ZeRO-3 run sometimes aborted (SIGABRT, "terminate called without an active exception",
    twice in CI: a C++ thread of the collectives calling into the finalizing interpreter), failing the run."""
    if args.save_model and ema is not None:  # (no EMA under ZeRO-3 or with LoRA: ema.module is the whole policy)
        ema.module.save_pretrained(os.path.join(args.output_dir, "ema"), is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        writer.close()
        if args.save_model:
            tokenizer.save_pretrained(args.output_dir)
            if ema is not None:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "ema"))
            write_model_card(args, **card)
        if args.push_to_hub:
            push_to_hub(args.output_dir, repo_id=args.hub_model_id, private=args.hub_private)
    accelerator.wait_for_everyone()
    if engine is not None:
        engine.llm_engine.engine_core.shutdown()
    accelerator.end_training()
    if not accelerator.is_main_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def reduce_stats(accelerator, stats):
    """An update's statistics (a utils.Stats, or {name: 0-d tensor}) over all processes: each mean over the
    processes' values, or their max for a name that ends in _max, and each token statistic the mean over every token
    of every process. Returns {name: float}."""
    means, tokens = stats.local() if hasattr(stats, "local") else (stats, {})
    out = {}
    if means:
        values = torch.stack([torch.as_tensor(v, device=accelerator.device).float() for v in means.values()])
        gathered = accelerator.gather(values[None])  # (processes, statistics)
        maxed = torch.tensor([name.endswith("_max") for name in means], device=values.device)
        out.update(zip(means, torch.where(maxed, gathered.amax(0), gathered.mean(0)).tolist()))
    if tokens:
        sums = accelerator.reduce(torch.stack(list(tokens.values())).to(accelerator.device), reduction="sum")  # (n, 2)
        # (a statistic no token counted this update is left out, as TRL leaves it, rather than logged as 0)
        means, counts = (sums[:, 0] / sums[:, 1].clamp(min=1.0)).tolist(), sums[:, 1].tolist()
        out.update((name, mean) for name, mean, count in zip(tokens, means, counts) if count > 0)
    return out
