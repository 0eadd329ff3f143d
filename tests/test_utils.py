"""Each vectorised formula against a naive reference: LOO baseline, KL estimators, masked statistics, truncation,
logprobs, sampling."""

import functools
import json
import math
import os
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import infra  # noqa: E402
import utils  # noqa: E402
from rloo import rloo_advantages  # noqa: E402


def test_rloo_advantages_match_loop():
    k, prompts = 4, 5
    rewards = torch.randn(k * prompts, generator=torch.Generator().manual_seed(0))
    expected = torch.zeros_like(rewards)
    for j in range(prompts):
        for i in range(k):
            others = [rewards[j * k + m].item() for m in range(k) if m != i]
            expected[j * k + i] = rewards[j * k + i] - sum(others) / (k - 1)
    everyone = torch.ones(k * prompts, dtype=torch.bool)
    torch.testing.assert_close(rloo_advantages(rewards, k, everyone), expected)
    # the advantages of one prompt's completions sum to zero: the baseline takes nothing from the expected gradient
    torch.testing.assert_close(rloo_advantages(rewards, k, everyone).reshape(prompts, k).sum(1), torch.zeros(prompts))


def test_rloo_advantages_leave_unscored_completions_out():
    """A completion no reward source scored gets 0 and is left out of the others' baselines; a scored completion with
    no other scored one in its prompt gets 0 too. The reward of an unscored one (here 100) must not leak anywhere."""
    k = 4
    rewards = torch.tensor([1.0, 2.0, 100.0, 4.0, 5.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0])
    scored = torch.tensor([1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    expected = torch.zeros_like(rewards)
    for j in range(len(rewards) // k):
        for i in range(k):
            others = [rewards[j * k + m].item() for m in range(k) if m != i and scored[j * k + m]]
            if scored[j * k + i] and others:
                expected[j * k + i] = rewards[j * k + i] - sum(others) / len(others)
    advantages = rloo_advantages(rewards, k, scored)
    torch.testing.assert_close(advantages, expected)
    assert advantages[0] == 1.0 - 3.0 and advantages[4] == 0.0 and (advantages[8:] == 0).all()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_values(kind):
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    expected = []
    for a, b in zip(logp.tolist(), ref.tolist()):
        r = math.exp(b - a)  # reference / policy probability ratio
        expected.append({"k1": -math.log(r), "k2": 0.5 * math.log(r) ** 2, "k3": r - 1 - math.log(r)}[kind])
    torch.testing.assert_close(utils.kl_estimate(logp, ref, kind), torch.tensor(expected))


def test_kl_estimators_are_unbiased_or_not_as_documented():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), 0)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    true_kl = (p * (p / q).log()).sum()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, logq = p.log()[tokens], q.log()[tokens]
    assert utils.kl_estimate(logp, logq, "k1").mean() == pytest.approx(true_kl.item(), abs=0.01)
    assert utils.kl_estimate(logp, logq, "k3").mean() == pytest.approx(true_kl.item(), abs=0.01)
    assert (utils.kl_estimate(logp, logq, "k3") >= 0).all()
    with pytest.raises(ValueError):
        utils.kl_estimate(logp, logq, "k4")


def kl_closed_form(p, q):
    return (p * (p / q).log()).sum()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_as_losses(kind):
    """PPO's --kl_penalty loss: the estimate on tokens sampled from the policy, minimised by gradient descent on a toy
    categorical policy (logits over 6 tokens) against a fixed reference. In expectation over the samples the
    gradient is k2: that of KL(p || q); k3: that of KL(q || p); k1: zero (E_p[grad log p] = 0), so k1 trains nothing."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=g, requires_grad=True)
    q = torch.softmax(torch.randn(6, generator=g), 0)

    # exact expectation: each token's estimate weighted by its probability, held fixed as the sampling distribution
    logp = torch.log_softmax(logits, 0)
    p = logp.exp().detach()
    (grad,) = torch.autograd.grad((p * utils.kl_estimate(logp, q.log(), kind)).sum(), logits)
    forward_kl = kl_closed_form(p, q)
    expected = {
        "k1": torch.zeros(6),
        "k2": p * ((p / q).log() - forward_kl),  # d KL(p || q) / d logits
        "k3": p - q,  # d KL(q || p) / d logits
    }[kind]
    torch.testing.assert_close(grad, expected)
    assert kind == "k1" or grad.abs().max() > 0.01

    # sampled, as in training: 300 steps of SGD on the mean estimate over 1,000 tokens drawn from the current policy
    optimizer = torch.optim.SGD([logits], lr=1.0)
    for _ in range(300):
        logp = torch.log_softmax(logits, 0)
        tokens = torch.multinomial(logp.exp().detach(), 1000, replacement=True, generator=g)
        loss = utils.kl_estimate(logp[tokens], q.log()[tokens], kind).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = kl_closed_form(torch.softmax(logits, 0).detach(), q)
    if kind == "k1":  # noise around a zero gradient: the KL wanders, it is not driven down
        assert after > 0.5 * forward_kl, (forward_kl, after)
    else:
        assert after < 0.05 * forward_kl, (forward_kl, after)


def test_masked_statistics_match_selected_entries():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) > 0.4
    picked = values[mask]
    assert utils.masked_mean(values, mask).item() == pytest.approx(picked.mean().item(), rel=1e-5)
    torch.testing.assert_close(
        utils.masked_mean(values, mask, dim=1), torch.stack([v[m].mean() for v, m in zip(values, mask)])
    )
    white = utils.masked_whiten(values, mask)
    assert white[mask].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert white[mask].var().item() == pytest.approx(1.0, rel=1e-4)
    kept = utils.masked_whiten(values, mask, shift_mean=False)
    assert kept[mask].mean().item() == pytest.approx(picked.mean().item(), rel=1e-4)
    trls = utils.masked_whiten(values, mask, std_eps=1e-4)  # TRL's RLOO: (x - mean) / (unbiased std + 1e-4)
    mean, std = statistics.mean(picked.tolist()), statistics.stdev(picked.tolist())
    assert trls[mask].tolist() == pytest.approx([(x - mean) / (std + 1e-4) for x in picked.tolist()], rel=1e-5)


def test_truncate_response_keeps_the_stop_token_and_pads_after_it():
    stop, pad = 9, 0
    responses = torch.tensor([[5, 9, 7, 9], [5, 6, 7, 8], [9, 1, 2, 3], [4, 4, 4, 9]])
    out, lengths = infra.data.truncate_response(responses, stop, pad)
    assert out.tolist() == [[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0], [4, 4, 4, 9]]
    assert lengths.tolist() == [2, 4, 1, 4]
    # pad == stop (a tokenizer whose pad token is its EOS): lengths still come from the first stop token
    out, lengths = infra.data.truncate_response(responses, stop, stop)
    assert lengths.tolist() == [2, 4, 1, 4]
    out, lengths = infra.data.truncate_response(responses, None, pad)
    assert out.tolist() == responses.tolist() and lengths.tolist() == [4, 4, 4, 4]


def test_logprobs_and_entropy_match_log_softmax():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(logits, -1)
    expected = torch.tensor([[logp[b, t, tokens[b, t]].item() for t in range(3)] for b in range(2)])
    torch.testing.assert_close(utils.logprobs_from_logits(logits, tokens), expected)
    picked, entropy = utils.logprobs_from_logits(logits, tokens, with_entropy=True)
    torch.testing.assert_close(picked, expected)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [1 << 20, 40, 7])  # one chunk; chunks of several rows; chunks of one position
def test_chunked_logprobs_match_autograd_log_softmax(dtype, budget):
    """Values, entropy and gradient of the chunked logprobs against plain autograd through log_softmax, with a
    temperature, on a non-contiguous view (logits[:, :-1], as the scripts pass it), chunk edges falling mid-row."""
    gen = torch.Generator().manual_seed(0)
    # offset by 40, as trained models' logits often are: the entropy must not lose digits to it
    full = (3 * torch.randn(5, 7, 13, generator=gen) + 40).to(dtype)
    tokens = torch.randint(0, 13, (5, 6), generator=gen)
    weights = torch.randn(5, 6, generator=gen)  # a loss that weighs each position differently
    results = []
    for chunked in (True, False):
        logits = full.clone().requires_grad_(True)
        if chunked:
            picked, entropy = utils.logprobs_from_logits(logits[:, :-1], tokens, 0.7, with_entropy=True, budget=budget)
        else:
            logp = torch.log_softmax(logits[:, :-1].float() / 0.7, -1)
            picked, entropy = logp.gather(-1, tokens[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1).detach()
        (picked * weights).sum().backward()
        assert picked.dtype == torch.float32 and logits.grad.dtype == dtype
        results.append((picked, entropy, logits.grad))
    (picked, entropy, grad), (want, want_entropy, want_grad) = results
    torch.testing.assert_close(picked, want)
    torch.testing.assert_close(utils.logprobs_from_logits(full[:, :-1], tokens, 0.7, budget=budget), want)  # no entropy
    torch.testing.assert_close(entropy, want_entropy)
    torch.testing.assert_close(grad, want_grad)
    assert grad[:, -1].abs().max() == 0  # the dropped position gets no gradient


@pytest.mark.parametrize("budget", [1 << 20, 7])
@pytest.mark.parametrize("terms", ["both", "entropy"])
def test_chunked_entropy_gradient_matches_autograd(budget, terms):
    """An entropy bonus (grpo.py's --entropy_coef): the gradient of the chunked entropy, alone or beside the logprobs',
    against plain autograd through softmax."""
    gen = torch.Generator().manual_seed(1)
    full = 3 * torch.randn(4, 6, 11, generator=gen) + 40
    tokens = torch.randint(0, 11, (4, 5), generator=gen)
    weights, bonus = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    grads = []
    for chunked in (True, False):
        logits = full.clone().requires_grad_(True)
        if chunked:
            picked, entropy = utils.logprobs_from_logits(logits[:, :-1], tokens, 0.7, with_entropy=True, budget=budget)
        else:
            logp = torch.log_softmax(logits[:, :-1] / 0.7, -1)
            picked, entropy = logp.gather(-1, tokens[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        loss = (entropy * bonus).sum() + ((picked * weights).sum() if terms == "both" else 0.0)
        (grad,) = torch.autograd.grad(loss, logits)
        grads.append(grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert grads[0][:, -1].abs().max() == 0  # the dropped position gets no gradient


def test_left_pad():
    ids, mask = infra.data.left_pad([[1, 2, 3], [4]], pad_token_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), infra.models.load_tokenizer(tiny_model_dir)


def test_recomputed_logprobs_equal_the_sampling_distribution(tiny_lm):
    """Sample with transformers' own generate() (temperature, no top-k/top-p), then check that our forward on the
    left-padded query+response, with logits / temperature, gives the log-probabilities generate() sampled from."""
    model, tok = tiny_lm
    temperature = 0.7
    queries, mask = infra.data.left_pad([tok("the function returns")["input_ids"], tok("a")["input_ids"]], tok.pad_token_id)
    torch.manual_seed(0)
    out = model.generate(
        input_ids=queries,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )
    responses = out.sequences[:, queries.shape[1] :]
    sampled = torch.stack(
        [torch.log_softmax(s, -1).gather(1, responses[:, t : t + 1])[:, 0] for t, s in enumerate(out.scores)], 1
    )
    full_mask = torch.cat([mask, torch.ones_like(responses)], 1)
    logits = utils.forward(model, out.sequences, full_mask).logits[:, queries.shape[1] - 1 : -1]
    torch.testing.assert_close(utils.logprobs_from_logits(logits / temperature, responses), sampled, atol=1e-4, rtol=1e-4)
    # without the temperature the numbers are different: the test can tell
    assert not torch.allclose(utils.logprobs_from_logits(logits, responses), sampled, atol=1e-3)


def test_generate_matches_a_loop_without_kv_cache(tiny_lm):
    """Our KV-cached sampler against a naive one that reruns the whole sequence per token, same random stream."""
    model, tok = tiny_lm
    queries, mask = infra.data.left_pad([tok("the list of")["input_ids"], tok("x")["input_ids"]] * 2, tok.pad_token_id)
    uniforms = torch.rand(len(queries), 8)
    ours = infra.decode.generate(model, queries, mask, response_length=8, rule=0.9, uniforms=uniforms)
    seq, seq_mask = queries, mask
    with torch.no_grad():
        for t in range(8):
            probs = torch.softmax(utils.forward(model, seq, seq_mask).logits[:, -1] / 0.9, -1)
            # inverse CDF, written out: the first token whose cumulative probability reaches the uniform number
            token = torch.tensor([[int((p.cumsum(0) < u).sum())] for p, u in zip(probs, uniforms[:, t])])
            seq, seq_mask = torch.cat([seq, token], 1), torch.cat([seq_mask, torch.ones_like(token)], 1)
    assert ours.tolist() == seq[:, queries.shape[1] :].tolist()
    # a row's sample does not depend on the rows batched with it (what lets two processes match one)
    alone = infra.decode.generate(
        model, queries[1:2, -1:], mask[1:2, -1:], response_length=8, rule=0.9, uniforms=uniforms[1:2]
    )
    assert alone.tolist() == ours[1:2].tolist()


def test_sampled_and_scored_completions_do_not_depend_on_the_chunking(tiny_lm):
    """infra.rollout.sample_completions generates chunk rows at a time and infra.rewards.score_completions truncates and
    scores them chunk by chunk: any chunking gives what one generate() call over all rows and a loop scoring each
    completion alone give, the batch only as wide as its longest completion."""
    model, tok = tiny_lm
    prompts = ["the list of", "x", "a b c", "the function returns"]
    queries, mask = infra.data.left_pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id)
    queries, mask = queries.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # (prompts * 2, query_len)
    texts = [p for p in prompts for _ in range(2)]
    uniforms = torch.rand(len(queries), 10, generator=torch.Generator().manual_seed(0))
    free = infra.decode.generate(model, queries, mask, response_length=10, rule=1.0, uniforms=uniforms)
    stop = free[:, 1:].flatten().mode().values.item()  # a frequent token, so the completions stop at different lengths
    whole = infra.decode.generate(model, queries, mask, response_length=10, rule=1.0, stop_token_id=stop, uniforms=uniforms)
    lens = []  # each completion's length, by a loop over its tokens
    for row in whole.tolist():
        lens.append(row.index(stop) + 1 if stop in row else len(row))
    assert len(set(lens)) > 1, lens
    sources = [{"name": "chars", "fn": lambda prompts, completions, **_: [float(len(c)) for c in completions], "weight": 1.0}]
    for chunk in (1, 2, 3, 8):
        sampled, engine_logprobs = infra.rollout.sample_completions(
            model, None, queries, mask, k=2, max_length=10, rule=1.0, stop_token_id=stop,
            pad_token_id=tok.pad_token_id, uniforms=uniforms, seeds=None, chunk=chunk, group=2 if chunk % 2 == 0 else 1,
        )  # fmt: skip
        assert engine_logprobs is None
        responses, lengths, per_source = infra.rewards.score_completions(
            sources, tok, queries, mask, sampled, prompts=texts, columns={}, stop_token_id=stop, chunk=chunk
        )
        assert lengths.tolist() == lens and responses.shape[1] == max(lens)
        for i, n in enumerate(lens):
            assert responses[i, :n].tolist() == whole[i, :n].tolist()
            assert (responses[i, n:] == tok.pad_token_id).all()
            text = tok.decode(whole[i, :n], skip_special_tokens=True)
            assert per_source[0, i].item() == float(len(text)), (chunk, i)


def tiny_llama(tok, attn_implementation, **kwargs):
    """SmolLM2's shape in miniature: grouped-query attention, rotary positions, the LM head tied to the embedding"""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )
    return (
        LlamaForCausalLM(config).eval()
        if attn_implementation is None
        else LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).eval()
    )


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_grouped_equals_forward_values_and_gradients(tiny_lm, tiny_model_dir, arch, attn):
    """Each prompt run once for its k completions (one packed row per prompt): the same logits and the same gradients
    as running every row in full, with left-padded prompts of different lengths and right-padded responses, for
    either attention that takes the packed mask."""
    from transformers import AutoModelForCausalLM

    _, tok = tiny_lm
    if arch == "gpt_neox":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    else:
        model = tiny_llama(tok, attn)
    k, width = 3, 5
    prompts, pmask = infra.data.left_pad([tok("the list of")["input_ids"], tok("x")["input_ids"]], tok.pad_token_id)
    queries, qmask = prompts.repeat_interleave(k, 0), pmask.repeat_interleave(k, 0)  # row j * k + i: prompt j
    responses = torch.randint(0, model.config.vocab_size, (len(queries), width), generator=torch.Generator().manual_seed(0))
    rmask = (torch.arange(width)[None, :] < torch.tensor([5, 2, 4, 1, 5, 3])[:, None]).long()
    seqs, mask = torch.cat([queries, responses], 1), torch.cat([qmask, rmask], 1)
    context = queries.shape[1]
    shapes = []  # the input of every call of the model: the packed path makes one, of one row per prompt
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    results = []
    for group in (1, k):
        model.zero_grad()
        logits = utils.forward_grouped(model, seqs, mask, context, group, width + 1)
        assert logits.shape == (len(seqs), width + 1, model.config.vocab_size)
        logp = utils.logprobs_from_logits(logits[:, :-1], responses)
        (logp * rmask).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    hook.remove()
    assert shapes == [tuple(seqs.shape), (2, context - 1 + k * (width + 1))]
    (plain, plain_grads), (grouped, grouped_grads) = results
    full = utils.forward(model, seqs, mask).logits[:, context - 1 :]  # forward() itself, all positions
    torch.testing.assert_close(plain, full.detach())
    torch.testing.assert_close(grouped, plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(grouped_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    model.zero_grad()
    # fewer logits kept: the last ones of each row
    torch.testing.assert_close(utils.forward_grouped(model, seqs, mask, context, k, 2), plain[:, -2:], atol=1e-5, rtol=1e-5)
    # generation with the prompt run once per group samples the same tokens from the same numbers
    uniforms = torch.rand(len(queries), 6)
    with torch.no_grad():
        alone = infra.decode.generate(model, queries, qmask, response_length=6, rule=0.9, uniforms=uniforms)
        grouped = infra.decode.generate(model, queries, qmask, response_length=6, rule=0.9, uniforms=uniforms, group=k)
    assert grouped.tolist() == alone.tolist()


def test_forward_grouped_runs_rows_in_full_under_a_shorter_sliding_window(tiny_lm):
    """A sliding window shorter than the packed row (here 12 columns: 3 + 2 x 7) would cut a completion off its prompt:
    such a model runs every row in full, and a window that covers the packed row lets it pack."""
    _, tok = tiny_lm
    seqs = torch.randint(0, len(tok), (4, 10), generator=torch.Generator().manual_seed(0))
    for window, expected in [(12, (4, 10)), (17, (2, 17))]:
        model = tiny_llama(tok, "sdpa", sliding_window=window)
        shapes = []
        hook = model.register_forward_pre_hook(lambda _, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        utils.forward_grouped(model, seqs, torch.ones_like(seqs), context_length=4, group=2, logits_to_keep=7)
        hook.remove()
        assert shapes == [expected]


def test_rollout_passes_hold_at_most_the_logits_budget(tiny_lm, monkeypatch):
    """The rollout's logprob and KL passes take --local_rollout_forward_batch_size rows at a time, fewer (whole groups)
    where a chunk's logits (its completions' positions and one more) would pass utils.LOGITS_BUDGET (a 150k vocabulary
    at 512 tokens), with the same values; the reference may read the completions after other prompts; a DeepSpeed
    engine (whose own .config is its settings) holds the model."""
    import types

    _, tok = tiny_lm
    model, vocab = tiny_llama(tok, "sdpa").eval(), len(tok)
    k, prompts, width = 2, 4, 5
    queries = torch.randint(1, vocab, (prompts * k, 3), generator=torch.Generator().manual_seed(1))
    responses = torch.randint(1, vocab, (prompts * k, width), generator=torch.Generator().manual_seed(2))

    def batch(queries):
        seqs, lengths = torch.cat([queries, responses], 1), torch.tensor([5, 2, 4, 1, 5, 3, 5, 4])
        return types.SimpleNamespace(
            lengths=lengths,
            context_length=queries.shape[1],
            query_responses=seqs,
            attention_mask=torch.ones_like(seqs),
            chunk=8,
            group=k,
            sampled=torch.arange(width)[None, :] < lengths[:, None],
        )

    class Engine(torch.nn.Module):  # as deepspeed.DeepSpeedEngine: the model in .module, its settings in .config
        def __init__(self, module):
            super().__init__()
            self.module, self.config = module, {"zero_optimization": {"stage": 3}}

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    rows = []  # the rows each pass's model call holds logits for: one packed row per prompt
    model.register_forward_pre_hook(lambda _, a, kw: rows.append(kw["input_ids"].shape[0] * k), with_kwargs=True)
    a, b = batch(queries), batch(torch.cat([queries, queries[:, :2]], 1))  # the reference reads longer prompts
    whole = utils.rollout_logprobs(model, a, 0.9), utils.rollout_full_kl(model, model, a, 0.9, ref_batch=b)
    assert rows == [8, 8, 8]
    rows.clear()
    monkeypatch.setattr(utils, "LOGITS_BUDGET", 5 * (width + 1) * vocab)  # 5 rows' logits: two groups a pass
    cut = utils.rollout_logprobs(Engine(model), a, 0.9), utils.rollout_full_kl(model, model, a, 0.9, ref_batch=b)
    assert rows == [4] * 2 + [4] * 4  # logprobs, then the KL: the policy's and the reference's, two chunks each
    torch.testing.assert_close(cut, whole)
    monkeypatch.setattr(utils, "LOGITS_BUDGET", 1)  # nothing fits: a group at a time still
    rows.clear()
    utils.rollout_logprobs(model, a, 0.9)
    assert rows == [2] * 4


def test_sample_tokens_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0, -30.0]])
    n = 200_000
    tokens = infra.decode.sample_tokens(logits.expand(n, -1), 0.8, torch.rand(n))[:, 0]
    freq = torch.bincount(tokens, minlength=5).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.8, -1), atol=4e-3, rtol=0)
    assert infra.decode.sample_tokens(logits, 0.0, torch.rand(1)).item() == 0  # greedy
    # the extreme uniforms never pick a token of zero probability
    edges = torch.tensor([[-1000.0, 2.0, 0.0, 1.0, -1000.0]]).expand(2, -1)
    largest = torch.tensor(1.0).nextafter(torch.tensor(0.0))  # torch.rand's largest value
    assert infra.decode.sample_tokens(edges, 1.0, torch.stack([torch.tensor(0.0), largest])).tolist() == [[1], [3]]


def naive_rule(row, seen, temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
    """The sampling rule written out for one row from its definitions, in vLLM's order: {token: probability}"""
    z = [x / repetition_penalty if s and x > 0 else x * repetition_penalty if s else x for x, s in zip(row, seen)]
    if temperature == 0:
        return {z.index(max(z)): 1.0}
    z = [x / temperature for x in z]

    def probs(keep):
        total = sum(math.exp(z[i]) for i in keep)
        return {i: math.exp(z[i]) / total for i in keep}

    keep = set(range(len(z)))
    if min_p > 0:
        p = probs(keep)
        keep = {i for i in keep if p[i] >= min_p * max(p.values())}
    if top_k > 0:
        kth = sorted((z[i] for i in keep), reverse=True)[min(top_k, len(keep)) - 1]
        keep = {i for i in keep if z[i] >= kth}  # (ties with the k-th kept)
    if top_p < 1.0:
        p, above, kept = probs(keep), 0.0, set()
        for i in sorted(keep, key=lambda i: -p[i]):  # a token stays while the likelier ones hold less than top_p
            if above < top_p:
                kept.add(i)
            above += p[i]
        keep = kept
    return probs(keep)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(temperature=0.0, repetition_penalty=1.5),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=0.7, min_p=0.1),
        dict(temperature=0.9, repetition_penalty=1.3),
        dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        dict(temperature=0.5, top_k=3, top_p=0.5, min_p=0.3, repetition_penalty=0.8),
    ],
)
def test_sampling_rule_keeps_the_tokens_a_naive_loop_keeps(settings):
    """utils.sampling_logits against the rule written out per row: the same tokens kept, with the same probabilities
    (ties at the k-th largest logit kept), and a decoder drawing from it"""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    logits[0, :4] = 5.0  # four tied likeliest
    seen = torch.rand(6, 40) < 0.3
    got = torch.softmax(utils.sampling_logits(logits, seen, **settings), -1)
    for row in range(6):
        expected = naive_rule(logits[row].tolist(), seen[row].tolist(), **settings)
        assert set(got[row].nonzero()[:, 0].tolist()) == set(expected)
        torch.testing.assert_close(got[row, sorted(expected)], torch.tensor([expected[i] for i in sorted(expected)]))
    rule = functools.partial(utils.sampling_logits, **settings)
    tokens = infra.decode.sample_tokens(logits, rule, torch.rand(6), seen)[:, 0]
    assert all(got[row, t] > 0 for row, t in enumerate(tokens.tolist()))


def test_sampling_rule_is_transformers_where_their_orders_agree():
    """transformers' own processors (TRL's generation without vLLM): the repetition penalty, temperature, top-k and
    top-p (or min-p) in generate()'s order give the rule's logits; generate() applies min-p after top-p, the rule (as
    vLLM) before, so only with both set do they differ (the test sees it)."""
    from transformers import generation as g

    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 2
    ids = torch.randint(0, 30, (4, 6))  # each row's tokens so far
    seen = torch.zeros(4, 30, dtype=torch.bool).scatter_(1, ids, True)

    def theirs(temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
        processors = [g.RepetitionPenaltyLogitsProcessor(repetition_penalty), g.TemperatureLogitsWarper(temperature)]
        processors += [g.TopKLogitsWarper(top_k)] if top_k else []
        processors += [g.TopPLogitsWarper(top_p)] if top_p < 1 else []
        processors += [g.MinPLogitsWarper(min_p)] if min_p else []
        return g.LogitsProcessorList(processors)(ids, logits.clone())

    for settings in [
        dict(temperature=0.7, top_k=10, top_p=0.8, repetition_penalty=1.3),
        dict(temperature=0.7, top_k=10, min_p=0.1, repetition_penalty=1.3),
    ]:
        torch.testing.assert_close(utils.sampling_logits(logits, seen, **settings), theirs(**settings))
    both = dict(temperature=1.0, top_p=0.6, min_p=0.3)
    differ = (utils.sampling_logits(logits, seen, **both) > -math.inf) != (theirs(**both) > -math.inf)
    assert differ.any()


def test_sample_tokens_never_picks_a_zero_probability_token_at_the_ends():
    """u = 1 (or a float64 u that rounds to 1 in float32) must not run past the last token of positive probability
    to the vocabulary's end, nor u = 0 stop at a first token of zero probability."""
    # zero in float32: exp(-1e4) underflows, exp(-inf) is 0
    logits = torch.tensor([[2.0, 0.0, 1.0, -1e4, -1e4], [0.5, 1.0, -1.0, 3.0, -float("inf")]])
    for u in [1.0, 1 - 1e-12]:  # (1 - 1e-12 rounds to 1.0 in float32)
        uniforms = torch.full((2,), u, dtype=torch.float64)
        for temperature in (1.0, 0.7):
            assert infra.decode.sample_tokens(logits, temperature, uniforms).tolist() == [[2], [3]]
    leading = torch.tensor([[-float("inf"), -1e4, 0.0, 1.0], [-1e4, 2.0, -float("inf"), 0.0]])
    assert infra.decode.sample_tokens(leading, 1.0, torch.zeros(2)).tolist() == [[2], [1]]


def test_generate_stops_once_every_row_has_stopped(tiny_lm):
    """Rows that produce the stop token at different steps: generation runs until the last of them has, and no
    further (one model call per step, a width of that step + 1, short of response_length), and the stop token
    changes none of the tokens sampled until then, in rows that have stopped or not."""
    model, tok = tiny_lm
    length = 10
    prompt = tok("the")["input_ids"]
    uniforms = torch.rand(3, length, generator=torch.Generator().manual_seed(0))
    query, query_mask = infra.data.left_pad([prompt], tok.pad_token_id)
    first = infra.decode.generate(model, query, query_mask, response_length=length, rule=1.0, uniforms=uniforms[:1])
    first = first[0].tolist()
    # rows 1 and 2 go on from row 0's first and second token with its numbers, so they meet its later tokens one and
    # two steps sooner: the stop token below stops the rows at three different steps
    queries, mask = infra.data.left_pad([prompt, prompt + first[:1], prompt + first[:2]], tok.pad_token_id)
    uniforms[1, :-1], uniforms[2, :-2] = uniforms[0, 1:], uniforms[0, 2:]
    calls = []

    def counting(**kwargs):  # the model, counting its forward calls
        calls.append(kwargs["input_ids"].shape[1])
        return model(**kwargs)

    free = infra.decode.generate(counting, queries, mask, response_length=length, rule=1.0, uniforms=uniforms)
    assert len(calls) == length  # the prompts, then one token per step but the last
    free = free.tolist()

    def steps(token):  # the step at which each row first samples `token`
        return [row.index(token) if token in row else length for row in free]

    # a token of row 0's, new at its step 3 or later, that every row samples before the last step
    stop = next((t for k, t in enumerate(first) if k >= 3 and t not in first[:k] and max(steps(t)) < length - 1), None)
    assert stop is not None, free
    stops = steps(stop)
    last = max(stops)
    assert len(set(stops)) == 3 and last < length - 1
    calls.clear()
    out = infra.decode.generate(
        counting, queries, mask, response_length=length, rule=1.0, stop_token_id=stop, uniforms=uniforms
    )
    assert out.shape[1] == last + 1 and len(calls) == last + 1
    assert out.tolist() == [row[: last + 1] for row in free]


def test_reward_fn_loading_and_checks(tmp_path):
    (tmp_path / "rew.py").write_text(
        "def length(prompts, completions):\n    return [len(c) for c in completions]\n"
        "def needs_answer(prompts, completions, answer, scale=1.0):\n    return [scale * a for a in answer]\n"
    )
    fn = infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:length", columns=[])
    assert fn(["p", "q"], ["ab", "c"]) == [2, 1]
    assert infra.rewards.load_reward_fn("sentiment", columns=[]) is infra.rewards.sentiment_reward
    good, bad = infra.rewards.sentiment_reward(["", ""], ["What a wonderful, lovely day!", "This is awful and sad."])
    assert good > 0.5 and bad < -0.5
    assert infra.rewards.check_rewards([1, 2.5, None], 3, "f") == [1.0, 2.5, None]
    assert infra.rewards.check_rewards(torch.tensor([1.0, 2.0]), 2, "f") == [1.0, 2.0]
    for spec in [f"{tmp_path}/nope.py:f", f"{tmp_path}/rew.py:missing", "no_such_module_xyz:f", "sentiments"]:
        with pytest.raises(SystemExit):
            infra.rewards.load_reward_fn(spec, columns=[])
    for scores in [[1.0], [1.0, float("nan")], [1.0, float("inf")], ["a", 1.0], None, "12", [1.0, [2.0]]]:
        with pytest.raises(SystemExit):
            infra.rewards.check_rewards(scores, 2, "f")
    # columns: a function names the ones it needs (checked against the dataset at load), or takes **columns
    with pytest.raises(SystemExit, match="needs the dataset column"):
        infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:needs_answer", columns=["question"])
    fn = infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:needs_answer", columns=["answer", "question"])
    columns = {"answer": [3, 4], "question": ["a", "b"]}
    assert infra.rewards.call_reward_fn(fn, ["p", "q"], ["x", "y"], columns) == [3.0, 4.0]  # question not passed: not named
    accuracy = infra.rewards.load_reward_fn("accuracy", ["answer"])
    assert infra.rewards.call_reward_fn(accuracy, ["", ""], ["7", "8"], columns) == [0, 0]
    with pytest.raises(SystemExit, match=r"needs the dataset column\(s\) \['answer'\]; the dataset has \['question'\]$"):
        infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:needs_answer", columns=["question", "completion_ids"])


def test_a_reward_function_is_called_as_it_can_be_or_refused_at_load(tmp_path):
    """One that takes the completions alone, by name, gets them alone; one that cannot take the call (one positional
    parameter under another name) is refused as it loads, in one line, not at the first batch"""
    (tmp_path / "rew.py").write_text(
        "def alone(completions):\n    return [len(c) for c in completions]\n"
        "def singular(prompt, completion):\n    return [len(c) for c in completion]\n"
        "def texts(samples):\n    return [0.0 for s in samples]\n"
        "def starred(*args):\n    return []\n"
        "def answer_only(*, answer):\n    return answer\n"
    )
    fn = infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:alone", columns=["answer", "completion_ids"])
    assert infra.rewards.call_reward_fn(fn, ["p", "q"], ["ab", "c"], {"answer": [1, 2]}) == [2, 1]
    # by position, a column named as its second parameter is not given twice
    fn = infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:singular", columns=["completion"])
    assert infra.rewards.call_reward_fn(fn, ["p", "q"], ["ab", "c"], {"completion": ["xyz", "w"]}) == [2, 1]
    with pytest.raises(SystemExit, match=r"rew.py:texts' cannot be called as f\(prompts, completions, \*\*columns\)"):
        infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:texts", columns=[])
    for name in ["starred", "answer_only"]:  # (called, they would read no completion)
        with pytest.raises(SystemExit, match="it would get no completions"):
            infra.rewards.load_reward_fn(f"{tmp_path}/rew.py:{name}", columns=["answer"])


REWARD_FORMS = """
import asyncio
def ours(prompts, completions, answer):
    return [f"{p}{c}{a}" for p, c, a in zip(prompts, completions, answer)]
def ours_all(prompts, completions, **columns):
    return [f"{p}{c}{a}" for p, c, a in zip(prompts, completions, columns["answer"])]
def trl(completions, **kwargs):  # TRL's form: every argument by keyword
    return [f"{p}{c}{a}" for p, c, a in zip(kwargs["prompts"], completions, kwargs["answer"])]
def trl_named(completions, answer, **kwargs):
    return [f"{p}{c}{a}" for p, c, a in zip(kwargs["prompts"], completions, answer)]
def only_kwargs(**kwargs):
    return [f"{p}{c}{a}" for p, c, a in zip(kwargs["prompts"], kwargs["completions"], kwargs["answer"])]
def positional(p, c, **columns):  # other names: the first two by position
    return [f"{x}{y}{a}" for x, y, a in zip(p, c, columns["answer"])]
def other_first(samples, completions, answer):
    return [f"{x}{y}{a}" for x, y, a in zip(samples, completions, answer)]
def positional_only(prompts, completions, /, answer):
    return [f"{x}{y}{a}" for x, y, a in zip(prompts, completions, answer)]
async def awaited(prompts, completions, answer):
    await asyncio.sleep(0)
    return [f"{p}{c}{a}" for p, c, a in zip(prompts, completions, answer)]
"""


@pytest.mark.parametrize(
    "name", ["ours", "ours_all", "trl", "trl_named", "only_kwargs", "positional", "other_first", "positional_only", "awaited"]
)
def test_reward_functions_in_every_form_get_the_prompts_completions_and_columns(tmp_path, name):
    """A reward function in our form (prompts and completions first), in TRL's (by keyword: f(completions, **kwargs)),
    or with its first two parameters named otherwise (by position), async or not: each loads against the dataset's
    columns and gets the prompts, the completions and the column it reads."""
    (tmp_path / "forms.py").write_text(REWARD_FORMS)
    fn = infra.rewards.load_reward_fn(f"{tmp_path}/forms.py:{name}", columns=["answer", "completion_ids"])
    columns = {"answer": [1, 2], "completion_ids": [[5], [6, 7]]}
    assert infra.rewards.call_reward_fn(fn, ["p", "q"], ["x", "y"], columns) == ["px1", "qy2"]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("85", 85, 1.0),
        ("The answer is 85.", "85", 1.0),
        ("47 + 38 = 85", 85, 1.0),
        ("85 or maybe 86", 85, 0.0),  # the last number counts
        ("1,234", 1234, 1.0),
        ("-12", -12, 1.0),
        ("85.0", 85, 1.0),
        ("eighty-five", 85, 0.0),
        ("", 85, 0.0),
    ],
)
def test_accuracy_reward_reads_the_last_number(completion, answer, expected):
    assert infra.rewards.accuracy_reward(["q"], [completion], answer=[answer]) == [expected]


def test_scalar_forward_reads_the_score_head(tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        per_token = utils.scalar_forward(rm, ids, torch.ones_like(ids))
        # transformers' own pooled output reads the last token of an unpadded row
        torch.testing.assert_close(per_token[:, -1], rm(input_ids=ids).logits[:, 0])
        # left padding does not change the score of the real tokens
        padded = utils.scalar_forward(rm, torch.tensor([[1, 1, 5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1, 1, 1]]))
    torch.testing.assert_close(padded[:, -1], per_token[:, -1], atol=1e-5, rtol=1e-5)


def reward_model_batch(tok, rows, stop):
    """A rollout-shaped batch built from canonical encodings: (query text, completion text, stopped) rows become
    left-padded queries, then right-padded responses ending with the stop token where stopped."""
    q_ids = [tok(q, add_special_tokens=False)["input_ids"] for q, _, _ in rows]
    r_ids = [tok(c, add_special_tokens=False)["input_ids"] + [stop] * stopped for _, c, stopped in rows]
    queries, query_mask = infra.data.left_pad(q_ids, tok.pad_token_id)
    lengths = torch.tensor([len(r) for r in r_ids])
    width = int(lengths.max())
    responses = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in r_ids])
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return torch.cat([queries, responses], 1), torch.cat([query_mask, response_mask], 1), queries.shape[1], lengths


@pytest.mark.parametrize("stop", ["eos", "."])  # a special stop token, dropped by decoding; an ordinary one, kept
def test_reward_model_with_another_tokenizer_is_read_where_the_same_vocabulary_is(
    stop, tiny_tokenizer_dir, tiny_reward_model_dir
):
    """The decode-and-re-encode path reads the reward model at the same token as reading the policy's tokens
    directly: at the stop token of completions that stopped, at the last token of those cut off. The reward model's
    tokenizer is the policy's plus one token, so the re-encoding path runs while ordinary text keeps its ids."""
    from transformers import AutoModelForSequenceClassification

    tok = infra.models.load_tokenizer(tiny_tokenizer_dir)
    rm_tok = infra.models.load_tokenizer(tiny_tokenizer_dir)
    rm_tok.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    assert not infra.models.same_vocabulary(tok, rm_tok)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    stop_token_id = tok.eos_token_id if stop == "eos" else tok.convert_tokens_to_ids(".")
    rows = [
        ("Tell me about the river", " the function returns a list", True),
        ("x", " of values", False),
        ("Describe the old house", " and then", True),
        ("Explain", " it is the value of", False),
        ("Give advice on my garden", " yes", True),
    ]
    query_responses, mask, context_length, lengths = reward_model_batch(tok, rows, stop_token_id)
    for row, n in zip(query_responses, context_length + lengths):  # canonical: the decoded text re-encodes the same
        ids = [i for i in row[:n].tolist() if i not in (tok.pad_token_id, tok.eos_token_id)]
        assert rm_tok(tok.decode(row[:n], skip_special_tokens=True), add_special_tokens=False)["input_ids"] == ids
    kwargs = dict(
        tokenizer=tok,
        query_responses=query_responses,
        mask=mask,
        context_length=context_length,
        lengths=lengths,
        stop_token_id=stop_token_id,
    )
    with torch.no_grad():
        direct = infra.rewards.rm_scores(rm, rm_tokenizer=None, **kwargs)
        reencoded = infra.rewards.rm_scores(rm, rm_tokenizer=rm_tok, **kwargs)
    torch.testing.assert_close(reencoded, direct, atol=1e-5, rtol=1e-5)

    if stop == "eos":  # a reward model's tokenizer without an EOS token has nothing to end a stopped completion with
        rm_tok.eos_token = None
        with pytest.raises(SystemExit, match="no EOS token"):
            infra.rewards.rm_scores(rm, rm_tokenizer=rm_tok, **kwargs)


def test_load_prompts_from_files_folders_and_chat_messages(tmp_path, tiny_model_dir):
    import datasets

    tok = infra.models.load_tokenizer(tiny_model_dir)
    rows = {
        "prompt": ["the first prompt", "a second, longer prompt about the river"],
        "ref": [" one ", "two\n"],
        "answer": [1, 2],
    }
    datasets.Dataset.from_dict(rows).to_csv(str(tmp_path / "p.csv"))
    (tmp_path / "folder").mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "folder" / "train.parquet"))
    for source in [tmp_path / "p.csv", tmp_path / "folder"]:
        queries, texts, refs, columns = infra.data.load_prompts(str(source), "train", "prompt", tok, 64, reference_field="ref")
        assert texts == rows["prompt"] and refs == ["one", "two"]
        assert columns == {"ref": [" one ", "two\n"], "answer": [1, 2]}  # every column but the prompt, for rewards
        assert queries == [tok(t, add_special_tokens=False)["input_ids"] for t in rows["prompt"]]
    # too long prompts are dropped
    short = len(tok("the first prompt", add_special_tokens=False)["input_ids"])
    _, texts, refs, columns = infra.data.load_prompts(str(tmp_path / "p.csv"), "train", "prompt", tok, max_prompt_length=short)
    assert texts == ["the first prompt"] and refs == [None] and columns["answer"] == [1]  # aligned with what is kept
    # chat messages go through the chat template, with the generation prompt
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    (tmp_path / "chat.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi there"}]}\n')
    queries, texts, _, _ = infra.data.load_prompts(str(tmp_path / "chat.jsonl"), "train", "prompt", tok, max_prompt_length=64)
    assert texts == ["hi there"] and tok.decode(queries[0]) == "<user>hi there<assistant>"
    # a prompt ending with the assistant's words (a prefill): continued, not closed, as TRL renders it
    prefill = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Well, the"}]
    (tmp_path / "prefill.jsonl").write_text(json.dumps({"prompt": prefill}) + "\n")
    queries, _, _, _ = infra.data.load_prompts(str(tmp_path / "prefill.jsonl"), "train", "prompt", tok, max_prompt_length=64)
    assert tok.decode(queries[0]) == "<user>hi there<assistant>Well, the"


def test_same_vocabulary_ignores_an_added_pad_token(tiny_tokenizer_dir, tmp_path):
    from pydoc_data.topics import topics

    from conftest import train_bpe
    from transformers import PreTrainedTokenizerFast

    def make(pad):
        tok = train_bpe("\n".join(topics.values()), 512, ["<|endoftext|>"])
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        if pad:  # as the TL;DR SFT tokenizer: "[PAD]" appended to the vocabulary
            wrapped.add_special_tokens({"pad_token": "[PAD]"})
        return wrapped

    plain, padded = make(False), make(True)
    plain.pad_token = plain.eos_token  # what load_tokenizer does for a tokenizer without one
    assert padded.pad_token_id == len(plain) and infra.models.same_vocabulary(padded, plain)
    other = infra.models.load_tokenizer(tiny_tokenizer_dir)
    assert not infra.models.same_vocabulary(padded, other)  # another vocabulary (and another EOS id)
    shifted = make(False)
    shifted.add_special_tokens({"additional_special_tokens": ["<sep>"]})
    shifted.pad_token = shifted.eos_token
    assert not infra.models.same_vocabulary(shifted, plain)  # an extra token that is not padding


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_factor_is_transformers_schedule_of_its_name(kind, warmup):
    """utils.lr_factor at each update against transformers' scheduler of the same name (a step an update), warmup and
    min_lr_rate included; the default, linear without warmup, is the seed's 1 - step / total to the last bit."""
    from transformers import get_scheduler

    total = 11
    extra = {"min_lr_rate": 0.1} if kind == "cosine_with_min_lr" else {}
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    theirs = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=extra)
    ours = [utils.lr_factor(kind, step, total, warmup, **extra) for step in range(total)]
    assert ours == pytest.approx([theirs.lr_lambdas[0](step) for step in range(total)], rel=1e-12, abs=1e-15)
    if kind == "linear" and warmup == 0:
        assert ours == [1.0 - (update - 1.0) / total for update in range(1, total + 1)]


def test_decay_groups_spare_what_transformers_spares():
    """AdamW's weight decay on the weights transformers' Trainer decays (not biases, LayerNorms, RMSNorms), for a
    GPT-NeoX (LayerNorm, biases) and a Llama (RMSNorm) model, and only their trainable weights"""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer

    small = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=50)
    for model in [GPTNeoXForCausalLM(GPTNeoXConfig(**small)), LlamaForCausalLM(LlamaConfig(**small))]:
        model.get_input_embeddings().weight.requires_grad_(False)
        decay, rest = utils.decay_groups(model, 0.1)
        assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
        names = {id(p): n for n, p in model.named_parameters()}
        expected = set(Trainer.get_decay_parameter_names(None, model))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert {names[id(p)] for p in decay["params"]} == expected & trainable
        assert {names[id(p)] for p in rest["params"]} == trainable - expected
        assert rest["params"] and decay["params"]


def test_the_reference_sync_is_trls_mixup():
    """utils.sync_reference against alpha p + (1 - alpha) ref per weight, and TRL's own SyncRefModelCallback where TRL
    imports"""
    torch.manual_seed(3)
    policy, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in ref.parameters()]
    utils.sync_reference(ref, policy, 0.6)
    for r, b, p in zip(ref.parameters(), before, policy.parameters()):
        torch.testing.assert_close(r, 0.6 * p + 0.4 * b)
    try:
        from trl.trainer.callbacks import SyncRefModelCallback
    except ImportError:
        return
    theirs = torch.nn.Linear(4, 3)
    theirs.load_state_dict(dict(zip(["weight", "bias"], before)))
    SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    for r, t in zip(ref.parameters(), theirs.parameters()):
        torch.testing.assert_close(r, t, rtol=0, atol=1e-7)


def test_each_sources_reward_stats_are_over_what_it_scored():
    """rewards/<name>/mean and /std over the completions a source scored (NaN: not judged); one that scored none in
    the update has neither (not a mean of 0); objective/scores is NaN when no completion was scored (TRL's nanmean)"""
    from types import SimpleNamespace

    from infra.outputs import reward_stats

    nan = float("nan")
    per_source = torch.tensor([[1.0, nan, 3.0, nan], [nan, nan, nan, nan]])  # (sources, completions)
    sources = [{"name": "judge"}, {"name": "never"}]
    scores, scored = torch.tensor([1.0, 0.0, 3.0, 0.0]), torch.tensor([True, False, True, False])
    same = SimpleNamespace(reduce=lambda tensor, reduction: tensor)  # (one process)
    stats = reward_stats(same, per_source, sources, scores, scored)
    assert stats["rewards/judge/mean"] == 2.0 and stats["rewards/judge/std"] == pytest.approx(2**0.5)  # (unbiased)
    one = reward_stats(same, per_source[:, :2], sources, scores[:2], scored[:2])  # one value: TRL's nanstd is NaN
    assert one["rewards/judge/mean"] == 1.0 and math.isnan(one["rewards/judge/std"])
    assert not any(key.startswith("rewards/never/") for key in stats)
    assert stats["objective/scores"] == 2.0 and stats["objective/unscored"] == 2
    none = reward_stats(same, per_source, sources, scores, torch.zeros(4, dtype=torch.bool))  # nothing scored
    assert math.isnan(none["objective/scores"]) and math.isnan(none["reward"]) and none["objective/unscored"] == 4
