"""tools/judge_tldr.py run as a user would, against a real OpenAI-compatible HTTP server on 127.0.0.1 whose
verdicts a test can predict: it prefers the longer of the two summaries it is shown."""

import json
import os
import random
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

SCRIPT = "tools/judge_tldr.py"


def fate(index):
    """How the "flaky" judge treats a sample (the post text carries the index), so that a test can count failures."""
    return {3: "http500", 5: "garbage"}.get(index % 7)


def slow(index):
    """The samples on which the "slow" judge sleeps past the client's timeout."""
    return index % 4 == 1


class Judge(BaseHTTPRequestHandler):
    """/v1/chat/completions for either protocol's prompt; the requested model name picks the behaviour:
    longer (prefers the longer summary, the first shown on a tie), flaky (see fate()), slow (see slow()),
    unauthorized (HTTP 401), garbage (never a verdict), letters (always "A", a verdict only in the project protocol).
    Samples are recognised by "post number N" in the prompt; the script's test request has none."""

    log = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        message = body["messages"][-1]["content"]
        trl = message.startswith("I require a leaderboard")
        if trl:
            prompt, first, second = re.findall(r'"""(.*?)"""', message, re.S)
        else:
            prompt, first, second = re.search(
                r"Post:\n(.*)\n\nSummary A:\n(.*)\n\nSummary B:\n(.*)\n\nWhich", message, re.S
            ).groups()
        number = re.search(r"post number (\d+)", prompt)
        index = int(number.group(1)) if number else None
        model = body["model"]
        entry = {"model": model, "index": index, "trl": trl, "prompt": prompt, "first": first, "second": second}
        entry.update(body=body, auth=self.headers.get("Authorization"))
        Judge.log.append(entry)
        position = 0 if len(first) >= len(second) else 1
        answer = str(position) if trl else "AB"[position]
        if self.path != "/v1/chat/completions" or model == "unauthorized":
            return self.reply(401, b'{"error": {"message": "invalid api key"}}')
        if model == "flaky" and index is not None and fate(index) == "http500":
            return self.reply(500, b'{"error": {"message": "overloaded"}}')
        if model == "garbage" or (model == "flaky" and index is not None and fate(index) == "garbage"):
            answer = "Both"
        if model == "letters":
            answer = "A"
        if model == "slow" and index is not None and slow(index):
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


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default 5 resets connections when 16 workers connect at once


@pytest.fixture
def judge_url():
    server = Server(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Judge.log.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def summary(rng, word, not_near=None):
    """A summary of 1-12 words whose length in characters differs from not_near's by at least 2 (the trl protocol
    adds a space to the reference), so that the longer-wins judge never sees a tie."""
    while True:
        text = " ".join([word] * rng.randint(1, 12))
        if not_near is None or abs(len(text) - len(not_near)) >= 2:
            return text


def write_run(out, episodes, n, seed=0):
    """A TL;DR run's output_dir as infra.evaluation.record_eval writes it: eval_samples/episode_{N}.jsonl for each episode, n
    samples each (written in a shuffled order), the same prompts and references in every episode, the completions
    drawn per episode. Returns {episode: {index: sample}}."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "eval_samples"), exist_ok=True)
    references = [summary(random.Random(i), "ref") for i in range(n)]
    runs = {}
    for episode in episodes:
        rows = []
        for i in range(n):
            text = f"SUBREDDIT: r/cats\n\nTITLE: title {i}\n\nPOST: post number {i}: my cat sat on the mat again.\n\nTL;DR:"
            completion = summary(rng, "word", not_near=references[i])
            sample = {"index": i, "prompt": text, "reference": references[i]}
            sample.update(completion=completion, score=rng.random(), length=len(completion.split()), stopped=True)
            rows.append(sample)
        runs[episode] = {r["index"]: r for r in rows}
        rng.shuffle(rows)
        with open(os.path.join(out, "eval_samples", f"episode_{episode}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return runs


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_ok(result):
    assert result.returncode == 0, result.stdout + result.stderr


def sample_requests(model):
    """The logged requests about samples (not the test request) to the given model."""
    return [e for e in Judge.log if e["index"] is not None and e["model"] == model]


def check_order(verdicts, samples, requests, second):
    """Each pair was shown in the order its verdict row says (swapped: the summary second), and both orders occur."""
    swapped = {v["index"]: v["swapped"] for v in verdicts}
    for e in requests:
        s = samples[e["index"]]
        shown = (second(s), s["completion"]) if swapped[e["index"]] else (s["completion"], second(s))
        assert (e["first"], e["second"]) == shown
    assert 0.25 < sum(swapped.values()) / len(swapped) < 0.75


def test_project_protocol(run, tmp_path, judge_url, monkeypatch):
    """Failures (HTTP 500, a reply that is no verdict) leave the denominator; every other verdict is the longer-wins
    oracle's, whichever order the pair was shown in; the run's last evaluation is judged; the key is sent."""
    out = str(tmp_path / "run")
    samples = write_run(out, [64, 192, 128], n=42)[192]
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    flags = f"--judge_base_url {judge_url} --judge_model flaky --judge_api_key_env JUDGE_TEST_KEY --judge_workers 8"
    result = run(f"{SCRIPT} --samples {out} {flags} --judge_retries 1", cwd=tmp_path)
    check_ok(result)

    [row] = read_json(os.path.join(out, "judge", "project.json"))
    verdicts = read_jsonl(os.path.join(out, "judge", "project_episode_192.jsonl"))
    failing = {i for i in samples if fate(i)}
    oracle = {i: len(s["completion"]) > len(s["reference"]) for i, s in samples.items()}
    assert {v["index"]: v["win"] for v in verdicts} == {i: None if i in failing else oracle[i] for i in samples}
    assert all(bool(v["error"]) == (v["index"] in failing) for v in verdicts)
    wins = sum(oracle[i] for i in samples if i not in failing)
    assert 0 < wins < len(samples) - len(failing)
    assert row["episode"] == 192 and row["protocol"] == "project" and row["judge_model"] == "flaky"
    assert (row["n"], row["judged"], row["wins"], row["failures"]) == (42, 42 - len(failing), wins, len(failing))
    assert row["win_rate"] == pytest.approx(wins / (42 - len(failing)))
    assert "HTTP 500" in row["first_error"] or "'Both'" in row["first_error"]
    lines = [line for line in result.stdout.splitlines() if line.startswith("episode ")]
    assert len(lines) == 1 and f"({wins} wins / {42 - len(failing)}), {len(failing)} failures" in lines[0]

    requests = sample_requests("flaky")
    assert {e["prompt"] for e in requests} == {s["prompt"] for s in samples.values()}  # the last evaluation only
    check_order(verdicts, samples, requests, second=lambda s: s["reference"])
    # retried once with backoff: a broken reply too, in this protocol
    assert all(sum(e["index"] == i for e in requests) == (2 if i in failing else 1) for i in samples)
    assert all(e["body"]["temperature"] == 0 and "max_tokens" not in e["body"] for e in Judge.log)
    assert all(e["auth"] == "Bearer sk-test" for e in Judge.log)

    # the same seed shows every pair in the same order again; another seed draws other orders, same verdicts
    for seed, same in [(1, True), (2, False)]:
        Judge.log.clear()
        check_ok(run(f"{SCRIPT} --samples {out} {flags} --judge_retries 0 --seed {seed}", cwd=tmp_path))
        again = read_jsonl(os.path.join(out, "judge", "project_episode_192.jsonl"))
        assert ([v["swapped"] for v in again] == [v["swapped"] for v in verdicts]) == same
        assert [v["win"] for v in again] == [v["win"] for v in verdicts]
        check_order(again, samples, sample_requests("flaky"), second=lambda s: s["reference"])


def test_trl_protocol(run, tmp_path, judge_url, monkeypatch):
    """TRL's prompt (the full prompt text, the reference with its leading space), max_tokens=1 and no temperature, a
    verdict only as "0" or "1" mapped back through the shuffle, failures counted as losses and reported; a broken
    reply is not retried, an HTTP error is; no key header without the variable."""
    out = str(tmp_path / "run")
    samples = write_run(out, [256], n=42)[256]
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    flags = f"--judge_base_url {judge_url} --judge_model flaky --judge_api_key_env JUDGE_TEST_KEY --judge_workers 8"
    result = run(f"{SCRIPT} --samples {out} {flags} --protocol trl --judge_retries 1", cwd=tmp_path)
    check_ok(result)

    [row] = read_json(os.path.join(out, "judge", "trl.json"))
    verdicts = read_jsonl(os.path.join(out, "judge", "trl_episode_256.jsonl"))
    failing = {i for i in samples if fate(i)}
    oracle = {i: len(s["completion"]) > len(s["reference"]) for i, s in samples.items()}
    assert {v["index"]: v["win"] for v in verdicts} == {i: None if i in failing else oracle[i] for i in samples}
    wins = sum(oracle[i] for i in samples if i not in failing)
    assert (row["n"], row["judged"], row["wins"], row["failures"]) == (42, 42 - len(failing), wins, len(failing))
    assert row["win_rate"] == pytest.approx(wins / 42)  # a failure is a loss
    assert row["protocol"] == "trl" and row["first_error"]
    assert f"({wins} wins / 42), {len(failing)} failures" in result.stdout

    requests = sample_requests("flaky")
    assert all(e["trl"] and e["prompt"] == samples[e["index"]]["prompt"] for e in requests)
    check_order(verdicts, samples, requests, second=lambda s: " " + s["reference"])
    retried = {i for i in samples if fate(i) == "http500"}
    assert all(sum(e["index"] == i for e in requests) == (2 if i in retried else 1) for i in samples)
    assert all(e["body"]["max_tokens"] == 1 and "temperature" not in e["body"] for e in Judge.log)
    assert all(e["auth"] is None for e in Judge.log)


def test_against(run, tmp_path, judge_url):
    """One run's summaries against another's, matched by index: the oracle compares the two completions."""
    first = write_run(str(tmp_path / "a"), [64], n=30, seed=1)[64]
    second = write_run(str(tmp_path / "b"), [32, 96], n=40, seed=2)[96]
    flags = f"--judge_base_url {judge_url} --judge_model longer --judge_retries 0"
    check_ok(run(f"{SCRIPT} --samples {tmp_path / 'a'} --against {tmp_path / 'b'} {flags}", cwd=tmp_path))

    [row] = read_json(tmp_path / "a" / "judge" / "project_vs_b_episode_96.json")
    verdicts = read_jsonl(tmp_path / "a" / "judge" / "project_vs_b_episode_96_episode_64.jsonl")
    oracle = {i: len(s["completion"]) > len(second[i]["completion"]) for i, s in first.items()}
    assert {v["index"]: v["win"] for v in verdicts} == oracle
    assert (row["n"], row["wins"], row["failures"]) == (30, sum(oracle.values()), 0)
    assert row["against"].endswith("episode_96.jsonl")
    check_order(verdicts, first, sample_requests("longer"), second=lambda s: second[s["index"]]["completion"])


def test_all_evaluations(run, tmp_path, judge_url):
    """--all_evaluations: one row and one verdict file per episode, in order; judging the last one again later
    replaces its row and keeps the others."""
    out = str(tmp_path / "run")
    runs = write_run(out, [64, 128, 192], n=20)
    flags = f"--judge_base_url {judge_url} --judge_model longer --judge_retries 0"
    result = run(f"{SCRIPT} --samples {out} --all_evaluations {flags}", cwd=tmp_path)
    check_ok(result)

    rows = read_json(os.path.join(out, "judge", "project.json"))
    assert [r["episode"] for r in rows] == [64, 128, 192]
    for r in rows:
        oracle = [len(s["completion"]) > len(s["reference"]) for s in runs[r["episode"]].values()]
        assert r["wins"] == sum(oracle) and r["n"] == 20
        verdicts = read_jsonl(os.path.join(out, "judge", f"project_episode_{r['episode']}.jsonl"))
        assert [v["win"] for v in verdicts] == oracle
    assert len([line for line in result.stdout.splitlines() if line.startswith("episode ")]) == 3

    check_ok(run(f"{SCRIPT} --samples {out} {flags} --judge_model longer2", cwd=tmp_path))
    rows = read_json(os.path.join(out, "judge", "project.json"))
    assert [(r["episode"], r["judge_model"]) for r in rows] == [(64, "longer"), (128, "longer"), (192, "longer2")]


def test_num_examples_and_one_file(run, tmp_path, judge_url):
    """--num_examples N judges the first N by index of a file written out of order; one samples file works as
    --samples, its results going to its run's judge/ folder."""
    out = str(tmp_path / "run")
    samples = write_run(out, [64, 128], n=30)[64]
    path = os.path.join(out, "eval_samples", "episode_64.jsonl")
    flags = f"--judge_base_url {judge_url} --judge_model longer --judge_retries 0"
    check_ok(run(f"{SCRIPT} --samples {path} --num_examples 12 --protocol trl {flags}", cwd=tmp_path))

    [row] = read_json(os.path.join(out, "judge", "trl.json"))
    verdicts = read_jsonl(os.path.join(out, "judge", "trl_episode_64.jsonl"))
    assert [v["index"] for v in verdicts] == list(range(12))
    assert row["episode"] == 64 and row["n"] == 12
    assert row["wins"] == sum(len(samples[i]["completion"]) > len(samples[i]["reference"]) for i in range(12))
    assert sorted(e["index"] for e in sample_requests("longer")) == list(range(12))


def test_timeouts_counted(run, tmp_path, judge_url):
    """A judge slower than --judge_timeout: those samples fail (timed out), the others are judged."""
    out = str(tmp_path / "run")
    samples = write_run(out, [64], n=12)[64]
    flags = f"--judge_base_url {judge_url} --judge_model slow --judge_timeout 1 --judge_retries 0 --judge_workers 12"
    start = time.time()
    check_ok(run(f"{SCRIPT} --samples {out} {flags}", cwd=tmp_path))
    assert time.time() - start < 10

    [row] = read_json(os.path.join(out, "judge", "project.json"))
    verdicts = read_jsonl(os.path.join(out, "judge", "project_episode_64.jsonl"))
    late = {i for i in samples if slow(i)}
    assert row["failures"] == len(late) == 3 and row["judged"] == 9
    assert {v["index"] for v in verdicts if v["win"] is None} == late
    assert all("timed out" in v["error"] for v in verdicts if v["index"] in late)
    assert "timed out" in row["first_error"]


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_path", "does not exist"),
        ("no_eval_samples", "has no eval_samples/episode_{N}.jsonl"),
        ("missing_key", "line 3 has no 'completion'"),
        ("null_reference", "line 3: 'reference' must be text, got None"),
        ("text_index", "line 3: 'index' must be a whole number, got '"),
        ("not_a_url", "--judge_base_url 'notaurl' must start with http:// or https://"),
        ("nan_timeout", "--judge_timeout must be positive"),
        ("bad_results", "is not this script's results (a list of rows with an episode): move it aside"),
        ("not_json", "line 2 is not JSON"),
        ("too_few", "holds 10 samples, fewer than --num_examples 11"),
        ("all_evaluations_file", "--all_evaluations needs"),
        ("against_prompt", "index 4 has different prompts"),
        ("against_missing", "has no sample with index 8"),
        ("unreachable", "failed a test request: [Errno 111] Connection refused"),
        ("unauthorized", "failed a test request: HTTP 401"),
        ("garbage", "answered a test request with 'Both', not A or B"),
        ("letters_trl", 'answered a test request with \'A\', not "0" or "1" (--protocol trl)'),
    ],
)
def test_one_line_errors(run, tmp_path, judge_url, case, message):
    """Bad input stops the script with one line before any sample is judged (input errors: before any request)."""
    out = str(tmp_path / "run")
    write_run(out, [64], n=10)
    path = os.path.join(out, "eval_samples", "episode_64.jsonl")
    samples, extra, model, url = out, "", "longer", judge_url
    if case == "missing_path":
        samples = str(tmp_path / "nowhere")
    elif case == "no_eval_samples":
        os.makedirs(tmp_path / "plain")
        samples = str(tmp_path / "plain")
    elif case in ("missing_key", "not_json", "null_reference", "text_index"):
        lines = open(path).read().splitlines()
        if case == "missing_key":
            lines[2] = json.dumps({k: v for k, v in json.loads(lines[2]).items() if k != "completion"})
        elif case in ("null_reference", "text_index"):  # (a held-out set without references; an index as text)
            row = json.loads(lines[2])
            row.update({"reference": None} if case == "null_reference" else {"index": str(row["index"])})
            lines[2] = json.dumps(row)
        else:
            lines[1] = "{oops"
        open(path, "w").write("\n".join(lines) + "\n")
    elif case == "too_few":
        extra = "--num_examples 11"
    elif case == "all_evaluations_file":
        samples, extra = path, "--all_evaluations"
    elif case == "against_prompt":
        other = os.path.join(tmp_path, "other", "eval_samples", "episode_64.jsonl")
        write_run(str(tmp_path / "other"), [64], n=10, seed=1)
        rows = [dict(r, prompt="another post") if r["index"] == 4 else r for r in read_jsonl(other)]
        open(other, "w").write("".join(json.dumps(r) + "\n" for r in rows))
        extra = f"--against {tmp_path / 'other'}"
    elif case == "against_missing":
        write_run(str(tmp_path / "other"), [64], n=8)
        extra = f"--against {tmp_path / 'other'}"
    elif case == "unreachable":
        url = f"http://127.0.0.1:{closed_port()}/v1"
    elif case == "letters_trl":
        model, extra = "letters", "--protocol trl"
    elif case == "not_a_url":
        url = "notaurl"
    elif case == "nan_timeout":
        extra = "--judge_timeout nan"
    elif case == "bad_results":  # (read before the test request, which costs money on a real judge)
        os.makedirs(os.path.join(out, "judge"))
        open(os.path.join(out, "judge", "project.json"), "w").write("{oops")
    elif case in ("unauthorized", "garbage"):
        model = case

    result = run(f"{SCRIPT} --samples {samples} --judge_base_url {url} --judge_model {model} {extra}", cwd=tmp_path)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    assert message in result.stderr
    assert sample_requests(model) == []
    if case not in ("unreachable", "unauthorized", "garbage", "letters_trl"):
        assert Judge.log == []  # bad input is found before the test request
    assert case == "bad_results" or not os.path.exists(os.path.join(out, "judge", "project.json"))
