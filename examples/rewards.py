"""Example reward functions for --reward_fn (docs/rewards.md): each is called as fn(prompts, completions, **columns) and
returns one number (or None) per completion.

    python rloo.py --reward_fn examples/rewards.py:brevity
    python rloo.py --dataset_name data/arithmetic.jsonl --reward_fn accuracy --reward_fn examples/rewards.py:brevity \
        --reward_weights 1.0 0.1
"""


def brevity(prompts, completions):
    """shorter is better: minus the completion's length in characters, in hundreds"""
    return [-len(c) / 100 for c in completions]


def exact(prompts, completions, answer):
    """1 if the completion, stripped, is the `answer` column's value, else 0 (the dataset needs an `answer` column)"""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]
