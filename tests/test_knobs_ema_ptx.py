"""The EMA copy of the policy (--ema_beta) and the PTX loss (--ptx_coef): the helpers against naive loops, and runs of
rloo.py and ppo.py with a reward that is the same for every completion, so that only the PTX loss moves the policy."""

import copy
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_rloo import check_ok, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["rloo.py", "ppo.py", "grpo.py", "rloo_tldr.py", "ppo_tldr.py"]
sys.path.insert(0, REPO)

from infra.data import Shuffled, lm_loss, load_ptx, ptx_batch  # noqa: E402

TEXTS = [
    "The river runs past the old mill and into the sea.",
    "A quiet morning in the garden, with rain on the leaves.",
    "The city at night is full of lights and distant music.",
    "My dog likes to sleep by the fire in the winter.",
]


def test_ema_update_matches_a_naive_loop():
    """The scripts' EMA: torch's AveragedModel with its EMA average, started with one update that copies the weights,
    then one update after each optimiser step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)  # frozen: it never moves, and neither does its average
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    beta, snapshots = 0.7, []
    ema = AveragedModel(model, device="cpu", multi_avg_fn=get_ema_multi_avg_fn(beta))
    ema.update_parameters(model)
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))  # as an optimiser step would
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ema.update_parameters(model)
    averaged = dict(ema.module.named_parameters())
    for name in init:
        for i in range(init[name].numel()):
            expected = init[name].flatten()[i].item()
            for snap in snapshots:
                expected = beta * expected + (1 - beta) * snap[name].flatten()[i].item()
            assert averaged[name].flatten()[i].item() == pytest.approx(expected, abs=1e-6)
    # beta 0 is the weights themselves
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.0))
    ema.update_parameters(model)
    with torch.no_grad():
        model[0].weight.mul_(3)
    ema.update_parameters(model)
    assert torch.equal(ema.module[0].weight, model[0].weight)


def test_lm_loss_matches_a_naive_loop():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    total, count = 0.0, 0
    for r in range(3):
        for t in range(4):
            if mask[r, t + 1]:
                total -= torch.log_softmax(logits[r, t].double(), -1)[ids[r, t + 1]].item()
                count += 1
    loss = lm_loss(logits, ids, mask)
    assert loss.item() == pytest.approx(total / count, abs=1e-5)
    loss.backward()
    assert logits.grad[1, 3:].abs().sum() == 0  # nothing from padding


def fake_accelerator(rank, world):
    return SimpleNamespace(
        process_index=rank, num_processes=world, device=torch.device("cpu"), state=SimpleNamespace(deepspeed_plugin=None)
    )


def ptx_args(path, **kwargs):
    args = dict(
        ptx_dataset=str(path),
        ptx_split="train",
        ptx_text_field="text",
        ptx_max_length=None,
        ptx_coef=1.0,
        max_prompt_length=4,
        response_length=3,
        seed=1,
        ema_beta=None,
        use_peft=False,
    )
    return SimpleNamespace(**{**args, **kwargs})


def test_ptx_stream_processes_take_disjoint_slices_and_resume(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*TEXTS, "A", "x y z w"]))
    ptx_texts = load_ptx(ptx_args(path), tokenizer)
    assert all(2 <= len(t) <= 7 for t in ptx_texts)  # cut to max_prompt_length + response_length
    assert len(ptx_texts) == 5  # "A" is one token: dropped
    texts = [tuple(t) for t in ptx_texts]
    streams = [Shuffled(len(ptx_texts), seed=1) for _ in range(2)]
    drawn = []
    for _ in range(2):  # 2 x 2 processes x 2 texts = 8: one pass of 5, then 3 of a reshuffle
        for rank in range(2):
            ids, mask = ptx_batch(ptx_texts, streams[rank], 2, fake_accelerator(rank, 2), pad_token_id=-1)
            for row, m in zip(ids, mask):
                assert m.tolist() == sorted(m.tolist(), reverse=True)  # right-padded
                assert (row == -1).tolist() == (m == 0).tolist()
                drawn.append(tuple(row[m.bool()].tolist()))
    assert sorted(drawn[:5]) == sorted(texts)  # without replacement within a pass
    assert len(set(drawn[5:])) == 3
    # the stream continues exactly from its saved position
    saved = copy.deepcopy(streams[0].state_dict())  # (what accelerate's save_state keeps of a registered object)
    expected = ptx_batch(ptx_texts, streams[0], 3, fake_accelerator(0, 1), pad_token_id=-1)
    fresh = Shuffled(len(ptx_texts), seed=1)
    fresh.load_state_dict(saved)
    again = ptx_batch(ptx_texts, fresh, 3, fake_accelerator(0, 1), pad_token_id=-1)
    assert all(torch.equal(a, b) for a, b in zip(expected, again))


def test_bad_ptx_data_gets_one_line(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    path = tmp_path / "texts.jsonl"
    path.write_text(json.dumps({"body": TEXTS[0]}) + "\n")
    for args, message in [
        (ptx_args(tmp_path / "none.jsonl"), "dataset path"),
        (ptx_args(path), "dataset {!r} (split 'train') has no column 'text'".format(str(path))),
    ]:
        with pytest.raises(SystemExit) as e:
            load_ptx(args, tokenizer)
        assert str(e.value).startswith("error: " + message) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--ema_beta 1.0", "--ema_beta must be in [0, 1)"),
        ("--ema_beta 0.9 --use_peft", "--ema_beta does not work with --use_peft"),
        ("--ptx_coef -1", "--ptx_coef must be at least 0, got -1.0"),
        ("--ptx_coef 1", "--ptx_coef needs --ptx_dataset"),
        ("--ptx_coef 1 --ptx_dataset texts.jsonl --ptx_max_length 1", "--ptx_max_length must be at least 2"),
    ],
)
def test_bad_ema_and_ptx_flags_get_one_line(flags, message, tmp_path):
    """Every script stops with the flag's line right after parsing, before the (missing) model is looked for."""
    from test_knobs_card import RUN_ALL

    (tmp_path / "run_all.py").write_text(RUN_ALL)
    argvs = []
    for script in SCRIPTS:
        model = "--sft_model_path" if "tldr" in script else "--model_name_or_path"
        argv = f"{model} {tmp_path}/missing --gradient_accumulation_steps 1 --output_dir {tmp_path}/{script} {flags}"
        argvs.append([os.path.join(REPO, script), *argv.split()])
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run_all.py"), json.dumps(argvs)], capture_output=True, text=True, cwd=tmp_path
    )
    check_ok(proc)
    exits = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("EXIT ")]
    assert len(exits) == len(SCRIPTS) and all(e.startswith("error: " + message) for e in exits), exits


def write_inputs(tmp_path):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    (tmp_path / "reward.py").write_text("def same(prompts, completions, **columns):\n    return [1.0] * len(completions)\n")
    return texts


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def command(script, model, prompts, out, tmp_path, extra):
    k = "--rloo_k 2" if script == "rloo.py" else ""
    return (
        f"{script} {k} --model_name_or_path {model} --dataset_name {prompts} --output_dir {out} --kl_coef 0"
        f" --reward_fn {tmp_path}/reward.py:same --total_episodes 24 --per_device_train_batch_size 4"
        f" --gradient_accumulation_steps 2 --num_ppo_epochs 2 --response_length 6 --num_sample_generations 0"
        f" --learning_rate 3e-3 {extra}"
    )


def test_ema_and_ptx_end_to_end_with_exact_resume(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """A reward that is the same for every completion and no KL penalty leave RLOO no gradient (every advantage is 0):
    the policy moves only with the PTX loss, the EMA lags it, and a resumed run continues both exactly."""
    from transformers import AutoModelForCausalLM

    texts = write_inputs(tmp_path)
    init = weights(tiny_model_dir)

    # with both: 3 updates of 2 optimiser steps, a checkpoint after each
    out = tmp_path / "on"
    extra = (
        f"--ema_beta 0.5 --ptx_coef 1 --ptx_dataset {texts} --ptx_text_field body --checkpoint_every 1 --keep_checkpoints 3"
    )
    check_ok(run(command("rloo.py", tiny_model_dir, tiny_prompts_file, out, tmp_path, extra), cwd=tmp_path))
    rows = read_metrics(out)
    assert all(r["loss/policy_avg"] == 0 for r in rows)  # every advantage 0: the policy gradient is 0
    ptx = [r["loss/ptx"] for r in rows]
    assert ptx[0] > ptx[1] > ptx[2], ptx  # the policy learns the texts
    final, ema = weights(out), weights(out / "ema")
    assert not all(torch.equal(init[k], v) for k, v in final.items())  # the PTX loss reached the gradient
    AutoModelForCausalLM.from_pretrained(out / "ema")  # a plain transformers model
    moved = sum((final[k] - init[k]).norm() ** 2 for k in init) ** 0.5
    lag = sum((ema[k] - init[k]).norm() ** 2 for k in init) ** 0.5
    behind = sum((final[k] - ema[k]).norm() ** 2 for k in init) ** 0.5
    assert 0 < lag < moved and behind > 0, (lag, moved, behind)
    assert os.path.exists(out / "checkpoint-0000002" / "custom_checkpoint_2.pkl")  # the prompts, the PTX texts, the EMA

    # the same run, stopped after its second checkpoint, then resumed
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "checkpoint-0000003")
    shutil.rmtree(cut / "ema")
    os.remove(cut / "model.safetensors")
    check_ok(run(command("rloo.py", tiny_model_dir, tiny_prompts_file, cut, tmp_path, extra + " --resume"), cwd=tmp_path))
    assert [r["loss/ptx"] for r in read_metrics(cut)] == ptx
    assert all(torch.equal(ema[k], v) for k, v in weights(cut / "ema").items())
    assert all(torch.equal(final[k], v) for k, v in weights(cut).items())


def test_ppo_ema_beta_0_is_the_final_policy_and_ptx_moves_it(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    texts = write_inputs(tmp_path)
    off, on = tmp_path / "off", tmp_path / "on"
    check_ok(run(command("ppo.py", tiny_model_dir, tiny_prompts_file, off, tmp_path, "--total_episodes 8"), cwd=tmp_path))
    assert "loss/ptx" not in read_metrics(off)[0] and not os.path.exists(off / "ema")  # off by default
    extra = f"--ema_beta 0 --ptx_coef 1 --ptx_dataset {texts} --ptx_text_field body --total_episodes 8"
    check_ok(run(command("ppo.py", tiny_model_dir, tiny_prompts_file, on, tmp_path, extra), cwd=tmp_path))
    assert read_metrics(on)[0]["loss/ptx"] > 0
    final, ema = weights(on), weights(on / "ema")
    assert set(final) == set(ema) and all(torch.equal(final[k], ema[k]) for k in final)
    # the PTX texts have a generator of their own, so the runs differ only by the PTX loss's gradient
    assert not all(torch.equal(v, final[k]) for k, v in weights(off).items())
