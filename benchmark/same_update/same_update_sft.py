"""One SFT update on identical inputs, sft.py's real main against TRL 1.16's real SFTTrainer.train(): the same
examples (the batch sft.py draws for its first update, in its order and its micro-batches), the same weights, the same
optimiser settings; each side renders the rows itself, runs its own loss, backward, clipping and AdamW step. Prints
whether the two renderings of every row are the same tokens and the same learnt tokens, both losses (per micro-batch
as backpropagated, and as logged), how far apart the gradients before clipping are, and how far apart the weights
after the step (TRL's model against the model.safetensors sft.py saved). A relative difference near 1e-5 is float32
rounding.

    python benchmark/same_update/same_update_sft.py --seed 1                      # prompt-completion strings
    python benchmark/same_update/same_update_sft.py --seed 1 --format chat        # prompt-completion chat messages
    python benchmark/same_update/same_update_sft.py --seed 1 --format messages    # conversations with tool calls
    python benchmark/same_update/same_update_sft.py --seed 1 --loss_type dft      # DFT (each NLL times its probability)
    python benchmark/same_update/same_update_sft.py --seed 1 --packing bfd        # rows packed by best fit decreasing
    python benchmark/same_update/same_update_sft.py --seed 1 --packing wrapped    # the tokens end to end, cut
    python benchmark/same_update/same_update_sft.py --seed 1 --format messages --packing bfd_split --shuffle_dataset

The data: --format string and chat are data/preferences.jsonl's 256 prompts with their chosen completions as
prompt-completion rows (strings: "Question: <the user's message>\\nAnswer:" and " <the completion>", EOS appended by
both sides; chat: the messages, through SmolLM2's chat template), so the loss covers the completion only (TRL's
completion_only_loss, both sides' default for this format); --format messages is data/calculator_sft.jsonl's 1000
tool-use conversations (a `tools` column) through examples/environments/chatml_tools.jinja (sft.py --chat_template,
SFTConfig.chat_template_path), the loss on every token. The batch: 8 rows of the file drawn by sft.py with --seed,
micro-batches of 4, two gradient-accumulation steps, so TRL's num_items_in_batch (the learnt tokens of both
micro-batches, counted before the first is run) is what each micro-batch's summed loss is divided by; ours divides
by the same count (sft.py's `tokens`). SmolLM2-135M-Instruct, fp32, learning rate 2e-5 (sft.py's default) at its
full value for the step (ours: annealed linearly over --total_episodes 8 = one update; TRL: "linear", max_steps 1,
no warmup), AdamW eps 1e-5, no weight decay, gradients clipped at 1.0 on both sides. With --packing the rows are
packed into rows of --max_length 256 tokens on both sides (TRL's pack_dataset; bfd: TRL's padding-free collator, ours
each example apart), and the batch is 8 packed rows.

Our side is sft.main as `python sft.py --total_episodes 8 --per_device_train_batch_size 4
--gradient_accumulation_steps 2 ...` runs it, watched (harness.StepWatch: the rows it collates, accelerate's
backward and clip_grad_norm_); its weights are the model.safetensors it saves. TRL's side is an SFTTrainer on the
same file whose train sampler hands out our rows in our order (harness.in_order); everything else is its own:
_prepare_dataset (EOS, chat template, common-prefix completion mask, labels), its collator, compute_loss with
num_items_in_batch, the Trainer's loop, fused AdamW and linear schedule."""

import argparse
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: the scripts, utils, infra, benchmark.harness
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import tyro  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import sft  # noqa: E402  (sft.py; its main is guarded)
from benchmark import harness  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the batch (sft.py's draw) and its order")
parser.add_argument("--format", choices=["string", "chat", "messages"], default="string", help="the rows' format")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--learning_rate", type=float, default=2e-5)
parser.add_argument("--loss_type", choices=["nll", "dft"], default="nll", help="dft: each token's NLL times its probability")
parser.add_argument("--packing", choices=["bfd", "bfd_split", "wrapped"], default=None, help="TRL's packing_strategy")
parser.add_argument("--shuffle_dataset", action="store_true", help="both sides shuffle the rows by --seed (before packing)")
parser.add_argument("--max_length", type=int, default=None, help="default: 256 with --packing, else 1024")
cli = parser.parse_args()
MAX_LENGTH = cli.max_length or (256 if cli.packing else 1024)
PACKING = ["--packing", "--packing_strategy", cli.packing] if cli.packing else []
PACKING += ["--shuffle_dataset"] if cli.shuffle_dataset else []
PER_DEVICE, ACCUMULATION = 4, 2
BATCH = PER_DEVICE * ACCUMULATION
tmp = tempfile.mkdtemp()
TEMPLATE = os.path.join(REPO, "examples", "environments", "chatml_tools.jinja")

# ------------------------------------------------------------------------------------------------------------------
# 1. the data file both sides read
if cli.format == "messages":
    data = os.path.join(REPO, "data", "calculator_sft.jsonl")
else:
    data = os.path.join(tmp, f"sft_{cli.format}.jsonl")
    with open(os.path.join(REPO, "data", "preferences.jsonl")) as f, open(data, "w") as out:
        for line in f:
            pair = json.loads(line)
            if cli.format == "chat":
                row = {"prompt": pair["prompt"], "completion": pair["chosen"]}
            else:
                question, answer = pair["prompt"][0]["content"], pair["chosen"][0]["content"]
                row = {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"}
            out.write(json.dumps(row) + "\n")

# ------------------------------------------------------------------------------------------------------------------
# 2. our update: sft.py's main, watched
watch = harness.StepWatch()
flags = [
    "--model_name_or_path", cli.model, "--dataset_name", data, "--seed", str(cli.seed),
    "--total_episodes", str(BATCH), "--per_device_train_batch_size", str(PER_DEVICE),
    "--gradient_accumulation_steps", str(ACCUMULATION), "--learning_rate", str(cli.learning_rate),
    "--output_dir", f"{tmp}/ours", *(["--chat_template", TEMPLATE] if cli.format == "messages" else []),
    "--loss_type", cli.loss_type, "--max_length", str(MAX_LENGTH), *PACKING,
]  # fmt: skip
sft.main(tyro.cli(sft.Args, args=flags, use_underscores=True))
# rows: our rendering of every row: {"ids", "mask"}
ours, rows, order, our_row, w_ours = harness.our_step(watch, f"{tmp}/ours")
print(f"ours: {len(ours['steps'])} optimiser step, micro-batches {ours['micro_batches']} of {len(rows)} rows")

# ------------------------------------------------------------------------------------------------------------------
# 3. TRL's update on our rows, in our order
import datasets  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import SFTConfig, SFTTrainer, __version__  # noqa: E402

config = harness.trl_step_config(
    SFTConfig,
    f"{tmp}/trl",
    cli.seed,
    cli.learning_rate,
    PER_DEVICE,
    ACCUMULATION,
    max_length=MAX_LENGTH,
    packing=bool(cli.packing),
    packing_strategy=cli.packing or "bfd",
    shuffle_dataset=cli.shuffle_dataset,
    chat_template_path=TEMPLATE if cli.format == "messages" else None,
    loss_type=cli.loss_type,
)
logs = harness.trl_logs()
trainer = SFTTrainer(
    model=cli.model,
    args=config,
    train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
    processing_class=AutoTokenizer.from_pretrained(cli.model),
    callbacks=[logs],
)
print(f"TRL {__version__} loaded: {trainer.model.dtype} {trainer.model.config._attn_implementation}")
w_start = load_file(os.path.join(cli.model, "model.safetensors"))
assert all(torch.equal(p, w_start[n]) for n, p in trainer.model.named_parameters()), "the models start apart"

# the two renderings: every row's tokens, and the tokens the loss covers (TRL: labels != -100); packed by bfd: each
# row's examples (ours: "docs"; TRL: seq_lengths)
prepared = trainer.train_dataset
assert len(prepared) == len(rows), (len(prepared), len(rows))
docs = [row.get("docs", [row]) for row in rows]
ids = [[t for d in row for t in d["ids"]] for row in docs]
same_ids = sum(prepared[i]["input_ids"] == ids[i] for i in range(len(rows)))
same_mask = sum(
    [label != -100 for label in prepared[i]["labels"]] == [m for d in docs[i] for m in d["mask"]] for i in range(len(rows))
)
if "seq_lengths" in prepared.column_names:
    same_bins = sum(prepared[i]["seq_lengths"] == [len(d["ids"]) for d in docs[i]] for i in range(len(rows)))
    print(f"packing: {same_bins} of {len(rows)} rows hold the same examples, {sum(len(d) for d in docs)} examples")
learnt = [sum(sum(d["mask"][1:]) for d in docs[i]) for i in order]
print(f"rendering: {same_ids} of {len(rows)} rows the same tokens, {same_mask} the same learnt tokens")
print(f"the batch: rows {order}, tokens {[len(ids[i]) for i in order]}, learnt {learnt} ({sum(learnt)})")

trainer._get_train_sampler = lambda dataset=None: harness.in_order(order)
trainer.train()
trl = watch.take()
trl_row = logs.rows[0]
w_trl = {n: p.detach() for n, p in trainer.model.named_parameters()}

# ------------------------------------------------------------------------------------------------------------------
# 4. comparison
print(
    f"\nseed {cli.seed}, format {cli.format}, loss {cli.loss_type}, packing {cli.packing}: one step of {BATCH} rows, "
    f"micro-batches of {PER_DEVICE}, "
    f"lr {cli.learning_rate}"
)
harness.step_report(ours, trl, our_row, trl_row, [("loss/sft", "loss")], (w_start, w_ours, w_trl), cli.learning_rate)
shutil.rmtree(tmp)  # the saved models
