"""The scripts' own decoder: generate(), token by token with a KV cache, each token drawn by inverse CDF from the row's
own uniform number (sample_tokens), so that a completion depends on its noise, not on the batch or process it is
sampled in. --cuda_graphs replays the same step from CUDA graphs (graphs.py); --use_vllm samples with an engine
(engine.py).
"""

import torch

from utils import forward, positions


def sample_tokens(logits, temperature, uniforms):
    """One token per row from softmax(logits / temperature) by inverse CDF: the first token whose cumulative probability
    reaches the row's uniform number, so a row's token depends on its own logits and number only, not on the batch or
    process it is drawn in. Temperature 0: greedy. logits (batch, vocab), uniforms (batch,) -> tokens (batch, 1)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    cdf = torch.softmax(logits.float() / temperature, dim=-1).cumsum(-1)
    total = cdf[:, -1:]  # rounding leaves it a hair off 1
    # searched to the right, so a token of probability above zero: u = 0 skips leading zeros, and the target stays
    # strictly below the total, which u = 1 would reach, running past trailing zeros to the vocabulary's last token
    target = torch.minimum(uniforms[:, None].to(cdf) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)  # (the clamp: NaN logits)


@torch.no_grad()
def generate(
    model,
    queries,
    query_mask,
    response_length,
    temperature,
    stop_token_id=None,
    uniforms=None,
    group=1,
    synced=False,
    max_position=None,
):
    """Sample up to response_length tokens per row from softmax(logits / temperature) with a KV cache (no top-k/top-p;
    temperature 0: greedy), stopping once every row has produced stop_token_id. uniforms (batch, response_length) pick
    each token (sample_tokens; None: drawn from torch's generator). group: rows come in groups of copies of one query,
    whose prompt then runs once. synced (ZeRO-3, where each forward pass needs every process): stop only once every
    process's rows have stopped. max_position: positions past it are held there (the caller throws away a row's tokens
    past its context's end; attention being causal, they change none before). Returns responses (batch, <=
    response_length)."""
    uniforms = (torch.rand(len(queries), response_length) if uniforms is None else uniforms).to(queries.device)
    out = forward(model, queries[::group], query_mask[::group], use_cache=True, logits_to_keep=1)
    if group > 1:  # (prompts, ...) -> (prompts * group, ...)
        out.past_key_values.batch_repeat_interleave(group)
        out.logits = out.logits.repeat_interleave(group, 0)
    mask = query_mask
    places = positions(mask)[:, -1:]
    done = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
    tokens = []
    for t in range(response_length):
        token = sample_tokens(out.logits[:, -1], temperature, uniforms[:, t])  # (batch, 1)
        tokens.append(token)
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
