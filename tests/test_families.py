"""The model families transformers ships, in miniature (random weights, hidden size 32, 2 layers, 64 tokens): on each,
forward_grouped gives the logits and gradients of every row run alone, generate() the tokens of a greedy full forward,
and the reward model and the value head the scalars of every row alone; or check_model stops the run in one line."""

import copy
import functools
import os
import sys

import pytest
import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import infra  # noqa: E402
import utils  # noqa: E402

tf.logging.set_verbosity_error()

VOCAB = 64
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
GPT2_LIKE = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)
WIDE = 64  # a sliding window that covers the packed rows below (at most 4 + 3 x 7 = 25 columns): they may pack

# name -> (config, packs): packs is whether forward_grouped runs a prompt's completions as one packed row (True), runs
# every row in full (False), or check_model refuses the family (None)
FAMILIES = {
    "llama": (lambda: tf.LlamaConfig(**LLAMA_LIKE, **TOKENS), True),
    "qwen2": (lambda: tf.Qwen2Config(**LLAMA_LIKE, **TOKENS), True),
    # Qwen2 with its window on the second layer, shorter than the rows: every row in full
    "qwen2_window": (
        lambda: tf.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **LLAMA_LIKE, **TOKENS),
        False,
    ),
    "qwen2_moe": (
        lambda: tf.Qwen2MoeConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **LLAMA_LIKE,
            **TOKENS,
        ),
        True,
    ),
    "qwen3": (lambda: tf.Qwen3Config(head_dim=8, **LLAMA_LIKE, **TOKENS), True),
    "qwen3_moe": (
        lambda: tf.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **LLAMA_LIKE, **TOKENS
        ),
        True,
    ),
    "mistral": (lambda: tf.MistralConfig(sliding_window=8, **LLAMA_LIKE, **TOKENS), False),  # 8: each row is longer
    "mistral_wide": (lambda: tf.MistralConfig(sliding_window=WIDE, **LLAMA_LIKE, **TOKENS), True),
    "mixtral": (lambda: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **LLAMA_LIKE, **TOKENS), True),
    "gemma": (lambda: tf.GemmaConfig(head_dim=8, **LLAMA_LIKE, **TOKENS), True),
    "gemma2": (lambda: tf.Gemma2Config(head_dim=8, sliding_window=8, **LLAMA_LIKE, **TOKENS), False),
    "gemma2_wide": (lambda: tf.Gemma2Config(head_dim=8, sliding_window=WIDE, **LLAMA_LIKE, **TOKENS), True),
    "gemma3": (lambda: tf.Gemma3TextConfig(head_dim=8, sliding_window=8, **LLAMA_LIKE, **TOKENS), False),
    "gemma3_wide": (lambda: tf.Gemma3TextConfig(head_dim=8, sliding_window=WIDE, **LLAMA_LIKE, **TOKENS), True),
    "phi": (
        lambda: tf.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **TOKENS),
        True,
    ),
    "phi3": (lambda: tf.Phi3Config(**LLAMA_LIKE, **TOKENS), True),
    "gpt2": (lambda: tf.GPT2Config(**GPT2_LIKE, **TOKENS), True),
    "gpt_bigcode": (lambda: tf.GPTBigCodeConfig(**GPT2_LIKE, **TOKENS), True),
    "gpt_neox": (lambda: tf.GPTNeoXConfig(**LLAMA_LIKE, **TOKENS), True),
    # GPT-Neo's local layers: a window of its own (window_size), shorter than the rows
    "gpt_neo": (
        lambda: tf.GPTNeoConfig(
            hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8, **TOKENS
        ),
        False,
    ),
    "gptj": (lambda: tf.GPTJConfig(rotary_dim=4, **GPT2_LIKE, **TOKENS), True),
    "opt": (
        lambda: tf.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32, **TOKENS
        ),
        True,
    ),
    "falcon": (lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **TOKENS), True),
    "falcon_alibi": (
        lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, **TOKENS),
        False,
    ),
    "bloom": (lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **TOKENS), False),
    "mpt": (lambda: tf.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=64, **TOKENS), False),
    "stablelm": (lambda: tf.StableLmConfig(**LLAMA_LIKE, **TOKENS), True),
    "olmo": (lambda: tf.OlmoConfig(**LLAMA_LIKE, **TOKENS), True),
    "olmo2": (lambda: tf.Olmo2Config(**LLAMA_LIKE, **TOKENS), True),
    "olmo3": (lambda: tf.Olmo3Config(sliding_window=WIDE, **LLAMA_LIKE, **TOKENS), True),
    "starcoder2": (lambda: tf.Starcoder2Config(sliding_window=None, **LLAMA_LIKE, **TOKENS), True),
    "smollm3": (lambda: tf.SmolLM3Config(**LLAMA_LIKE, **TOKENS), True),
    "granite": (lambda: tf.GraniteConfig(**LLAMA_LIKE, **TOKENS), True),
    "cohere": (lambda: tf.CohereConfig(**LLAMA_LIKE, **TOKENS), True),
    "deepseek_v3": (
        lambda: tf.DeepseekV3Config(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            **TOKENS,
        ),
        True,
    ),
    "gpt_oss": (
        lambda: tf.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=WIDE, **LLAMA_LIKE, **TOKENS
        ),
        True,
    ),
    # Llama 4's chunked attention (chunks of 8 positions): every row in full
    "llama4_chunked": (
        lambda: tf.Llama4TextConfig(
            intermediate_size_mlp=64, head_dim=8, num_local_experts=2, attention_chunk_size=8, **LLAMA_LIKE, **TOKENS
        ),
        False,
    ),
    # recurrent, state-space and hybrid models: a state carries the context, not a KV cache
    "mamba": (lambda: tf.MambaConfig(hidden_size=32, num_hidden_layers=2, state_size=4, **TOKENS), None),
    "rwkv": (
        lambda: tf.RwkvConfig(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, **TOKENS),
        None,
    ),
    "jamba": (
        lambda: tf.JambaConfig(
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=4,
            mamba_dt_rank=4,
            **LLAMA_LIKE,
            **TOKENS,
        ),
        None,
    ),
    # LFM2's short convolutions (its layer_types say "conv"), without transformers' stateful flag
    "lfm2": (lambda: tf.Lfm2Config(full_attn_idxs=[1], **LLAMA_LIKE, **TOKENS), None),
}
# every family under both attentions that take the packed mask (sdpa a boolean one, eager one added to the scores),
# but those transformers runs with eager alone
EAGER_ONLY = {"gemma2", "gemma2_wide", "gpt_neo", "gptj", "bloom", "mpt", "gpt_oss", "mamba", "rwkv"}
CASES = [(name, attn) for name in FAMILIES for attn in (["eager"] if name in EAGER_ONLY else ["sdpa", "eager"])]
SUPPORTED = [case for case in CASES if FAMILIES[case[0]][1] is not None]
# the families --cuda_graphs refuses: a cache that keeps a window (sliding or chunked layers), ALiBi's biases
GRAPH_REFUSED = {
    *("qwen2_window", "mistral", "mistral_wide", "gemma2", "gemma2_wide", "gemma3", "gemma3_wide", "olmo3", "gpt_oss"),
    *("llama4_chunked", "gpt_neo", "falcon_alibi", "bloom", "mpt"),
}


def vllm_config(name):
    """The family's config with attention heads of 32 (the smallest vLLM's CPU attention takes) and without the shared
    test keys its class does not take (a GPT-NeoX config given num_key_value_heads would have vLLM read 2 kv heads)."""
    import inspect

    config = FAMILIES[name][0]()
    for attr in ("hidden_size", "n_embd", "d_model"):
        if isinstance(config.__dict__.get(attr), int):
            setattr(config, attr, config.__dict__[attr] * 4)
    if isinstance(config.__dict__.get("head_dim"), int):
        config.head_dim = 32
    if name == "deepseek_v3":
        config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim = 16, 16, 32
    if "num_key_value_heads" in config.__dict__:
        if "num_key_value_heads" not in inspect.signature(type(config).__init__).parameters:
            del config.num_key_value_heads
    return config


@functools.cache
def build(name, attn):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(FAMILIES[name][0](), attn_implementation=attn).eval()


def batch(k=3, lengths=(5, 3), width=6):
    """Two prompts (left-padded) with k completions each (right-padded): rows j * k ... j * k + k - 1 share prompt j.
    Returns (queries, query_mask, responses, response_mask, left padding of each row)."""
    g = torch.Generator().manual_seed(0)
    context = max(lengths)
    pads = torch.tensor([context - n for n in lengths])
    qmask = (torch.arange(context)[None] >= pads[:, None]).long()
    queries = torch.randint(3, VOCAB, (len(lengths), context), generator=g) * qmask
    responses = torch.randint(3, VOCAB, (len(lengths) * k, width), generator=g)
    rmask = (torch.arange(width)[None] < torch.tensor([6, 2, 4, 1, 6, 3])[:, None]).long()
    return queries.repeat_interleave(k, 0), qmask.repeat_interleave(k, 0), responses, rmask, pads.repeat_interleave(k)


def loss_and_grads(model, logits, responses, rmask):
    """The responses' logprobs (0 at padding) and the gradients of their sum"""
    logprobs = utils.logprobs_from_logits(logits[:, :-1], responses)
    model.zero_grad()
    (logprobs * rmask).sum().backward()
    return logprobs.detach() * rmask, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name, attn", CASES)
def test_forward_grouped_equals_every_row_alone(name, attn):
    """A prompt's k completions: the logprobs of the responses and the gradients of their sum as from the prompt's rows
    run alone with forward(), the prompt's left padding dropped (a refused family's kept, and no gradients: its state
    changes with padding), packed into one row where the family is known to allow it and run in full otherwise."""
    model, packs = build(name, attn), FAMILIES[name][1]
    queries, qmask, responses, rmask, pads = batch()
    seqs, mask, k = torch.cat([queries, responses], 1), torch.cat([qmask, rmask], 1), 3
    context, width = queries.shape[1], responses.shape[1]
    pads = pads if packs is not None else torch.zeros_like(pads)
    shapes = []  # the input of every call of the model: a packed row per prompt, of 4 + 3 x 7 columns
    hook = model.register_forward_pre_hook(lambda _, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    with torch.set_grad_enabled(packs is not None):
        grouped = utils.forward_grouped(model, seqs, mask, context, k, width + 1)
        hook.remove()
        rows = [slice(j, j + k) for j in range(0, len(seqs), k)]
        alone = torch.cat(
            [utils.forward(model, seqs[r, pads[r.start] :], mask[r, pads[r.start] :]).logits[:, -width - 1 :] for r in rows]
        )
    if packs is None:
        torch.testing.assert_close(grouped, alone, atol=1e-5, rtol=1e-5)
    else:
        (logprobs, grads), (alone_logprobs, alone_grads) = (
            loss_and_grads(model, x, responses, rmask) for x in (grouped, alone)
        )
        torch.testing.assert_close(logprobs, alone_logprobs, atol=1e-5, rtol=1e-5)
        scale = max(g.abs().max() for g in alone_grads)  # within 1e-4 of the largest gradient entry
        for a, b in zip(grads, alone_grads):
            torch.testing.assert_close(a, b, atol=1e-4 * scale, rtol=1e-4)
    assert shapes[0] == ((2, context - 1 + k * (width + 1)) if packs else tuple(seqs.shape))


@pytest.mark.parametrize("name, attn", CASES)
def test_forward_packed_equals_every_row(name, attn):
    """Rows with padding (left and right) run packed without it (sft.py --padding_free): at the wanted
    columns, the logits of the rows run with forward(), and the gradients of their targets' logprobs, for every family
    can_pack() takes at the rows' length; a family it refuses would mix the rows (a window, ALiBi, a state)."""
    model = build(name, attn)
    queries, qmask, responses, rmask, _ = batch()
    seqs, mask = torch.cat([queries, responses], 1), torch.cat([qmask, rmask], 1)
    if not utils.can_pack(model.config, seqs.shape[1]):
        assert FAMILIES[name][1] is not True, name  # (packs at a longer row: at this one too)
        return
    wanted = mask.bool().clone()
    wanted[:, -1] = False  # the positions that predict a next real token
    wanted[:, :-1] &= mask[:, 1:].bool()
    targets = seqs[:, 1:][wanted[:, :-1]]
    results, shapes = [], []
    for packed in (True, False):
        model.zero_grad()
        if packed:
            hooks = [
                model.register_forward_pre_hook(lambda _, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True),
                model.get_output_embeddings().register_forward_pre_hook(lambda _, a: shapes.append(a[0].shape[:-1])),
            ]
            logits = infra.forward_packed(model, seqs, mask, wanted)
            for hook in hooks:
                hook.remove()
        else:
            logits = utils.forward(model, seqs, mask).logits[wanted]
        utils.logprobs_from_logits(logits[None], targets[None]).sum().backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        results.append((logits.detach(), grads))
    (packed, packed_grads), (full, full_grads) = results
    assert packed.shape == (int(wanted.sum()), VOCAB)
    # rows of 11, 9, 9, 7, 6 and 4 tokens, first fit into rows of 11 (7 + 4 share one); the output layer on the wanted only
    assert shapes == [(5, 11), (int(wanted.sum()),)]
    torch.testing.assert_close(packed, full, atol=1e-5, rtol=1e-5)
    scale = max(g.abs().max() for g in full_grads)
    for a, b in zip(packed_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-4 * scale, rtol=1e-4)


@pytest.mark.parametrize("name, attn", SUPPORTED)
def test_generate_equals_a_greedy_full_forward(name, attn):
    """generate() at temperature 0, with its KV cache, with each prompt run once for its 3 rows or not: the tokens
    chosen by running the whole sequence again at every step."""
    model = build(name, attn)
    queries, qmask, *_ = batch()
    seqs, mask = queries, qmask
    with torch.no_grad():
        for _ in range(6):
            token = utils.forward(model, seqs, mask).logits[:, -1].argmax(-1, keepdim=True)
            seqs, mask = torch.cat([seqs, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    for group in (1, 3):
        responses = infra.decode.generate(model, queries, qmask, response_length=6, rule=0, group=group)
        assert responses.tolist() == seqs[:, queries.shape[1] :].tolist()


@pytest.mark.parametrize("name, attn", SUPPORTED)
def test_onednn_layers_give_the_logits_gradients_and_draws_of_the_plain_model(name, attn, monkeypatch):
    """--onednn's layers (infra/onednn.py, every nn.Linear of the family routed): the plain model's logits and
    gradients, and generate()'s draws (its weights packed), on fixed uniform numbers, in float32 and under bfloat16
    autocast (--bf16's sampling, on bfloat16 copies)."""
    plain = copy.deepcopy(build(name, attn))  # (build's model is shared with the other tests)
    for layer in plain.modules():  # (biases made nonzero: a family's are initialised to zero)
        if isinstance(layer, torch.nn.Linear) and layer.bias is not None:
            torch.nn.init.normal_(layer.bias, std=0.5, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(infra.onednn, "ON", False)
    infra.onednn.switch(True)
    model = infra.onednn.route(copy.deepcopy(plain))
    assert any(type(m) is infra.onednn.Linear for m in model.modules())
    queries, qmask, responses, rmask, _ = batch()
    seqs, mask, width = torch.cat([queries, responses], 1), torch.cat([qmask, rmask], 1), responses.shape[1]
    (ours, our_grads), (theirs, their_grads) = (
        loss_and_grads(m, utils.forward(m, seqs, mask).logits[:, -width - 1 :], responses, rmask) for m in (model, plain)
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    scale = max(g.abs().max() for g in their_grads)
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, atol=1e-4 * scale, rtol=1e-4)
    uniforms = torch.rand(len(queries), 16, generator=torch.Generator().manual_seed(0))
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            draws = [infra.decode.generate(m, queries, qmask, 16, 1.0, uniforms=uniforms, group=3) for m in (model, plain)]
        assert draws[0].tolist() == draws[1].tolist(), bf16


@pytest.mark.parametrize("name, attn", SUPPORTED)
def test_graph_decoder_draws_what_generate_draws(name, attn):
    """--cuda_graphs' decoding (GraphDecoder: a static KV cache and 4D masks, run here without the capture, which needs a
    GPU) against generate(): the same tokens from the same uniforms, greedy and at temperature 0.7, with top-k, top-p,
    min-p and a repetition penalty (the tokens present kept in the graph's buffer), in fp32 and under bf16 autocast,
    with left-padded prompts and a stop token, twice on one graph (its cache reset between calls), the least recently
    used graph dropped; or, for a family it refuses (a cache that is not a plain static one: sliding or
    chunked windows), generate()'s tokens from the first call on, with one line saying why."""
    model = build(name, attn)
    queries, qmask, *_ = batch(k=2)
    decoder = infra.graphs.GraphDecoder(capture=False, kept=2)
    uniforms = torch.rand(len(queries), 12, generator=torch.Generator().manual_seed(1))
    # (the third: the graph made by the second; the last under bf16 autocast, as the scripts sample with --bf16)
    truncated = functools.partial(
        utils.sampling_logits, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3
    )
    for rule, bf16 in [(0.0, False), (0.7, False), (0.7, False), (truncated, False), (0.7, True)]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            expected = infra.decode.generate(model, queries, qmask, 12, rule, stop_token_id=5, uniforms=uniforms)
            got = decoder(model, queries, qmask, 12, rule, stop_token_id=5, uniforms=uniforms)
        assert got.tolist() == expected.tolist()
        if name in GRAPH_REFUSED:
            assert decoder.off.startswith("--cuda_graphs: ") and model.config.model_type in decoder.off, decoder.off
            assert "\n" not in decoder.off and not decoder.graphs
            return
        assert decoder.off is None
    # the two most recently used graphs kept (the others gone), each checked when made
    kept = [(dict(key[3][2]), key[4]) for key in decoder.graphs]
    assert kept == [(truncated.keywords, None), ({"temperature": 0.7}, torch.bfloat16)]
    assert all(g.checked for g in decoder.graphs.values())


@pytest.mark.parametrize("name, attn", SUPPORTED)
def test_reward_model_and_value_head_read_every_row_as_alone(name, attn):
    """scalar_forward (reward models, critics) on a sequence-classification model of the family, and the value head on
    the policy's trunk: each row's scalars as from its prompt's rows alone, their left padding dropped. A family with no
    sequence-classification model has PPO's critic on the policy's trunk refused in one line."""
    policy = build(name, attn)
    both = utils.PolicyAndValue(policy, seed=0).eval()
    heads = [lambda s, m: both(s, m, logits_to_keep=1)[1]]
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    try:
        torch.manual_seed(0)
        critic = tf.AutoModelForSequenceClassification.from_config(config).eval()
        heads.append(lambda s, m: utils.scalar_forward(critic, s, m))
        infra.models.check_model(policy, critic=True)
    except ValueError:  # none in transformers (Granite, Cohere, Llama 4)
        with pytest.raises(SystemExit, match=f"^error: {config.model_type} has no sequence-classification model"):
            infra.models.check_model(policy, critic=True)
    queries, qmask, responses, rmask, pads = batch()
    seqs, mask = torch.cat([queries, responses], 1), torch.cat([qmask, rmask], 1)
    with torch.no_grad():
        for values in heads:
            batched = values(seqs, mask)
            for j in (0, 3):  # the rows of each prompt, at their real tokens
                rows, real = slice(j, j + 3), mask[j : j + 3, pads[j] :].bool()
                alone = values(seqs[rows, pads[j] :], mask[rows, pads[j] :])
                torch.testing.assert_close(batched[rows, pads[j] :][real], alone[real])


@pytest.mark.parametrize("name, attn", CASES)
def test_check_model_refuses_recurrent_models_in_one_line(name, attn):
    """Mamba, RWKV, Jamba, LFM2 (whose generate() crashes, and whose packed or padded rows read other tokens' state)
    stop the run with one line that names the family; every other family passes."""
    model = build(name, attn)
    if FAMILIES[name][1] is not None:
        infra.models.check_model(model)
        return
    with pytest.raises(SystemExit) as refused:
        infra.models.check_model(model)
    message = str(refused.value)
    assert message.startswith("error: ") and model.config.model_type in message and "\n" not in message


def test_every_packed_family_is_tested():
    assert utils.PACKED_FAMILIES == {build(*case).config.model_type for case in SUPPORTED if FAMILIES[case[0]][1]}


@pytest.mark.parametrize(
    "config, packs",
    [
        (dict(), True),
        (dict(sliding_window=24), False),  # shorter than the packed row of 25 columns
        (dict(sliding_window=25), True),
        (dict(window_size=8, attention_layers=["global", "local"]), False),  # GPT-Neo's
        (dict(window_size=25, attention_layers=["global", "local"]), True),
        (dict(attention_chunk_size=8), False),  # Llama 4's
        # local layers with no width given
        (dict(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2), False),
        (dict(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2, sliding_window=32), True),
        (dict(alibi=True), False),  # Falcon's
        (dict(attn_config=tf.MptConfig().attn_config), False),  # MPT's, alibi by default
        (dict(position_embedding_type="alibi"), False),
    ],
)
def test_can_pack_reads_every_local_attention(config, packs):
    """Any layer whose attention a packed row would change keeps a family's rows in full: a window or chunk shorter
    than the packed row, in any of the names configs give it, or ALiBi."""
    llama = tf.LlamaConfig(**config)
    llama._attn_implementation = "sdpa"
    assert utils.can_pack(llama, 25) == packs
    assert not utils.can_pack(tf.BloomConfig(), 25) and not utils.can_pack(tf.GPTNeoConfig(window_size=256), 25)


# end to end: a script on a family that runs every row in full, and one it refuses


def save_family(config, tokenizer_dir, path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def test_grpo_trains_gpt_neo_and_rloo_refuses_mamba(run, tmp_path, tiny_tokenizer_dir, tiny_prompts_file):
    """GPT-Neo's local attention (a window shorter than the packed rows) runs every row in full: grpo.py takes two
    updates, the reference agreeing with the policy at the first (KL 0 with --beta). Mamba keeps a recurrent state:
    rloo.py stops with one line naming it, before any update."""
    from test_rloo import VOWELS, check_ok, read_metrics
    from transformers import AutoTokenizer, GPTNeoConfig, MambaConfig

    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    neo = GPTNeoConfig(
        vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4
    )
    neo_dir = save_family(neo, tiny_tokenizer_dir, tmp_path / "neo")
    (tmp_path / "reward.py").write_text(VOWELS)
    common = (
        f"--dataset_name {tiny_prompts_file} --total_episodes 32 --per_device_train_batch_size 8"
        " --gradient_accumulation_steps 2 --response_length 8 --num_sample_generations 0 --no_save_model"
    )
    out = tmp_path / "grpo"
    flags = f"--model_name_or_path {neo_dir} --reward_fn {tmp_path}/reward.py:vowels --beta 0.1 --output_dir {out}"
    check_ok(run(f"grpo.py {common} {flags}", cwd=tmp_path))
    rows = read_metrics(out)
    assert len(rows) == 2 and rows[0]["kl"] == 0.0 and all(torch.isfinite(torch.tensor(r["loss/policy_avg"])) for r in rows)

    mamba_dir = save_family(
        MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2), tiny_tokenizer_dir, tmp_path / "m"
    )
    proc = run(f"rloo.py {common} --model_name_or_path {mamba_dir} --output_dir {tmp_path / 'rloo'}", cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: mamba models keep a recurrent state"), last
    assert not os.path.exists(tmp_path / "rloo" / "metrics.jsonl")


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "raft.py"])
def test_a_mixture_of_experts_trains_with_its_router_loss(script, run, tmp_path, tiny_tokenizer_dir, tiny_prompts_file):
    """TRL's router_aux_loss_coef: a mixture of experts adds its router's load-balancing loss (logged as aux_loss)
    times the coefficient, by default its config's (Mixtral's 0.001), to the loss: with 5 the first update's metrics
    are those with 0, which turns it off (one rollout, one step after it), and the second's differ (the router loss
    moved the weights). A coefficient for a model without a router is refused in one line."""
    from test_rloo import VOWELS, check_ok, read_metrics
    from transformers import AutoTokenizer, MixtralConfig

    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    moe = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, vocab_size=vocab, **LLAMA_LIKE)
    moe_dir = save_family(moe, tiny_tokenizer_dir, tmp_path / "moe")
    (tmp_path / "reward.py").write_text(VOWELS)
    k = "--rloo_k 4" if script == "rloo.py" else "--num_generations 4"
    common = (
        f"{script} {k} --dataset_name {tiny_prompts_file} --total_episodes 32 --per_device_train_batch_size 8"
        f" --gradient_accumulation_steps 2 --response_length 8 --num_sample_generations 0 --no_save_model"
        f" --reward_fn {tmp_path}/reward.py:vowels --learning_rate 3e-2 --temperature 1.0 --model_name_or_path"
    )
    rows = {}
    for name, flags in [("default", ""), ("off", "--router_aux_loss_coef 0"), ("five", "--router_aux_loss_coef 5")]:
        check_ok(run(f"{common} {moe_dir} {flags} --output_dir {tmp_path / name}", cwd=tmp_path))
        rows[name] = [{k: v for k, v in row.items() if k != "eps"} for row in read_metrics(tmp_path / name)]
    assert 1.5 < rows["default"][0]["aux_loss"] < 3 and "aux_loss" not in rows["off"][0]
    # (the update's pass runs every row in full with the router loss, packed without: the ratio differs by rounding)
    assert rows["five"][0].pop("aux_loss") == rows["default"][0]["aux_loss"]
    assert rows["five"][0] == pytest.approx(rows["off"][0], abs=1e-6)
    assert rows["five"][1]["objective/scores"] != rows["off"][1]["objective/scores"]
    dense = save_family(tf.LlamaConfig(vocab_size=vocab, **LLAMA_LIKE), tiny_tokenizer_dir, tmp_path / "dense")
    proc = run(f"{common} {dense} --router_aux_loss_coef 0.1 --output_dir {tmp_path / 'refused'}", cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: --router_aux_loss_coef: LlamaForCausalLM is not"), last


def test_sft_trains_a_mixture_of_experts_with_its_router_loss(run, tmp_path, tiny_tokenizer_dir):
    """sft.py's --router_aux_loss_coef (TRL's SFTConfig): the first update's NLL is the same with 5 and with 0 (its
    two micro-batches read the initial weights), the router loss is logged as aux_loss, and the second update's loss
    differs (the router loss moved the weights); the held-out router loss is eval/aux_loss, before training the
    initial model's on the held-out row (transformers' aux_loss); --padding_free with it refused in one line"""
    from test_rloo import check_ok, read_metrics
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig

    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    moe_dir = save_family(
        MixtralConfig(num_local_experts=4, num_experts_per_tok=2, vocab_size=vocab, **LLAMA_LIKE), tiny_tokenizer_dir,
        tmp_path / "moe",
    )  # fmt: skip
    data, held_out = tmp_path / "sft.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(f'{{"prompt": "Say {i}", "completion": " the number {i} twice"}}\n' for i in range(16)))
    held_out.write_text('{"prompt": "Say 20", "completion": " the number 20 twice"}\n')
    common = (
        f"sft.py --model_name_or_path {moe_dir} --dataset_name {data} --per_device_train_batch_size 4"
        f" --gradient_accumulation_steps 2 --learning_rate 3e-2 --no_save_model --eval_dataset_name {held_out}"
    )
    rows, evals = {}, {}
    for name, coef in [("off", 0), ("five", 5)]:
        check_ok(run(f"{common} --router_aux_loss_coef {coef} --output_dir {tmp_path / name}", cwd=tmp_path))
        rows[name] = [r for r in read_metrics(tmp_path / name) if "eval/loss" not in r]
        evals[name] = [r for r in read_metrics(tmp_path / name) if "eval/loss" in r]
    assert "aux_loss" not in rows["off"][0] and rows["five"][0]["aux_loss"] > 0
    assert rows["five"][0]["loss/sft"] == pytest.approx(rows["off"][0]["loss/sft"], rel=1e-6)
    assert rows["five"][1]["loss/sft"] != pytest.approx(rows["off"][1]["loss/sft"], rel=1e-4)
    assert not any("eval/aux_loss" in r for r in evals["off"]) and evals["five"][0]["episode"] == 0
    model, tok = AutoModelForCausalLM.from_pretrained(moe_dir), AutoTokenizer.from_pretrained(moe_dir)
    ids = tok("Say 20 the number 20 twice" + tok.eos_token, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        aux = model(ids, output_router_logits=True).aux_loss.item()
    assert evals["five"][0]["eval/aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert evals["five"][-1]["eval/aux_loss"] != pytest.approx(aux, rel=1e-3)  # (the trained model's)
    proc = run(f"{common} --router_aux_loss_coef 1 --padding_free --output_dir {tmp_path / 'refused'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --padding_free packs rows")
