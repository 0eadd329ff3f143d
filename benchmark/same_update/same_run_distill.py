"""A whole distillation run on identical completions, distill.py's real main against TRL 1.16's real train(): the same
prompts in the same order and the same completions at every step; the two students' weights compared after every
optimiser step. Where same_update_distill.py checks one update's gradient, this checks everything around it over a run:
the learning-rate schedule, AdamW's state, gradient clipping, the accumulation, the order of the data.

    /path/to/venv-with-trl/bin/python benchmark/same_update/same_run_distill.py --seed 1

The settings are benchmark/distill/distill_trl.py's (harness.distill_flags and harness.distill_config): the RLOO policy
that distill_demo.py trains as teacher, SmolLM2-135M-Instruct as student, 16 completions of cheerful.jsonl's
prompts per optimiser step (micro-batches of 8, two accumulated), 24 tokens, temperature 0.7, the reverse KL (--beta),
learning rate 5e-5 annealed linearly to 0, fp32, --updates steps.

Our side runs distill.main as `python distill.py` would, watched: the prompts each update draws, its completions and
the student's weights after each optimiser step are recorded (infra.hooks: the draw, the batch and the step). TRL's
side is a DistillationTrainer whose train sampler hands out those prompts in that order (each generation batch twice,
as its RepeatSampler does) and whose sampler (`_generate_single_turn`) hands back our completions for them; the rest
is its own: tokenization, the loss, the Trainer's loop, optimiser and scheduler. After each step it prints how far
TRL's change of the weights since the start is from ours, relatively: float32 rounding stays near 1e-5 to 1e-4 and
does not grow."""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: the scripts, utils, infra, benchmark.harness
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import tyro  # noqa: E402

import distill  # noqa: E402
import infra  # noqa: E402
from benchmark import harness  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the prompts' order and the sampling noise")
parser.add_argument("--updates", type=int, default=12)
parser.add_argument("--beta", type=float, default=1.0, help="the generalised JSD's beta on both sides (0, 0.5, 1)")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--teacher", default=harness.DISTILL_TEACHER)
cli = parser.parse_args()
if not os.path.exists(os.path.join(cli.teacher, "config.json")):
    sys.exit(f"error: no teacher at {cli.teacher}: run benchmark/distill/distill_demo.py --tasks rloo, or pass --teacher")
tmp = tempfile.mkdtemp()

# ------------------------------------------------------------------------------------------------------------------
# 1. our run, watched: each update's prompts and completions, the weights at the start and after each optimiser step
flags = harness.distill_flags(
    model=cli.model, teacher=cli.teacher, seed=cli.seed, updates=cli.updates, output_dir=f"{tmp}/ours"
)
args = tyro.cli(distill.Args, args=[*flags, "--beta", str(cli.beta), "--no_save_model"], use_underscores=True)
prompts, completions, start, after_step = [], [], {}, []


def watched_batch(sampler, batch):
    completions.append([batch.responses[i, :n].tolist() for i, n in enumerate(batch.lengths.tolist())])  # with the EOS
    if not start:  # before the first optimiser step
        start.update({n: p.detach().clone() for n, p in sampler.unwrapped().named_parameters()})


def watched_step(run, model):
    if run.accelerator.sync_gradients:  # an optimiser step, not an accumulation step
        after_step.append({n: p.detach().clone() for n, p in run.accelerator.unwrap_model(model).named_parameters()})


infra.hooks.WATCH["draw"].append(lambda indices: prompts.append(list(indices)))
infra.hooks.WATCH["batch"].append(watched_batch)
infra.hooks.WATCH["step"].append(watched_step)
distill.main(args)
our_losses = [json.loads(line)["distill/loss"] for line in open(f"{tmp}/ours/metrics.jsonl") if '"eps"' in line]
print(f"ours: {len(after_step)} optimiser steps on {sum(map(len, completions))} completions")

# ------------------------------------------------------------------------------------------------------------------
# 2. TRL's run on our prompts, in our order, and our completions
from transformers import TrainerCallback  # noqa: E402

tokenizer = infra.models.load_tokenizer(cli.model)
queries = infra.data.load_prompts(
    dataset_name=harness.DISTILL_PROMPTS, split="train", prompt_field="prompt", tokenizer=tokenizer, max_prompt_length=128
)[0]


class OurOrder(torch.utils.data.Sampler):
    """our prompts, each update's generation batch twice (TRL's RepeatSampler, repeat_count = accumulation steps)"""

    def __iter__(self):
        for idx in prompts:
            for _ in range(args.gradient_accumulation_steps):
                yield from idx

    def __len__(self):
        return args.gradient_accumulation_steps * sum(map(len, prompts))


trl_losses, report = [], []


class Compare(TrainerCallback):
    def on_step_end(self, _args, state, _control, **kw):
        ours = after_step[state.global_step - 1]
        diff = change = 0.0
        for n, p in trainer.model.named_parameters():
            diff += (p.detach().double() - ours[n].double()).pow(2).sum().item()
            change += (ours[n].double() - start[n].double()).pow(2).sum().item()
        report.append((state.global_step, (diff / change) ** 0.5, change**0.5))

    def on_log(self, _args, state, _control, logs=None, **kw):
        if logs and "loss" in logs:
            trl_losses.append(logs["loss"])


trainer = harness.distill_trainer(
    cli.model,
    cli.teacher,
    harness.distill_config(output_dir=f"{tmp}/trl", seed=cli.seed, updates=cli.updates, beta=cli.beta),
    callbacks=[Compare()],
)
assert len(queries) == len(trainer.train_dataset)  # load_prompts kept every row, so our indices are the dataset's
assert all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters()), "the students start apart"
trainer._get_train_sampler = lambda dataset=None: OurOrder()
generation = iter(range(len(completions)))


def our_completions(prompt_ids, images, multimodal_fields, has_tool_images=False):
    k = next(generation)
    assert [list(p) for p in prompt_ids] == [queries[i] for i in prompts[k]], f"TRL's prompts differ at update {k + 1}"
    return completions[k]


trainer._generate_single_turn = our_completions
trainer.train()

# ------------------------------------------------------------------------------------------------------------------
# 3. comparison
print(f"\nseed {cli.seed}, beta {cli.beta}: {cli.updates} optimiser steps of {len(completions[0])} completions each")
print("step | loss ours | loss TRL  | |W_ours - W_start| | |W_TRL - W_ours| / |W_ours - W_start|")
for (step, rel, change), lo, lt in zip(report, our_losses, trl_losses):
    print(f"{step:4d} | {lo:.6f}  | {lt:.6f}  | {change:.6e}       | {rel:.3e}")
