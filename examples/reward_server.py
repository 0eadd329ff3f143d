"""A reward function that asks an HTTP server for the rewards: a reward model served elsewhere, a judge, a sandbox.

    REWARD_URL=http://localhost:8000/score python rloo.py --reward_fn examples/reward_server.py:server

The protocol: POST {"prompts": [...], "completions": [...], "<column>": [...]} (each dataset column of the rows) in
batches of REWARD_BATCH_SIZE completions (default 64); the reply must be {"rewards": [number or null, ...]}, one per
completion, null meaning "cannot judge". A failed request waits at most REWARD_TIMEOUT seconds (default 60) and is sent
again up to REWARD_RETRIES times (default 3), after 1, 2, 4, ... seconds; then the run stops with one line. A server
that cannot be reached as the file loads (tried as often) stops the run before any model loads.

For several servers, write a function per server that calls ask() (each is a reward source of its own):

    from reward_server import ask  # with this folder on sys.path, or the file copied beside yours

    def judge(prompts, completions, **columns):
        return ask("http://judge:8000/score", prompts, completions, columns)
"""

import http.client
import json
import math
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


def setting(name, default, kind, least):
    """an environment variable's number of kind (int: at least `least`; float: above it), or one line"""
    text = os.environ.get(name, str(default))
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not (value >= least if kind is int else least < value < math.inf):
        what = "a whole number, at least" if kind is int else "a number above"
        raise SystemExit(f"error: {name} must be {what} {least}, got {text!r}")
    return value


URL = os.environ.get("REWARD_URL")
BATCH_SIZE, TIMEOUT = setting("REWARD_BATCH_SIZE", 64, int, 1), setting("REWARD_TIMEOUT", 60, float, 0)
RETRIES = setting("REWARD_RETRIES", 3, int, 0)
if URL is not None and not URL.startswith(("http://", "https://")):  # checked as the scripts load the function
    raise SystemExit(f"error: REWARD_URL {URL!r} must start with http:// or https://")
if URL is None and any(arg.endswith("reward_server.py:server") for arg in sys.argv):  # (server() would need it later)
    raise SystemExit("error: examples/reward_server.py:server needs REWARD_URL, e.g. REWARD_URL=http://localhost:8000")


def reachable(url, timeout=60.0, retries=3):
    """Stop in one line unless a connection to url's host opens (tried as ask() tries a request): a server that is down
    stops the run as the scripts load the function, before any model loads"""
    parts = urllib.parse.urlsplit(url)
    for attempt in range(retries + 1):
        try:
            socket.create_connection((parts.hostname, parts.port or {"https": 443}.get(parts.scheme, 80)), timeout).close()
            return
        except OSError as e:
            error = e
        if attempt < retries:
            time.sleep(2**attempt)
    raise SystemExit(f"error: reward server {url} cannot be reached ({retries + 1} time(s)): {error}")


if URL is not None:
    reachable(URL, TIMEOUT, RETRIES)


def ask(url, prompts, completions, columns, batch_size=64, timeout=60.0, retries=3):
    """The rewards of completions from the server at url, in batches, each request retried after 1, 2, 4, ... s."""
    rewards = []
    for start in range(0, len(completions), batch_size):
        end = start + batch_size
        body = {"prompts": list(prompts[start:end]), "completions": list(completions[start:end])}
        # the dataset's columns (and an episode's messages); not the live environments nor the token ids
        data = {name: values for name, values in columns.items() if name not in ("environments", "completion_ids")}
        body.update({name: list(values[start:end]) for name, values in data.items()})
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    reply = json.loads(response.read())
                break
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read(200).decode(errors='replace').strip()}"
            except (OSError, http.client.HTTPException) as e:  # refused, unreachable, timed out, cut off
                error = str(getattr(e, "reason", e)) or type(e).__name__
            except ValueError:
                error = "the reply is not JSON"
            if attempt == retries:
                raise SystemExit(f"error: reward server {url} failed {retries + 1} time(s); the last said: {error}")
            time.sleep(2**attempt)
        if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
            raise SystemExit(f'error: reward server {url} must reply {{"rewards": [...]}}, got {str(reply)[:80]}')
        if len(reply["rewards"]) != len(body["completions"]):
            n, got = len(body["completions"]), len(reply["rewards"])
            raise SystemExit(f"error: reward server {url} returned {got} scores for {n} completions")
        rewards += reply["rewards"]
    return rewards


def server(prompts, completions, **columns):
    """The server at REWARD_URL, with REWARD_BATCH_SIZE, REWARD_TIMEOUT and REWARD_RETRIES (read as the file loads)."""
    if URL is None:
        raise SystemExit("error: examples/reward_server.py:server needs REWARD_URL, e.g. REWARD_URL=http://localhost:8000")
    return ask(URL, prompts, completions, columns, batch_size=BATCH_SIZE, timeout=TIMEOUT, retries=RETRIES)
