"""Writes data/arithmetic.jsonl, the verifiable task that ships with the project: two-number additions as chat
prompts, each with its `answer` column, for `--reward_fn accuracy`. Deterministic (seeded), so the file can be rebuilt
and checked: python data/make_arithmetic.py [PATH] (default: data/arithmetic.jsonl)"""

import json
import os
import random
import sys

rng = random.Random(0)
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.jsonl")
with open(path, "w") as f:
    for _ in range(2000):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} + {b}? Answer with the number only."
        f.write(json.dumps({"prompt": [{"role": "user", "content": question}], "answer": a + b}) + "\n")
