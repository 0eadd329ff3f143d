"""Reward sources as users combine them: dataset columns reaching reward functions, several weighted sources, None
("cannot judge"), a reward server over real HTTP on 127.0.0.1, per-completion logs, and the shipped arithmetic task."""

import glob
import json
import os
import re
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import REPO
from test_rloo import check_ok, read_metrics

REWARDS = """
def from_column(prompts, completions, target):
    return [float(t) for t in target]

def constant(prompts, completions):  # the two-argument form
    return [2.0] * len(completions)

def picky(prompts, completions, **columns):
    # None (cannot judge) for completions whose length is a multiple of 3, and for every completion of rows marked so
    return [None if len(c) % 3 == 0 or not ok else float(len(c)) for c, ok in zip(completions, columns["judgeable"])]

def lonely(prompts, completions, **columns):
    # the rows marked unjudgeable: their first completion alone scored (no baseline for it), the others None
    firsts = [i == 0 or prompts[i] != prompts[i - 1] for i in range(len(prompts))]
    return [float(len(c)) if ok or first else None for c, ok, first in zip(completions, columns["judgeable"], firsts)]

def never(prompts, completions):
    return [None] * len(completions)
"""


@pytest.fixture
def columns_data(tmp_path, tiny_prompts_file):
    """The tiny prompts with two more columns: `target` (a number per row) and `judgeable` (False every 4th row)."""
    with open(tiny_prompts_file) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    rows = [{"prompt": p, "target": i / 10, "judgeable": i % 4 != 0} for i, p in enumerate(prompts)]
    path = tmp_path / "columns.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return str(path), {r["prompt"]: r for r in rows}


def read_completions(out):
    with open(os.path.join(out, "completions.jsonl")) as f:
        return [json.loads(line) for line in f]


def command(script, model, data, out, extra):
    return (
        f"{script} --model_name_or_path {model} --dataset_name {data} --total_episodes 32 --per_device_train_batch_size 8"
        f" --gradient_accumulation_steps 2 --response_length 8 --local_rollout_forward_batch_size 8 --output_dir {out}"
        f" --log_completions {extra}"
    )


def test_columns_reach_functions_and_weighted_sources_add_up(run, tmp_path, tiny_model_dir, columns_data, monkeypatch):
    """fn(prompts, completions, **columns) gets each completion's own row; two sources with weights 0.5 and 3 sum to
    the score; each source's statistics are logged; completions.jsonl holds every completion with its rewards, and
    with --track (wandb offline) each update's rows are a wandb table."""
    monkeypatch.setenv("COLUMNS", "200")  # room for the sample table's column names
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    data, rows = columns_data
    out = tmp_path / "out"
    extra = (
        f"--rloo_k 4 --reward_fn {tmp_path}/rewards.py:from_column --reward_fn {tmp_path}/rewards.py:constant"
        " --reward_weights 0.5 3 --num_sample_generations 2 --track --log_unique_prompts"
    )
    proc = run(command("rloo.py", tiny_model_dir, data, out, extra), tmp_path)
    check_ok(proc)
    logged = read_completions(out)
    assert [r["episode"] for r in logged] == [16] * 16 + [32] * 16
    for r in logged:
        target = rows[r["prompt"]]["target"]
        assert r["rewards/from_column"] == pytest.approx(target) and r["rewards/constant"] == 2.0
        assert r["score"] == pytest.approx(0.5 * target + 3 * 2.0)
    for update in (1, 2):
        mine = [r for r in logged if r["update"] == update]
        (metrics,) = [m for m in read_metrics(out) if m["episode"] == 16 * update]
        targets = torch.tensor([r["rewards/from_column"] for r in mine])
        assert metrics["rewards/from_column/mean"] == pytest.approx(targets.mean().item(), abs=1e-6)
        assert metrics["rewards/from_column/std"] == pytest.approx(targets.std().item(), abs=1e-5)
        assert metrics["rewards/constant/mean"] == 2.0 and metrics["rewards/constant/std"] == 0.0
        assert metrics["objective/scores"] == pytest.approx(sum(r["score"] for r in mine) / 16, abs=1e-5)
        assert metrics["objective/unscored"] == 0
        # every completion scored: a prompt's leave-one-out advantages sum to zero
        for j in range(0, 16, 4):
            group = [r["advantage"] for r in mine[j : j + 4]]
            assert sum(group) == pytest.approx(0.0, abs=1e-4)
    # the console table has a column per source
    assert "from_column" in proc.stdout and "constant" in proc.stdout
    # the wandb tables: one per update, completions.jsonl's rows, with --log_unique_prompts each prompt's first only
    # (wandb stores NaN-free floats as given)
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    tables = sorted(glob.glob(os.path.join(run_dir, "files", "media", "table", "completions_*.table.json")))
    assert len(tables) == 2
    for path in tables:
        with open(path) as f:
            table = json.load(f)
        update = [r for r in logged if r["update"] == table["data"][0][table["columns"].index("update")]]
        first = [r for i, r in enumerate(update) if r["prompt"] not in {u["prompt"] for u in update[:i]}]
        assert table["columns"] == list(logged[0]) and [tuple(r) for r in table["data"]] == [tuple(r.values()) for r in first]
        assert len(first) == 4  # the update's four prompts, of the 16 completions


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py", "grpo.py"])
def test_unscored_completions_take_no_part(script, run, tmp_path, tiny_model_dir, eos_model_dir, columns_data):
    """None from a source: a completion no source scored gets advantage 0 and stays out of the baselines (RLOO) and
    of the update (PPO). Partly None: the RLOO advantages are the leave-one-out over the scored completions only. All
    None: the policy does not move at all, though the missing-EOS penalty, were it counted, would tell apart the
    completions that stopped (about a third) from the others."""
    from safetensors.torch import load_file

    data, rows = columns_data
    k = {"rloo.py": "--rloo_k 4", "ppo.py": "", "grpo.py": "--num_generations 4"}[script]
    if script == "rloo.py":
        out = tmp_path / "partly"
        extra = f"{k} --kl_coef 0 --reward_fn {tmp_path}/rewards.py:picky --num_sample_generations 0"
        check_ok(run(command(script, tiny_model_dir, data, out, extra), tmp_path))
        logged = read_completions(out)
        for r in logged:
            expected_none = len(r["completion"]) % 3 == 0 or not rows[r["prompt"]]["judgeable"]
            assert (r["score"] is None) == expected_none and (r["rewards/picky"] is None) == expected_none
        assert any(r["score"] is None for r in logged) and any(r["score"] is not None for r in logged)
        for update in (1, 2):
            mine = [r for r in logged if r["update"] == update]
            (metrics,) = [m for m in read_metrics(out) if m["episode"] == 16 * update]
            assert metrics["objective/unscored"] == sum(r["score"] is None for r in mine)
            for j in range(0, 16, 4):  # naive leave-one-out over the scored completions of each prompt
                group = mine[j : j + 4]
                assert len({r["prompt"] for r in group}) == 1
                for i, r in enumerate(group):
                    others = [o["score"] for m, o in enumerate(group) if m != i and o["score"] is not None]
                    expected = r["score"] - sum(others) / len(others) if r["score"] is not None and others else 0.0
                    assert r["advantage"] == pytest.approx(expected, abs=1e-4)

        # --normalize_advantages (TRL's): whitened over the completions with a baseline alone (TRL's NaN rows: unscored,
        # or scored alone in their group, which then get 0)
        out = tmp_path / "lonely"
        extra = f"{k} --kl_coef 0 --reward_fn {tmp_path}/rewards.py:lonely --num_sample_generations 0 --normalize_advantages"
        check_ok(run(command(script, tiny_model_dir, data, out, extra), tmp_path))
        for update in (1, 2):
            mine = [r for r in read_completions(out) if r["update"] == update]
            groups = [[r["score"] for r in mine[j : j + 4]] for j in range(0, 16, 4)]
            raw = [s - (sum(g) - s) / 3 if None not in g else None for g in groups for s in g]
            assert None in raw and any(s is not None for g in groups if None in g for s in g)  # (both kinds)
            kept = [a for a in raw if a is not None]
            mean, std = statistics.mean(kept), statistics.stdev(kept)
            for r, a in zip(mine, raw):
                assert r["advantage"] == pytest.approx(0.0 if a is None else (a - mean) / (std + 1e-4), abs=1e-4)

    out = tmp_path / "never"
    extra = (
        f"{k} --reward_fn {tmp_path}/rewards.py:never --missing_eos_penalty 1.0 --learning_rate 0.01"
        " --num_sample_generations 0"
    )
    # 2 tokens: about half the completions stop
    check_ok(run(command(script, eos_model_dir, data, out, extra).replace("length 8", "length 2"), tmp_path))
    assert [m["objective/unscored"] for m in read_metrics(out)] == [16, 16]
    assert 0 < sum(m["val/num_eos_tokens"] for m in read_metrics(out)) < 32
    assert all(r["score"] is None and r["advantage"] == 0.0 for r in read_completions(out))
    before, after = load_file(os.path.join(eos_model_dir, "model.safetensors")), load_file(out / "model.safetensors")
    for name, weight in before.items():
        torch.testing.assert_close(after[name], weight, atol=0, rtol=0, msg=name)


class RewardServer(BaseHTTPRequestHandler):
    """A reward server; the path picks the behaviour: /len (the completion's length, and the `target` column echoed
    back as a check), /null (null for every other completion), /slow (the first request sleeps past the client's
    timeout), /error (HTTP 500), /short (one reward too few)."""

    log = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RewardServer.log.append((self.path, body))
        n = len(body["completions"])
        if self.path == "/error":
            return self.reply(500, {"error": "out of memory"})
        if self.path == "/slow" and len(RewardServer.log) == 1:
            time.sleep(2.5)
        rewards = [len(c) + t for c, t in zip(body["completions"], body["target"])]
        if self.path == "/null":
            rewards = [None if i % 2 else r for i, r in enumerate(rewards)]
        if self.path == "/short":
            rewards = rewards[:-1]
        self.reply(200, {"rewards": rewards, "n": n})

    def reply(self, code, obj):
        data = json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    RewardServer.log.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


SERVERS = """
import sys
sys.path.insert(0, {examples!r})
from reward_server import ask

def slow(prompts, completions, **columns):
    return ask({url!r} + "/slow", prompts, completions, columns, batch_size=3, timeout=1, retries=1)

def null(prompts, completions, **columns):
    return ask({url!r} + "/null", prompts, completions, columns, batch_size=3, timeout=1, retries=1)
"""


def test_reward_server_batches_retries_and_nulls(run, tmp_path, tiny_model_dir, columns_data, server_url):
    """examples/reward_server.py's ask(), one reward function per server: batches of 3 with the prompts, completions
    and columns; a request that times out is retried; null is "cannot judge"; the rewards come back in order."""
    data, rows = columns_data
    out = tmp_path / "out"
    (tmp_path / "servers.py").write_text(SERVERS.format(examples=os.path.join(REPO, "examples"), url=server_url))
    extra = f"--reward_fn {tmp_path}/servers.py:slow --reward_fn {tmp_path}/servers.py:null --num_sample_generations 0"
    check_ok(run(command("ppo.py", tiny_model_dir, data, out, extra), tmp_path))
    logged = read_completions(out)
    for r in logged:
        expected = len(r["completion"]) + rows[r["prompt"]]["target"]
        assert r["rewards/slow"] == pytest.approx(expected)
    # /null answered null for every other completion of each batch of 3 (8 completions per chunk: 3 + 3 + 2)
    for update in (1, 2):
        mine = [r for r in logged if r["update"] == update]
        nulls = [r["rewards/null"] is None for r in mine]
        assert nulls == [False, True, False] * 2 + [False, True] + [False, True, False] * 2 + [False, True]
        # a completion /null could not judge still has /slow's reward: every one is scored
        assert all(r["score"] == pytest.approx(r["rewards/slow"] + (r["rewards/null"] or 0)) for r in mine)
    bodies = [body for path, body in RewardServer.log if path == "/null"]
    assert [len(b["completions"]) for b in bodies] == [3, 3, 2] * 4
    assert all(set(b) == {"prompts", "completions", "target", "judgeable"} for b in bodies)
    assert all(rows[p]["target"] == t for b in bodies for p, t in zip(b["prompts"], b["target"]))
    slow = [path for path, _ in RewardServer.log if path == "/slow"]
    assert len(slow) == 3 * 4 + 1  # the first request timed out and was sent again


@pytest.mark.parametrize(
    "path, message",
    [
        ("error", "failed 2 time(s); the last said: HTTP 500"),
        ("short", "returned 2 scores for 3 completions"),
    ],
)
def test_reward_server_failures_stop_the_run_with_one_line(
    path, message, run, tmp_path, tiny_model_dir, columns_data, server_url, monkeypatch
):
    """examples/reward_server.py:server, configured by the environment, as the README runs it."""
    data, _ = columns_data
    out = tmp_path / "out"
    for name, value in [("REWARD_URL", f"{server_url}/{path}"), ("REWARD_BATCH_SIZE", "3"), ("REWARD_RETRIES", "1")]:
        monkeypatch.setenv(name, value)
    extra = f"--rloo_k 4 --reward_fn {os.path.join(REPO, 'examples', 'reward_server.py')}:server"
    proc = run(command("rloo.py", tiny_model_dir, data, out, extra), tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out / "metrics.jsonl") or not read_metrics(out)


def test_a_reward_server_that_is_down_stops_the_run_before_any_model_loads(
    run, tmp_path, tiny_model_dir, columns_data, monkeypatch
):
    """examples/reward_server.py:server with REWARD_URL at a port nothing listens on, or none, or a setting that is not
    a number: one line as the function loads, nothing written (a server that is up: test_reward_server_batches_...)"""
    import socket

    with socket.socket() as closed:  # a port that was free a moment ago
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    data, _ = columns_data
    out = tmp_path / "out"
    monkeypatch.setenv("REWARD_URL", f"http://127.0.0.1:{port}/score")
    monkeypatch.setenv("REWARD_RETRIES", "1")
    extra = f"--rloo_k 4 --reward_fn {os.path.join(REPO, 'examples', 'reward_server.py')}:server"
    proc = run(command("rloo.py", tiny_model_dir, data, out, extra), tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: reward server http://127.0.0.1:{port}/score cannot be reached (2 time(s))"), last
    assert "Traceback" not in proc.stderr and not out.exists()
    # no REWARD_URL, or a setting that is not a number: the same, as the file loads
    for name, value, line in [
        (
            "REWARD_URL",
            None,
            "error: examples/reward_server.py:server needs REWARD_URL, e.g. REWARD_URL=http://localhost:8000",
        ),
        ("REWARD_RETRIES", "x", "error: REWARD_RETRIES must be a whole number, at least 0, got 'x'"),
        ("REWARD_TIMEOUT", "inf", "error: REWARD_TIMEOUT must be a number above 0, got 'inf'"),
    ]:
        monkeypatch.setenv(name, value) if value is not None else monkeypatch.delenv(name)
        proc = run(command("rloo.py", tiny_model_dir, data, out, extra), tmp_path)
        assert proc.stderr.strip().splitlines()[-1] == line and "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--reward_fn sentiment --reward_weights 1 2", "--reward_weights has 2 weights for 1 reward sources (sentiment)"),
        ("--reward_fn {server}", "REWARD_URL 'localhost:8000' must start with http:// or https://"),
        ("--reward_fn {tmp}/rewards.py:needs_answer", "needs the dataset column(s) ['answer']"),
        ("--reward_fn accuracy", "needs the dataset column(s) ['answer']"),
        ("--reward_fn {tmp}/rewards.py:bad", "returned inf; NaN or inf is not a reward"),
        ("--reward_fn {tmp}/rewards.py:words", "must return a list of numbers (or None), got 'good'"),
    ],
)
def test_bad_reward_input_is_one_line(extra, message, run, tmp_path, tiny_model_dir, columns_data, monkeypatch):
    data, _ = columns_data
    monkeypatch.setenv("REWARD_URL", "localhost:8000")  # read by examples/reward_server.py only
    with open(tmp_path / "rewards.py", "a") as f:
        f.write(
            "\ndef needs_answer(prompts, completions, answer):\n    return answer\n"
            "\ndef bad(prompts, completions):\n    return [1.0] * (len(completions) - 1) + [float('inf')]\n"
            "\ndef words(prompts, completions):\n    return ['good'] * len(completions)\n"
        )
    out = tmp_path / "out"
    server = os.path.join(REPO, "examples", "reward_server.py") + ":server"
    extra = "--rloo_k 4 " + extra.format(tmp=tmp_path, server=server)
    proc = run(command("rloo.py", tiny_model_dir, data, out, extra), tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out / "metrics.jsonl") or not read_metrics(out)


def test_the_arithmetic_task_is_what_it_says(tmp_path):
    """data/arithmetic.jsonl and the held-out data/arithmetic_test.jsonl: chat prompts "What is a + b? ..." whose answer
    column is a + b; no held-out sum is a training one, in either order, or repeated; make_arithmetic.py rebuilds both
    (into a temporary folder, the same; the shipped files are never written)."""
    import subprocess
    import sys

    path = os.path.join(REPO, "data", "arithmetic.jsonl")
    before = os.stat(path).st_mtime_ns
    pairs, shipped = {}, {}
    for name in ("arithmetic.jsonl", "arithmetic_test.jsonl"):
        with open(os.path.join(REPO, "data", name)) as f:
            shipped[name] = f.read()
        pairs[name] = []
        for line in shipped[name].splitlines():
            row = json.loads(line)
            a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", row["prompt"][0]["content"]).groups())
            assert row["answer"] == a + b
            pairs[name].append((a, b))
    train, test = pairs["arithmetic.jsonl"], pairs["arithmetic_test.jsonl"]
    assert len(train) == 2000 and len(test) == 200 == len(set(test))
    assert not set(test) & (set(train) | {(b, a) for a, b in train})
    assert not set(test) & {(b, a) for a, b in test if a != b}  # nor one held-out sum in both orders
    subprocess.run([sys.executable, os.path.join(REPO, "data", "make_arithmetic.py"), str(tmp_path)], check=True)
    for name in shipped:
        assert (tmp_path / name).read_text() == shipped[name]
    assert os.stat(path).st_mtime_ns == before  # the test wrote nothing into the repository
