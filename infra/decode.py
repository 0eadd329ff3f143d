"""The scripts' own decoder: generate(), token by token with a KV cache, each token drawn by the script's sampling rule
(utils.sampling_logits, given the run's settings: bind_rule) by inverse CDF from the row's own uniform number
(sample_tokens), so that a completion depends on its noise, not on the batch or process it is sampled in.
--cuda_graphs replays the same step from CUDA graphs (graphs.py); --use_vllm samples with an engine (engine.py).
"""

import functools
import inspect

import torch

from utils import die, forward, positions, sampling_logits

from .onednn import packed


def sample_tokens(logits, rule, uniforms, seen=None):
    """One token per row from softmax(rule(logits, seen)) (the script's sampling rule: utils.sampling_logits with the
    run's temperature, top-k, ..., or a temperature; seen: (batch, vocab) bool, the tokens of each row so far, which
    a repetition penalty reads) by inverse CDF: the first
    token whose cumulative probability reaches the row's uniform number, so a row's token depends on its own logits
    and number only, not on the batch or process it is drawn in. logits (batch, vocab), uniforms (batch,) -> tokens
    (batch, 1)."""
    cdf = torch.softmax(as_rule(rule)(logits, seen), dim=-1).cumsum(-1)
    total = cdf[:, -1:]  # rounding leaves it a hair off 1
    # searched to the right, so a token of probability above zero: u = 0 skips leading zeros, and the target stays
    # strictly below the total, which u = 1 would reach, running past trailing zeros to the vocabulary's last token
    target = torch.minimum(uniforms[:, None].to(cdf) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)  # (the clamp: NaN logits)


def as_rule(rule):
    """a sampling rule, or a temperature's: utils.sampling_logits at it"""
    return rule if callable(rule) else functools.partial(sampling_logits, temperature=rule)


def bind_rule(rule, **settings):
    """rule with the run's settings as keywords (functools.partial), or one line naming a setting it does not take"""
    params = inspect.signature(rule).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        missing = sorted(set(settings) - {p.name for p in params if p.kind is not p.POSITIONAL_ONLY})
        if missing:
            die(f"--generation_kwargs: the sampling rule {rule.__name__} takes no {', '.join(missing)}")
    return functools.partial(rule, **settings)


def seen_tokens(queries, query_mask, vocab, rule):
    """(rows, vocab) bool: the tokens of each row's prompt (padding aside), which a repetition penalty reads; None
    where the rule is known not to read them (utils.sampling_logits without a penalty), so that no decoding step
    keeps them"""
    if isinstance(rule, functools.partial) and rule.func is sampling_logits:
        if rule.keywords.get("repetition_penalty", 1.0) == 1.0:
            return None
    counts = torch.zeros(len(queries), vocab, dtype=torch.int32, device=queries.device)
    return counts.scatter_add_(1, queries, query_mask.int()) > 0


@torch.no_grad()
def generate(
    model,
    queries,
    query_mask,
    response_length,
    rule,
    stop_token_id=None,
    uniforms=None,
    group=1,
    synced=False,
    max_position=None,
):
    """Sample up to response_length tokens per row from softmax(rule(logits, seen)) (the script's sampling rule, or a
    temperature: utils.sampling_logits at it; seen: the row's tokens so far) with a KV cache, stopping once every row
    has produced stop_token_id. uniforms (batch, response_length) pick each token (sample_tokens; None: drawn from
    torch's generator). group: rows come in groups of copies of one query, whose prompt then runs once. synced
    (ZeRO-3, where each forward pass needs every process): stop only once every process's rows have stopped.
    max_position: positions past it are held there (the caller throws away a row's tokens past its context's end;
    attention being causal, they change none before). Returns responses (batch, <= response_length)."""
    with packed(model, len(queries), response_length):  # (--onednn: the weights in oneDNN's layout while they are fixed)
        rule = as_rule(rule)
        uniforms = (torch.rand(len(queries), response_length) if uniforms is None else uniforms).to(queries.device)
        out = forward(model, queries[::group], query_mask[::group], use_cache=True, logits_to_keep=1)
        if group > 1:  # (prompts, ...) -> (prompts * group, ...)
            out.past_key_values.batch_repeat_interleave(group)
            out.logits = out.logits.repeat_interleave(group, 0)
        seen = seen_tokens(queries, query_mask, out.logits.shape[-1], rule)
        mask = query_mask
        places = positions(mask)[:, -1:]
        done = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
        tokens = []
        for t in range(response_length):
            token = sample_tokens(out.logits[:, -1], rule, uniforms[:, t], seen)  # (batch, 1)
            tokens.append(token)
            if seen is not None:
                seen.scatter_(1, token, True)
            if stop_token_id is not None:
                done |= token[:, 0] == stop_token_id
            if t == response_length - 1:
                break
            if synced:
                pending = (~done).any().float()  # rows still running here; summed over the processes
                torch.distributed.all_reduce(pending)
                if pending.item() == 0:
                    break
            elif done.all():
                break
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            places = places + 1 if max_position is None else (places + 1).clamp(max=max_position)
            out = model(
                input_ids=token, attention_mask=mask, position_ids=places, past_key_values=out.past_key_values, use_cache=True
            )
        return torch.cat(tokens, dim=1)
