"""Summarise one run's metrics.jsonl: rows, last episode, eps (episodes/s since the start of training, the scripts' own
figure), whether every numeric value is finite, a few objective values."""

import json
import math
import sys

name, path, wall = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    rows = [json.loads(line) for line in open(path)]
except OSError as e:
    print(f"{name}: NO METRICS ({e}) wall={wall}s")
    sys.exit(0)
bad = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)})
last = rows[-1] if rows else {}
keys = [
    k for k in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "val/response_length") if k in last
]
# eps is cumulative (episodes / seconds since training began), so row i ended at t_i = episode_i / eps_i; the rate
# after the first update (which holds the warm-up) is (episode_last - episode_1) / (t_last - t_1).
steady = float("nan")
if len(rows) >= 3:
    t = [r["episode"] / r["eps"] for r in rows]
    steady = (rows[-1]["episode"] - rows[0]["episode"]) / (t[-1] - t[0])
    first = t[0]
else:
    first = float("nan")
print(
    f"{name}: rows={len(rows)} episode={last.get('episode')} eps_final={last.get('eps', float('nan')):.2f} "
    f"eps_after_update1={steady:.2f} update1_s={first:.2f} "
    f"wall={wall}s finite={'yes' if not bad else 'NO ' + ','.join(bad)} " + " ".join(f"{k}={last[k]:.4g}" for k in keys)
)
