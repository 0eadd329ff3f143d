#!/usr/bin/env bash
# The published TL;DR benchmark on one machine with 8 GPUs: rloo_tldr.py and ppo_tldr.py on Pythia-1B (the SFT policy
# and reward model of cleanrl/EleutherAI_pythia-1b-deduped__*__tldr, every other flag the scripts' default), seeds 1 2 3,
# then the GPT-4o-mini judge on the first 1,000 validation examples with TRL's prompt and counting. TRL published win
# rates against the reference summaries of SFT 33.0%, RLOO 51.2%, PPO 63.0% (one seed each). Not run yet: no GPU has
# been available to this project. Usage: OPENAI_API_KEY=... bash benchmark/gpu/tldr_gpu.sh [seeds...]
# On the same machine, the real-model curves beside TRL run on the GPU in bf16, with GPU memory measured, as
#   python benchmark/curves/curves.py rloo --task sentiment --gpu   (and grpo; ppo; --task arithmetic): see benchmark/README.md
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=("${@:-1 2 3}")
for seed in ${seeds[@]}; do
    for algo in rloo ppo; do
        out=output/${algo}_tldr_seed${seed}
        accelerate launch --config_file configs/deepspeed_zero2.yaml ${algo}_tldr.py --seed "$seed" \
            --output_dir "$out" --eval_long_prompts truncate --checkpoint_every 50
        python tools/judge_tldr.py --samples "$out" --judge_base_url https://api.openai.com/v1 \
            --judge_model gpt-4o-mini --protocol trl --num_examples 1000
    done
done
