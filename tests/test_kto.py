"""kto.py: its loss and reference point against naive loops, its data (TRL's unpaired format, pairs unpaired in TRL's
order, each example's mismatched completion as TRL pairs them, bad rows refused), each completion's logprob against
the row run alone, and the script as a user runs it (it learns; --precompute_ref_log_probs gives the live run's
numbers; --sync_ref_model in dpo.py and kto.py)."""

import math
import types

import pytest
import torch
from test_pipeline import pairs, rows_dataset, tokenizer_of, write
from test_rloo import check_ok, read_metrics

import infra.offline as offline
import kto


def unpaired(n, offset=0):
    """labelled completions of pairs(n): the chosen one desirable, every other rejected one undesirable"""
    rows = []
    for i, p in enumerate(pairs(n, offset)):
        rows.append({"prompt": p["prompt"], "completion": p["chosen"], "label": True})
        if i % 2:
            rows.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False})
    return rows


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_matches_a_naive_loop(loss_type):
    """KTO's equation (7) against z, APO-zero unpaired without it, each weighted by its kind; z the mismatched pairs'
    mean log-ratio, detached, never below 0"""
    torch.manual_seed(0)
    args = types.SimpleNamespace(beta=0.3, loss_type=loss_type, desirable_weight=1.5, undesirable_weight=0.7)
    logratios, desirable = torch.randn(8) * 3, torch.tensor([True, False, True, True, False, False, True, False])
    partner = (torch.randn(8) + 0.5).requires_grad_()
    z = kto.reference_point(partner)
    assert z.item() == pytest.approx(max(0.0, sum(partner.tolist()) / 8)) and not z.requires_grad
    assert kto.reference_point(partner.detach() - 10).item() == 0.0
    got = kto.kto_loss(logratios, z, desirable, args)
    for j in range(8):
        r, s = logratios[j].item(), (lambda x: 1 / (1 + math.exp(-x)))
        if loss_type == "kto":
            want = 1 - s(0.3 * (r - z.item())) if desirable[j] else 1 - s(0.3 * (z.item() - r))
        else:
            want = 1 - s(0.3 * r) if desirable[j] else s(0.3 * r)
        want *= 1.5 if desirable[j] else 0.7
        assert got[j].item() == pytest.approx(want, rel=1e-5, abs=1e-6), j


def test_labelled_rows_unpair_pairs_and_pick_each_partner_as_trl_does(tiny_model_dir):
    """1100 pairs: TRL's unpair_preference_dataset order (per 1000 pairs, the chosen completions then the rejected);
    each row's partner the previous row's completion in blocks of 3 (the first taking its block's last, a short last
    block too), cut with the row to --max_length after its own prompt; a row whose prompt fills it left out first"""
    tok = tokenizer_of(tiny_model_dir)
    data = pairs(1100)
    data[5]["prompt"] = "Tell me about the river " * 30  # (its two rows' prompts fill --max_length)
    rows = offline.labelled_rows(tok, rows_dataset(data), "test", max_length=40, block=3)
    order = [(i, True) for i in range(1000)] + [(i, False) for i in range(1000)]
    order += [(i, True) for i in range(1000, 1100)] + [(i, False) for i in range(1000, 1100)]
    order = [o for o in order if o[0] != 5]
    assert [r["label"] for r in rows] == [o[1] for o in order]
    full = []
    for i, label in order:
        p = data[i]
        head = tok(p["prompt"])["input_ids"]
        whole = tok(p["prompt"] + (p["chosen"] if label else p["rejected"]) + tok.eos_token)["input_ids"]
        assert whole[: len(head)] == head
        full.append((head, whole[len(head) :]))
    for k, r in enumerate(rows):
        start = k - k % 3
        partner = k - 1 if k > start else min(start + 3, len(rows)) - 1
        head, completion = full[k]
        assert r["prompt"] == head and r["completion"] == completion[: 40 - len(head)]
        assert r["partner"] == full[partner][1][: 40 - len(head)]
    assert len(rows) % 3 == 2  # (a short last block)
    assert all(r["partner"] is None for r in offline.labelled_rows(tok, rows_dataset(data[:4]), "t", None, block=None))


def test_each_completion_and_its_partner_get_the_logprob_of_the_row_run_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    tok = tokenizer_of(tiny_model_dir)
    rows = offline.labelled_rows(tok, rows_dataset(unpaired(5)), "test", max_length=None, block=4)
    run = types.SimpleNamespace(
        args=types.SimpleNamespace(seed=1, train_sampling_strategy="random"),
        tokenizer=tok,
        device=torch.device("cpu"),
        accelerator=None,
    )
    batch = offline.Examples(run, rows, None, pairs=True).collate(list(range(len(rows))))
    assert batch.group == 2 and batch.label.tolist() == [r["label"] for r in rows]
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logprobs = kto.completion_logprobs(policy, batch)
        for j, row in enumerate(rows):
            for side, completion in enumerate((row["completion"], row["partner"])):
                ids = torch.tensor([row["prompt"] + completion])
                logits = policy(ids).logits[0].log_softmax(-1)
                want = sum(logits[len(row["prompt"]) + t - 1, completion[t]].item() for t in range(len(completion)))
                assert logprobs[j, side].item() == pytest.approx(want, rel=1e-4, abs=1e-4)


@pytest.fixture
def kto_data(tmp_path):
    return {"unpaired": write(tmp_path / "u.jsonl", unpaired(32)), "test": write(tmp_path / "t.jsonl", unpaired(8, 48))}


def kto_command(model, data, out, extra=""):
    return (
        f"kto.py --model_name_or_path {model} --dataset_name {data['unpaired']} --eval_dataset_name {data['test']}"
        f" --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --output_dir {out} {extra}"
    )


def test_kto_learns_the_labelled_completions(run, tmp_path, tiny_model_dir, kto_data):
    """The held-out desirable completions' implicit reward rises above the undesirable ones'; the KL estimate is logged
    and at least 0; the saved model loads with plain transformers."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    check_ok(
        run(kto_command(tiny_model_dir, kto_data, out, "--num_train_epochs 4 --learning_rate 3e-3 --beta 0.5"), cwd=tmp_path)
    )
    rows = read_metrics(out)
    evals = [r for r in rows if "eval/rewards/chosen" in r]
    margin = [r["eval/rewards/chosen"] - r["eval/rewards/rejected"] for r in evals]
    assert len(evals) == 2 and margin[0] == pytest.approx(0.0, abs=1e-6) and margin[-1] > 0.1, margin
    assert all(r["kl"] >= 0 for r in rows if "kl" in r) and any(r["kl"] > 0 for r in rows if "kl" in r)
    AutoModelForCausalLM.from_pretrained(out)


def test_one_kind_of_example_alone_is_noted(run, tmp_path, tiny_model_dir):
    """Every example desirable: the run trains (TRL's does, with a warning of the imbalance) and says so in one note;
    with that kind's weight 0 it stops in one line, before any work."""
    path = write(tmp_path / "good.jsonl", [r for r in unpaired(16) if r["label"]])
    out = tmp_path / "out"
    proc = run(
        f"kto.py --model_name_or_path {tiny_model_dir} --dataset_name {path} --total_episodes 16 --output_dir {out}", tmp_path
    )
    check_ok(proc)
    assert "note: every training example is desirable: the loss sees one kind" in proc.stdout
    proc = run(f"kto.py --model_name_or_path {tiny_model_dir} --dataset_name {path} --desirable_weight 0", tmp_path)
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: every training example is desirable and --desirable_weight is 0: the loss would be 0"
    )


def test_precomputed_reference_logprobs_give_the_live_runs_numbers(run, tmp_path, tiny_model_dir, kto_data):
    """--precompute_ref_log_probs (the reference freed, the mismatched completions' logprobs kept too) against the live
    reference: the same metrics"""
    rows = {}
    for name, extra in [("live", ""), ("cached", "--precompute_ref_log_probs")]:
        out = tmp_path / name
        args = kto_command(tiny_model_dir, kto_data, out, f"--total_episodes 16 --learning_rate 1e-3 {extra}")
        check_ok(run(args.replace(f"--eval_dataset_name {kto_data['test']}", ""), cwd=tmp_path))
        rows[name] = [{k: v for k, v in r.items() if k != "eps"} for r in read_metrics(out)]
    assert len(rows["live"]) == 2
    for a, b in zip(rows["live"], rows["cached"]):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6) for k in a)


@pytest.mark.parametrize(
    "rows, flags, error",
    [
        ([{"prompt": "a", "completion": " b"}], "", "needs `prompt`, `completion` and `label` columns"),
        ([{"prompt": "a", "completion": " b", "label": "yes"}], "", "row 0: `label` must be true or false"),
        ([{"prompt": "a", "completion": " ", "label": True}], "", "row 0: empty completion"),
        # pairs, unpaired: the file's row and which completion it lacks (TRL's order puts the rejected ones last)
        ([*pairs(2), {"prompt": "c", "chosen": " d"}], "", "row 2: no rejected completion"),
        ([{"prompt": "a", "completion": " b", "label": True}], "--per_device_train_batch_size 1", "at least 2"),
        ([{"prompt": "a", "completion": " b", "label": True}], "--desirable_weight -1", "--desirable_weight"),
    ],
)
def test_bad_data_and_flags_stop_in_one_line_before_any_work(rows, flags, error, run, tmp_path, tiny_model_dir):
    path = write(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    proc = run(f"kto.py --model_name_or_path {tiny_model_dir} --dataset_name {path} --output_dir {out} {flags}", cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and error in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("script", ["dpo.py", "kto.py"])
def test_sync_ref_model_moves_the_reference_to_the_policy(script, run, tmp_path, tiny_model_dir):
    """--sync_ref_model with alpha 1 after every optimiser step: the second update's reference is the policy, so each
    log-ratio there is 0 (DPO's loss log 2, KTO's 1/2 with a KL estimate of 0); without it they are not. A file of 8
    pairs: kto.py trains on it unpaired, an epoch of 16 examples (2 updates of 8); dpo.py on 2 epochs of its pairs"""
    path = write(tmp_path / "p.jsonl", pairs(8))
    rows = {}
    for name, extra in [("synced", "--sync_ref_model --ref_model_mixup_alpha 1 --ref_model_sync_steps 1"), ("plain", "")]:
        out = tmp_path / name
        flags = "--per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 1e-2"
        flags += " --num_train_epochs 2" if script == "dpo.py" else ""
        command = f"{script} --model_name_or_path {tiny_model_dir} --dataset_name {path} {flags} {extra} --output_dir {out}"
        check_ok(run(command + " --no_save_model", cwd=tmp_path))
        assert [r["episode"] for r in read_metrics(out)] == [8, 16]
        rows[name] = read_metrics(out)[1]
    loss = "loss/dpo" if script == "dpo.py" else "loss/kto"
    assert rows["synced"]["rewards/chosen"] == rows["synced"]["rewards/rejected"] == 0.0
    assert rows["synced"][loss] == pytest.approx(math.log(2) if script == "dpo.py" else 0.5, abs=1e-6)
    assert rows["plain"]["rewards/chosen"] != 0.0 and rows["plain"][loss] != rows["synced"][loss]
