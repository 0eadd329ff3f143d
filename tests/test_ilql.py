"""ilql.py: trlX's ILQL loss and its gradients against a per-token loop written from the paper and trlX's definition,
the value-shaped sampler against a greedy loop over full forward passes, the target heads' Polyak sync, bad data
refused in one line, and a run whose saved model and heads load."""

import json
import math
import types

import pytest
import torch
from safetensors.torch import load_file
from test_pipeline import write
from test_rloo import check_ok, read_metrics

import ilql


def naive_loss(logits, qs, target, values, actions, mask, rewards, args):
    """ILQL's loss action by action in plain float arithmetic on autograd scalars: for each real action t of each row,
    (Q_i - r - gamma V(t + 1) [0 after the row's last action])^2 per Q head, the expectile of min Q_target - V, CQL's
    logsumexp_a Q_i - Q_i(action), the LM's NLL times exp(beta (min Q_target - V)); each summed and over the actions."""
    rows, steps = actions.shape
    n = max(1, int(mask.sum()))
    loss_q = loss_v = loss_cql = loss_awac = 0.0
    for b in range(rows):
        real = [t for t in range(steps) if mask[b, t]]
        for t in real:
            a = int(actions[b, t])
            last = t == max(real)
            v_next = 0.0 if last else values[b, t + 1].detach()
            backup = rewards[b, t] + args.gamma * v_next
            for q in qs:
                loss_q = loss_q + (q[b, t, a] - backup) ** 2
                loss_cql = loss_cql + (torch.logsumexp(q[b, t], 0) - q[b, t, a])
            gap = target[b, t, a] - values[b, t]
            loss_v = loss_v + (args.tau if gap >= 0 else 1 - args.tau) * gap**2
            weight = math.exp(args.beta * float(gap))
            loss_awac = loss_awac + (torch.logsumexp(logits[b, t], 0) - logits[b, t, a]) * weight
    total = loss_q + loss_v + args.cql_scale * loss_cql + args.awac_scale * loss_awac
    return total / n, [x / n for x in (loss_q, loss_v, loss_cql, loss_awac)]


@pytest.mark.parametrize("beta", [0.0, 0.7])
def test_the_loss_and_its_gradients_are_the_per_token_loop(beta):
    torch.manual_seed(0)
    rows, steps, vocab = 3, 5, 7
    args = types.SimpleNamespace(tau=0.7, gamma=0.9, cql_scale=0.1, awac_scale=1.0, beta=beta)
    logits = torch.randn(rows, steps, vocab, requires_grad=True)
    qs = [torch.randn(rows, steps, vocab, requires_grad=True) for _ in range(2)]
    target = torch.randn(rows, steps, vocab)
    values = torch.randn(rows, steps + 1, requires_grad=True)
    actions = torch.randint(vocab, (rows, steps))
    lengths = torch.tensor([5, 3, 1])
    mask = torch.arange(steps)[None] < lengths[:, None]
    rewards = torch.zeros(rows, steps)
    rewards[torch.arange(rows), lengths - 1] = torch.tensor([1.0, -0.5, 2.0])
    loss, terms, *_ = ilql.ilql_loss(logits, qs, target, values, actions, mask, rewards, mask.sum(), args)
    want, want_terms = naive_loss(logits, qs, target, values, actions, mask, rewards, args)
    for got, expected in zip(terms.values(), want_terms):
        assert float(got) == pytest.approx(float(expected), rel=1e-5)
    leaves = [logits, *qs, values]
    grads = torch.autograd.grad(loss, leaves)
    expected = torch.autograd.grad(want, leaves)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def tiny_ilql(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = ilql.ILQLModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir), two_qs=True).eval()
    for q in model.target_q_heads:  # (targets apart from the online heads, so that min and which heads are read count)
        for p in q.parameters():
            p.data.normal_(0, 0.3)
    return model


def test_value_shaped_sampling_is_the_greedy_loop_over_full_forward_passes(tiny_model_dir):
    """--temperature 0: each token the argmax of log_softmax(logits) + gen_beta (min target Q - V) at the last
    position of the whole sequence so far, run in full; the sampler's KV cache through Shaped gives the same tokens"""
    from transformers import AutoTokenizer

    model = tiny_ilql(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = types.SimpleNamespace(temperature=0.0, top_k=0, gen_beta=2.0)
    prompts = [[{"role": "user", "content": "the river is"}], [{"role": "user", "content": "a quiet old house by the sea"}]]
    got = ilql.sample(model, tok, prompts, args, response_length=6)
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p[0]["content"], add_special_tokens=False)["input_ids"]
            out = []
            for _ in range(6):
                o = model.policy(torch.tensor([ids]), output_hidden_states=True)
                h = o.hidden_states[-1][0, -1]
                shaped = o.logits[0, -1].log_softmax(-1) + 2.0 * (
                    torch.minimum(model.target_q_heads[0](h), model.target_q_heads[1](h)) - model.value_head(h)
                )
                token = int(shaped.argmax())
                out.append(token)
                ids.append(token)
                if token == tok.eos_token_id:
                    break
            want.append(tok.decode(out, skip_special_tokens=True).strip())
        plain = ilql.sample(model, tok, prompts, types.SimpleNamespace(temperature=0.0, top_k=0, gen_beta=0.0), 6)
    assert got == want
    assert plain != got  # (the values change the greedy completions here)


def scored_rows(n=24):
    goods = "sunny bright warm kind gentle happy".split()
    return [
        {"prompt": f"Describe day {i}.", "completion": f" It was {goods[i % 6]}.", "reward": (i % 6) / 5}
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "rows, line",
    [
        ([{"prompt": "a", "completion": "b"}], "needs `prompt`, `completion` and `reward` columns"),
        ([{"prompt": "a", "completion": "b", "reward": float("nan")}], "row 0: `reward` must be a finite number, got nan"),
        ([{"prompt": "a", "completion": "b", "reward": "good"}], "row 0: `reward` must be a finite number, got 'good'"),
    ],
)
def test_bad_data_is_refused_in_one_line_before_any_model_loads(rows, line, run, tmp_path, tiny_model_dir):
    path, out = write(tmp_path / "bad.jsonl", rows), tmp_path / "out"
    proc = run(f"ilql.py --model_name_or_path {tiny_model_dir} --dataset_name {path} --output_dir {out}", tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert line in proc.stderr.strip().splitlines()[-1]
    assert not out.exists()


def test_a_run_saves_a_model_plain_transformers_loads_and_heads_whose_targets_follow(run, tmp_path, tiny_model_dir):
    """4 optimiser steps, the targets synced every 2 at alpha 1: the saved targets are the online heads; every 3: they
    are not (the online heads moved on after step 3)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write(tmp_path / "scored.jsonl", scored_rows())
    heads = {}
    for every in (2, 3):
        out = tmp_path / f"every{every}"
        flags = "--total_episodes 32 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --alpha 1"
        command = f"ilql.py --model_name_or_path {tiny_model_dir} --dataset_name {path} {flags}"  # (no held-out set: the
        proc = run(f"{command} --steps_for_target_q_sync {every} --learning_rate 1e-3 --output_dir {out}", tmp_path)
        check_ok(proc)
        assert not (out / "eval.json").exists()  # shipped one is the shipped set's)
        heads[every] = load_file(out / "ilql_heads.safetensors")
        rows = read_metrics(out)
        assert len(rows) == 4 and all(math.isfinite(v) for r in rows for v in r.values())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("update ")]  # (the console's, with the loss)
        assert [f"  loss {r['loss/ilql']:.4g}  " in line for r, line in zip(rows, lines)] == [True] * 4
    AutoModelForCausalLM.from_pretrained(out)  # the plain LM
    model = ilql.load(out)
    tok = AutoTokenizer.from_pretrained(out, padding_side="left")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    prompt = [{"role": "user", "content": scored_rows(1)[0]["prompt"]}]
    assert len(ilql.sample(model, tok, [prompt], ilql.Args(dataset_name=str(path)), 4)) == 1
    names = [k for k in heads[2] if k.startswith("q_heads.")]
    assert names and all(torch.equal(heads[2][k], heads[2]["target_" + k]) for k in names)
    assert not any(torch.equal(heads[3][k], heads[3]["target_" + k]) for k in names)


def test_lora_in_bf16_trains_the_adapters_and_heads_and_its_folder_loads(run, tmp_path, tiny_model_dir):
    """--use_peft --bf16: finite metrics; the folder (adapters, heads) loads with ilql.load, whose LM is the adapted one
    (its logits not the base model's) and whose heads are the saved ones; a held-out set scored by a reward function
    of a file, logged under the function's name"""
    from transformers import AutoModelForCausalLM

    path, out = write(tmp_path / "scored.jsonl", scored_rows()), tmp_path / "out"
    (tmp_path / "score.py").write_text("def brevity(prompts, completions):\n    return [-len(c) for c in completions]\n")
    flags = "--total_episodes 16 --per_device_train_batch_size 4 --learning_rate 1e-3 --use_peft --bf16"
    held_out = f"--eval_dataset_name {path} --eval_reward_fn {tmp_path}/score.py:brevity --response_length 4"
    command = f"ilql.py --model_name_or_path {tiny_model_dir} --dataset_name {path} {held_out} {flags}"
    check_ok(run(f"{command} --output_dir {out}", tmp_path))
    rows, evals = [r for r in read_metrics(out) if "eval/loss/ilql" not in r], json.load(open(out / "eval.json"))
    assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values())
    assert [sorted(k for k in r if k.startswith("eval/rewards/")) for r in evals] == [
        ["eval/rewards/brevity", "eval/rewards/data"]
    ] * 2
    assert all(r["eval/rewards/brevity"] <= 0 for r in evals)
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    model, heads = ilql.load(out), load_file(out / "ilql_heads.safetensors")
    assert torch.equal(model.q_heads[0][2].weight, heads["q_heads.0.2.weight"])
    ids = torch.tensor([[5, 6, 7, 8]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(model.policy(ids).logits, base(ids).logits)


def test_load_reads_as_many_q_heads_as_the_run_trained(run, tmp_path, tiny_model_dir):
    """ilql.load of a --no_two_qs run: one Q head (and its target), each read from the file, none left random; a file
    of other heads is refused"""
    from safetensors.torch import load_file, save_file

    path, out = write(tmp_path / "scored.jsonl", scored_rows()), tmp_path / "out"
    flags = "--total_episodes 16 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --no_two_qs"
    check_ok(run(f"ilql.py --model_name_or_path {tiny_model_dir} --dataset_name {path} {flags} --output_dir {out}", tmp_path))
    model, heads = ilql.load(out), load_file(out / "ilql_heads.safetensors")
    assert len(model.q_heads) == len(model.target_q_heads) == 1
    state = model.state_dict()
    assert heads.keys() == {k for k in state if not k.startswith("policy.")}
    assert all(torch.equal(state[k], heads[k]) for k in heads)
    save_file({**heads, "extra.weight": torch.zeros(1)}, out / "ilql_heads.safetensors")
    with pytest.raises(ValueError, match="does not match ILQL's heads"):
        ilql.load(out)
