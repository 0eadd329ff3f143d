"""The metrics callback of the TRL 1.x peers (trl_rloo.py, trl_grpo.py, trl_real.py): one JSON row per optimiser step
in OUTPUT/metrics.jsonl (episode, seconds since training began, reward, per-token KL, mean completion length), so
the harnesses read every peer as they read our scripts."""

import json
import os
import time

from transformers import TrainerCallback


class Log(TrainerCallback):
    def __init__(self, output, batch):
        self.path, self.batch = os.path.join(output, "metrics.jsonl"), batch  # batch: completions per optimiser step

    def on_train_begin(self, *a, **kw):
        self.start = time.time()

    def on_log(self, _args, state, _control, logs=None, **kw):
        if logs and "reward" in logs:
            row = {"episode": state.global_step * self.batch, "seconds": time.time() - self.start, "reward": logs["reward"]}
            row["kl"] = logs.get("kl")
            row["length"] = logs.get("completions/mean_length")
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
