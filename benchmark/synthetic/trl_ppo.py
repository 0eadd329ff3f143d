"""The peer for ppo.py: TRL 0.21.0's PPOTrainer on the benchmark world, run in benchmark/.venv-trl021 (transformers
4.57.6; see setup_trl021.sh). Same settings as compare.py gives ppo.py; one JSON row per update (episode, seconds since
training began, score, KL) goes to OUTPUT/metrics.jsonl. Run by compare.py."""

import argparse
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("world")
parser.add_argument("output")
parser.add_argument("--updates", type=int, default=10)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--response_length", type=int, default=53)
parser.add_argument("--temperature", type=float, default=0.7)
parser.add_argument("--kl_coef", type=float, default=0.05)
parser.add_argument("--learning_rate", type=float, default=3e-4)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()

import datasets  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from trl import PPOConfig, PPOTrainer  # noqa: E402

# a tokenizer saved by transformers 5 is read from its tokenizer.json here
tokenizer = PreTrainedTokenizerFast(
    tokenizer_file=os.path.join(args.world, "model", "tokenizer.json"),
    eos_token="<|endoftext|>",
    bos_token="<|endoftext|>",
    unk_token="<|endoftext|>",
    pad_token="<|pad|>",
    padding_side="left",
)
prompts = datasets.load_dataset("json", data_files=os.path.join(args.world, "prompts.jsonl"), split="train")
prompts = prompts.map(lambda row: {"input_ids": tokenizer(row["prompt"])["input_ids"]}, remove_columns=["prompt"])
os.makedirs(args.output, exist_ok=True)


class Log(TrainerCallback):
    def on_train_begin(self, *a, **kw):
        self.start = time.time()

    def on_log(self, _args, state, _control, logs=None, **kw):
        if logs and "objective/scores" in logs:
            row = {"episode": logs["episode"], "seconds": time.time() - self.start, "reward": logs["objective/scores"]}
            row["kl"] = logs["objective/kl"]
            with open(os.path.join(args.output, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")


config = PPOConfig(
    output_dir=args.output,
    per_device_train_batch_size=args.batch,
    gradient_accumulation_steps=1,
    num_mini_batches=1,
    num_ppo_epochs=1,
    local_rollout_forward_batch_size=args.batch,
    response_length=args.response_length,
    temperature=args.temperature,
    kl_coef=args.kl_coef,
    learning_rate=args.learning_rate,
    total_episodes=args.updates * args.batch,
    stop_token="eos",
    num_sample_generations=0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    seed=args.seed,
    disable_tqdm=True,
)
model_dir, rm_dir = os.path.join(args.world, "model"), os.path.join(args.world, "reward_model")
trainer = PPOTrainer(
    args=config,
    processing_class=tokenizer,
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    ref_model=AutoModelForCausalLM.from_pretrained(model_dir),
    reward_model=AutoModelForSequenceClassification.from_pretrained(rm_dir),
    value_model=AutoModelForSequenceClassification.from_pretrained(rm_dir),  # the critic starts from the reward model
    train_dataset=prompts,
    eval_dataset=prompts.select(range(16)),
    callbacks=[Log()],
)
trainer.train()
