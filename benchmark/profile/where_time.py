"""Where an update's time goes, on either side: runs one of our scripts or a TRL peer in this process, with the same
timers around the same kinds of work, and writes the seconds per update by phase.

    python benchmark/profile/where_time.py OUT.json rloo.py --rloo_k 4 ...        # any of our scripts, with its flags
    python benchmark/profile/where_time.py OUT.json benchmark/curves/trl_real.py rloo DIR ...   # the peer, its flags
    python benchmark/profile/where_time.py OUT.json benchmark/distill/distill_trl.py --side trl_run ...  # TRL's distiller

Phases (the outermost timed call counts; nothing is counted twice):
- generation: our infra.decode.generate (or with --use_vllm the engine's, infra.engine.vllm_generate), transformers'
  generate() for TRL; weight sync: infra.engine.vllm_sync, the policy's weights into the engine (--use_vllm);
- logprob passes: forward passes and logprob arithmetic without gradient outside generation (the rollout's policy
  and reference passes; ppo.py's critic; distill.py's teacher): our utils.forward_grouped, logprobs_from_logits and
  scalar_forward, TRL's _get_per_token_logps_and_entropies (DistillationTrainer: _get_last_hidden_state, the
  backbones; its lm_head projections, inside its divergence, fall in the rest, as distill.py's JSD does);
- training forward: the same functions with gradient;
- backward: torch.autograd.backward; optimiser step: AdamW.step;
- the rest: rewards, advantages, data, logging, gradient clipping.
Timed from the first generation to the end of the last optimiser step, so loading the model is left out. The
timers synchronise nothing: on a GPU, time a phase only with CUDA_LAUNCH_BLOCKING=1."""

import atexit
import json
import os
import runpy
import sys
import time
from collections import defaultdict

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, utils, the scripts it runs
if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
out_path, script, command = sys.argv[1], sys.argv[2], " ".join(sys.argv[2:])
if not os.path.exists(script):  # a path from the repository's root, run from elsewhere
    script = os.path.join(REPO, script)
seconds, depth, marks = defaultdict(float), [0], {"start": None, "end": None, "steps": 0}


def timed(fn, phase):
    """fn with its time added to phase, or to phase(grad) when phase is a pair (without, with gradient)"""

    def wrapper(*args, **kwargs):
        if depth[0]:  # inside another timed call: counted there
            return fn(*args, **kwargs)
        name = phase[torch.is_grad_enabled()] if isinstance(phase, tuple) else phase
        if marks["start"] is None:
            marks["start"] = time.perf_counter()
        depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            depth[0] -= 1
            if name == "optimiser step":
                marks["end"], marks["steps"] = time.perf_counter(), marks["steps"] + 1

    wrapper.__wrapped__ = fn
    return wrapper


passes = ("logprob passes", "training forward")
torch.autograd.backward = timed(torch.autograd.backward, "backward")
torch.optim.AdamW.step = timed(torch.optim.AdamW.step, "optimiser step")
if "trl" in os.path.basename(script):
    from transformers import GenerationMixin
    from trl import DistillationTrainer, GRPOTrainer, RLOOTrainer

    GenerationMixin.generate = timed(GenerationMixin.generate, "generation")
    for cls in (RLOOTrainer, GRPOTrainer):
        cls._get_per_token_logps_and_entropies = timed(cls._get_per_token_logps_and_entropies, passes)
    # distillation: the student's backbone with gradient, the teacher's without (its lm_head runs in the divergence)
    DistillationTrainer._get_last_hidden_state = timed(DistillationTrainer._get_last_hidden_state, passes)
else:  # the scripts call these as utils.NAME, infra's modules by the names they imported: each module is patched
    import infra
    import utils

    phases = {"generate": "generation", "vllm_generate": "generation", "vllm_sync": "weight sync"}  # vllm: --use_vllm
    phases.update(dict.fromkeys(("forward_grouped", "logprobs_from_logits", "scalar_forward"), passes))
    for module in (utils, infra.decode, infra.rollout, infra.rewards, infra.evaluation, infra.engine, infra.graphs):
        for name, phase in phases.items():
            if hasattr(module, name):
                setattr(module, name, timed(getattr(module, name), phase))


@atexit.register
def report():
    if not marks["steps"]:
        return
    total = marks["end"] - marks["start"]
    synced = ["weight sync"] if "weight sync" in seconds else []  # --use_vllm only
    phases = ["generation", *synced, *passes, "backward", "optimiser step"]
    row = {name: seconds[name] / marks["steps"] for name in phases}
    row["the rest"] = total / marks["steps"] - sum(row.values())
    result = {"command": command, "updates": marks["steps"], "seconds_per_update": row}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(" | ".join(f"{name} {s:.2f} s" for name, s in row.items()), f"| per update, over {marks['steps']} updates")


sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
