"""One reward-model update on identical inputs, reward.py's real main against TRL 1.16's real RewardTrainer.train():
the same preference pairs (the batch reward.py draws for its first update, in its order and its micro-batches), each
with a margin, the same weights (the score head included), the same optimiser settings; each side renders the pairs
itself, scores them with its own forward, and runs its own Bradley-Terry loss with the margin and the centring term,
backward, clipping and AdamW step. Prints whether the two renderings of every pair are the same tokens, both losses
(per micro-batch as backpropagated, and as logged) and TRL's metrics beside ours, how far apart the gradients before
clipping are, and how far apart the weights after the step (TRL's model against the model.safetensors reward.py
saved). A relative difference near 1e-5 is float32 rounding.

    python benchmark/same_update/same_update_reward.py --seed 1                    # chat messages
    python benchmark/same_update/same_update_reward.py --seed 1 --format string    # strings, EOS appended
    python benchmark/same_update/same_update_reward.py --seed 1 --format string --trl_pad_token "<|endoftext|>"
    python benchmark/same_update/same_update_reward.py --seed 1 --format empty_prompt --trl_pad_token "<|endoftext|>"
    python benchmark/same_update/same_update_reward.py --seed 1 --format implicit --trl_pad_token "<|endoftext|>"

The data: data/preferences.jsonl's 256 pairs (an explicit prompt, chosen and rejected chat messages) with a `margin`
column, score_chosen - score_rejected (0 to 1); --format string makes them strings ("Question: <the user's
message>\\nAnswer:", " <completion>"; both sides append the EOS), and two more formats hold the same strings otherwise
split (same_update_dpo.py's, where the split matters):
  --format empty_prompt: "prompt": "", chosen and rejected the whole "Question: <message>\\nAnswer: <completion>": a
      prompt of no tokens (SmolLM2's tokenizer adds no BOS). TRL joins prompt and completion into one text
      (reward_trainer.py:705-707) and tokenizes it (722-725); reward.py renders a prompt of no tokens and the
      completion (its batch holds one padding column before it) and reads the score at the completion's last token.
  --format implicit: no prompt column; chosen and rejected the whole 'Question: <message>\\nAnswer: "<completion>"'.
      TRL's RewardTrainer extracts no prompt: it tokenizes chosen and rejected whole (722-725). reward.py splits them
      by TRL's extract_prompt rule (infra.offline.implicit_prompt) and renders the prompt + completion as one text,
      so the tokens it scores are the whole text's wherever the cut falls: this checks that a prompt-less pair, whose
      prompt (ending with ' "', or inside a word the two answers share) is no rendering of its own, is read whole.
  Both formats end each completion with the EOS, the pad token, as --format string does: --trl_pad_token
  "<|endoftext|>" compares them like for like (below).
The batch: 8 pairs drawn by reward.py with --seed, micro-batches of 4 pairs, two gradient-accumulation steps. The
model: SmolLM2-135M-Instruct with a one-output score head (AutoModelForSequenceClassification, num_labels=1) that
reward.py's init_value_head draws with --seed, saved once into a folder both sides load, so both start from the same
head; fp32. Loss on both sides: -logsigmoid(r_chosen - r_rejected - margin).mean() + 0.01 * mean((r_chosen +
r_rejected)^2) per micro-batch (reward.py --center_rewards_coefficient 0.01 =
RewardConfig(center_rewards_coefficient=0.01)), divided by the accumulation steps; learning rate 1e-4 (both defaults)
at its full value for the step, AdamW eps 1e-5, no weight decay, gradients clipped at 1.0.

Our side is reward.main as `python reward.py --total_episodes 8 --per_device_train_batch_size 4
--gradient_accumulation_steps 2 --center_rewards_coefficient 0.01 ...` runs it, watched (harness.StepWatch); its
weights are the model.safetensors it saves. TRL's side is a RewardTrainer on the same file whose train sampler hands
out our pairs in our order (harness.in_order); everything else is its own: _prepare_dataset (EOS, chat template,
prompt + completion as one conversation), DataCollatorForPreference (chosen rows, then rejected, right-padded with
the pad token), the model's own forward (the score at each row's last token that is not the pad token),
compute_loss, the Trainer's loop, fused AdamW and linear schedule.

Where each side reads a completion's score: reward.py at its last token (infra.offline.Batch.lengths, whatever the
token); TRL's model at the last token of the row that is not the pad token. SmolLM2's pad token is its EOS token, so
a completion that ends with the EOS (every string completion: both sides append it) is scored by TRL at the token
before it, and by reward.py at the EOS; a conversation through SmolLM2's template ends with "\n" after the EOS and
both read that. The script prints how many of the batch's rows the two read at different tokens. --trl_pad_token gives
TRL another pad token (RewardConfig.pad_token; SmolLM2's "<|endoftext|>", which no row holds), with which it reads
every row at its last token too."""

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
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

import reward  # noqa: E402  (reward.py; its main is guarded)
from benchmark import harness  # noqa: E402
from utils import init_value_head  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the batch (reward.py's draw), its order and the head")
parser.add_argument(
    "--format", choices=["chat", "string", "empty_prompt", "implicit"], default="chat", help="the pairs' format"
)
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--learning_rate", type=float, default=1e-4)
parser.add_argument("--center_rewards_coefficient", type=float, default=0.01)
parser.add_argument("--trl_pad_token", default=None, help="TRL's pad token (RewardConfig.pad_token; default: the EOS)")
cli = parser.parse_args()
PER_DEVICE, ACCUMULATION = 4, 2
BATCH = PER_DEVICE * ACCUMULATION
tmp = tempfile.mkdtemp()


def strings(pair, form):
    """a pair's question and completions as strings, in --format's columns (same_update_dpo.py's)"""
    question, chosen, rejected = (pair[key][0]["content"] for key in ("prompt", "chosen", "rejected"))
    text = f"Question: {question}\nAnswer:"
    if form == "string":
        return {"prompt": text, "chosen": f" {chosen}", "rejected": f" {rejected}"}
    if form == "empty_prompt":  # the whole text a completion, after a prompt of no tokens
        return {"prompt": "", "chosen": f"{text} {chosen}", "rejected": f"{text} {rejected}"}
    # implicit: no prompt column; the answers quoted, so that the first character that differs follows no space
    return {"chosen": f'{text} "{chosen}"', "rejected": f'{text} "{rejected}"'}


# ------------------------------------------------------------------------------------------------------------------
# 1. the data file both sides read, and the reward model both start from
data = os.path.join(tmp, f"pairs_{cli.format}.jsonl")
with open(os.path.join(REPO, "data", "preferences.jsonl")) as f, open(data, "w") as out:
    for line in f:
        pair = json.loads(line)
        row = (
            {key: pair[key] for key in ("prompt", "chosen", "rejected")} if cli.format == "chat" else strings(pair, cli.format)
        )
        row["margin"] = pair["score_chosen"] - pair["score_rejected"]
        out.write(json.dumps(row) + "\n")
start_model = os.path.join(tmp, "reward_start")
tokenizer = AutoTokenizer.from_pretrained(cli.model)
model = AutoModelForSequenceClassification.from_pretrained(cli.model, num_labels=1)
init_value_head(model.score, model.config.initializer_range, cli.seed)  # reward.py's new head (infra/offline.py)
model.config.pad_token_id = tokenizer.pad_token_id
model.save_pretrained(start_model)
tokenizer.save_pretrained(start_model)
del model

# ------------------------------------------------------------------------------------------------------------------
# 2. our update: reward.py's main, watched
watch = harness.StepWatch()
flags = [
    "--model_name_or_path", start_model, "--dataset_name", data, "--seed", str(cli.seed),
    "--total_episodes", str(BATCH), "--per_device_train_batch_size", str(PER_DEVICE),
    "--gradient_accumulation_steps", str(ACCUMULATION), "--learning_rate", str(cli.learning_rate),
    "--center_rewards_coefficient", str(cli.center_rewards_coefficient), "--output_dir", f"{tmp}/ours",
]  # fmt: skip
reward.main(tyro.cli(reward.Args, args=flags, use_underscores=True))
# rows: our rendering of every pair: {"prompt", "chosen", "rejected", "margin", "row"}
ours, rows, order, our_row, w_ours = harness.our_step(watch, f"{tmp}/ours")
print(f"ours: {len(ours['steps'])} optimiser step, micro-batches {ours['micro_batches']} of {len(rows)} pairs")

# ------------------------------------------------------------------------------------------------------------------
# 3. TRL's update on our pairs, in our order
import datasets  # noqa: E402
from trl import RewardConfig, RewardTrainer, __version__  # noqa: E402

config = harness.trl_step_config(
    RewardConfig,
    f"{tmp}/trl",
    cli.seed,
    cli.learning_rate,
    PER_DEVICE,
    ACCUMULATION,
    max_length=1024,  # ours
    center_rewards_coefficient=cli.center_rewards_coefficient,
    pad_token=cli.trl_pad_token,
)
logs = harness.trl_logs()
trainer = RewardTrainer(
    model=start_model,
    args=config,
    train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
    processing_class=AutoTokenizer.from_pretrained(start_model),
    callbacks=[logs],
)
print(f"TRL {__version__} loaded: {trainer.model.dtype} {trainer.model.config._attn_implementation}")
w_start = load_file(os.path.join(start_model, "model.safetensors"))
assert all(torch.equal(p, w_start[n]) for n, p in trainer.model.named_parameters()), "the models start apart"

# the two renderings: each pair's prompt + chosen and prompt + rejected tokens, and its margin
prepared = trainer.train_dataset
assert len(prepared) == len(rows) and all(r["row"] == i for i, r in enumerate(rows)), "a side left pairs out"
same = sum(
    prepared[i]["chosen_ids"] == r["prompt"] + r["chosen"]
    and prepared[i]["rejected_ids"] == r["prompt"] + r["rejected"]
    and abs(prepared[i]["margin"] - r["margin"]) < 1e-12
    for i, r in enumerate(rows)
)
print(f"rendering: {same} of {len(rows)} pairs the same tokens and margin")
print(f"the batch: pairs {order}, margins {[round(rows[i]['margin'], 4) for i in order]}")
pad = trainer.processing_class.pad_token_id  # TRL's; the model's config holds it too
sequences = [rows[i]["prompt"] + rows[i][c] for i in order for c in ("chosen", "rejected")]
apart = sum(max(j for j, t in enumerate(ids) if t != pad) != len(ids) - 1 for ids in sequences)
print(
    f"score read at: ours each row's last token, TRL the last that is not its pad token ({pad}); the rows' last tokens "
    f"{sorted({ids[-1] for ids in sequences})}: {apart} of {len(sequences)} rows read at different tokens"
)

trainer._get_train_sampler = lambda dataset=None: harness.in_order(order)
trainer.train()
trl = watch.take()
trl_row = logs.rows[0]
w_trl = {n: p.detach() for n, p in trainer.model.named_parameters()}

# ------------------------------------------------------------------------------------------------------------------
# 4. comparison
print(
    f"\nseed {cli.seed}, format {cli.format}, TRL's pad token {pad}: one step of {BATCH} pairs, micro-batches of "
    f"{PER_DEVICE}, lr {cli.learning_rate}"
)
harness.step_report(
    ours,
    trl,
    our_row,
    trl_row,
    [
        ("loss/reward", "loss"),
        ("train/accuracy", "accuracy"),
        ("train/margin", "margin"),
        ("train/reward_mean", "mean_reward"),
    ],
    (w_start, w_ours, w_trl),
    cli.learning_rate,
    ("model.", "score."),
)
shutil.rmtree(tmp)  # the saved models
