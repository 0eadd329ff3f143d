"""From reward-labelled rows (data/scored.jsonl), what the study's other methods train on: the training prompts, each
once (raft.py samples its own completions of them), and a preference pair per prompt, its best-scored completion
chosen over its worst (dpo.py; a prompt whose completions all score the same gives none).

    python benchmark/offline/data.py /tmp/offline     (writes prompts.jsonl and pairs.jsonl there)
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
groups = {}  # prompt -> its rows, in the file's order
for line in open(os.path.join(REPO, "data", "scored.jsonl")):
    row = json.loads(line)
    groups.setdefault(json.dumps(row["prompt"]), []).append(row)
prompts, pairs = [], []
for rows in groups.values():
    prompts.append({"prompt": rows[0]["prompt"]})
    best, worst = max(rows, key=lambda r: r["reward"]), min(rows, key=lambda r: r["reward"])
    if best["reward"] > worst["reward"]:
        pairs.append({"prompt": rows[0]["prompt"], "chosen": best["completion"], "rejected": worst["completion"]})
for name, lines in [("prompts.jsonl", prompts), ("pairs.jsonl", pairs)]:
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))  # (whole, for a run reading it meanwhile)
