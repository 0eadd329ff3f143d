"""The benchmark harness's own measuring parts: the GPU memory of harness.run (against a fake nvidia-smi) and
profile/where_time.py's phase timers around a real run of rloo.py."""

import json
import os
import sys

from conftest import REPO
from test_rloo import check_ok, read_metrics

sys.path.insert(0, REPO)  # benchmark.harness

# answers like nvidia-smi's memory query on two GPUs: its first call (before the run starts) 100 and 50 MiB in use,
# then 400 and 250 while the run holds memory, 300 and 150 after it freed some
FAKE_SMI = """#!/bin/sh
n=$(cat "$0.count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$0.count"
if [ "$n" = 0 ]; then printf '100\\n50\\n'; elif [ "$n" -lt 4 ]; then printf '400\\n250\\n'; else printf '300\\n150\\n'; fi
"""


def test_gpu_memory_is_the_peak_over_the_start(tmp_path, monkeypatch):
    from benchmark.harness import run

    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    seconds, peak = run(["sleep", "1.5"], str(tmp_path / "log"), gpu=True)
    assert seconds >= 1.5
    assert int((tmp_path / "nvidia-smi.count").read_text()) >= 5  # sampled through the run, past the peak
    assert peak == (400 + 250 - 100 - 50) * 2**20  # both GPUs, less what was in use before


def test_where_time_splits_a_real_run_into_phases(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out, report = tmp_path / "out", tmp_path / "phases.json"
    proc = run(
        f"benchmark/profile/where_time.py {report} rloo.py --model_name_or_path {tiny_model_dir}"
        f" --dataset_name {tiny_prompts_file} --rloo_k 4 --total_episodes 32 --per_device_train_batch_size 8"
        f" --gradient_accumulation_steps 2 --response_length 8 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    assert len(read_metrics(out)) == 2  # the script ran whole under the timers
    result = json.loads(report.read_text())
    assert result["updates"] == 2
    phases = result["seconds_per_update"]
    assert list(phases) == ["generation", "logprob passes", "training forward", "backward", "optimiser step", "the rest"]
    # every timer caught its kind of work: the rollout's passes run without gradient, the update's with it
    assert all(phases[name] > 0 for name in list(phases)[:-1]), phases
    assert phases["the rest"] > -1e-3  # the phases never add up to more than the time measured
