"""Side by side in one invocation: our script against its peer on the same model, prompts, reward and settings.

    python benchmark/synthetic/compare.py rloo --updates 20   # rloo.py vs TRL RLOOTrainer -> benchmark/results/synthetic/rloo
    python benchmark/synthetic/compare.py ppo --updates 20    # ppo.py vs TRL 0.21 PPOTrainer -> .../synthetic/ppo
    python benchmark/synthetic/compare.py grpo --updates 20   # grpo.py vs TRL GRPOTrainer -> .../synthetic/grpo
    python benchmark/synthetic/compare.py rloo --updates 20 --vocab_size 50304   # pythia's vocabulary -> rloo_vocab50304

Both sides run as separate processes, one after the other, on the world of benchmark/synthetic/world.py (a GPT-NeoX of
pythia-14m's shape with random weights, a BPE tokenizer of 4,096 or 50,304 tokens, 509 prompts): 53 response
tokens, temperature 0.7, one epoch of one mini-batch, 64 completions per update (RLOO and GRPO: 16 prompts x k = 4).
RLOO and GRPO (dapo loss, group scaling, beta 0.04) are rewarded by the share of vowels (a reward function); PPO by
the world's random reward model, which TRL's
PPOTrainer needs, with the critic starting from it on both sides. The PPO peer runs in benchmark/.venv-trl021
(synthetic/setup_trl021.sh). The harness takes each process's peak resident memory from the kernel (os.wait4), reads both
metric files, and writes OUT/results.json,
OUT/results.md and OUT/curves.png (reward, KL and episodes/s against episodes)."""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: benchmark.harness (and the scripts it runs)
from benchmark import harness  # noqa: E402
from benchmark.synthetic.world import build  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def matmul_peak(seconds=3.0, n=1024):
    """Measured fp32 matmul throughput of this machine (FLOP/s), the yardstick for model FLOP utilisation."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    done, start = 0, time.time()
    while time.time() - start < seconds:
        a @ b
        done += 1
    return done * 2 * n**3 / (time.time() - start)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algo", choices=["rloo", "ppo", "grpo"])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--vocab_size", type=int, default=4096, help="the world's vocabulary: 4096, or pythia's 50304")
    parser.add_argument("--out", default=None, help="default: benchmark/results/synthetic/{algo}, _vocab50304 appended")
    parser.add_argument("--world", default=None, help="default: benchmark/.world, -50304 appended")
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.04, help="grpo: the KL weight on both sides (0: no reference)")
    parser.add_argument("--loss_type", default="dapo", help="grpo: the loss aggregation on both sides")
    parser.add_argument("--scale_rewards", default="group", help="grpo: the advantage scaling on both sides")
    args = parser.parse_args()
    suffix = "" if args.vocab_size == 4096 else f"_vocab{args.vocab_size}"
    args.out = args.out or os.path.join(harness.RESULTS, "synthetic", f"{args.algo}{suffix}")
    args.world = args.world or os.path.join(harness.BENCHMARK, ".world" + suffix.replace("_vocab", "-"))
    os.makedirs(args.out, exist_ok=True)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    # both sides on the CPU, also on a machine with a GPU: the peers run with use_cpu=True and the memory measured is
    # the processes' resident memory (a GPU mode is not written yet)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    world = os.path.abspath(build(args.world, vocab_size=args.vocab_size))
    k, prompts, length = 4, 16, 53
    batch = str(k * prompts)  # completions per update
    episodes = args.updates * k * prompts

    ours_dir, peer_dir = os.path.abspath(os.path.join(args.out, "ours")), os.path.abspath(os.path.join(args.out, "trl"))
    for d in (ours_dir, peer_dir):
        if os.path.exists(os.path.join(d, "metrics.jsonl")):
            os.remove(os.path.join(d, "metrics.jsonl"))
    common = [
        "--response_length", str(length), "--temperature", "0.7",
        "--learning_rate", str(args.learning_rate), "--total_episodes", str(episodes), "--seed", str(args.seed),
        "--per_device_train_batch_size", batch, "--gradient_accumulation_steps", "1", "--num_mini_batches", "1",
        "--local_rollout_forward_batch_size", batch, "--num_sample_generations", "0",
        "--no_save_model", "--model_name_or_path", f"{world}/model", "--dataset_name", f"{world}/prompts.jsonl",
        "--output_dir", ours_dir,
    ]  # fmt: skip
    if args.algo != "grpo":
        common += ["--kl_coef", "0.05", "--num_ppo_epochs", "1"]
    if args.algo == "rloo":
        ours_cmd = [sys.executable, os.path.join(REPO, "rloo.py"), *common, "--rloo_k", str(k)]
        ours_cmd += ["--reward_fn", f"{world}/reward.py:vowels"]
        peer_cmd = [sys.executable, os.path.join(HERE, "trl_rloo.py"), world, peer_dir, "--prompts_per_update", str(prompts)]
        peer_cmd += ["--k", str(k)]
        peer_name = "TRL RLOOTrainer"
    elif args.algo == "grpo":
        grpo_flags = ["--beta", str(args.beta), "--loss_type", args.loss_type, "--scale_rewards", args.scale_rewards]
        ours_cmd = [sys.executable, os.path.join(REPO, "grpo.py"), *common, "--num_generations", str(k)]
        ours_cmd += ["--num_iterations", "1", "--reward_fn", f"{world}/reward.py:vowels", *grpo_flags]
        peer_cmd = [sys.executable, os.path.join(HERE, "trl_grpo.py"), world, peer_dir, "--prompts_per_update", str(prompts)]
        peer_cmd += ["--k", str(k), *grpo_flags]
        peer_name = "TRL GRPOTrainer"
    else:
        ours_cmd = [sys.executable, os.path.join(REPO, "ppo.py"), *common, "--reward_model_path", f"{world}/reward_model"]
        peer_python = harness.TRL021_PYTHON
        if not os.path.exists(peer_python):
            sys.exit("error: the PPO peer needs benchmark/.venv-trl021: run benchmark/synthetic/setup_trl021.sh first")
        peer_cmd = [peer_python, os.path.join(HERE, "trl_ppo.py"), world, peer_dir, "--batch", batch]
        peer_name = "TRL PPOTrainer"
    peer_cmd += ["--updates", str(args.updates), "--response_length", str(length), "--seed", str(args.seed)]
    peer_cmd += ["--learning_rate", str(args.learning_rate)]
    peak_flops = matmul_peak()
    ours_wall, ours_mem = harness.run(ours_cmd, os.path.join(args.out, "ours.log"))
    peer_wall, peer_mem = harness.run(peer_cmd, os.path.join(args.out, "trl.log"))

    ours, peer = harness.read(os.path.join(ours_dir, "metrics.jsonl")), harness.read(os.path.join(peer_dir, "metrics.jsonl"))
    peer_version = subprocess.run(
        [peer_cmd[0], "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    ours_eps = ours[-1]["eps"]  # episodes per second of training, loading excluded, for both
    peer_eps = peer[-1]["episode"] / peer[-1]["seconds"]
    length_key = "completions/mean_length" if args.algo == "grpo" else "val/response_length"
    ours_len = sum(r[length_key] for r in ours) / len(ours)
    peer_lengths = [r.get("length") for r in peer]  # TRL's PPOTrainer does not log it: counted at the full length
    peer_len = sum(peer_lengths) / len(peer) if None not in peer_lengths else float(length)

    # model FLOPs per episode, one formula for both sides: 2 per parameter and token forward, 6 forward and backward.
    # The policy's transformer (B parameters outside the embeddings) runs over the prompt and the response, 12 times:
    # generation 2 + the policy's and the reference's logprob passes 2 x 2 + the training pass 6; its LM head (H) is
    # needed only where a response token is predicted, also 12 times. PPO adds the critic's and the reward model's
    # passes (2 x 2) and the critic's training (6), 10 more times B: they have no LM head. Attention's own FLOPs are
    # left out. GRPO runs RLOO's passes (without the reference's 2 when beta is 0); with one iteration of one
    # mini-batch both sides skip the old-policy logprob pass, which the formula still counts on both sides.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(f"{world}/model"))
    head = net.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in net.parameters()) - net.get_input_embeddings().weight.numel() - head
    tokenizer = AutoTokenizer.from_pretrained(f"{world}/model")
    with open(f"{world}/prompts.jsonl") as f:
        prompt_lengths = [len(tokenizer(json.loads(line)["prompt"])["input_ids"]) for line in f]
    prompt_len = sum(prompt_lengths) / len(prompt_lengths)

    def side(eps, response_len, mem, wall):
        head_passes = 10 if args.algo == "grpo" and not args.beta else 12
        passes = {"rloo": 12, "ppo": 22, "grpo": head_passes}[args.algo]
        flops = passes * body * (prompt_len + response_len) + head_passes * head * response_len
        return {
            "episodes_per_s": eps,
            "generated_tokens_per_s": eps * response_len,
            "mean_response_length": response_len,
            "peak_rss_mib": mem / 2**20,
            "wall_s": wall,
            "model_flops_fraction_of_matmul_peak": eps * flops / peak_flops,
        }

    results = {
        "setting": {"algo": args.algo, "updates": args.updates, "completions_per_update": k * prompts,
                    "response_length": length, "epochs": 1, "mini_batches": 1, "learning_rate": args.learning_rate,
                    "seed": args.seed}
                   | ({"beta": args.beta, "loss_type": args.loss_type, "scale_rewards": args.scale_rewards}
                      if args.algo == "grpo" else {}),
        "machine": {"cpu_count": os.cpu_count(), "matmul_peak_gflops": peak_flops / 1e9, "torch": torch.__version__},
        "ours": side(ours_eps, ours_len, ours_mem, ours_wall),
        "trl": side(peer_eps, peer_len, peer_mem, peer_wall) | {"version": peer_version},
        "ratio_episodes_per_s": ours_eps / peer_eps,
        "ratio_peak_rss": ours_mem / peer_mem,
    }  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)

    rows = [
        ("episodes/s", "episodes_per_s", "{:.1f}"),
        ("generated tokens/s", "generated_tokens_per_s", "{:.0f}"),
        ("peak memory (MiB)", "peak_rss_mib", "{:.0f}"),
        ("model FLOPs / matmul peak", "model_flops_fraction_of_matmul_peak", "{:.1%}"),
    ]
    table = f"| | {args.algo}.py | {peer_name} {peer_version} | ratio |\n| --- | --- | --- | --- |\n"
    for label, key, fmt in rows:
        a, b = results["ours"][key], results["trl"][key]
        table += f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {a / b:.2f}x |\n"
    table += f"\nfp32 matmul peak measured: {peak_flops / 1e9:.0f} GFLOP/s on {os.cpu_count()} cores.\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    curves = [
        (
            "reward (vowel share)" if args.algo != "ppo" else "reward (random reward model)",
            [r["objective/scores"] for r in ours],
            [r["reward"] for r in peer],
        ),
        (
            "KL to the reference" + (" (summed per completion)" if args.algo == "ppo" else " (mean per token)"),
            # TRL's RLOOTrainer and GRPOTrainer log a per-token mean, its PPOTrainer a per-completion sum, as our
            # scripts; grpo.py logs TRL's per-token `kl` itself (none with beta 0)
            [
                r.get("kl")
                if args.algo == "grpo"
                else r["objective/kl"] / (r["val/response_length"] if args.algo == "rloo" else 1)
                for r in ours
            ],
            [r["kl"] for r in peer],
        ),
        ("episodes/s", [r["eps"] for r in ours], [r["episode"] / r["seconds"] for r in peer]),
    ]
    for ax, (title, a, b) in zip(axes, curves):
        ax.plot([r["episode"] for r in ours], a, label=f"{args.algo}.py")
        ax.plot([r["episode"] for r in peer], b, label=f"{peer_name} {peer_version}")
        ax.set_title(title)
        ax.set_xlabel("episode")
        ax.legend()
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(args.out, "curves.png"))
