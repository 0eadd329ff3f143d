"""The peer for the real-model curves (curves.py): TRL's RLOOTrainer or GRPOTrainer on SmolLM2-135M-Instruct (as a
transformers folder), the shipped prompts and the project's own built-in reward functions, with the settings
curves.py gives both sides. Logs one JSON row per optimiser step to OUTPUT/metrics.jsonl (episode, seconds since
training began, reward, per-token KL, mean completion length), as the other peers do; with --eval_dataset, rows of our
scripts' held-out evaluation of the model (speedrun.py), their time left out of the seconds. By hand:
python benchmark/curves/trl_real.py rloo OUTPUT --dataset data/arithmetic.jsonl --reward accuracy --updates 24 ..."""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, benchmark.harness

parser = argparse.ArgumentParser()
parser.add_argument("algo", choices=["rloo", "grpo"])
parser.add_argument("output")
parser.add_argument("--model", required=True, help="a transformers folder (curves.py converts SmolLM2's GGUF into one)")
parser.add_argument("--dataset", default=os.path.join(REPO, "data", "prompts.jsonl"))
parser.add_argument("--reward", default="sentiment", choices=["sentiment", "accuracy"])
parser.add_argument("--updates", type=int, default=24)
parser.add_argument("--k", type=int, default=4)
parser.add_argument("--per_device_train_batch_size", type=int, default=8)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--response_length", type=int, default=24)
parser.add_argument("--temperature", type=float, default=0.7)
parser.add_argument("--beta", type=float, default=0.05, help="RLOO's KL coefficient, GRPO's KL weight")
parser.add_argument("--learning_rate", type=float, default=5e-5)
parser.add_argument("--gradient_checkpointing", action="store_true", help="TRL's default; off in our scripts")
parser.add_argument("--gpu", action="store_true", help="on the GPU in bf16 (curves.py --gpu); default: the CPU, fp32")
parser.add_argument("--bf16", action="store_true", help="bf16 on the CPU too (accelerate's autocast, as our --bf16)")
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--use_vllm", action="store_true", help="TRL's colocate vLLM engine (needs a GPU and vllm)")
parser.add_argument("--eval_dataset", default=None, help="held-out prompts, evaluated as our scripts evaluate them")
parser.add_argument("--eval_every", type=int, default=4, help="optimiser steps between evaluations (--eval_dataset)")
args = parser.parse_args()

import datasets  # noqa: E402  (after argparse, so --help is instant)

from benchmark import harness  # noqa: E402
from infra.models import load_tokenizer  # noqa: E402
from infra.rewards import BUILTIN_REWARDS  # noqa: E402

if args.algo == "rloo":
    from trl import RLOOConfig as Config
    from trl import RLOOTrainer as Trainer
else:
    from trl import GRPOConfig as Config
    from trl import GRPOTrainer as Trainer

builtin = BUILTIN_REWARDS[args.reward]


def reward(prompts, completions, **columns):
    """The project's own reward function; TRL hands chat completions over as message lists"""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return builtin(prompts, texts, **columns)


reward.__name__ = args.reward  # TRL names the reward's metrics after the function
dataset = datasets.load_dataset("json", data_files=args.dataset, split="train")
os.makedirs(args.output, exist_ok=True)
batch = args.per_device_train_batch_size * args.gradient_accumulation_steps  # completions per optimiser step


config = Config(
    output_dir=args.output,
    num_generations=args.k,
    per_device_train_batch_size=args.per_device_train_batch_size,
    gradient_accumulation_steps=args.gradient_accumulation_steps,
    steps_per_generation=args.gradient_accumulation_steps,  # one rollout per optimiser step: one mini-batch
    num_iterations=1,
    max_completion_length=args.response_length,
    temperature=args.temperature,
    beta=args.beta,
    learning_rate=args.learning_rate,
    adam_epsilon=1e-5,  # our scripts' (TRL's own default is 1e-8)
    lr_scheduler_type="linear",
    max_steps=args.updates,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=not args.gpu,
    bf16=args.gpu or args.bf16,
    gradient_checkpointing=args.gradient_checkpointing,
    seed=args.seed,
    disable_tqdm=True,
    # --use_vllm: TRL's colocate mode, with our scripts' share of the GPU (0.3, TRL's default too)
    use_vllm=args.use_vllm,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.3,
)
tokenizer = load_tokenizer(args.model)  # left padding, the EOS token as pad if it has none, as our scripts


held_out = None  # with --eval_dataset: our scripts' held-out evaluation of the model TRL trains
if args.eval_dataset is not None:
    from types import SimpleNamespace

    from infra.data import load_eval
    from infra.evaluation import evaluate
    from infra.rewards import load_reward_sources

    flags = dict(eval_dataset_name=args.eval_dataset, eval_split="train", prompt_field="prompt", max_prompt_length=128)
    eval_set = load_eval(SimpleNamespace(**flags), tokenizer, columns={})
    flags = dict(reward_model_paths=[], reward_fn=[args.reward], reward_weights=None, trust_remote_code=False)
    sources = load_reward_sources(SimpleNamespace(**flags), tokenizer, eval_set[3])

    def held_out(model):
        """infra.evaluation.evaluate (each prompt's greedy completion, scored by the same reward function), as our
        scripts call it, so that both sides are scored alike"""
        metrics, _ = evaluate(
            trainer.accelerator,
            model,
            tokenizer,
            sources=sources,
            eval_set=eval_set,
            response_length=args.response_length,
            stop_token_id=tokenizer.eos_token_id,
            batch_size=64,
        )
        return metrics


log = harness.peer_log(args.output, batch, held_out, every=args.eval_every)
trainer = Trainer(
    model=args.model,  # a path, so that TRL loads its reference model (beta > 0) from it too
    reward_funcs=reward,
    args=config,
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[log],
)
trainer.train()
