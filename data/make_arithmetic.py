"""Writes data/arithmetic.jsonl and data/arithmetic_test.jsonl, the verifiable task that ships with the project:
two-number additions as chat prompts, each with its `answer` column, for `--reward_fn accuracy`. The 2,000 training
prompts are drawn with replacement; the 200 held-out ones (for --eval_dataset_name) are distinct sums none of which
appears in the training file in either order. Deterministic (seeded), so the files can be rebuilt and checked:
python data/make_arithmetic.py [FOLDER] (default: data/)"""

import json
import os
import random
import sys

rng = random.Random(0)
folder = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))


def row(a, b):
    question = f"What is {a} + {b}? Answer with the number only."
    return json.dumps({"prompt": [{"role": "user", "content": question}], "answer": a + b}) + "\n"


seen = set()
with open(os.path.join(folder, "arithmetic.jsonl"), "w") as f:
    for _ in range(2000):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        seen |= {(a, b), (b, a)}
        f.write(row(a, b))
with open(os.path.join(folder, "arithmetic_test.jsonl"), "w") as f:
    held_out = 0
    while held_out < 200:  # the same generator, continued, skipping every pair already used
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) not in seen:
            seen |= {(a, b), (b, a)}
            f.write(row(a, b))
            held_out += 1
