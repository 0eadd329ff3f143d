"""The held-out evaluation: greedy (and sampled) completions or episodes of the held-out prompts, scored as in
training, and their metrics rows and samples on disk.
"""

import functools
import json
import math
import os

import torch
from accelerate.utils import gather_object

from utils import weighted_scores

from .data import left_pad
from .decode import as_rule, generate
from .models import zero3
from .rewards import score_completions
from .rollout import Batch, sample_completions


def evaluate(accelerator, model, tokenizer, sources, eval_set, response_length, stop_token_id, batch_size, k=0,
             rule=1.0, seed=0, sampler=None, measure=None):  # fmt: skip
    """Completions of the held-out prompts scored by the reward sources (the weighted score, as in training): a greedy one per
    prompt (the sampling rule at temperature 0: a repetition penalty applies; eval/scores: with a 0/1 reward such as
    accuracy, pass@1), and with k > 0, k sampled by rule (the run's sampling rule, or a temperature) (eval/mean@k,
    the mean score of the samples; eval/pass@k, the mean over prompts of the best sample's score: with a 0/1 reward, the share
    of prompts some sample solved). As in training, a completion no source scored (each returned None) has no score and is in
    no mean; eval/unscored (and eval/unscored@k) count them. The samples draw their noise from a generator of their own seeded
    with `seed`, by prompt, so an evaluation is the same on any number of processes and in a resumed run. measure(batch) ->
    {name: (rows,)}: more metrics of each greedy completion (a Batch of them), eval/<name> their mean (distill.py's KL to the
    teacher). With --environment (sampler.env) each completion is an episode (greedy or sampled turns), its environment seeded
    by seed and the prompt. eval_set = load_eval's. Each process takes every world_size-th prompt. Returns (metrics, samples)
    on the main process, (None, None) on the others; the samples (prompt, reference, completion, score, ...) are what
    tools/judge_tldr.py judges. model: the policy as accelerate prepared it (PPO's PolicyAndValue: its policy)."""
    policy = accelerator.unwrap_model(model)
    policy = getattr(policy, "policy", policy)
    rule = as_rule(rule)
    greedy = functools.partial(rule, temperature=0.0)
    queries, texts, references, columns, raw = eval_set
    env = sampler.env if sampler is not None else None
    width = response_length * (sampler.args.max_turns if env is not None else 1)  # the noise of every turn
    device = accelerator.device
    synced = zero3(accelerator)
    mine = list(range(accelerator.process_index, len(queries), accelerator.num_processes))
    real = len(mine)
    # every process runs as many batches as the others (under ZeRO-3 each forward pass needs all of them): one with a
    # prompt fewer repeats one and drops its copy's sample
    mine += [mine[-1] if mine else 0] * (-(-len(queries) // accelerator.num_processes) - len(mine))
    # the sampling noise of prompt i's k samples, the same whichever process evaluates it
    uniforms = torch.rand((len(queries), k, width), generator=torch.Generator().manual_seed(seed)) if k else None

    def complete(idx, repeat, noise):
        """Completions of the prompts idx, each `repeat` times (greedy without noise), their scores and lengths: the
        rollout's sampling and scoring."""
        prompts = [texts[i] for i in idx for _ in range(repeat)]
        rows = {name: [values[i] for i in idx for _ in range(repeat)] for name, values in columns.items()}
        measured = {}
        if env is not None:
            completions, lengths, per_source, stopped = play(idx, repeat, noise, prompts, rows)
        else:
            completions, lengths, per_source, stopped, measured = complete_once(idx, repeat, noise, prompts, rows)
        scores, scored = weighted_scores(per_source, [s["weight"] for s in sources])
        scores = scores.masked_fill(~scored, math.nan).tolist()  # NaN: no source scored it
        scores = [None if math.isnan(x) else x for x in scores]
        return completions, per_source, scores, lengths, stopped, measured

    def play(idx, repeat, noise, prompts, rows):
        """--environment: an episode per row (no engine, as below); the completion is its conversation, its length the
        policy's tokens (as TRL counts an episode's)"""
        ids, response, lengths, policy, _, info = sampler.play(
            [raw[i] for i in idx],
            rows=[{sampler.args.prompt_field: raw[i], **{c: v[i] for c, v in columns.items()}} for i in idx],
            env_seeds=[seed * 100003 + i for i in idx],
            uniforms=noise,
            seeds=None,
            max_length=response_length,
            k=repeat,
            rule=rule if noise is not None else greedy,
            engine=False,
        )
        per_source = sampler.score_episodes(ids, response, lengths, prompts, rows)
        return [list(m) for m in env.messages], policy.sum(1), per_source, info[:, 1] == 0

    def complete_once(idx, repeat, noise, prompts, rows):
        """one completion of each row, truncated after the stop token and scored"""
        query, query_mask = left_pad([queries[i] for i in idx], tokenizer.pad_token_id)
        query = query.repeat_interleave(repeat, 0).to(device)
        query_mask = query_mask.repeat_interleave(repeat, 0).to(device)
        response, _ = sample_completions(
            policy,
            None,
            query,
            query_mask,
            k=repeat,
            max_length=response_length,
            rule=rule if noise is not None else greedy,
            stop_token_id=stop_token_id,
            pad_token_id=tokenizer.pad_token_id,
            uniforms=noise,
            seeds=None,
            chunk=len(query),
            synced=synced,
            decode=sampler.decode if sampler is not None else generate,
        )
        response, lengths, per_source = score_completions(
            sources,
            tokenizer,
            query,
            query_mask,
            response,
            prompts=prompts,
            columns=rows,
            stop_token_id=stop_token_id,
            chunk=len(query),
            raw=[raw[i] for i in idx for _ in range(repeat)] if raw is not None else None,
        )
        stopped = (response == stop_token_id).any(1) if stop_token_id is not None else torch.ones_like(lengths).bool()
        measured = {}
        if measure is not None and noise is None:
            real = torch.arange(response.shape[1], device=device)[None, :] < lengths[:, None]
            measured = measure(Batch(
                texts=prompts, index=[i for i in idx for _ in range(repeat)], queries=query, context_length=query.shape[1],
                responses=response, lengths=lengths, sampled=real, query_responses=torch.cat([query, response], 1),
                attention_mask=torch.cat([query_mask, real.long()], 1), per_source=per_source, contain_eos=stopped,
                behaviour_logprobs=None, max_length=response_length, stats={}, chunk=len(query), group=1, columns=rows,
            ))  # fmt: skip
        completions = [c.strip() for c in tokenizer.batch_decode(response, skip_special_tokens=True)]
        return completions, lengths, per_source, stopped, measured

    samples = []
    with torch.no_grad(), accelerator.autocast():  # the precision the policy trains in
        for start in range(0, len(mine), batch_size):
            idx = mine[start : start + batch_size]
            completions, per_source, scores, lengths, stopped, measured = complete(idx, 1, None)
            if k:  # (prompts * k, ...): row j * k + i is prompt j's i-th sample
                noise = uniforms[idx].reshape(-1, width).to(device)
                sampled, _, sampled_scores, _, _, _ = complete(idx, k, noise)
            for j, i in enumerate(idx[: max(0, real - start)]):
                sample = {
                    "index": i,
                    "prompt": texts[i],
                    "reference": references[i] if references is not None else None,
                    "completion": completions[j],
                    "score": scores[j],
                    "length": lengths[j].item(),
                    "stopped": bool(stopped[j]),
                }
                if measured:
                    sample["measures"] = {name: values[j].item() for name, values in measured.items()}
                if len(sources) > 1:
                    sample["rewards"] = {s["name"]: per_source[n, j].item() for n, s in enumerate(sources)}
                if k:
                    sample["samples"] = [
                        {"completion": sampled[j * k + r], "score": sampled_scores[j * k + r]} for r in range(k)
                    ]
                samples.append(sample)
    samples = gather_object(samples)
    if not accelerator.is_main_process:
        return None, None
    samples.sort(key=lambda s: s["index"])
    n = len(samples)
    mean = lambda values: sum(values) / len(values) if values else math.nan  # noqa: E731
    scored = [s["score"] for s in samples if s["score"] is not None]  # a completion no source scored is in no mean
    metrics = {"eval/scores": mean(scored), "eval/unscored": n - len(scored)} if sources else {}  # (distill.py: none)
    metrics["eval/response_length"] = sum(s["length"] for s in samples) / n
    metrics["eval/stopped_fraction"] = sum(s["stopped"] for s in samples) / n
    for name in samples[0].get("measures", {}):
        metrics[f"eval/{name}"] = mean([s["measures"][name] for s in samples])
    if len(sources) > 1:  # each source's mean over the greedy completions it scored
        for s in sources:
            values = [x["rewards"][s["name"]] for x in samples if not math.isnan(x["rewards"][s["name"]])]
            metrics[f"eval/rewards/{s['name']}"] = mean(values)
    if k:  # over the scored samples, and the prompts with one
        sampled = [[x["score"] for x in s["samples"] if x["score"] is not None] for s in samples]
        metrics[f"eval/mean@{k}"] = mean([x for scores in sampled for x in scores])
        metrics[f"eval/pass@{k}"] = mean([max(scores) for scores in sampled if scores])
        metrics[f"eval/unscored@{k}"] = n * k - sum(map(len, sampled))
    return metrics, samples


def record_eval(output_dir, episode, metrics, samples, writer=None):
    """Write an evaluation: a row {"episode", "eval/..."} appended to metrics.jsonl (and TensorBoard), the samples to
    eval_samples/episode_{episode}.jsonl, and eval.json rebuilt from metrics.jsonl's eval rows (so that a resumed run,
    whose metrics.jsonl was cut back, never lists an evaluation twice)."""
    row = {"episode": episode, **metrics}
    shown = (f"{k.removeprefix('eval/')} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in metrics.items())
    print(f"eval at episode {episode}: " + "  ".join(shown), flush=True)
    with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if writer is not None:
        for k, v in metrics.items():
            writer.add_scalar(k, v, episode)
    os.makedirs(os.path.join(output_dir, "eval_samples"), exist_ok=True)
    with open(os.path.join(output_dir, "eval_samples", f"episode_{episode}.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    write_eval_json(output_dir)


def write_eval_json(output_dir):
    """eval.json: the eval rows of metrics.jsonl, as one list."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [row for row in rows if any(k.startswith("eval/") for k in row)]
    with open(os.path.join(output_dir, "eval.json.tmp"), "w") as f:
        json.dump(evals, f, indent=1)
    os.replace(os.path.join(output_dir, "eval.json.tmp"), os.path.join(output_dir, "eval.json"))
