"""The peer for grpo.py: TRL's GRPOTrainer on the benchmark world, with the same settings (loss type, reward scaling,
KL weight, batch and lengths), logging one JSON row per step to OUTPUT/metrics.jsonl (episode, seconds since training
began, reward, KL, mean completion length) so the harness reads both sides alike. Run by compare.py; by hand:
python benchmark/synthetic/trl_grpo.py WORLD OUTPUT --updates 20 ..."""

import argparse
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness

parser = argparse.ArgumentParser()
parser.add_argument("world")
parser.add_argument("output")
parser.add_argument("--updates", type=int, default=20)
parser.add_argument("--prompts_per_update", type=int, default=16)
parser.add_argument("--k", type=int, default=4)
parser.add_argument("--response_length", type=int, default=53)
parser.add_argument("--temperature", type=float, default=0.7)
parser.add_argument("--beta", type=float, default=0.04)
parser.add_argument("--loss_type", default="dapo")
parser.add_argument("--scale_rewards", default="group")
parser.add_argument("--learning_rate", type=float, default=3e-4)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()

import datasets  # noqa: E402  (after argparse, so --help is instant)
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from benchmark import harness  # noqa: E402

spec = importlib.util.spec_from_file_location("reward", os.path.join(args.world, "reward.py"))
reward = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reward)
model_dir = os.path.join(args.world, "model")
dataset = datasets.load_dataset("json", data_files=os.path.join(args.world, "prompts.jsonl"), split="train")
os.makedirs(args.output, exist_ok=True)
batch = args.prompts_per_update * args.k


config = GRPOConfig(
    output_dir=args.output,
    num_generations=args.k,
    per_device_train_batch_size=batch,  # completions per step, as grpo.py counts them
    gradient_accumulation_steps=1,
    steps_per_generation=1,  # one mini-batch
    num_iterations=1,
    max_completion_length=args.response_length,
    temperature=args.temperature,
    beta=args.beta,
    loss_type=args.loss_type,
    scale_rewards=args.scale_rewards,
    learning_rate=args.learning_rate,
    lr_scheduler_type="linear",
    max_steps=args.updates,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,  # TRL's default is on; grpo.py's is off (--gradient_checkpointing)
    seed=args.seed,
    disable_tqdm=True,
)
trainer = GRPOTrainer(
    model=model_dir,
    reward_funcs=reward.vowels,
    args=config,
    train_dataset=dataset,
    processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
    callbacks=[harness.peer_log(args.output, batch)],
)
trainer.train()
