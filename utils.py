"""The method the scripts share: the forward passes (packed where exact), the episode loop, the score (the reward
sources' weighted sum, the missing-EOS penalty, TRL's scaling and clipping), group statistics, importance weights,
logprobs, entropy and the exact KL, the KL estimators, masked statistics, the value head, and the statistics of an
update. What one algorithm alone needs (baselines, advantages, losses) stays in its script; the plumbing (flags,
loading, the decoders and the vLLM engine, reward sources, checkpoints, logs, the model card) is in infra/, a package
of modules by concern.
"""

import math
import re
import sys
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn as nn

# written into the logprobs of padding positions, so that a padding token that leaks into a sum is easy to spot
INVALID_LOGPROB = 1.0
LOGITS_BUDGET = 1 << 30  # the most logits a rollout pass holds at once (4 GiB in float32): rollout_chunks


class Stopped(SystemExit):
    """die()'s exit, status `code`; str() is its line, already on stderr"""

    def __str__(self):
        return self.line


def die(msg, code=2):
    """Stop the run with one line on stderr, no traceback: status 2 for bad input (the user's to fix, as a flag the
    parser refuses), 1 for a run that fails as it goes (a non-finite loss)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    stop = Stopped(code)
    stop.line = f"error: {msg}"
    raise stop


# ---------------------------------------------------------------------------------------------------------------------
# the sampling rule


def sampling_logits(logits, seen, *, temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
    """The sampling rule a script hands its sampler (infra.Sampler): a step's logits (rows, vocab) -> the float32 logits
    whose softmax its token is drawn from (-inf: ruled out), in vLLM's order: the repetition penalty on the tokens
    `seen` ((rows, vocab) bool, prompt and completion so far; Keskar et al. 2019: a positive logit divided, a negative
    one multiplied), the temperature (0: the first largest logit alone), min-p (Nguyen et al. 2024), top-k (ties kept),
    top-p (Holtzman et al. 2020; at least one token). transformers' generate() applies min-p after top-k and top-p. The
    loss, the KL and the importance weights read logits / temperature untruncated (logprobs_from_logits), as TRL's."""
    logits = logits.float()
    if repetition_penalty != 1.0:
        penalised = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if temperature == 0:
        return torch.full_like(logits, -math.inf).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    logits = logits / temperature
    if min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[:, -1:], -math.inf)
    if top_p < 1.0:
        ascending, order = logits.sort(-1)
        below = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # the unlikeliest tokens, whose mass stays below 1 - p
        below[:, -1] = False  # (the likeliest is kept)
        logits = logits.masked_fill(torch.zeros_like(below).scatter_(-1, order, below), -math.inf)
    return logits


# ---------------------------------------------------------------------------------------------------------------------
# forward passes and the value head


def positions(attention_mask):
    """Each column's position, counted from its row's first real token as the decoder (infra.decode) counts them; a
    padding column takes its neighbour's (0 on the left, the last real token's on the right), so that a row filling
    the model's positions pads within them (padding is read by no real token)."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def forward(model, input_ids, attention_mask, **kwargs):
    """A causal LM on left-padded rows, with positions counted from each row's first real token as the decoder does."""
    position_ids = positions(attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def scalar_forward(model, input_ids, attention_mask):
    """One scalar per token (batch, seq) from a sequence-classification model (num_labels=1): its backbone, then its
    `score` head on every position; for reward models and critics. (The model's own forward finds the last token by
    comparing with the pad id, which breaks when pad == EOS.)"""
    backbone = getattr(model, model.base_model_prefix)
    position_ids = positions(attention_mask)
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
    model) or, with critic None, from a value head on the policy's trunk (a linear one, or value_head: one's own)."""

    def __init__(self, policy, critic=None, seed=0, value_head=None):
        super().__init__()
        self.policy, self.critic = policy, critic
        if critic is None:  # std 1 / sqrt(hidden + 1), as the N+ details study
            hidden = policy.config.hidden_size  # (value_head: a module, never empty)
            self.value_head = value_head or init_value_head(nn.Linear(hidden, 1), 1 / math.sqrt(hidden + 1), seed)

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


@torch.no_grad()
def sync_reference(ref_policy, policy, alpha):
    """TR-DPO's reference update (Gorbatovski et al. 2024, TRL's sync_ref_model): ref <- alpha policy + (1 - alpha) ref"""
    for ref, param in zip(ref_policy.parameters(), policy.parameters(), strict=True):
        ref.lerp_(param.to(ref.dtype), alpha)


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


def packed_mask(config, sees):
    """Packed rows' attention, sees (rows, L, L) bools (which columns each column sees), as the 4D mask the model takes
    as given (transformers passes it on): booleans for sdpa, added to the scores for eager. A column that would see
    none (padding, which none sees) sees itself rather than nothing."""
    sees = sees | torch.eye(sees.shape[-1], dtype=torch.bool, device=sees.device) & ~sees.any(-1, keepdim=True)
    if config._attn_implementation == "eager":
        return torch.zeros(sees.shape, device=sees.device).masked_fill(~sees, torch.finfo(torch.float32).min)[:, None]
    return sees[:, None]


def forward_grouped(model, query_responses, mask, context_length, group, logits_to_keep, hidden=False, router=False):
    """forward()'s logits at the last logits_to_keep positions (at most the response's length + 1), for rows in groups
    of `group` completions of one prompt (rows g * group ... g * group + group - 1 share their first context_length
    tokens), equal in values and gradients to running every row in full (tested). hidden: the last hidden states there
    instead, for a score head. router: (the logits, an MoE's router load-balancing loss), every row in full, as TRL's.
    Each prompt runs once: a group is one packed row, the prompt then each completion, each seeing the prompt and
    itself at the positions it would have alone (k = 4, prompts as long as the responses: 3/8 fewer positions). group=1
    is plain forward(), as is every model can_pack() refuses (a family not tested, flash attention, ALiBi, ...)."""
    rows, width = query_responses.shape
    # the prompt's last token runs with each completion, whose first token its logits predict: then every logit wanted
    # lies in the completions' segments
    start, seg = context_length - 1, width - context_length + 1
    config = getattr(model, "module", model).config  # (the wrapped model's, under DDP or DeepSpeed)
    out = dict(output_hidden_states=True) if hidden else dict(logits_to_keep=logits_to_keep)
    if router:  # (packed, a prompt would count once where TRL counts it with each completion)
        result = forward(model, query_responses, mask, output_router_logits=True, **out)
        return result.logits, result.aux_loss
    if group == 1 or start < 1 or not can_pack(config, start + group * seg):
        result = forward(model, query_responses, mask, **out)
        return result.hidden_states[-1][:, -logits_to_keep:] if hidden else result.logits
    prompts = rows // group
    # (prompts, start + group * seg): the prompt once, then each completion's segment; positions as forward() counts them
    ids, real, places = (
        torch.cat([x[::group, :start], x[:, start:].reshape(prompts, group * seg)], 1)
        for x in (query_responses, mask.bool(), positions(mask))
    )
    # a column sees the real columns up to itself of the prompt and of its own segment (-1: the prompt)
    part = torch.cat([torch.full((start,), -1), torch.arange(group).repeat_interleave(seg)]).to(ids.device)
    col = torch.arange(len(part), device=ids.device)
    sees = ((part[None, :] == -1) | (part[None, :] == part[:, None])) & (col[None, :] <= col[:, None])  # (L, L)
    if not hidden:
        out["logits_to_keep"] = group * seg
    attention = packed_mask(config, sees & real[:, None, :])  # (prompts, L, L) -> (prompts, 1, L, L)
    result = model(input_ids=ids, attention_mask=attention, position_ids=places, **out)
    values = result.hidden_states[-1][:, start:] if hidden else result.logits
    return values.reshape(rows, seg, -1)[:, seg - logits_to_keep :]  # (prompts, group * seg, vocab) -> (rows, seg, vocab)


def episodes(sample, prompts, respond, max_turns, max_tokens, stop_token_id, context=None, reduce=None):
    """Multi-turn episodes, token in and token out: a row's episode is the tokens the policy sampled, turn after turn,
    and each observation's tokens as they come (never re-rendered from text). Turn t: sample(rows, their prompts +
    episodes, t, room) -> (tokens (rows, width), engine logprobs or None), room: each row's most tokens this turn (the
    rest of max_tokens, and of the context: the most tokens the model or the engine reads, prompt included; None: no
    bound), each turn then cut after its stop token and at its room. respond(rows, turns, last) -> each row's
    observation (token ids), or None where the environment ends the episode; last[j]: the turn is the episode's last
    whatever the environment says (it has no stop token, it is turn max_turns, or no token would fit after it), so no
    tool runs and the answer only says whether the environment would go on.

    An episode is cut off when its last turn did not end with the stop token, whatever the environment says (TRL's
    truncation); capped when a bound (max_turns, no room after an observation) ended it after a complete turn. reduce
    (ZeRO-3) sums a count over the processes: all sample every turn. Returns per row its tokens (after the prompt),
    which the policy sampled, the engine's logprobs (0 on observations; or None), its turns, if cut off, and capped."""
    n = len(prompts)
    tokens, policy, engine = ([[] for _ in range(n)] for _ in range(3))
    turns, cut, capped, active, logprobs = [0] * n, [False] * n, [False] * n, list(range(n)), None

    def room(i):  # the most tokens row i may still add
        left = max_tokens - len(tokens[i])
        return left if context is None else min(left, context - len(prompts[i]) - len(tokens[i]))

    for t in range(max_turns):
        # a process whose episodes have ended still takes part in each forward pass of the others' turns (ZeRO-3)
        if (reduce(len(active)) if reduce else len(active)) == 0:
            break
        rows, seqs, rooms = [0], prompts[:1], [1]  # (such a process samples its first prompt again, unused)
        if active:  # (each has room for a token: its prompt was checked, and an observation joins only with room)
            rows, seqs, rooms = active, [prompts[i] + tokens[i] for i in active], [room(i) for i in active]
        sampled, logprobs = sample(rows, seqs, t, rooms)
        done, last = [], []
        for j, i in enumerate(active):
            turn = sampled[j].tolist()[: rooms[j]]
            turn = turn[: turn.index(stop_token_id) + 1] if stop_token_id in turn else turn
            tokens[i], policy[i], turns[i] = tokens[i] + turn, policy[i] + [True] * len(turn), turns[i] + 1
            engine[i] += logprobs[j, : len(turn)].tolist() if logprobs is not None else []
            cut[i] = stop_token_id is not None and turn[-1:] != [stop_token_id]
            done.append(turn)
            last.append(cut[i] or t == max_turns - 1 or room(i) < 1)
        still = []
        for i, end, obs in zip(active, last, respond(active, done, last) if active else []):
            if obs is None:  # the environment ended the episode
                continue
            if end or len(obs) + 1 > room(i):  # the environment would go on, a bound does not
                capped[i] = not cut[i]
                continue
            tokens[i], policy[i], engine[i] = tokens[i] + obs, policy[i] + [False] * len(obs), engine[i] + [0.0] * len(obs)
            still.append(i)
        active = still
    return tokens, policy, engine if logprobs is not None else None, turns, cut, capped


# ---------------------------------------------------------------------------------------------------------------------
# importance weights and group statistics


def importance_weights(logprobs, behaviour_logprobs, sampled, mode, clip_min=None, clip_max=3.0):
    """Importance sampling of an engine's samples (TRL's vllm_importance_sampling_mode; Yao et al. 2025): the trainer's
    probability of what the engine sampled over the engine's, correcting a loss computed as if the trainer had sampled.
    mode token_*: one weight per token (rows, width), 1 on padding; sequence_*: one per completion (rows,).
    *_truncate: the ratio clipped to [clip_min, clip_max]; *_mask: 0 outside them (a bound None: none). Returns the
    weights and their metrics: the mean and max |logprob difference| over the sampled tokens (sampled: (rows, width)),
    and the fraction of ratios outside the bounds."""
    diff = (logprobs - behaviour_logprobs).masked_fill(~sampled, 0.0)
    level, action = mode.split("_")
    ratio = diff.sum(1).exp() if level == "sequence" else diff.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    outside = outside if level == "sequence" else outside & sampled  # a token's: of the sampled tokens only
    fraction = outside.float().mean() if level == "sequence" else outside.sum() / sampled.sum().clamp(min=1)
    weights = ratio.clamp(low, high) if action == "truncate" else ratio.masked_fill(outside, 0.0)
    if level == "token":
        weights = weights.masked_fill(~sampled, 1.0)
    stats = {"vllm/logprob_diff_mean": diff.abs().sum() / sampled.sum().clamp(min=1), "vllm/capped_fraction": fraction}
    return weights, {**stats, "vllm/logprob_diff_max": diff.abs().max()}


def weighted_scores(per_source, weights):
    """(sources, rows) rewards, NaN where a source returned None, and the sources' weights -> (scores, scored), both
    (rows,): the weighted sum over the sources that scored each completion; one that no source scored gets 0 and scored
    False (it takes no part in the update)."""
    weights = torch.tensor(weights, device=per_source.device)[:, None]
    return (weights * per_source).nansum(0), ~per_source.isnan().all(0)


def score(batch, weights, missing_eos_penalty=None):
    """Each completion's score (scores, scored), (rows,) each: the reward sources' weighted sum (weighted_scores), less
    missing_eos_penalty where the completion was cut off before its stop token (an episode: its last turn), subtracted
    rather than replacing the score as TRL's old trainers did, so that the reward still ranks such completions."""
    scores, scored = weighted_scores(batch.per_source, weights)
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~batch.contain_eos).float()
    return scores, scored


class ScoreScaler:
    """TRL's score scaling and clipping of the scored completions (the others untouched): with scaling divided by the
    running std of every score so far (+ float32's epsilon, as TRL), with norm their running mean subtracted first;
    with clip clipped to [-clip, clip]. The running moments (count, mean, m2: the sum of squared deviations) take in
    each batch before it is scaled, over all processes (reduce: a sum over them); a checkpoint holds them."""

    def __init__(self, scaling=False, norm=False, clip=None, reduce=None):
        self.scaling, self.norm, self.clip, self.reduce = scaling, norm, clip, reduce
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def __call__(self, scores, scored):
        out = scores
        if self.scaling:
            self.update(scores, scored)
            out = (out - self.mean if self.norm else out) / (self.std() + torch.finfo(torch.float32).eps)
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return torch.where(scored, out, scores)

    def update(self, values, mask):
        """The values where mask is true merged in (Chan, Golub and LeVeque's pairwise update, exact where summing
        squares would cancel); every process calls it."""
        reduce = self.reduce or (lambda x: x)
        m = mask.to(torch.float32)
        values = values.float().masked_fill(~mask, 0.0)  # whatever an unmasked entry holds (NaN too) stays out
        total, n = reduce(torch.stack([(values * m).sum(), m.sum()])).tolist()
        mean = total / max(n, 1.0)
        squares = reduce(((values - mean) ** 2 * m).sum())  # around the batch's own mean, not the running one
        if n == 0:  # no value in the whole batch
            return
        count, delta = self.count + n, mean - self.mean
        self.m2 = self.m2 + squares.item() + delta**2 * self.count * n / count
        self.count, self.mean = count, self.mean + delta * n / count

    def std(self):
        """The unbiased standard deviation of the values seen (0 before two values)."""
        return math.sqrt(self.m2 / max(self.count - 1.0, 1.0))

    def metrics(self):
        """the running moments this update's scores were scaled with (none without scaling)"""
        return {"objective/score_mean_running": self.mean, "objective/score_std_running": self.std()} if self.scaling else {}

    def state_dict(self):
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state):
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def distinct_groups(scores, scored, k):
    """Whether each prompt's group of k completions has scores that differ (at least two scored ones, not all equal):
    (prompts * k,) in rollout order -> (prompts,). A group without is one that GRPO's and RLOO's advantages leave at
    zero, whatever the scores' scale."""
    grouped, valid = scores.reshape(-1, k), scored.reshape(-1, k)
    highest = grouped.masked_fill(~valid, -torch.inf).amax(1)
    lowest = grouped.masked_fill(~valid, torch.inf).amin(1)
    return (valid.sum(1) >= 2) & (highest > lowest)


def pad_cat(chunks, value):
    """Rows of chunks that may end at different widths (a rollout's chunks stop at their own longest completion), right-
    padded with `value` to the widest and concatenated: (rows, width, ...)."""
    width = max(c.shape[1] for c in chunks)
    return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=value) for c in chunks])


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
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True, reduce=None, std_eps=None):
    """Normalise to unit variance over the masked entries (and zero mean unless shift_mean=False): divided by
    sqrt(var + 1e-8), or with std_eps by std + std_eps (TRL's RLOO: 1e-4), var the unbiased variance. reduce, e.g.
    partial(accelerator.reduce, reduction="sum"), sums the statistics over processes, so N processes whiten as one."""
    m, reduce = mask.to(values.dtype), reduce or (lambda x: x)
    sums = reduce(torch.stack([(values * m).sum(), m.sum()]))
    mean, n = sums[0] / sums[1], sums[1]
    squares = reduce(((values - mean) ** 2 * m).sum())
    var = squares / (n - 1).clamp(min=1)  # unbiased
    whitened = (values - mean) * (torch.rsqrt(var + 1e-8) if std_eps is None else 1 / (var.sqrt() + std_eps))
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------------------------------
# an update: the rollout's forward passes, its mini-batches, its statistics


def rollout_chunks(batch, model):
    """An infra.rollout.Batch's rows, batch.chunk at a time, fewer (whole groups) where their logits (completion + 1
    positions) would pass LOGITS_BUDGET, each only as wide as its longest completion: (rows, ids, mask, responses)."""
    config = getattr(model, "module", model).config  # (a DeepSpeed engine's own .config is its settings)
    width = batch.query_responses.shape[1] - batch.context_length + 1
    fit = LOGITS_BUDGET // (width * config.get_text_config().vocab_size)
    chunk = min(batch.chunk, max(batch.group, fit // batch.group * batch.group))
    for i in range(0, len(batch.lengths), chunk):
        rows = slice(i, i + chunk)
        end = batch.context_length + int(batch.lengths[rows].max())
        query_response, mask = batch.query_responses[rows, :end], batch.attention_mask[rows, :end]
        yield rows, query_response, mask, query_response[:, batch.context_length :]


@torch.no_grad()
def rollout_logprobs(model, batch, temperature):
    """log p(token) of the batch's completions under softmax(logits / temperature), the distribution sampled from:
    (rows, width), INVALID_LOGPROB on padding; each prompt run once for its completions where the batch's chunks allow
    (forward_grouped)."""
    logprobs = []
    for rows, query_response, mask, response in rollout_chunks(batch, model):
        logits = forward_grouped(model, query_response, mask, batch.context_length, batch.group, response.shape[1] + 1)
        logprobs.append(logprobs_from_logits(logits[:, :-1], response, temperature))
        del logits  # (chunk, width, vocab): freed before the next chunk allocates its own
    return pad_cat(logprobs, INVALID_LOGPROB).masked_fill(~batch.sampled, INVALID_LOGPROB)


@torch.no_grad()
def rollout_full_kl(policy, ref_policy, batch, temperature, ref_batch=None):
    """The exact KL(policy || reference) at every completion token of the batch (full_kl; 0 on padding), chunk by chunk.
    ref_policy None: the policy without its LoRA adapters; ref_batch: the batch as the reference reads it (None: batch)."""
    kls, ref_batch = [], ref_batch or batch
    chunks = zip(rollout_chunks(batch, policy), rollout_chunks(ref_batch, policy))  # (the same completions: rows)
    for (_, query_response, mask, response), (_, ref_query, ref_mask, _) in chunks:
        width = response.shape[1] + 1
        logits = forward_grouped(policy, query_response, mask, batch.context_length, batch.group, width)[:, :-1]
        with reference_model(policy, ref_policy) as ref:
            ref_logits = forward_grouped(ref, ref_query, ref_mask, ref_batch.context_length, batch.group, width)[:, :-1]
        kls.append(full_kl(logits, ref_logits, temperature))
        del logits, ref_logits
    return pad_cat(kls, 0.0).masked_fill(~batch.sampled, 0.0)


def lr_factor(kind, step, total, warmup=0, min_lr_rate=0.0):
    """The learning rate's share at update `step` (from 0) of `total` by transformers' schedule of that name: a linear
    rise from 0 over `warmup` updates ("constant": none), then linear to 0, a half cosine to 0 (cosine_with_min_lr: to
    min_lr_rate) or constant. Linear without warmup is the seed's 1 - step / total."""
    if step < warmup and kind != "constant":
        return step / max(1, warmup)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    low = min_lr_rate if kind == "cosine_with_min_lr" else 0.0
    return max(0.0, low + (1 - low) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def decay_groups(model, weight_decay):
    """AdamW's parameter groups for a model's trainable weights: weight decay on each, but the biases and the norms'
    weights (transformers' rule: a LayerNorm, or a name with bias, layernorm, rmsnorm or norm as a part)."""
    norms = {name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)}
    spared = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
    decay, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            owner = name.rpartition(".")[0]
            (rest if owner in norms or spared.search(name.lower()) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def minibatches(n, mini, micro, group=1, device=None):
    """One epoch over n rows: shuffled (rows in groups of `group`, a prompt's completions, kept together), cut into
    mini-batches of `mini` rows, one optimiser step each, and those into micro-batches of `micro`: a list per
    mini-batch of the micro-batches' row indices."""
    order = torch.randperm(n // group, device=device)[:, None] * group
    order = (order + torch.arange(group, device=device)).flatten()
    return [list(order[start : start + mini].split(micro)) for start in range(0, n, mini)]


class Stats:
    """An update's statistics by name: add() takes values (a micro-batch's, or the batch's), whose mean the update
    logs; add_tokens() takes per-token values, whose mean over every token added (on all processes) it logs. infra's
    log reduces them over the processes."""

    def __init__(self):
        self.values, self.tokens = defaultdict(list), defaultdict(list)

    def add(self, **values):
        for name, value in values.items():
            self.values[name].append(torch.as_tensor(value).detach().float())

    def add_tokens(self, mask, **values):
        """values (rows, width), counted where mask is true"""
        for name, value in values.items():
            self.tokens[name].append(torch.stack([value.detach()[mask].float().sum(), mask.sum().float()]))

    def var(self, name):
        """the variance of the values added under name (over the micro-batches)"""
        return torch.stack(self.values[name]).var(unbiased=False)

    def local(self):
        """{name: the mean of its values} and {name: (sum, count)} of the token statistics, this process's"""
        means = {name: torch.stack(v).mean() for name, v in self.values.items()}
        return means, {name: torch.stack(v).sum(0) for name, v in self.tokens.items()}
