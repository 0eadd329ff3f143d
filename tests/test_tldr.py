"""rloo_tldr.py and ppo_tldr.py on a TL;DR-shaped mini dataset, with a real HTTP server on 127.0.0.1 as the judge."""

import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_rloo import KEYS as RLOO_KEYS
from test_rloo import check_ok, read_metrics

PPO_KEYS = RLOO_KEYS + ["loss/value_avg", "val/clipfrac_avg", "val/vpred", "objective/kl_coef"]
EVAL_KEYS = ["episode", "eval/scores", "eval/response_length", "eval/stopped_fraction"]
JUDGE_KEYS = EVAL_KEYS + ["eval/judged", "eval/judge_failures", "eval/win_rate"]


def validation_rows(tldr_dir):
    import datasets

    return datasets.load_dataset(tldr_dir, split="validation").to_list()


def flaky(post):
    """How the "flaky" judge fails, decided by the post so that the test can count the failures."""
    return {0: "not json", 1: "not a letter"}.get(len(post) % 3)


class Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible /chat/completions endpoint; the requested model name picks the behaviour:
    longer (prefers the longer summary, A on a tie), flaky (some replies broken, see flaky()), slow (sleeps past the
    client's timeout on posts of even length), unauthorized (HTTP 401), garbage (never answers A or B)."""

    log = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        post, a, b = re.search(r"Post:\n(.*)\n\nSummary A:\n(.*)\n\nSummary B:\n(.*)\n\nWhich", prompt, re.S).groups()
        model, test_request = body["model"], post == "The cat sat on the mat."
        answer = "A" if len(a) >= len(b) else "B"
        entry = {"model": model, "post": post, "a": a, "b": b, "auth": self.headers.get("Authorization"), "ok": True}
        Judge.log.append(entry)
        if self.path != "/v1/chat/completions" or model == "unauthorized":
            return self.reply(401, b'{"error": {"message": "invalid api key"}}')
        if model == "garbage" or (model == "flaky" and not test_request and flaky(post) == "not a letter"):
            entry["ok"], answer = False, "Both summaries have merits."
        if model == "flaky" and not test_request and flaky(post) == "not json":
            entry["ok"] = False
            return self.reply(200, b"<html>502 Bad Gateway</html>")
        if model == "slow" and not test_request and len(post) % 2 == 0:
            entry["ok"] = False
            time.sleep(2.5)
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
        self.reply(200, json.dumps(reply).encode())

    def reply(self, code, data):
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
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Judge.log.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def read_samples(out, episode):
    with open(os.path.join(out, "eval_samples", f"episode_{episode}.jsonl")) as f:
        return [json.loads(line) for line in f]


def recompute_eval(policy, tok, rm, samples, response_length=12):
    """Check eval_samples rows against plain transformers, one prompt at a time: greedy generate() cut after the EOS
    token, and the reward model's own pooled score of prompt + completion. Returns the recomputed completions."""
    import torch

    completions = []
    for s in samples:
        ids = tok(s["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            full = policy.generate(
                input_ids=ids,
                do_sample=False,
                max_new_tokens=response_length,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0]
            response = full[ids.shape[1] :]
            if (response == tok.eos_token_id).any():
                response = response[: int((response == tok.eos_token_id).nonzero()[0]) + 1]
            score = rm(torch.cat([ids[0], response])[None]).logits[0, 0].item()
        completions.append(tok.decode(response, skip_special_tokens=True).strip())
        assert s["completion"] == completions[-1]
        assert s["length"] == len(response) and s["stopped"] == bool((response == tok.eos_token_id).any())
        assert s["score"] == pytest.approx(score, abs=1e-4)
    return completions


def small(script, tldr_dir, model, reward_model, out, extra=""):
    """A run of a TL;DR script small enough for a test: 2 updates of 16 completions, 10 eval prompts."""
    return (
        f"{script} --sft_model_path {model} --reward_model_path {reward_model} --dataset_name {tldr_dir}"
        " --max_prompt_length 200 --response_length 12 --total_episodes 32 --per_device_train_batch_size 4"
        " --gradient_accumulation_steps 2 --num_mini_batches 2 --num_ppo_epochs 2 --local_rollout_forward_batch_size 16"
        f" --eval_examples 10 --eval_batch_size 4 --num_sample_generations 0 --output_dir {out} {extra}"
    )


def test_rloo_tldr_trains_evaluates_and_judges(
    run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir, judge_url, monkeypatch
):
    monkeypatch.setenv("TLDR_TEST_KEY", "sk-test")
    out = tmp_path / "out"
    judge = f"--judge_base_url {judge_url} --judge_model flaky --judge_api_key_env TLDR_TEST_KEY --judge_retries 0"
    proc = run(
        small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, f"--eval_every 16 {judge}"), tmp_path
    )
    check_ok(proc)
    rows = read_metrics(out)
    train = [r for r in rows if "objective/scores" in r]
    evals = [r for r in rows if "eval/scores" in r]
    assert [r["episode"] for r in train] == [16, 32] and all(sorted(r) == sorted(RLOO_KEYS) for r in train)
    assert [r["episode"] for r in evals] == [0, 16, 32] and all(sorted(r) == sorted(JUDGE_KEYS) for r in evals)
    with open(out / "eval.json") as f:
        assert json.load(f) == evals

    reference = validation_rows(tldr_dir)[:10]
    expected_failures = sum(flaky(r["prompt"]) is not None for r in reference)
    assert 0 < expected_failures < 10  # the dataset exercises both
    for row in evals:
        samples = read_samples(out, row["episode"])
        assert [s["prompt"] for s in samples] == [r["prompt"] for r in reference]
        assert [s["reference"] for s in samples] == [r["completion"].strip() for r in reference]
        assert row["eval/scores"] == pytest.approx(sum(s["score"] for s in samples) / 10)
        assert row["eval/judge_failures"] == expected_failures and row["eval/judged"] == 10 - expected_failures
        # the judge prefers the longer summary: check each verdict where the lengths differ
        for s in samples:
            if flaky(s["prompt"]) is not None:
                assert s["win"] is None
            elif len(s["completion"]) != len(s["reference"]):
                assert s["win"] == (len(s["completion"]) > len(s["reference"]))
        judged = [s["win"] for s in samples if s["win"] is not None]
        assert row["eval/win_rate"] == pytest.approx(sum(judged) / len(judged))

    # one test request, then 10 per evaluation; the key came from the environment; the order was randomised
    calls = [e for e in Judge.log if e["post"] != "The cat sat on the mat."]
    assert len(Judge.log) == 1 + 30 and len(calls) == 30
    assert all(e["auth"] == "Bearer sk-test" for e in Judge.log)
    refs = {r["completion"].strip() for r in reference}
    reference_first = sum(e["a"] in refs and e["b"] not in refs for e in calls)
    reference_second = sum(e["b"] in refs and e["a"] not in refs for e in calls)
    assert reference_first >= 5 and reference_second >= 5

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size > 0


def test_eval_matches_transformers_greedy_and_reward_model(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    """The episode-0 evaluation, recomputed one prompt at a time with plain transformers: greedy generate() and the
    reward model's own pooled score."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "out"
    proc = run(small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, "--total_episodes 16"), tmp_path)
    check_ok(proc)
    evals = [r for r in read_metrics(out) if "eval/scores" in r]
    assert [r["episode"] for r in evals] == [0, 16] and all(sorted(r) == sorted(EVAL_KEYS) for r in evals)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    samples = read_samples(out, 0)
    recompute_eval(policy, tok, rm, samples)
    assert evals[0]["eval/scores"] == pytest.approx(sum(s["score"] for s in samples) / len(samples))


def test_ppo_tldr_counts_judge_timeouts(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir, judge_url):
    out = tmp_path / "out"
    judge = f"--judge_base_url {judge_url} --judge_model slow --judge_timeout 1 --judge_retries 0 --judge_workers 4"
    proc = run(small("ppo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, judge), tmp_path)
    check_ok(proc)
    rows = read_metrics(out)
    train = [r for r in rows if "objective/scores" in r]
    evals = [r for r in rows if "eval/scores" in r]
    assert [r["episode"] for r in train] == [16, 32] and all(sorted(r) == sorted(PPO_KEYS) for r in train)
    assert [r["episode"] for r in evals] == [0, 32]
    slow = sum(len(r["prompt"]) % 2 == 0 for r in validation_rows(tldr_dir)[:10])
    assert 0 < slow < 10
    for row in evals:
        assert row["eval/judge_failures"] == slow and row["eval/judged"] == 10 - slow
    assert "judge calls failed" in proc.stdout
    assert os.path.exists(out / "critic" / "model.safetensors")


def test_resumed_run_lists_each_evaluation_once(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    import shutil

    out = tmp_path / "out"
    command = small(
        "rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, "--eval_every 16 --checkpoint_every 1"
    )
    check_ok(run(command, tmp_path))
    shutil.rmtree(out / "checkpoint-0000002")  # as if the run had died after its first checkpoint
    check_ok(run(command + " --resume", tmp_path))
    with open(out / "eval.json") as f:
        assert [r["episode"] for r in json.load(f)] == [0, 16, 32]
    assert [r["episode"] for r in read_metrics(out)] == [0, 16, 16, 32, 32]


@pytest.mark.parametrize(
    "case, message",
    [
        ("judge_down", "failed a test request"),
        ("judge_401", "HTTP 401"),
        ("judge_garbage", "not A or B"),
        ("no_reference_column", "no column 'summary'"),
        ("no_eval_split", "split 'test'"),
        ("reward_model_missing", "does not exist"),
    ],
)
def test_bad_input_is_one_clear_line_before_any_work(
    run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir, judge_url, case, message
):
    extra = {
        "judge_down": "--judge_base_url http://127.0.0.1:9/v1",  # the discard port: nothing listens
        "judge_401": f"--judge_base_url {judge_url} --judge_model unauthorized",
        "judge_garbage": f"--judge_base_url {judge_url} --judge_model garbage",
        "no_reference_column": "--reference_field summary",
        "no_eval_split": "--eval_split test",
        "reward_model_missing": "",
    }[case]
    reward_model = tmp_path / "nowhere" if case == "reward_model_missing" else tiny_reward_model_dir
    out = tmp_path / "out"
    proc = run(small("rloo_tldr.py", tldr_dir, tiny_model_dir, reward_model, out, extra), tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out / "metrics.jsonl")


def test_two_processes_shard_the_evaluation(tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    from test_distributed import launch

    out = tmp_path / "out"
    script, args = small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out).split(" ", 1)
    check_ok(launch(2, script, args, tmp_path))
    rows = read_metrics(out)
    # 32 episodes = one update of 2 processes x 16 completions; each row written once
    assert [r["episode"] for r in rows] == [0, 32, 32]
    reference = validation_rows(tldr_dir)[:10]
    for episode in (0, 32):
        samples = read_samples(out, episode)  # gathered from both processes, in the eval set's order
        assert [s["index"] for s in samples] == list(range(10))
        assert [s["prompt"] for s in samples] == [r["prompt"] for r in reference]
