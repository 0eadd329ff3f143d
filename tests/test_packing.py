"""sft.py --packing (TRL's bfd, bfd_split and wrapped) against naive loops and TRL's own pack_dataset where TRL is
installed; a run packed by bfd takes the unpacked run's step, wrapped's loss is the token stream's; reward.py
--padding_free takes the padded run's step."""

import random

import pytest
import torch
from safetensors.torch import load_file
from test_pipeline import GOOD, TOPICS, data, small, tokenizer_of, write  # noqa: F401  (data: a fixture)
from test_rloo import check_ok, read_metrics

import infra.offline as offline
from infra import packing


def naive_bins(lengths, size):
    """Best fit decreasing, the slow way: longest first (ties in order); each into the open bin with the least room
    that holds it, of those the one that has had that room longest; else a new bin."""
    bins, room, since, clock = [], [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if 0 < room[b] and lengths[i] <= room[b] < size]
        if fits:
            b = min(fits, key=lambda b: (room[b], since[b]))
        else:
            bins.append([]), room.append(size), since.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
        since[b], clock = clock, clock + 1
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_bins_are_best_fit_decreasing(seed):
    rng = random.Random(seed)
    size = rng.choice([8, 16, 64])
    lengths = [rng.randint(1, size) for _ in range(rng.randint(1, 300))]
    got = packing.bins(lengths, size)
    assert got == naive_bins(lengths, size)
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= size for b in got)


def rows_of(lengths, seed=0):
    rng = random.Random(seed)
    return [{"ids": [rng.randrange(1000) for _ in range(n)], "mask": [rng.random() < 0.7 for _ in range(n)]} for n in lengths]


def test_pack_cuts_splits_and_wraps_a_block_at_a_time(monkeypatch):
    """bfd: each row's first `size` tokens, binned; bfd_split: every token, in pieces of `size` in order; wrapped: the
    rows end to end, cut every `size`; each BLOCK rows (datasets' map batch, TRL's) packed apart"""
    monkeypatch.setattr(packing, "BLOCK", 4)
    rows = rows_of([3, 9, 5, 2, 7, 4, 1])
    bfd = packing.pack(rows, 6, "bfd")
    pieces = [r for b in bfd for r in b["docs"]]
    assert sorted(map(str, pieces)) == sorted(str({k: r[k][:6] for k in r}) for r in rows)
    # the first block's rows in the first bins (3, 6, 5, 2 binned in 6: [6], [5], [3, 2]), then the second block's
    assert [[len(r["ids"]) for r in b["docs"]] for b in bfd] == [[6], [5], [3, 2], [6], [4, 1]]
    split = packing.pack(rows, 6, "bfd_split")
    assert sum(len(r["ids"]) for b in split for r in b["docs"]) == sum(len(r["ids"]) for r in rows)
    assert sorted(len(r["ids"]) for b in split[:4] for r in b["docs"]) == [2, 3, 3, 5, 6]  # 9 -> 6 + 3
    wrapped = packing.pack(rows, 6, "wrapped")
    first = [t for r in rows[:4] for t in r["ids"]]  # 19 tokens: 6, 6, 6, 1
    assert [r["ids"] for r in wrapped[:4]] == [first[i : i + 6] for i in range(0, 19, 6)]
    assert [len(r["ids"]) for r in wrapped[4:]] == [6, 6]  # 7 + 4 + 1
    assert [m for r in wrapped for m in r["mask"]] == [m for r in rows for m in r["mask"]]


def test_shuffled_is_datasets_shuffle():
    import datasets

    rows = [{"i": i} for i in range(50)]
    want = datasets.Dataset.from_dict({"i": list(range(50))}).shuffle(seed=3)["i"]
    assert [r["i"] for r in packing.shuffled(rows, 3)] == want


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_pack_equals_trls_pack_dataset(strategy):
    """2500 rows (three of TRL's map batches) of lengths 1 to 300 into rows of 128: the same rows, the same examples
    in each (seq_lengths), the same learnt tokens"""
    trl = pytest.importorskip("trl")
    import datasets

    rng = random.Random(1)
    rows = rows_of([rng.randint(1, 300) for _ in range(2500)])
    ds = datasets.Dataset.from_dict({"input_ids": [r["ids"] for r in rows], "labels": [r["mask"] for r in rows]})
    theirs = trl.pack_dataset(ds, 128, strategy)
    ours = packing.pack(rows, 128, strategy)
    assert len(ours) == len(theirs)
    for row, their in zip(ours, theirs):
        docs = row.get("docs", [row])
        assert [t for d in docs for t in d["ids"]] == their["input_ids"]
        assert [m for d in docs for m in d["mask"]] == their["labels"]
        if strategy != "wrapped":
            assert [len(d["ids"]) for d in docs] == their["seq_lengths"]


def texts(n):
    return [{"text": f"{TOPICS[i % 8]} is {' '.join(GOOD[: 1 + i % 7])}"} for i in range(n)]


def test_a_run_packed_by_bfd_takes_the_unpacked_runs_step(run, tmp_path, tiny_model_dir):
    """8 texts in bins of 64 tokens, one update over all of them: each example attends to itself at its own positions,
    so the held-out loss (--eval_packing, by default with --packing), the training loss and the weights after the step
    are the unpacked run's"""
    path = write(tmp_path / "t.jsonl", texts(8))
    tok = tokenizer_of(tiny_model_dir)
    rows = offline.sft_rows(tok, offline.read_dataset(path, "train"), "t", None, None, False)
    bins = len(packing.pack(rows, 64, "bfd"))
    assert bins <= 4  # (several examples to a bin)
    outs = {}
    for name, n, extra in [("plain", 8, ""), ("packed", bins, "--packing --max_length 64")]:
        outs[name] = tmp_path / name
        flags = f"--per_device_train_batch_size {n} --gradient_accumulation_steps 1 --total_episodes {n} {extra}"
        check_ok(run(f"sft.py --model_name_or_path {tiny_model_dir} --dataset_name {path} --eval_dataset_name {path}"
                     f" --eval_split train {flags} --learning_rate 1e-2 --output_dir {outs[name]}", cwd=tmp_path))  # fmt: skip
    plain, packed = read_metrics(outs["plain"]), read_metrics(outs["packed"])
    for key in ("eval/loss", "loss/sft", "train/mean_token_accuracy"):
        got, want = [r[key] for r in packed if key in r], [r[key] for r in plain if key in r]
        assert got == pytest.approx(want, rel=1e-5), key
    a, b = load_file(outs["plain"] / "model.safetensors"), load_file(outs["packed"] / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


def test_wrapped_learns_the_token_stream_cut_every_max_length(run, tmp_path, tiny_model_dir):
    """--packing_strategy wrapped: the texts' tokens end to end, cut every 16 tokens, each piece one causal row: the
    first update's loss is the mean NLL of every token but each piece's first, the pieces run alone by transformers"""
    from transformers import AutoModelForCausalLM

    path, out = write(tmp_path / "t.jsonl", texts(6)), tmp_path / "out"
    tok = tokenizer_of(tiny_model_dir)
    stream = [t for row in texts(6) for t in tok(row["text"] + tok.eos_token)["input_ids"]]
    pieces = [stream[i : i + 16] for i in range(0, len(stream), 16)]
    flags = "--packing --packing_strategy wrapped --max_length 16 --gradient_accumulation_steps 1"
    flags += f" --per_device_train_batch_size {len(pieces)}"
    command = f"sft.py --model_name_or_path {tiny_model_dir} --dataset_name {path} {flags} --output_dir {out}"
    check_ok(run(command + f" --total_episodes {len(pieces)} --no_save_model", cwd=tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for piece in pieces:
            logp = model(torch.tensor([piece])).logits[0].double().log_softmax(-1)
            total += -sum(logp[i - 1, piece[i]].item() for i in range(1, len(piece)))
            count += len(piece) - 1
    (row,) = read_metrics(out)
    assert row["loss/sft"] == pytest.approx(total / count, rel=1e-4)


@pytest.mark.parametrize(
    "flags, line",
    [
        ("--packing --truncation_mode keep_end", "--packing needs a --max_length and cuts examples from the start"),
        ("--eval_packing True", "--eval_packing needs --packing (with its --max_length)"),
    ],
)
def test_packing_refuses_what_it_cannot_do_in_one_line(flags, line, run, tmp_path, tiny_model_dir):
    path, out = write(tmp_path / "t.jsonl", texts(4)), tmp_path / "out"
    proc = run(f"sft.py --model_name_or_path {tiny_model_dir} --dataset_name {path} {flags} --output_dir {out}", tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {line}")
    assert not out.exists()


def test_reward_padding_free_takes_the_padded_step(run, tmp_path, tiny_model_dir, data):  # noqa: F811
    """reward.py --padding_free: each completion with its prompt, the rows packed without padding: the same scores,
    losses and weights as the padded pairs with their prompt run once"""
    outs = []
    for extra in ["", " --padding_free"]:
        outs.append(tmp_path / f"r{extra.strip()}")
        check_ok(run(small("reward.py", tiny_model_dir, data, outs[-1], "--total_episodes 16 --learning_rate 1e-3" + extra),
                     cwd=tmp_path))  # fmt: skip
    plain, free = read_metrics(outs[0]), read_metrics(outs[1])
    for a, b in zip(plain, free):
        for key in a:
            if key != "eps":
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    a, b = load_file(outs[0] / "model.safetensors"), load_file(outs[1] / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_shares_give_every_process_as_many_micro_batches(seed):
    """Every row once, each process's in order (round robin), micro-batches of at most size, as many on every process;
    where plain cuts of size already give that, those cuts."""
    rng = random.Random(seed)
    for _ in range(200):
        n, processes, size = rng.randint(1, 40), rng.randint(1, 4), rng.randint(1, 9)
        got = packing.shares(n, processes, size)
        plain = [
            [mine[i : i + size] for i in range(0, len(mine), size)]
            for mine in (list(range(p, n, processes)) for p in range(processes))
        ]
        assert len({len(share) for share in got}) == 1
        for p, share in enumerate(got):
            assert [i for part in share for i in part] == list(range(p, n, processes))
            assert all(len(part) <= size for part in share)
        if len({len(share) for share in plain}) == 1:
            assert got == plain
