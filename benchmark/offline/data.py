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
with open(os.path.join(out, "prompts.jsonl"), "w") as prompts, open(os.path.join(out, "pairs.jsonl"), "w") as pairs:
    for rows in groups.values():
        prompts.write(json.dumps({"prompt": rows[0]["prompt"]}) + "\n")
        best, worst = max(rows, key=lambda r: r["reward"]), min(rows, key=lambda r: r["reward"])
        if best["reward"] > worst["reward"]:
            pair = {"prompt": rows[0]["prompt"], "chosen": best["completion"], "rejected": worst["completion"]}
            pairs.write(json.dumps(pair) + "\n")
