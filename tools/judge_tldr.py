"""An LLM judge's win rate for a TL;DR run: each greedy summary the run wrote at an evaluation
(OUTPUT_DIR/eval_samples/episode_{N}.jsonl) against the dataset's reference summary, or against another run's summary
of the same post, through any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, ...).

Two protocols:
- project (default): our prompt, temperature 0, a reply counts when it starts with A or B; failed judgements
  (timeouts, HTTP errors, replies that are no verdict after every retry) are left out of the win rate.
- trl: TRL's judging as in its examples/scripts/evals/judge_tldr.py with OpenAIPairwiseJudge, so that the figure
  compares with TRL's published TL;DR win rates (gpt-4o-mini, first 1,000 validation examples): its "leaderboard"
  prompt, max_tokens=1, the API's default temperature, a reply counts only if it is exactly "0" or "1", and a failed
  judgement counts as a loss.

With the runs of README.md's commands (--output_dir output/rloo_tldr, output/ppo_tldr); the key is read from
OPENAI_API_KEY:
    python tools/judge_tldr.py --samples output/rloo_tldr --judge_base_url https://api.openai.com/v1
    python tools/judge_tldr.py --samples output/rloo_tldr --judge_base_url https://api.openai.com/v1 \
        --protocol trl --num_examples 1000
    python tools/judge_tldr.py --samples output/rloo_tldr --judge_base_url https://api.openai.com/v1 --all_evaluations
    python tools/judge_tldr.py --samples output/rloo_tldr --against output/ppo_tldr \
        --judge_base_url https://api.openai.com/v1
A local judge: vllm serve Qwen/Qwen2.5-7B-Instruct, then --judge_base_url http://localhost:8000/v1 --judge_model
Qwen/Qwen2.5-7B-Instruct.

Results go next to the samples: OUTPUT_DIR/judge/{protocol}[_vs_{other}].json (one row per evaluation judged, rows of
earlier invocations kept unless the same evaluation is judged again) and OUTPUT_DIR/judge/{protocol}[_vs_{other}]
_episode_{N}.jsonl (one verdict per sample).
"""

import http.client
import json
import os
import random
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Optional

import tyro


@dataclass
class Args:
    # what to judge
    samples: str = tyro.MISSING
    """a run's output_dir (its last evaluation, the highest episode_{N}.jsonl) or one eval_samples .jsonl file"""
    all_evaluations: bool = False
    """judge every evaluation of the run in --samples (a win-rate curve), not only the last"""
    against: Optional[str] = None
    """another run's output_dir (its last evaluation) or samples file: judge --samples' summaries against its summaries
    of the same prompts (matched by index) instead of against the references"""
    num_examples: Optional[int] = None
    """judge only the first this many samples by index (TRL's figures: 1000); None: all"""
    seed: int = 1
    """seed of the order in which each pair is shown, so a judge's position bias cancels out and reruns repeat"""

    # judge
    protocol: Literal["project", "trl"] = "project"
    """project: our prompt, failures left out of the win rate; trl: TRL's prompt and settings, failures count as losses"""
    judge_base_url: str = tyro.MISSING
    """an OpenAI-compatible API (https://api.openai.com/v1, a vLLM server, ...)"""
    judge_model: str = "gpt-4o-mini"
    """the judge's model name"""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """the environment variable holding the judge's API key (unset: no key is sent)"""
    judge_timeout: float = 60.0
    """seconds before a judge request counts as failed"""
    judge_retries: int = 2
    """extra attempts for a failed judge request, with backoff"""
    judge_workers: int = 16
    """judge requests in flight at once"""


# Our prompt (the one the TL;DR scripts used while they judged during training).
PROJECT_PROMPT = """Two summaries of the same Reddit post follow. The better summary states the post's most important \
points accurately and concisely, and adds nothing that the post does not say.

Post:
{post}

Summary A:
{a}

Summary B:
{b}

Which summary is better? Answer with one letter, A or B, and nothing else."""

# TRL's DEFAULT_PAIRWISE_SYSTEM_PROMPT, verbatim (a format string: {{ }} are literal braces), from
# https://github.com/huggingface/trl/blob/main/trl/trainer/judges.py, Copyright The HuggingFace Team, Apache-2.0.
# Quoted unchanged because judging with the identical prompt is what makes our win rates comparable with TRL's.
TRL_PROMPT = '''I require a leaderboard for various large language models. I'll provide you with prompts given to these models and their corresponding outputs. Your task is to assess these responses, and select the model that produces the best output from a human perspective.

## Instruction

{{
    "instruction": """{prompt}""",
}}

## Model Outputs

Here are the unordered outputs from the models. Each output is associated with a specific model, identified by a unique model identifier.

{{
    {{
        "model_identifier": "0",
        "output": """{response0}"""
    }},
    {{
        "model_identifier": "1",
        "output": """{response1}"""
    }}
}}

## Task

Evaluate the models on the basis of the quality and relevance of their results, and select the model that generated the best result. Reply with the identifier of the best model. Our evaluation will only take into account the first character of your answer, so make sure it contains only one of the identifiers and nothing else (no quotation marks, no spaces, no new lines, ...).
'''  # noqa: E501

SAMPLE_KEYS = ["index", "prompt", "reference", "completion"]


class JudgeError(Exception):
    pass


def die(msg):
    """Stop with a one-line error (no traceback): bad input is the user's to fix, not a crash."""
    raise SystemExit(f"error: {msg}")


def render(protocol, prompt, first, second):
    """The judge's message for a pair shown in this order (first as A / "0")."""
    if protocol == "trl":
        return TRL_PROMPT.format(prompt=prompt, response0=first, response1=second)
    return PROJECT_PROMPT.format(post=prompt, a=first, b=second)


def parse_verdict(protocol, reply):
    """0 when the judge prefers the pair shown first, 1 the second, None when the reply is no verdict.
    project: the reply starts with A or B as a word ("A", "**B**", "A."); trl: the reply is exactly "0" or "1", as
    OpenAIPairwiseJudge accepts it (no stripping)."""
    if protocol == "trl":
        return {"0": 0, "1": 1}.get(reply)
    match = re.match(r"\W*([AB])\b", reply)
    return "AB".index(match.group(1)) if match else None


def ask(args, api_key, message):
    """One request to the chat-completions endpoint -> the reply's text, or JudgeError saying why not."""
    body = {"model": args.judge_model, "messages": [{"role": "user", "content": message}]}
    if args.protocol == "trl":
        body["max_tokens"] = 1  # and no temperature: TRL leaves the API's default
    else:
        body["temperature"] = 0
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = args.judge_base_url.rstrip("/") + "/chat/completions"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=args.judge_timeout) as response:
            reply = json.loads(response.read())
        return str(reply["choices"][0]["message"]["content"])
    except urllib.error.HTTPError as e:
        raise JudgeError(f"HTTP {e.code}: {e.read(200).decode(errors='replace').strip()}") from None
    except (OSError, http.client.HTTPException) as e:  # refused, unreachable, timed out, cut off
        raise JudgeError(str(getattr(e, "reason", e)) or type(e).__name__) from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError("the reply is not a chat completion") from None


def judge_one(args, api_key, prompt, first, second, swapped):
    """The verdict on one pair: {"win": True when `first` is preferred, False, or None when every attempt failed,
    "reply", "error"}. swapped: show `second` first. Transport failures are retried with backoff in both protocols; a
    reply that is no verdict only in the project protocol (OpenAIPairwiseJudge takes it as -1 at once)."""
    shown = (second, first) if swapped else (first, second)
    message = render(args.protocol, prompt, *shown)
    reply, error = None, None
    for attempt in range(args.judge_retries + 1):
        if attempt:
            time.sleep(min(2 ** (attempt - 1), 30))  # back off: rate limits are the usual cause
        try:
            reply = ask(args, api_key, message)
        except JudgeError as e:
            reply, error = None, str(e)
            continue
        verdict = parse_verdict(args.protocol, reply)
        if verdict is not None:
            # map the position the judge chose back to the pair: `first` sat at position 1 when swapped
            return {"win": verdict == int(swapped), "reply": reply, "error": None}
        error = f"the reply {reply[:60]!r} is not a verdict ({'0 or 1' if args.protocol == 'trl' else 'A or B'})"
        if args.protocol == "trl":
            break
    return {"win": None, "reply": reply, "error": error}


def check_judge(args, api_key):
    """One test request before any judging, so a wrong URL, model, key or protocol is a one-line error at once."""
    where = f"judge {args.judge_model!r} at {args.judge_base_url}"
    message = render(args.protocol, "The cat sat on the mat.", "A cat sat.", "Dogs bark.")
    try:
        reply = ask(args, api_key, message)
    except JudgeError as e:
        die(f"{where} failed a test request: {e}")
    if parse_verdict(args.protocol, reply) is None:
        want = '"0" or "1"' if args.protocol == "trl" else "A or B"
        die(f"{where} answered a test request with {reply[:60]!r}, not {want} (--protocol {args.protocol})")


def episode_files(path):
    """{episode: samples file} of a run's output_dir, or {episode or None: path} for one file."""
    if os.path.isfile(path):
        match = re.search(r"episode_(\d+)\.jsonl$", path)
        return {int(match.group(1)) if match else None: path}
    folder = os.path.join(path, "eval_samples")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    files = {int(m.group(1)): os.path.join(folder, n) for n in names if (m := re.fullmatch(r"episode_(\d+)\.jsonl", n))}
    if not files:
        die(f"{path} has no eval_samples/episode_{{N}}.jsonl: is it a TL;DR run's output_dir?")
    return files


def read_samples(path, keys):
    """The rows of a samples file, sorted by index, each checked for `keys`."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                die(f"{path} line {number} is not JSON")
            missing = [k for k in keys if not isinstance(row, dict) or k not in row]
            if missing:
                die(f"{path} line {number} has no {', '.join(repr(k) for k in missing)} (is it an eval_samples file?)")
            for key in keys:  # (a null reference, from a held-out set without one, would be judged as the text None)
                kind = int if key == "index" else str
                if not isinstance(row[key], kind) or isinstance(row[key], bool):
                    what = "a whole number" if kind is int else "text"
                    die(f"{path} line {number}: {key!r} must be {what}, got {row[key]!r}")
            rows.append(row)
    if not rows:
        die(f"{path} holds no samples")
    rows.sort(key=lambda r: r["index"])
    if len({r["index"] for r in rows}) < len(rows):
        die(f"{path} lists an index twice")
    return rows


def first_n(rows, n, path):
    """The first n rows by index; fewer than n is an error, since the win rate would not be over the same examples."""
    if n is None:
        return rows
    if len(rows) < n:
        die(f"{path} holds {len(rows)} samples, fewer than --num_examples {n}")
    return rows[:n]


def write_atomic(path, text):
    """Write via a .tmp file and os.replace, so a reader never sees a half-written file."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def run_dir(path):
    """Where a run's files sit: path itself for a folder, the folder above eval_samples/ for one of its files."""
    if os.path.isdir(path):
        return path
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(folder) if os.path.basename(folder) == "eval_samples" else folder


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    if not args.judge_timeout > 0 or args.judge_retries < 0 or args.judge_workers < 1:  # (NaN: not > 0)
        die("--judge_timeout must be positive, --judge_retries >= 0 and --judge_workers >= 1")
    if args.num_examples is not None and args.num_examples < 1:
        die("--num_examples must be >= 1")
    if not args.judge_base_url.startswith(("http://", "https://")):
        die(f"--judge_base_url {args.judge_base_url!r} must start with http:// or https://")
    for path in [args.samples, args.against]:
        if path is not None and not os.path.exists(path):
            die(f"{path} does not exist")
    if args.all_evaluations and not os.path.isdir(args.samples):
        die("--all_evaluations needs --samples to be a run's output_dir, not one file")

    # 1. read every samples file before the first request, so bad input stops the script before it costs anything
    files = episode_files(args.samples)
    if not args.all_evaluations:
        last = max(files, key=lambda e: -1 if e is None else e)
        files = {last: files[last]}
    evaluations = {
        episode: first_n(read_samples(path, SAMPLE_KEYS), args.num_examples, path) for episode, path in files.items()
    }
    name = args.protocol
    others = None
    if args.against is not None:
        other_files = episode_files(args.against)
        other_episode = max(other_files, key=lambda e: -1 if e is None else e)
        other_path = other_files[other_episode]
        others = {r["index"]: r for r in read_samples(other_path, ["index", "prompt", "completion"])}
        for episode, rows in evaluations.items():
            for r in rows:
                if r["index"] not in others:
                    die(f"{other_path} has no sample with index {r['index']} ({files[episode]} has)")
                if others[r["index"]]["prompt"] != r["prompt"]:
                    die(
                        f"index {r['index']} has different prompts in {files[episode]} and {other_path}: not the same eval set"
                    )
        other_name = os.path.basename(os.path.normpath(run_dir(args.against)))
        if other_episode is not None:
            other_name += f"_episode_{other_episode}"
        name += "_vs_" + re.sub(r"[^A-Za-z0-9_.-]", "_", other_name)

    out = os.path.join(run_dir(args.samples), "judge")
    results_path = os.path.join(out, f"{name}.json")
    results = []
    if os.path.exists(results_path):  # (the earlier evaluations' results, kept beside the new ones)
        try:
            with open(results_path) as f:
                results = [row for row in json.load(f) if row["episode"] not in evaluations]
        except (ValueError, TypeError, KeyError):
            die(f"{results_path} is not this script's results (a list of rows with an episode): move it aside")

    # 2. one test request: a wrong URL, key, model or protocol fails here, in one line
    api_key = os.environ.get(args.judge_api_key_env)
    check_judge(args, api_key)
    os.makedirs(out, exist_ok=True)

    # 3. judge each evaluation: the first run's summary against the reference (or the other run's summary)
    def one(r):
        second = others[r["index"]]["completion"] if others else r["reference"]
        if args.protocol == "trl" and not others:
            # TRL shows trl-lib/tldr's completion column as it is, which starts with a space
            # (examples/datasets/tldr.py); the TL;DR scripts stripped it on loading
            second = " " + second
        # the order is drawn per index, so it does not depend on which or how many samples are judged
        swapped = random.Random(args.seed * 1_000_003 + r["index"]).random() < 0.5
        verdict = judge_one(args, api_key, prompt=r["prompt"], first=r["completion"], second=second, swapped=swapped)
        return {"index": r["index"], "swapped": swapped, **verdict}

    with ThreadPoolExecutor(args.judge_workers) as pool:
        for episode, rows in sorted(evaluations.items(), key=lambda item: -1 if item[0] is None else item[0]):
            verdicts = list(pool.map(one, rows))
            wins = sum(v["win"] is True for v in verdicts)
            failures = sum(v["win"] is None for v in verdicts)
            judged = len(verdicts) - failures
            # project: a failure says nothing about the summary, so it leaves the denominator;
            # trl: TRL's count(1) / len counts a failure (-1) as a loss
            denominator = len(verdicts) if args.protocol == "trl" else judged
            first_error = next((v["error"] for v in verdicts if v["error"]), None)
            row = {
                "episode": episode,
                "protocol": args.protocol,
                "judge_model": args.judge_model,
                "n": len(verdicts),
                "judged": judged,
                "wins": wins,
                "failures": failures,
                "win_rate": wins / denominator if denominator else None,
                "first_error": first_error,
                "samples": os.path.abspath(files[episode]),
                "against": os.path.abspath(other_path) if others else None,
                "seed": args.seed,
            }
            suffix = f"_episode_{episode}" if episode is not None else ""
            write_atomic(os.path.join(out, f"{name}{suffix}.jsonl"), "".join(json.dumps(v) + "\n" for v in verdicts))
            results.append(row)
            results.sort(key=lambda r: -1 if r["episode"] is None else r["episode"])
            write_atomic(results_path, json.dumps(results, indent=1) + "\n")
            rate = "n/a" if row["win_rate"] is None else f"{row['win_rate']:.1%}"
            print(
                f"episode {episode}: win rate {rate} ({wins} wins / {denominator}), {failures} failures, "
                f"{args.protocol} protocol, judge {args.judge_model}"
            )
            if first_error:
                print(f"warning: {failures} of {len(verdicts)} judgements failed; the first said: {first_error}")
    print(f"wrote {results_path}")
