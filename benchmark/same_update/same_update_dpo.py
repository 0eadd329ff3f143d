"""One DPO update on identical inputs, dpo.py's real main against TRL 1.16's real DPOTrainer.train(): the same
preference pairs (the batch dpo.py draws for its first update, in its order and its micro-batches), the same policy
and reference weights, the same optimiser settings; each side renders the pairs itself, runs its own policy and
reference passes, log-ratios and loss (any --loss_type of TRL 1.16's, several with --loss_weights; --ld_alpha,
--use_weighting, --f_divergence_type, --label_smoothing), backward, clipping and AdamW step. Prints
whether the two renderings of every pair are the same tokens, both losses (per micro-batch as backpropagated, and as
logged) and TRL's metrics beside ours (rewards/chosen, rejected, margins, accuracies; logps/chosen, rejected), how far
apart the gradients before clipping are, and how far apart the weights after the step (TRL's policy against the
model.safetensors dpo.py saved). A relative difference near 1e-5 is float32 rounding.

    python benchmark/same_update/same_update_dpo.py --seed 1                          # sigmoid, chat messages
    python benchmark/same_update/same_update_dpo.py --seed 1 --loss_type ipo          # and hinge
    python benchmark/same_update/same_update_dpo.py --seed 1 --loss_type bco_pair     # any of TRL 1.16's 15
    python benchmark/same_update/same_update_dpo.py --seed 1 --loss_type sigmoid bco_pair sft --loss_weights 0.8 0.2 1
    python benchmark/same_update/same_update_dpo.py --seed 1 --ld_alpha 0.5           # or --use_weighting
    python benchmark/same_update/same_update_dpo.py --seed 1 --format string          # strings, EOS appended
    python benchmark/same_update/same_update_dpo.py --seed 1 --format empty_prompt    # and --loss_type ipo
    python benchmark/same_update/same_update_dpo.py --seed 1 --format implicit        # no prompt column

The data: data/preferences.jsonl's 256 pairs (an explicit prompt, chosen and rejected chat messages); --format string
makes them strings ("Question: <the user's message>\\nAnswer:", " <completion>"; both sides append the EOS), and two
more formats hold the same strings otherwise split:
  --format empty_prompt: "prompt": "", chosen and rejected the whole "Question: <message>\\nAnswer: <completion>".
      The prompt renders to no tokens (SmolLM2's tokenizer adds no BOS), so nothing predicts a completion's first
      token ("Question", in chosen and rejected alike). TRL's DataCollatorForPreference puts the completion at column
      0 (dpo_trainer.py:350-353, then flush_left) and its fused LM head drops the first label (trl/trainer/utils.py:
      1617-1619, hidden states [:, :-1] against labels[:, 1:]): the logps sum every completion token but the first
      (dpo_trainer.py:1297-1304), while IPO divides by completion_mask's full count, the first token included
      (1399-1401). dpo.py leaves the first token out of the sum (Batch.logprob_mask: its logits would read the
      padding column before it) and its IPO divides by the completion's whole length. The first token's log-ratio is
      the same in chosen and rejected, so it cancels in the sigmoid and hinge losses and shows there in logps/ and
      rewards/chosen and rejected only; IPO, which divides each side by its own length, has it in its loss and
      gradients (--loss_type ipo).
  --format implicit: no prompt column; chosen and rejected the whole 'Question: <message>\\nAnswer: "<completion>"',
      the answer in quotes. Each side finds the prompt itself: TRL's _prepare_dataset maps extract_prompt over the
      pairs (dpo_trainer.py:1051-1054; trl/data_utils.py:623-632: cut at the first character that differs, moved
      before the space just before it if there is one), dpo.py with infra.offline.implicit_prompt, the same rule.
      The quotes make the rule matter: the first character that differs (most often the answer's first) follows the
      opening quote, not a space, so the prompt ends with ' "' (or inside a word the two answers share: '..."Th' for
      "The weather..." against "Thunderbolts..."; both sides then end the prompt's tokens where those of the prompt
      alone and of prompt + completion part, dpo_trainer.py:1106-1109), where the rule dpo.py had before (the text up
      to the last space before the first difference) cut these after "Answer:" and left ' "' to the completions. The script
      prints on how many pairs that rule's split, given to TRL's own _prepare_dataset as an explicit prompt, renders
      to other tokens than TRL's extraction.
The batch: 8 pairs drawn by dpo.py with --seed, micro-batches of 4 pairs, two gradient-accumulation steps. SmolLM2-135M-
Instruct, fp32, beta 0.1, learning rate 1e-6 (both defaults) at its full value for the step, AdamW eps 1e-5, no
weight decay, gradients clipped at 1.0. At a run's first step the policy is its reference, every log-ratio is 0 and
the implicit rewards say nothing, so the policy here is the initial weights plus Gaussian noise (--noise 0.02: each
weight matrix moves by 2% of its own std, one seeded draw saved into a folder) and the reference the initial weights,
as same_update_rloo.py does: the log-ratios are then a few nats. Our side gets the noisy policy by a wrapper around
infra.load_model, which dpo.py calls for its policy and reference (the policy's weights replaced by the folder's,
nothing else changed); TRL's side is given the noisy folder as its model and the initial weights as its ref_model.
Corresponding settings (dpo.py flag = DPOConfig field; TRL 1.16's lines in trl/trainer/dpo_trainer.py):
    --beta 0.1                  = beta=0.1
    --loss_type sigmoid         = loss_type=["sigmoid"]   (1388: -logsigmoid(beta * delta); dpo.py's
                                  --label_smoothing 0, its default, is the same loss)
    --loss_type ipo             = loss_type=["ipo"]       (1393-1404: log-ratios per completion token)
    --loss_type hinge           = loss_type=["hinge"]     (1391: relu(1 - beta * delta))
    (reference passes live)     = precompute_ref_log_probs=False

Our side is dpo.main as `python dpo.py --total_episodes 8 --per_device_train_batch_size 4
--gradient_accumulation_steps 2 ...` runs it, watched (harness.StepWatch); its weights are the model.safetensors it
saves. TRL's side is a DPOTrainer on the same file whose train sampler hands out our pairs in our order
(harness.in_order); everything else is its own: _prepare_dataset (EOS, chat template, the prompt as the common prefix),
DataCollatorForPreference (prompt + chosen rows, then prompt + rejected, right-padded), the policy's and reference's
passes through its fused LM head, the loss, the Trainer's loop, fused AdamW and linear schedule."""

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

import tyro  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import dpo  # noqa: E402  (dpo.py; its main is guarded)
from benchmark import harness  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the batch (dpo.py's draw), its order, the noise")
parser.add_argument(
    "--format", choices=["chat", "string", "empty_prompt", "implicit"], default="chat", help="the pairs' format"
)
parser.add_argument("--loss_type", choices=[x for x in dpo.LOSSES if x != "cdpo"], nargs="+", default=["sigmoid"])
parser.add_argument("--loss_weights", type=float, nargs="+", default=None, help="MPO: each loss's weight")
parser.add_argument("--label_smoothing", type=float, default=0.0, help="robust, exo_pair, aot, aot_unpaired")
parser.add_argument("--ld_alpha", type=float, default=None, help="LD-DPO")
parser.add_argument("--use_weighting", action="store_true", help="WPO")
parser.add_argument("--f_divergence_type", default="reverse_kl", help="f-DPO")
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--learning_rate", type=float, default=1e-6)
parser.add_argument("--noise", type=float, default=0.02, help="the policy's distance from the reference (0: none)")
cli = parser.parse_args()
PER_DEVICE, ACCUMULATION = 4, 2
BATCH = PER_DEVICE * ACCUMULATION
tmp = tempfile.mkdtemp()


def strings(pair, form):
    """a pair's question and completions as strings, in --format's columns"""
    question, chosen, rejected = (pair[key][0]["content"] for key in ("prompt", "chosen", "rejected"))
    text = f"Question: {question}\nAnswer:"
    if form == "string":
        return {"prompt": text, "chosen": f" {chosen}", "rejected": f" {rejected}"}
    if form == "empty_prompt":  # the whole text a completion, after a prompt of no tokens
        return {"prompt": "", "chosen": f"{text} {chosen}", "rejected": f"{text} {rejected}"}
    # implicit: no prompt column; the answers quoted, so that the first character that differs follows no space
    return {"chosen": f'{text} "{chosen}"', "rejected": f'{text} "{rejected}"'}


# ------------------------------------------------------------------------------------------------------------------
# 1. the data file both sides read
data = os.path.join(REPO, "data", "preferences.jsonl")
if cli.format != "chat":
    data = os.path.join(tmp, f"pairs_{cli.format}.jsonl")
    with open(os.path.join(REPO, "data", "preferences.jsonl")) as f, open(data, "w") as out:
        for line in f:
            out.write(json.dumps(strings(json.loads(line), cli.format)) + "\n")

# the policy both sides start from: the reference plus noise
policy_dir = os.path.join(tmp, "policy")
w_policy = harness.noisy_policy(cli.model, policy_dir, cli.noise, cli.seed)

# ------------------------------------------------------------------------------------------------------------------
# 2. our update: dpo.py's main, watched
watch = harness.StepWatch()
flags = [
    "--model_name_or_path", cli.model, "--dataset_name", data, "--seed", str(cli.seed),
    "--total_episodes", str(BATCH), "--per_device_train_batch_size", str(PER_DEVICE),
    "--gradient_accumulation_steps", str(ACCUMULATION), "--learning_rate", str(cli.learning_rate),
    "--beta", str(cli.beta), "--loss_type", *cli.loss_type, "--output_dir", f"{tmp}/ours",
    "--label_smoothing", str(cli.label_smoothing), "--f_divergence_type", cli.f_divergence_type,
]  # fmt: skip
flags += ["--loss_weights", *map(str, cli.loss_weights)] if cli.loss_weights else []
flags += ["--ld_alpha", str(cli.ld_alpha)] if cli.ld_alpha is not None else []
flags += ["--use_weighting"] if cli.use_weighting else []
dpo.main(tyro.cli(dpo.Args, args=flags, use_underscores=True))
# rows: our rendering of every pair: {"prompt", "chosen", "rejected", "margin", "row"}
ours, rows, order, our_row, w_ours = harness.our_step(watch, f"{tmp}/ours")
print(f"ours: {len(ours['steps'])} optimiser step, micro-batches {ours['micro_batches']} of {len(rows)} pairs")

# ------------------------------------------------------------------------------------------------------------------
# 3. TRL's update on our pairs, in our order
import datasets  # noqa: E402
from trl import DPOConfig, DPOTrainer, __version__  # noqa: E402

config = harness.trl_step_config(
    DPOConfig,
    f"{tmp}/trl",
    cli.seed,
    cli.learning_rate,
    PER_DEVICE,
    ACCUMULATION,
    max_length=1024,  # ours
    beta=cli.beta,
    loss_type=cli.loss_type,
    loss_weights=cli.loss_weights,
    label_smoothing=cli.label_smoothing,
    ld_alpha=cli.ld_alpha,
    use_weighting=cli.use_weighting,
    f_divergence_type=cli.f_divergence_type,
    precompute_ref_log_probs=False,
)
logs = harness.trl_logs()
trainer = DPOTrainer(
    model=policy_dir,
    ref_model=AutoModelForCausalLM.from_pretrained(cli.model),
    args=config,
    train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
    processing_class=AutoTokenizer.from_pretrained(cli.model),
    callbacks=[logs],
)
print(f"TRL {__version__} loaded: {trainer.model.dtype} {trainer.model.config._attn_implementation}")
w_start = w_policy
harness.check_start(trainer, w_start, cli.model)

# the two renderings: each pair's prompt, chosen and rejected tokens
prepared = trainer.train_dataset
assert len(prepared) == len(rows) and all(r["row"] == i for i, r in enumerate(rows)), "a side left pairs out"
same = sum(
    [prepared[i][f"{part}_ids"] for part in ("prompt", "chosen", "rejected")] == [r["prompt"], r["chosen"], r["rejected"]]
    for i, r in enumerate(rows)
)
print(f"rendering: {same} of {len(rows)} pairs the same prompt, chosen and rejected tokens")
if cli.format == "implicit":  # the rule dpo.py had: the prompt up to the last space before the first difference

    def last_space(pair):
        chosen, rejected = pair["chosen"], pair["rejected"]
        n = next((n for n, (x, y) in enumerate(zip(chosen, rejected)) if x != y), min(len(chosen), len(rejected)))
        n = max(chosen.rfind(" ", 0, n + 1), 0) if n < min(len(chosen), len(rejected)) else n
        return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}

    pairs = datasets.load_dataset("json", data_files=data, split="train").map(last_space)
    before = trainer._prepare_dataset(pairs, trainer.processing_class, config, "last-space")  # TRL's rendering
    apart = [i for i in range(len(rows)) if [before[i][f"{part}_ids"] for part in ("prompt", "chosen", "rejected")]
             != [prepared[i][f"{part}_ids"] for part in ("prompt", "chosen", "rejected")]]  # fmt: skip
    print(
        f"the last-space rule, split so and rendered by TRL: other tokens on {len(apart)} of {len(rows)} pairs, "
        f"{sum(i in apart for i in order)} of the batch's {len(order)}"
    )
lengths = [(len(rows[i]["prompt"]), len(rows[i]["chosen"]), len(rows[i]["rejected"])) for i in order]
print(f"the batch: pairs {order}, tokens (prompt, chosen, rejected) {lengths}")

trainer._get_train_sampler = lambda dataset=None: harness.in_order(order)
trainer.train()
trl = watch.take()
trl_row = logs.rows[0]
w_trl = {n: p.detach() for n, p in trainer.model.named_parameters()}

# ------------------------------------------------------------------------------------------------------------------
# 4. comparison
print(
    f"\nseed {cli.seed}, format {cli.format}, loss {' + '.join(cli.loss_type)}, beta {cli.beta}, noise {cli.noise}: "
    f"one step of {BATCH} pairs, micro-batches of {PER_DEVICE}, lr {cli.learning_rate}"
)
names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"]
harness.step_report(
    ours,
    trl,
    our_row,
    trl_row,
    [("loss/dpo", "loss")] + [(name, name) for name in names],
    (w_start, w_ours, w_trl),
    cli.learning_rate,
)
shutil.rmtree(tmp)  # the saved models
