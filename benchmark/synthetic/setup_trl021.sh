#!/usr/bin/env bash
# The peer of ppo.py: TRL 0.21.0's PPOTrainer (its last release with PPO in the main namespace) needs
# transformers 4.x, so it lives in its own virtual environment, benchmark/.venv-trl021.
set -euo pipefail
cd "$(dirname "$0")/.."  # benchmark/
python3 -m venv .venv-trl021
.venv-trl021/bin/pip install -q torch==2.13.0
.venv-trl021/bin/pip install -q trl==0.21.0 transformers==4.57.6  # pip picks accelerate and datasets that fit transformers 4
.venv-trl021/bin/python -c "import trl, transformers; print('trl', trl.__version__, 'transformers', transformers.__version__)"
