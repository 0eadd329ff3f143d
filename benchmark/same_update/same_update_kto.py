"""One KTO update on identical inputs, kto.py's real main against TRL 1.16's real KTOTrainer.train(): the same
labelled completions (the batch kto.py draws for its first update, in its order and its micro-batches), the same
policy and reference weights, the same optimiser settings; each side renders the data itself (TRL's pairs unpaired,
or an unpaired file), pairs each example with its mismatched completion for the KL term, runs its own policy and
reference passes, reference point, loss (--loss_type kto or apo_zero_unpaired), backward, clipping and AdamW step.
Prints whether the two renderings of every example (prompt, completion, mismatched completion, label) are the same
tokens, both losses (per micro-batch as backpropagated) and TRL's metrics beside ours, how far apart the gradients
before clipping are, and the weights after the step. A relative difference near 1e-5 is float32 rounding.

    python benchmark/same_update/same_update_kto.py --seed 1                             # kto, pairs unpaired
    python benchmark/same_update/same_update_kto.py --seed 1 --loss_type apo_zero_unpaired
    python benchmark/same_update/same_update_kto.py --seed 1 --format unpaired           # prompt, completion, label
    python benchmark/same_update/same_update_kto.py --seed 1 --desirable_weight 1.33 --format unpaired

The data: data/preferences.jsonl's 256 pairs (chat messages), which both sides unpair (TRL's unpair_preference_dataset:
the 256 chosen completions labelled desirable, then the 256 rejected ones); --format unpaired writes them so as a file
of `prompt`, `completion` and `label` rows, every third rejected one left out (so that the two kinds are unbalanced),
and both sides read that. The mismatched completion of each example (KTO's KL term) is the previous example's in
blocks of per_device_train_batch_size examples in the dataset's order (TRL's _prepare_dataset, kto_trainer.py
1141-1159; kto.py's infra.offline.labelled_rows): the same on both sides whatever the draw.
The batch: 8 examples drawn by kto.py with --seed, micro-batches of 4, two gradient-accumulation steps. SmolLM2-135M-
Instruct, fp32, beta 0.1, learning rate 1e-6 (both defaults) at its full value for the step, AdamW eps 1e-5, no
weight decay, gradients clipped at 1.0. The policy is the initial weights plus Gaussian noise (--noise 0.02, as
same_update_dpo.py), the reference the initial weights, so the log-ratios and the KL estimate are not 0.
Corresponding settings (kto.py flag = KTOConfig field; TRL 1.16's lines in trl/trainer/kto_trainer.py):
    --loss_type kto             = loss_type="kto"      (1471-1486: 1 - sigmoid(beta (log-ratio - z)) and
                                                        1 - sigmoid(beta (z - log-ratio)), z = the KL clamped at 0)
    --loss_type apo_zero_unpaired = loss_type="apo_zero_unpaired"
    --desirable_weight, --undesirable_weight = desirable_weight, undesirable_weight (1502-1505)
    (reference passes live)     = precompute_ref_log_probs=False

Our side is kto.main as `python kto.py --total_episodes 8 --per_device_train_batch_size 4
--gradient_accumulation_steps 2 ...` runs it, watched (harness.StepWatch); its weights are the model.safetensors it
saves. TRL's side is a KTOTrainer on the same file whose train sampler hands out our examples in our order."""

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

import kto  # noqa: E402  (kto.py; its main is guarded)
from benchmark import harness  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the batch (kto.py's draw), its order, the noise")
parser.add_argument("--format", choices=["pairs", "unpaired"], default="pairs", help="the data's format")
parser.add_argument("--loss_type", choices=["kto", "apo_zero_unpaired"], default="kto")
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--desirable_weight", type=float, default=1.0)
parser.add_argument("--undesirable_weight", type=float, default=1.0)
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--learning_rate", type=float, default=1e-6)
parser.add_argument("--noise", type=float, default=0.02, help="the policy's distance from the reference (0: none)")
cli = parser.parse_args()
PER_DEVICE, ACCUMULATION = 4, 2
BATCH = PER_DEVICE * ACCUMULATION
tmp = tempfile.mkdtemp()

# ------------------------------------------------------------------------------------------------------------------
# 1. the data file both sides read
data = os.path.join(REPO, "data", "preferences.jsonl")
if cli.format == "unpaired":
    data = os.path.join(tmp, "unpaired.jsonl")
    pairs = [json.loads(line) for line in open(os.path.join(REPO, "data", "preferences.jsonl"))]
    with open(data, "w") as out:
        for p in pairs:
            out.write(json.dumps({"prompt": p["prompt"], "completion": p["chosen"], "label": True}) + "\n")
        for i, p in enumerate(pairs):
            if i % 3:
                out.write(json.dumps({"prompt": p["prompt"], "completion": p["rejected"], "label": False}) + "\n")

# the policy both sides start from: the reference plus noise
policy_dir = os.path.join(tmp, "policy")
w_policy = harness.noisy_policy(cli.model, policy_dir, cli.noise, cli.seed)

# ------------------------------------------------------------------------------------------------------------------
# 2. our update: kto.py's main, watched
watch = harness.StepWatch()
flags = [
    "--model_name_or_path", cli.model, "--dataset_name", data, "--seed", str(cli.seed),
    "--total_episodes", str(BATCH), "--per_device_train_batch_size", str(PER_DEVICE),
    "--gradient_accumulation_steps", str(ACCUMULATION), "--learning_rate", str(cli.learning_rate),
    "--beta", str(cli.beta), "--loss_type", cli.loss_type, "--output_dir", f"{tmp}/ours",
    "--desirable_weight", str(cli.desirable_weight), "--undesirable_weight", str(cli.undesirable_weight),
]  # fmt: skip
kto.main(tyro.cli(kto.Args, args=flags, use_underscores=True))
# rows: our rendering of every example: {"prompt", "completion", "partner", "label", "row"}
ours, rows, order, our_row, w_ours = harness.our_step(watch, f"{tmp}/ours")
print(f"ours: {len(ours['steps'])} optimiser step, micro-batches {ours['micro_batches']} of {len(rows)} examples")

# ------------------------------------------------------------------------------------------------------------------
# 3. TRL's update on our examples, in our order
import datasets  # noqa: E402
from trl import KTOConfig, KTOTrainer, __version__  # noqa: E402

config = harness.trl_step_config(
    KTOConfig,
    f"{tmp}/trl",
    cli.seed,
    cli.learning_rate,
    PER_DEVICE,
    ACCUMULATION,
    max_length=1024,  # ours
    beta=cli.beta,
    loss_type=cli.loss_type,
    desirable_weight=cli.desirable_weight,
    undesirable_weight=cli.undesirable_weight,
    precompute_ref_log_probs=False,
)
logs = harness.trl_logs()
trainer = KTOTrainer(
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

# the two renderings: each example's prompt, completion, mismatched completion and label
prepared = trainer.train_dataset
assert len(prepared) == len(rows) and all(r["row"] == i for i, r in enumerate(rows)), "a side left examples out"


def theirs(i):
    kl = prepared[i]["KL_completion_ids"] if cli.loss_type == "kto" else None
    return [prepared[i]["prompt_ids"], prepared[i]["completion_ids"], kl, bool(prepared[i]["label"])]


same = sum(theirs(i) == [r["prompt"], r["completion"], r["partner"], r["label"]] for i, r in enumerate(rows))
print(f"rendering: {same} of {len(rows)} examples the same prompt, completion, mismatched completion and label")
labels = ["+" if rows[i]["label"] else "-" for i in order]
print(f"the batch: examples {order}, labels {''.join(labels)}")

trainer._get_train_sampler = lambda dataset=None: harness.in_order(order)
trainer.train()
trl = watch.take()
trl_row = logs.rows[0]
w_trl = {n: p.detach() for n, p in trainer.model.named_parameters()}

# ------------------------------------------------------------------------------------------------------------------
# 4. comparison (TRL logs each metric as the mean of its micro-batches' values; ours pools the update's examples)
print(
    f"\nseed {cli.seed}, format {cli.format}, loss {cli.loss_type}, beta {cli.beta}, weights "
    f"{cli.desirable_weight}/{cli.undesirable_weight}, noise {cli.noise}: one step of {BATCH} examples, micro-batches "
    f"of {PER_DEVICE}, lr {cli.learning_rate}"
)
names = ["kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"]
harness.step_report(
    ours,
    trl,
    our_row,
    trl_row,
    [("loss/kto", "loss")] + [(name, name) for name in names],
    (w_start, w_ours, w_trl),
    cli.learning_rate,
)
shutil.rmtree(tmp)  # the saved models
