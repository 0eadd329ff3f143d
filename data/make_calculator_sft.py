"""Writes the calculator task's data (examples/environments/calculator.py): data/calculator_sft.jsonl, 1,000 tool-use
traces for sft.py in TRL's conversational form (`messages`: the arithmetic task's question, an assistant turn that
calls `calculate`, the tool's result as the environment answers it, the number as the final answer; `tools`: the
tool's JSON schema, made as the environment makes it, so that SFT trains on the system prompt the RL run sees), and
data/calculator.jsonl (1,000) and data/calculator_test.jsonl (200) for grpo.py --reward_fn accuracy, prompts in
data/arithmetic.jsonl's format. The sums are of numbers of 3 to 5 digits, which the model cannot add unaided; every
pair is distinct in either order, so no held-out sum is among the SFT or GRPO training ones. A harder task, beyond
the traces: data/calculator_words.jsonl (1,000) and data/calculator_words_test.jsonl (200), the operator in words, a
third each sums, differences and products ("What is 8737 minus 560?"; 3- to 5-digit numbers, 2- to 3-digit factors),
each distinct (a sum or product in either order) and none held out a training one; the traces show only a "+" copied
from the question. Deterministic (seeded), so the files can be rebuilt and checked:
python data/make_calculator_sft.py [FOLDER] (default: data/)"""

import importlib.util
import json
import os
import random
import sys

from transformers.utils import get_json_schema

rng = random.Random(0)
here = os.path.dirname(os.path.abspath(__file__))
folder = sys.argv[1] if len(sys.argv) > 1 else here
spec = importlib.util.spec_from_file_location("calculator", os.path.join(here, "..", "examples/environments/calculator.py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
calculator = module.Calculator()
schema = get_json_schema(calculator.calculate)  # as apply_chat_template makes it from the environment's bound method


def number():
    digits = rng.randint(3, 5)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


pairs, seen = [], set()
while len(pairs) < 2200:  # SFT, GRPO training, held out: 2,200 distinct sums
    a, b = number(), number()
    if (a, b) not in seen:
        seen |= {(a, b), (b, a)}
        pairs.append((a, b))


def question(a, b):
    return [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]


def trace(a, b):
    expression = f"{a} + {b}"
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    messages = question(a, b) + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculate", "content": calculator.calculate(expression)},  # as the environment's
        {"role": "assistant", "content": str(a + b)},
    ]
    return {"messages": messages, "tools": [schema]}


def write(name, rows):
    with open(os.path.join(folder, name), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


write("calculator_sft.jsonl", [trace(a, b) for a, b in pairs[:1000]])
write("calculator.jsonl", [{"prompt": question(a, b), "answer": a + b} for a, b in pairs[1000:2000]])
write("calculator_test.jsonl", [{"prompt": question(a, b), "answer": a + b} for a, b in pairs[2000:]])


# the harder task: its own generator, so the files above stay as they were
WORDS = {"+": "plus", "-": "minus", "*": "times"}
words, rng, asked = [], random.Random(1), set()
while len(words) < 1200:
    op = "+-*"[len(words) % 3]
    a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in rng.choices((2, 3) if op == "*" else (3, 4, 5), k=2))
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)  # differences are not negative
    key = (op, a, b) if op == "-" else (op, min(a, b), max(a, b))  # a sum or product in either order is one question
    if key not in asked:
        asked.add(key)
        text = f"What is {a} {WORDS[op]} {b}? Answer with the number only."
        words.append({"prompt": [{"role": "user", "content": text}], "answer": {"+": a + b, "-": a - b, "*": a * b}[op]})
write("calculator_words.jsonl", words[:1000])
write("calculator_words_test.jsonl", words[1000:])
