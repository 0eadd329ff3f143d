"""Where distill_trl.py's difference in held-out KL comes from: each side trained with the other side's way of drawing
the sampled tokens, everything else as in distill_trl.py (harness.distill_flags and harness.distill_config), then
measured the same way (harness.distill_held_out_kl).

    python benchmark/distill/distill_draws.py --seed 1 --variant ours_multinomial
    /path/to/venv-with-trl/bin/python benchmark/distill/distill_draws.py --seed 1 --variant trl_inverse_cdf
    python benchmark/distill/distill_draws.py --table      # every variant's seeds so far, against TRL's as is

Variants:
    ours                  distill.py as is: inverse CDF (infra.decode.sample_tokens), uniforms from the data's generator
    ours_global_uniforms  the same draw, its uniforms from torch's global generator
    ours_float64          the inverse CDF in float64: the cumulative sum and the uniforms (torch's global generator), where
                          float32 cannot represent a token of probability below about 3e-8 late in the vocabulary
    ours_float64_same_uniforms  the float64 draw from distill.py's own uniforms: the same run as `ours` wherever the
                          two draws agree (all but about one draw in 4,600 here)
    ours_multinomial      torch.multinomial(softmax(logits / temperature)) on torch's global generator, as generate() does
    trl                   TRL's DistillationTrainer as is (transformers' generate())
    trl_inverse_cdf       TRL with infra.decode.generate in place of its generate(): the inverse CDF, torch's global uniforms
    trl_same_uniforms     the same from the uniforms distill.py draws (its data's generator, replayed here): `ours`,
                          wherever TRL's loop is distill.py's and the two draw the same tokens

Writes benchmark/results/distill/draws/{variant}/seed{N}.json; the trained student goes to a temporary folder."""

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: distill.py, utils, infra, benchmark.harness
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from benchmark import harness  # noqa: E402

VARIANTS = [
    "ours",
    "ours_global_uniforms",
    "ours_float64",
    "ours_float64_same_uniforms",
    "ours_multinomial",
    "trl",
    "trl_inverse_cdf",
    "trl_same_uniforms",
]
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--variant", choices=VARIANTS)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--table", action="store_true", help="print the results so far")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--teacher", default=harness.DISTILL_TEACHER)
parser.add_argument("--output", default=os.path.join(harness.RESULTS, "distill", "draws"))
cli = parser.parse_args()
UPDATES, LENGTH, TEMPERATURE = 12, 24, 0.7  # distill_trl.py's defaults


def table():
    kl = {}
    for path in glob.glob(os.path.join(cli.output, "*", "seed*.json")):
        row = json.load(open(path))
        kl.setdefault(row["variant"], {})[row["seed"]] = row["held_out_kl"]

    def paired(variant, base):  # the difference from base on the seeds both have: mean (t), how often above
        seeds = sorted(set(kl[variant]) & set(kl.get(base, {})))
        if variant == base or len(seeds) < 2:
            return "-"
        d = [kl[variant][s] - kl[base][s] for s in seeds]
        t = statistics.mean(d) / (statistics.stdev(d) / len(d) ** 0.5)
        return f"{statistics.mean(d):+.4f} ({t:+.1f}), above in {sum(x > 0 for x in d)} of {len(d)}"

    print("| variant | seeds | held-out KL, mean (sd) | paired with ours: difference (t) | paired with TRL's |")
    print("| --- | --- | --- | --- | --- |")
    for variant in [v for v in VARIANTS if v in kl]:
        values = list(kl[variant].values())
        spread = f"{statistics.mean(values):.4f}" + (f" ({statistics.stdev(values):.4f})" if len(values) > 1 else "")
        print(f"| {variant} | {len(values)} | {spread} | {paired(variant, 'ours')} | {paired(variant, 'trl')} |")


def train_ours(out):
    import torch
    import tyro

    import distill
    import infra.decode

    inverse_cdf = infra.decode.sample_tokens
    if cli.variant == "ours_global_uniforms":
        infra.decode.sample_tokens = lambda logits, temperature, uniforms: inverse_cdf(
            logits, temperature, torch.rand(len(logits))
        )
    if cli.variant in ("ours_float64", "ours_float64_same_uniforms"):

        def float64_draw(logits, temperature, uniforms):  # infra.decode.sample_tokens' lines in float64 (temperature > 0 here)
            if cli.variant == "ours_float64":  # 53-bit uniforms of its own
                uniforms = torch.rand(len(logits), dtype=torch.float64)
            cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(-1)
            total = cdf[:, -1:]
            target = torch.minimum(uniforms[:, None].double() * total, total.nextafter(torch.zeros_like(total)))
            return torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)

        infra.decode.sample_tokens = float64_draw
    if cli.variant == "ours_multinomial":
        infra.decode.sample_tokens = lambda logits, temperature, uniforms: torch.multinomial(
            torch.softmax(logits.float() / temperature, -1), 1
        )
    flags = harness.distill_flags(cli.model, cli.teacher, cli.seed, UPDATES, out, length=LENGTH)
    distill.main(tyro.cli(distill.Args, args=flags, use_underscores=True))
    return out


def train_trl(out):
    import torch

    import infra

    trainer = harness.distill_trainer(
        cli.model, cli.teacher, harness.distill_config(output_dir=out, seed=cli.seed, updates=UPDATES)
    )
    if cli.variant in ("trl_inverse_cdf", "trl_same_uniforms"):
        (stop,) = trainer.eos_token_ids  # infra.decode.generate stops at one token
        pad = trainer.processing_class.pad_token_id
        # trl_same_uniforms: distill.py's prompts and noise, replayed by infra.data.draw_prompts on the data distill.py
        # shuffles (TRL's sampler hands out the same prompts in the same order)
        data = infra.data.Shuffled(len(trainer.train_dataset), cli.seed)
        one = types.SimpleNamespace(world_size=1, response_length=LENGTH, response_length_min=None, use_vllm=False)

        def sample(prompt_ids, images, multimodal_fields, has_tool_images=False):  # as TRL's: each one's ids to its EOS
            ids, mask = infra.data.left_pad([list(p) for p in prompt_ids], pad)
            model = trainer.accelerator.unwrap_model(trainer.model)
            if cli.variant == "trl_same_uniforms":
                flags = types.SimpleNamespace(**vars(one), local_prompts=len(ids))
                _, uniforms, _, _ = infra.data.draw_prompts(data, flags, 1, 0)
            else:
                uniforms = torch.rand(len(ids), LENGTH)
            tokens = infra.decode.generate(model, ids, mask, LENGTH, TEMPERATURE, stop_token_id=stop, uniforms=uniforms)
            tokens, lengths = infra.data.truncate_response(tokens, stop, pad)
            return [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]

        trainer._generate_single_turn = sample
    trainer.train()
    trainer.save_model(os.path.join(out, "model"))
    trainer.processing_class.save_pretrained(os.path.join(out, "model"))
    return os.path.join(out, "model")


if cli.table:
    table()
    sys.exit()
if cli.variant is None:
    parser.error("--variant or --table")
with tempfile.TemporaryDirectory() as tmp:
    student = (train_trl if cli.variant.startswith("trl") else train_ours)(os.path.join(tmp, "student"))
    kl = harness.distill_held_out_kl(student, cli.teacher, os.path.join(tmp, "eval"))
os.makedirs(os.path.join(cli.output, cli.variant), exist_ok=True)
command = " ".join(["python", "benchmark/distill/distill_draws.py", *sys.argv[1:]])
row = {"variant": cli.variant, "seed": cli.seed, "held_out_kl": kl, "command": command}
json.dump(row, open(os.path.join(cli.output, cli.variant, f"seed{cli.seed}.json"), "w"), indent=1)
print(json.dumps(row))
