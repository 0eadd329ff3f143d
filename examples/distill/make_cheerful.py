"""Writes cheerful.jsonl and cheerful_test.jsonl beside this file: the shipped prompts (data/prompts.jsonl), the last 64
held out, each with a `teacher_prompt` column, the same conversation after a system message that asks for cheerful
answers. distill.py --teacher_prompt_field teacher_prompt distils that prompted behaviour into the unprompted model:

    python examples/distill/make_cheerful.py
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM = "You are a cheerful assistant. Whatever you are asked, answer warmly and look on the bright side."

rows = [json.loads(line) for line in open(os.path.join(HERE, "..", "..", "data", "prompts.jsonl"))]
for name, part in [("cheerful.jsonl", rows[:-64]), ("cheerful_test.jsonl", rows[-64:])]:
    with open(os.path.join(HERE, name), "w") as f:
        for row in part:
            teacher = [{"role": "system", "content": SYSTEM}] + row["prompt"]
            f.write(json.dumps({"prompt": row["prompt"], "teacher_prompt": teacher}) + "\n")
