"""The method the scripts share: sampling and generation (with a vLLM engine too), the forward passes (packed where
exact), logprobs and the exact KL, the KL estimators, masked statistics, TRL's score scaling, the value head, and
scoring with reward models and functions. What one algorithm alone needs (baselines, advantages, losses) stays in its
script; the plumbing (flags, loading, checkpoints, logs, the model card) is in infra.py.
"""

import inspect
import math
import numbers
import re
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.nn as nn

# written into the logprobs of padding positions, so that a padding token that leaks into a sum is easy to spot
INVALID_LOGPROB = 1.0


def die(msg):
    """Stop the run with a one-line error (no traceback): bad input is the user's to fix, not a crash."""
    raise SystemExit(f"error: {msg}")


def same_vocabulary(tokenizer, other):
    """True when every token id means the same to both tokenizers (a pad token only one of them added is ignored:
    padding is masked out), so a reward model can read the policy's tokens directly."""

    def vocab(tok):
        v = dict(tok.get_vocab())
        if tok.pad_token not in (tok.eos_token, tok.bos_token, tok.unk_token):
            v.pop(tok.pad_token, None)
        return v

    return vocab(tokenizer) == vocab(other) and tokenizer.eos_token_id == other.eos_token_id


def disable_dropout(model):
    """Every dropout probability to zero (modules, and the floats attention code reads), so that train mode, which
    gradient checkpointing needs, computes what eval mode does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                if "dropout" in name and isinstance(value, float):
                    setattr(config, name, 0.0)


def left_pad(seqs, pad_token_id):
    """Token-id lists -> (ids, mask), both (batch, longest), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------------
# rewards: reward models and functions, summed with weights


def sentiment_reward(prompts, completions, **columns):
    """`sentiment`: VADER's compound sentiment score of each completion, in [-1, 1]."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(c)["compound"] for c in completions]


def accuracy_reward(prompts, completions, answer, **columns):
    """`accuracy`: 1.0 when the completion's last number equals the row's `answer` (thousands separators ignored,
    "42.0" equals 42), else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
        scores.append(float(bool(numbers) and float(numbers[-1]) == float(expected)))
    return scores


BUILTIN_REWARDS = {"sentiment": sentiment_reward, "accuracy": accuracy_reward}


def call_reward_fn(fn, prompts, completions, columns):
    """fn(prompts, completions, **columns): every column to a function taking **kwargs, else the columns it names."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    return fn(list(prompts), list(completions), **columns)


def check_rewards(values, n, source):
    """A source's rewards -> n floats or None ("cannot judge"), or one line naming the source and the bad value."""
    if torch.is_tensor(values) or isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        die(f"reward {source} must return a list of numbers (or None), got {str(values)[:80]}")
    if len(values) != n:
        die(f"reward {source} returned {len(values)} scores for {n} completions")
    for v in values:
        if v is not None and (isinstance(v, str) or not isinstance(v, numbers.Real)):
            die(f"reward {source} must return a list of numbers (or None), got {v!r}")
        if v is not None and not math.isfinite(v):
            die(f"reward {source} returned {v}; NaN or inf is not a reward (None means it cannot judge a completion)")
    return [None if v is None else float(v) for v in values]


def rm_scores(reward_model, rm_tokenizer, tokenizer, query_responses, mask, context_length, lengths, stop_token_id):
    """A reward model's scores (batch,) read at the last real token of query_responses (left-padded queries of
    context_length columns, then responses of `lengths` tokens). With a tokenizer of its own (rm_tokenizer not None)
    the text is re-encoded, and a stop token that decoding drops (EOS) becomes the reward model's EOS token."""
    if rm_tokenizer is None:  # the policy's tokens as they are: nothing to decode
        ids, last = query_responses, context_length + lengths - 1
    else:
        completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        queries = tokenizer.batch_decode(query_responses[:, :context_length], skip_special_tokens=True)
        seqs = rm_tokenizer([q + c for q, c in zip(queries, completions)], add_special_tokens=False)["input_ids"]
        # read where the same vocabulary is read: at the stop token, which decoding drops when it is special (EOS)
        if stop_token_id is not None and stop_token_id in tokenizer.all_special_ids:
            if rm_tokenizer.eos_token_id is None:
                die(f"the reward model's tokenizer {rm_tokenizer.name_or_path!r} has no EOS token to end completions with")
            stopped = query_responses.gather(1, (context_length + lengths - 1)[:, None])[:, 0] == stop_token_id
            seqs = [s + [rm_tokenizer.eos_token_id] if end else s for s, end in zip(seqs, stopped.tolist())]
        ids, mask = (t.to(query_responses.device) for t in left_pad(seqs, rm_tokenizer.pad_token_id))
        last = torch.full_like(lengths, ids.shape[1] - 1)  # left-padded: the last column is real
    scores = scalar_forward(reward_model, ids, mask).gather(1, last[:, None]).squeeze(1).float()
    if not torch.isfinite(scores).all():
        die(f"reward model {reward_model.name_or_path!r} returned NaN or inf")
    return scores


def get_scores(sources, tokenizer, query_responses, mask, context_length, lengths, prompts, columns, stop_token_id):
    """Every source's rewards (sources, batch), NaN where one returned None. Reward models read the tokens; functions
    the prompt texts, the decoded completions and the rows' other columns ({name: list})."""
    completions = None
    rows = []
    for source in sources:
        if "model" in source:
            scores = rm_scores(
                source["model"],
                rm_tokenizer=source["tokenizer"],
                tokenizer=tokenizer,
                query_responses=query_responses,
                mask=mask,
                context_length=context_length,
                lengths=lengths,
                stop_token_id=stop_token_id,
            )
            rows.append(scores)
            continue
        if completions is None:
            completions = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
        values = call_reward_fn(source["fn"], prompts, completions, columns)
        values = check_rewards(values, len(completions), f"function {source['name']}")
        rows.append(torch.tensor([math.nan if v is None else v for v in values], device=query_responses.device))
    return torch.stack(rows)


def weighted_scores(per_source, sources):
    """(sources, batch) rewards, NaN for None -> (scores, scored), both (batch,): the weighted sum over the sources
    that scored each completion; one that no source scored gets 0 and scored False."""
    weights = torch.tensor([s["weight"] for s in sources], device=per_source.device)[:, None]
    return (weights * per_source).nansum(0), ~per_source.isnan().all(0)


# ---------------------------------------------------------------------------------------------------------------------
# forward passes and the value head


def forward(model, input_ids, attention_mask, **kwargs):
    """A causal LM on left-padded rows, with positions counted from each row's first real token as generate() does."""
    position_ids = attention_mask.cumsum(1) - attention_mask
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def scalar_forward(model, input_ids, attention_mask):
    """One scalar per token (batch, seq) from a sequence-classification model (num_labels=1): its backbone, then its
    `score` head on every position; for reward models and critics. (The model's own forward finds the last token by
    comparing with the pad id, which breaks when pad == EOS.)"""
    backbone = getattr(model, model.base_model_prefix)
    position_ids = attention_mask.cumsum(1) - attention_mask
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return model.score(hidden).squeeze(-1)


def init_value_head(head, std, seed):
    """A new value head (nn.Linear to 1): weights N(0, std^2) from a generator of its own seeded with `seed`, zero bias,
    so every process, and every way of loading the critic, starts from the same head (ZeRO-3 would otherwise shard
    each process's own random head)."""
    import contextlib

    gathered = contextlib.nullcontext()
    if hasattr(head.weight, "ds_id"):  # loaded under ZeRO-3, sharded as it loaded: gathered whole to be written
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0)
    with gathered, torch.no_grad():
        head.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        if head.bias is not None:
            head.bias.zero_()
    return head


class PolicyAndValue(nn.Module):
    """The policy and the critic in one module, so that one optimiser and one DDP wrapper hold both: a forward pass
    returns the policy's logits and the value of every position, from a separate critic (a sequence-classification
    model) or, with critic None, from a value head on the policy's trunk."""

    def __init__(self, policy, critic=None, seed=0):
        super().__init__()
        self.policy, self.critic = policy, critic
        if critic is None:  # std 1 / sqrt(hidden + 1), as the N+ details study
            hidden = policy.config.hidden_size
            self.value_head = init_value_head(nn.Linear(hidden, 1), 1 / math.sqrt(hidden + 1), seed)

    def forward(self, input_ids, attention_mask, logits_to_keep, policy_only=False):
        shared = self.critic is None and not policy_only
        out = forward(self.policy, input_ids, attention_mask, logits_to_keep=logits_to_keep, output_hidden_states=shared)
        if policy_only:  # the PTX loss: the policy's logits alone, through the wrapper that DDP or DeepSpeed runs
            return out.logits
        if shared:
            return out.logits, self.value_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, scalar_forward(self.critic, input_ids, attention_mask)


@contextmanager
def reference_model(policy, ref_policy):
    """The frozen reference: ref_policy, or with LoRA (ref_policy None) the policy with its adapters switched off."""
    if ref_policy is not None:
        yield ref_policy
    else:
        with policy.disable_adapter():
            yield policy


def check_model(model, critic=False):
    """Stop the run, in one line, on a policy the scripts cannot train: a recurrent, state-space or hybrid model (Mamba,
    RWKV, Jamba, LFM2's convolutions, ...) carries its context in a state, not a KV cache, which generate() can neither
    share among a prompt's completions nor extend token by token (and which RWKV's left padding changes). critic: the
    script builds a sequence-classification model of the policy's family (PPO's critic on the policy's trunk)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    config = getattr(model, "module", model).config
    layers = set(getattr(config.get_text_config(), "layer_types", None) or [])
    if getattr(model, "_is_stateful", False) or layers & {"conv", "linear_attention", "hybrid", "hybrid_sliding"}:
        die(f"{config.model_type} models keep a recurrent state, not the KV cache generation needs: use an attention model")
    if critic and config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        die(f"{config.model_type} has no sequence-classification model for a critic: use --value_head_shared")


# families whose attention takes every position from position_ids and a 4D mask as given, so that a packed row gives
# what each row alone does (each tested in tests/test_families.py); any other runs its rows in full. Out: GPT-Neo (its
# local attention counts columns), Bloom and MPT (ALiBi from columns or a 2D mask), recurrent and hybrid models (a
# completion would run through the state the ones before it left), and every family not tested.
PACKED_FAMILIES = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi phi3 gpt2 gpt_bigcode gpt_neox gptj"
    " opt falcon stablelm olmo olmo2 olmo3 starcoder2 smollm3 granite cohere deepseek_v3 gpt_oss".split()
)


def can_pack(config, length):
    """Whether forward_grouped may run a group as one packed row of `length` columns: a family of PACKED_FAMILIES,
    under an attention that takes a custom mask (sdpa and eager do; flash attention does not), with no layer a packed
    row would change: ALiBi (its biases count columns) or local attention (a sliding window, GPT-Neo's window_size,
    chunks) shorter than the packed row; one that covers it changes no row."""
    if config.model_type not in PACKED_FAMILIES or config._attn_implementation not in ("sdpa", "eager"):
        return False
    alibi = config.model_type in ("bloom", "mpt") or getattr(config, "position_embedding_type", None) == "alibi"
    if alibi or getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):
        return False
    local = {"local", "sliding_attention", "chunked_attention"} & {
        *(getattr(config, "layer_types", None) or []),
        *(getattr(config, "attention_layers", None) or []),
    }
    windows = [w for w in (getattr(config, n, None) for n in ("sliding_window", "window_size", "attention_chunk_size")) if w]
    return all(w >= length for w in windows) and bool(windows or not local)


def forward_grouped(model, query_responses, mask, context_length, group, logits_to_keep):
    """forward()'s logits at the last logits_to_keep positions (at most the response's length + 1), for rows in groups
    of `group` completions of one prompt (rows g * group ... g * group + group - 1 share their first context_length
    tokens), with the same values and gradients as running every row in full (tested).

    Each prompt runs once: a group becomes one packed row, the prompt then each completion, under an attention mask
    that lets a completion see the prompt and itself only, at the positions it would have alone (with k = 4 and
    prompts as long as the responses, 3/8 fewer positions). group=1 is plain forward(), and so is every model that
    can_pack() refuses: a family not tested, flash attention, ALiBi, a window shorter than the packed row."""
    rows, width = query_responses.shape
    # the prompt's last token runs with each completion, whose first token its logits predict: then every logit wanted
    # lies in the completions' segments
    start, seg = context_length - 1, width - context_length + 1
    config = getattr(model, "module", model).config  # (the wrapped model's, under DDP or DeepSpeed)
    if group == 1 or start < 1 or not can_pack(config, start + group * seg):
        return forward(model, query_responses, mask, logits_to_keep=logits_to_keep).logits
    prompts = rows // group
    # (prompts, start + group * seg): the prompt once, then each completion's segment; positions as forward() counts them
    positions = mask.cumsum(1) - mask
    ids, real, positions = (
        torch.cat([x[::group, :start], x[:, start:].reshape(prompts, group * seg)], 1)
        for x in (query_responses, mask.bool(), positions)
    )
    # a column sees the real columns up to itself of the prompt and of its own segment (-1: the prompt); a left-padding
    # column, which would see none (and which none sees), sees itself rather than nothing
    part = torch.cat([torch.full((start,), -1), torch.arange(group).repeat_interleave(seg)]).to(ids.device)
    col = torch.arange(len(part), device=ids.device)
    sees = ((part[None, :] == -1) | (part[None, :] == part[:, None])) & (col[None, :] <= col[:, None])  # (L, L)
    sees = sees & real[:, None, :]  # (prompts, L, L)
    sees |= torch.eye(len(col), dtype=torch.bool, device=ids.device) & ~sees.any(-1, keepdim=True)
    attention = sees[:, None]  # (prompts, 1, L, L): transformers passes a 4D mask on as it is; sdpa takes booleans
    if config._attn_implementation == "eager":  # which adds the mask to the scores
        attention = torch.zeros(attention.shape, device=ids.device).masked_fill(~attention, torch.finfo(torch.float32).min)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=group * seg).logits
    return logits.reshape(rows, seg, -1)[:, seg - logits_to_keep :]  # (prompts, group * seg, vocab) -> (rows, seg, vocab)


# ---------------------------------------------------------------------------------------------------------------------
# sampling


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
    model, queries, query_mask, response_length, temperature, stop_token_id=None, uniforms=None, group=1, synced=False
):
    """Sample up to response_length tokens per row from softmax(logits / temperature) with a KV cache (no top-k/top-p;
    temperature 0: greedy), stopping once every row has produced stop_token_id. uniforms (batch, response_length) pick
    each token (sample_tokens; None: drawn from torch's generator). group: rows come in groups of copies of one query,
    whose prompt then runs once. synced (ZeRO-3, where each forward pass needs every process): stop only once every
    process's rows have stopped. Returns responses (batch, <= response_length)."""
    if uniforms is None:
        uniforms = torch.rand(len(queries), response_length)
    uniforms = uniforms.to(queries.device)
    out = forward(model, queries[::group], query_mask[::group], use_cache=True, logits_to_keep=1)
    if group > 1:  # (prompts, ...) -> (prompts * group, ...)
        out.past_key_values.batch_repeat_interleave(group)
        out.logits = out.logits.repeat_interleave(group, 0)
    mask = query_mask
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -1:]
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
        positions = positions + 1
        out = model(
            input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=out.past_key_values, use_cache=True
        )
    return torch.cat(tokens, dim=1)


def vllm_sync(engine, model):
    """Load model's weights (an unwrapped transformers model, or a peft model) into the vLLM engine in place, and drop
    the engine's cached prompts (computed with the old weights). The output projection is sent even when tied to the
    embeddings: the engine keeps its own copy. Under ZeRO-3 the weights are gathered whole for the copy (each process
    holds the full model for a moment, as when saving). With LoRA the engine gets each adapted weight plus its
    adapters' product, computed aside: merging into the model and out again would leave rounding errors in the frozen
    weights, which are also the reference."""
    params = list(model.parameters())
    gathered = nullcontext()
    if hasattr(params[0], "ds_id"):  # ZeRO-3: every process gathers the same parameters in the same order
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered, torch.no_grad():
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        state = dict(base.state_dict())
        for name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a LoRA layer
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
                state[f"{name}.base_layer.weight"] = module.base_layer.weight + delta
        # peft's names back to the model's: q_proj.base_layer.weight -> q_proj.weight, adapters' own weights dropped
        state = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
        head = base.get_output_embeddings()
        if head is not None and "lm_head.weight" not in state:
            state["lm_head.weight"] = head.weight
        if not getattr(engine, "has_lm_head", True):  # (an engine that computes the logits from the embeddings)
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        # the checkpoint's names and layout, which the engine loads: transformers fuses some weights as it loads them
        # (a mixture of experts' into one tensor per layer) and splits them again as it saves
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(base, state)
        engine.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(state.items())))
    engine.reset_prefix_cache()


def vllm_generate(engine, queries, query_mask, k, max_tokens, temperature, stop_token_id, seeds, pad_token_id):
    """k completions of each of the prompts (queries, query_mask: (prompts, query_len), left-padded) sampled by the vLLM
    engine from softmax(logits / temperature), each prompt sent once with n = k; the engine seeds prompt j's k samples
    with seeds[j], seeds[j] + 1, ... Stops at stop_token_id (kept, as generate() keeps it). Returns responses
    (prompts * k, longest), padded with pad_token_id, and the engine's logprobs of their tokens (INVALID_LOGPROB on
    padding), on the queries' device; row j * k + i is prompt j's i-th completion."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": q[m.bool()].tolist()} for q, m in zip(queries, query_mask)]
    stop = [stop_token_id] if stop_token_id is not None else None
    params = [
        # ignore_eos: the engine would also stop at the EOS token of the model's config, which generate() does not
        SamplingParams(
            n=k, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=int(s), stop_token_ids=stop, ignore_eos=True
        )  # fmt: skip
        for s in seeds
    ]
    rows = [c for out in engine.generate(prompts, params, use_tqdm=False) for c in sorted(out.outputs, key=lambda c: c.index)]
    width = max(len(c.token_ids) for c in rows)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    logprobs = torch.full((len(rows), width), INVALID_LOGPROB)
    for i, c in enumerate(rows):
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        logprobs[i, : len(c.token_ids)] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return responses.to(queries.device), logprobs.to(queries.device)


def sample_completions(
    model,
    engine,
    queries,
    query_mask,
    *,
    k,
    max_length,
    temperature,
    stop_token_id,
    pad_token_id,
    uniforms,
    seeds,
    chunk,
    group=1,
    synced=False,
):
    """A rollout's completions of its rows (queries, query_mask: (prompts * k, query_len), left-padded, a prompt's k rows
    adjacent), up to max_length tokens at temperature: the vLLM engine's (--use_vllm; it must hold model's weights:
    vllm_sync), which gets each prompt once with its seed, else generate()'s on model, chunk rows at a time with their
    uniforms. Returns (responses (rows, width) padded with pad_token_id, the engine's logprobs of them or None)."""
    if engine is not None:
        return vllm_generate(
            engine,
            queries[::k],
            query_mask[::k],
            k=k,
            max_tokens=max_length,
            temperature=temperature,
            stop_token_id=stop_token_id,
            seeds=seeds,
            pad_token_id=pad_token_id,
        )
    responses = []
    for i in range(0, len(queries), chunk):
        rows = slice(i, i + chunk)
        responses.append(
            generate(
                model,
                queries[rows],
                query_mask[rows],
                response_length=max_length,
                temperature=temperature,
                stop_token_id=stop_token_id,
                uniforms=uniforms[rows],
                group=group,
                synced=synced,
            )
        )
    return pad_cat(responses, pad_token_id), None


def score_completions(sources, tokenizer, queries, query_mask, responses, *, prompts, columns, stop_token_id, chunk):
    """Each completion truncated after its stop token (the rest padding) and scored by every source, chunk rows at a
    time, each chunk only as wide as its longest completion. prompts: the rows' prompt texts; columns: {name: the rows'
    values}. Returns (responses (rows, longest), lengths (rows,), per_source (sources, rows): NaN where a source
    returned None)."""
    responses, lengths = truncate_response(responses, stop_token_id, tokenizer.pad_token_id)
    responses = responses[:, : int(lengths.max())]
    per_source = []
    for i in range(0, len(queries), chunk):
        rows = slice(i, i + chunk)
        response = responses[rows, : int(lengths[rows].max())]
        real = (torch.arange(response.shape[1], device=response.device)[None, :] < lengths[rows, None]).long()
        per_source.append(
            get_scores(
                sources,
                tokenizer=tokenizer,
                query_responses=torch.cat([queries[rows], response], 1),
                mask=torch.cat([query_mask[rows], real], 1),
                context_length=queries.shape[1],
                lengths=lengths[rows],
                prompts=prompts[rows],
                columns={name: values[rows] for name, values in columns.items()},
                stop_token_id=stop_token_id,
            )
        )
    return responses, lengths, torch.cat(per_source, 1)


def importance_weights(logprobs, engine_logprobs, padding_mask, mode, clip_min=None, clip_max=3.0):
    """Importance sampling of an engine's samples (TRL's vllm_importance_sampling_mode; Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"): the trainer's probability of what the engine
    sampled over the engine's, so that a loss computed as if the trainer had sampled is corrected for the engine
    having sampled. mode token_*: one weight per token (rows, width), 1 on padding; sequence_*: one per completion
    (rows,), the ratio of the completions' probabilities. *_truncate: the ratio clipped to [clip_min, clip_max];
    *_mask: the ratio, or 0 outside [clip_min, clip_max] (a bound None: none). Returns the weights and their metrics:
    the mean and max |logprob difference| over real tokens, and the fraction of ratios outside the bounds."""
    real = ~padding_mask
    diff = (logprobs - engine_logprobs).masked_fill(padding_mask, 0.0)
    level, action = mode.split("_")
    ratio = diff.sum(1).exp() if level == "sequence" else diff.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if level == "sequence":
        fraction = outside.float().mean()
    else:
        outside &= real
        fraction = outside.sum() / real.sum().clamp(min=1)
    weights = ratio.clamp(low, high) if action == "truncate" else ratio.masked_fill(outside, 0.0)
    if level == "token":
        weights = weights.masked_fill(padding_mask, 1.0)
    stats = {
        "vllm/logprob_diff_mean": diff.abs().sum() / real.sum().clamp(min=1),
        "vllm/logprob_diff_max": diff.abs().max(),
        "vllm/capped_fraction": fraction,
    }
    return weights, stats


def distinct_groups(scores, scored, k):
    """Whether each prompt's group of k completions has scores that differ (at least two scored ones, not all equal):
    (prompts * k,) in rollout order -> (prompts,). A group without is one that GRPO's and RLOO's advantages leave at
    zero, whatever the scores' scale."""
    grouped, valid = scores.reshape(-1, k), scored.reshape(-1, k)
    highest = grouped.masked_fill(~valid, -torch.inf).amax(1)
    lowest = grouped.masked_fill(~valid, torch.inf).amin(1)
    return (valid.sum(1) >= 2) & (highest > lowest)


def select_groups(keep, n):
    """DAPO's dynamic sampling: of the groups generated so far, in order, the first n that keep (a list of bools) marks;
    if fewer are marked, all of them and then the earliest unmarked ones, in generation order. Returns the chosen
    groups' positions, ascending, and how many unmarked ones filled the batch."""
    marked = [i for i, x in enumerate(keep) if x][:n]
    filled = [i for i, x in enumerate(keep) if not x][: n - len(marked)]
    return sorted(marked + filled), len(filled)


def pad_cat(chunks, value):
    """Rows of chunks that may end at different widths (a rollout's chunks stop at their own longest completion), right-
    padded with `value` to the widest and concatenated: (rows, width, ...)."""
    width = max(c.shape[1] for c in chunks)
    return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=value) for c in chunks])


def truncate_response(responses, stop_token_id, pad_token_id):
    """Each response up to and including its first stop token, the rest padding. Returns (responses, lengths); lengths
    count the stop token, so rows without one have the full length."""
    width = responses.shape[1]
    if stop_token_id is None:
        return responses, torch.full((len(responses),), width, device=responses.device)
    is_stop = responses == stop_token_id
    lengths = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, width)
    idx = torch.arange(width, device=responses.device)
    return responses.masked_fill(idx[None, :] >= lengths[:, None], pad_token_id), lengths


# ---------------------------------------------------------------------------------------------------------------------
# logprobs, KL and masked statistics


def _chunks(shape, budget):
    """(batch, seq) slices covering a (batch, seq, vocab) tensor, each about `budget` elements: small enough for the
    CPU's cache, or a GPU's scratch memory, where a whole batch's logits would not fit."""
    if budget is None:
        budget = 1 << 20  # 4 MB of float32: a CPU's cache
    batch, seq, vocab = shape
    positions = max(1, min(seq, budget // vocab))
    rows = max(1, budget // (positions * vocab))
    for i in range(0, batch, rows):
        for j in range(0, seq, positions):
            yield slice(i, i + rows), slice(j, j + positions)


class _LogProbs(torch.autograd.Function):
    """log softmax(logits / temperature) at the tokens, chunk by chunk. Plain autograd writes a tensor the size of the
    batch's logits at each step (divided, log-softmaxed, exponentiated, and three times in the backward), with a 50k
    vocabulary most of an update's time and memory; here only the gradient is written. It keeps the logits (they exist
    anyway) and one log-normaliser per position."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, budget, with_entropy):
        picked = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(picked)
        entropy = torch.empty_like(picked) if with_entropy else None  # one more pass over each chunk: only when asked
        for b, t in _chunks(logits.shape, budget):
            z = logits[b, t].float() / temperature
            top = z.amax(-1, keepdim=True)
            z -= top  # shifted so that exp cannot overflow, and the entropy's two terms stay small
            e = z.exp()
            total = e.sum(-1)
            log_total = total.log()
            lse[b, t] = top.squeeze(-1) + log_total
            if with_entropy:
                entropy[b, t] = log_total - (e * z).sum(-1) / total  # H = log Z - E_p[z]
            picked[b, t] = z.gather(-1, tokens[b, t, None]).squeeze(-1) - log_total
        ctx.save_for_backward(logits, tokens, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.budget = temperature, budget
        ctx.set_materialize_grads(False)  # an entropy no loss uses gets no gradient, and costs nothing in the backward
        return picked, entropy

    @staticmethod
    def backward(ctx, grad, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        if grad is None:
            grad = torch.zeros_like(lse)
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for b, t in _chunks(logits.shape, ctx.budget):
            # d log p(token) / d logits = (onehot(token) - softmax) / temperature
            g = grad[b, t, None] / ctx.temperature
            if grad_entropy is None:
                d = (logits[b, t].float() / ctx.temperature - lse[b, t, None]).exp_().mul_(-g)
            else:  # an entropy bonus too: d H / d logits = -p (log p + H) / temperature
                logp = logits[b, t].float() / ctx.temperature - lse[b, t, None]
                h = (logp + entropy[b, t, None]).mul_(grad_entropy[b, t, None] / ctx.temperature)
                d = logp.exp_().mul_(-g - h)
            out[b, t] = d.scatter_add_(-1, tokens[b, t, None], g)
        return out, None, None, None, None


def logprobs_from_logits(logits, tokens, temperature=1.0, with_entropy=False, budget=None):
    """log p(token) per position under softmax(logits / temperature): logits (batch, seq, vocab), tokens (batch, seq)
    -> (batch, seq), float32; with_entropy: also each position's entropy (batch, seq), with its gradient. The same
    values and gradients as log_softmax, in chunks of about `budget` logits (a GPU's default: 64 MB, since each chunk
    costs a dozen kernel launches)."""
    if budget is None and logits.device.type != "cpu":
        budget = 1 << 24
    picked, entropy = _LogProbs.apply(logits, tokens, temperature, budget, with_entropy)  # apply() takes no keywords
    return (picked, entropy) if with_entropy else picked


@torch.no_grad()
def full_kl(logits, ref_logits, temperature=1.0, budget=None):
    """The exact KL(policy || reference) at each position, sum over the vocabulary of p (log p - log q) under
    softmax(logits / temperature): (batch, seq, vocab) twice -> (batch, seq), float32, in chunks as above."""
    if budget is None and logits.device.type != "cpu":
        budget = 1 << 24
    kl = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for b, t in _chunks(logits.shape, budget):
        logp = torch.log_softmax(logits[b, t].float() / temperature, -1)
        logq = torch.log_softmax(ref_logits[b, t].float() / temperature, -1)
        p = logp.exp()
        # 0 log 0 = 0: a token the policy rules out adds nothing, even where the reference rules it out too (-inf - -inf)
        kl[b, t] = logp.sub_(logq).mul_(p).masked_fill_(p == 0, 0.0).sum(-1)
    return kl.clamp_(min=0.0)  # never below 0, which rounding could reach where p and q (almost) agree


def kl_estimate(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimators of KL(policy p || reference q) from tokens sampled from p (http://joschu.net/blog/kl-approx.html):
    k1 = log(p/q), unbiased, can be negative; k2 = log(p/q)^2 / 2, low-variance, biased; k3 = q/p - 1 - log(q/p),
    unbiased and never negative; abs = |log(p/q)| (TRL's old PPOTrainer), biased upward. The exact KL: full_kl."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2, k3 or abs")


def masked_mean(values, mask, dim=None):
    """The mean of values where mask is true; 0 where it is nowhere true."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True, reduce=None):
    """Normalise to unit variance over the masked entries (and zero mean unless shift_mean=False). reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the statistics over processes, so N processes whiten as one."""
    m = mask.to(values.dtype)
    sums = torch.stack([(values * m).sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    mean, n = sums[0] / sums[1], sums[1]
    squares = ((values - mean) ** 2 * m).sum()
    if reduce is not None:
        squares = reduce(squares)
    whitened = (values - mean) * torch.rsqrt(squares / (n - 1).clamp(min=1) + 1e-8)  # unbiased variance
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------------------------------
# TRL's score scaling and clipping (use_score_scaling, use_score_norm, score_clip)


def new_moments():
    """Running moments of no value yet: count, mean, and m2, the sum of squared deviations from the mean."""
    return {"count": 0.0, "mean": 0.0, "m2": 0.0}


def update_moments(moments, values, mask, reduce=None):
    """The running moments with this batch's values where mask is true merged in (Chan, Golub and LeVeque's pairwise
    update, exact where summing squares would cancel). reduce sums the batch's statistics over processes, so the
    moments are the global batch's; every process calls it. Returns new moments, as floats."""
    m = mask.to(torch.float32)
    values = values.float().masked_fill(~mask, 0.0)  # whatever an unmasked entry holds (NaN too) stays out
    sums = torch.stack([(values * m).sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    total, n = sums.tolist()
    mean = total / max(n, 1.0)
    squares = ((values - mean) ** 2 * m).sum()  # around the batch's own mean, not the running one
    if reduce is not None:
        squares = reduce(squares)
    if n == 0:  # no value in the whole batch
        return dict(moments)
    count = moments["count"] + n
    delta = mean - moments["mean"]
    m2 = moments["m2"] + squares.item() + delta**2 * moments["count"] * n / count
    return {"count": count, "mean": moments["mean"] + delta * n / count, "m2": m2}


def moments_std(moments):
    """The unbiased standard deviation of the values the moments have seen (0 before two values)."""
    return math.sqrt(moments["m2"] / max(moments["count"] - 1.0, 1.0))


def scale_scores(scores, scored, moments=None, norm=False, clip=None):
    """TRL's scaling and clipping of the scored completions' scores (the others untouched): with moments divided by
    their running std (+ float32's epsilon, as TRL), with norm their running mean subtracted first; with clip, clipped
    to [-clip, clip]."""
    out = scores
    if moments is not None:
        if norm:
            out = out - moments["mean"]
        out = out / (moments_std(moments) + torch.finfo(torch.float32).eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return torch.where(scored, out, scores)


def transform_scores(scores, scored, moments, args, reduce=None):
    """--use_score_scaling (--use_score_norm) and --score_clip: the moments take this batch in first (TRL's order, so
    the first batch is scaled by its own std), then scale_scores. Returns (scores, moments), as given with the flags
    off."""
    if args.use_score_scaling:
        moments = update_moments(moments, scores, scored, reduce)
    if args.use_score_scaling or args.score_clip is not None:
        moments_used = moments if args.use_score_scaling else None
        scores = scale_scores(scores, scored, moments=moments_used, norm=args.use_score_norm, clip=args.score_clip)
    return scores, moments


def lm_loss(logits, input_ids, attention_mask):
    """The mean next-token cross-entropy over the real tokens of right-padded rows; logits (rows, len, vocab)."""
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])  # chunked, as the policy's logprobs
    mask = attention_mask[:, 1:].bool()
    return -logprobs.masked_fill(~mask, 0.0).sum() / mask.sum()
