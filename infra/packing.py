"""sft.py's examples packed (TRL's packing): rows of --max_length tokens, each holding whole examples (bfd: best fit
decreasing, an example's tokens past --max_length dropped; bfd_split: split into pieces that fit) or a stretch of the
examples' tokens laid end to end (wrapped); and a micro-batch's rows run without their padding (forward_packed). Also
the rows in order among the processes, in as many micro-batches on each (shares)."""

import bisect
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch

from utils import die, packed_mask

from .data import note

BLOCK = 1000  # rows packed together: datasets' map batch, in which TRL packs


@dataclass
class PackingArgs:
    """How the examples are laid out in rows (TRL's names)."""

    packing: bool = False
    """pack the examples into rows of --max_length tokens (TRL's): fewer, fuller rows; bfd keeps each example apart (its
    own positions and attention: the same loss as unpacked), wrapped runs them as one text"""
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd"
    """bfd: whole examples by best fit decreasing, cut to --max_length; bfd_split: longer ones split into pieces; wrapped:
    the tokens end to end, cut every --max_length"""
    eval_packing: Optional[bool] = None
    """pack the held-out examples too (None: as --packing)"""
    shuffle_dataset: bool = False
    """shuffle the examples by --seed before packing, and the rows after (TRL's; the draw reshuffles them anyway)"""


def bins(lengths, size):
    """Best fit decreasing, as TRL's: the items, longest first (ties in order), each into the bin whose room is the
    least that holds it (of those, the one left with that room first), else a new bin; the bins in the order opened,
    each a list of item indices in the order put in."""
    out, rooms, holding = [], [], defaultdict(deque)  # rooms: the sorted distinct rooms > 0 some bin has; room -> bins
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(rooms, lengths[i])
        if at < len(rooms):
            room = rooms[at]
            b = holding[room].popleft()
            if not holding[room]:
                rooms.pop(at)
        else:
            room, b = size, len(out)
            out.append([])
        out[b].append(i)
        left = room - lengths[i]
        if left > 0:
            if not holding[left]:
                bisect.insort(rooms, left)
            holding[left].append(b)
    return out


def pack(rows, size, strategy):
    """Rows {"ids", "mask"} packed BLOCK at a time: bfd and bfd_split give {"docs": [rows]} (their tokens at most
    size), wrapped gives {"ids", "mask"} of size tokens (the block's last shorter)."""
    out = []
    for start in range(0, len(rows), BLOCK):
        block = rows[start : start + BLOCK]
        if strategy == "wrapped":
            ids, mask = [t for r in block for t in r["ids"]], [m for r in block for m in r["mask"]]
            out += [{"ids": ids[i : i + size], "mask": mask[i : i + size]} for i in range(0, len(ids), size)]
            continue
        pieces = [  # bfd: each row's first size tokens; bfd_split: all of them, size at a time
            {"ids": r["ids"][i : i + size], "mask": r["mask"][i : i + size]}
            for r in block
            for i in (range(0, len(r["ids"]), size) if strategy == "bfd_split" else [0])
        ]
        out += [{"docs": [pieces[i] for i in b]} for b in bins([len(p["ids"]) for p in pieces], size)]
    return out


def shuffled(rows, seed):
    """rows in datasets' Dataset.shuffle(seed=seed) order"""
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]


def cut(rows, max_length, keep_end, where, what="token to learn"):
    """Rows cut to max_length tokens from the start (TRL's keep_start; keep_end: from the end); a row left with no token
    the loss covers is dropped, as TRL drops it, with a note (`what` it lacks) of how many."""
    window = slice(None, max_length) if not keep_end or max_length is None else slice(-max_length, None)
    kept = [{"ids": r["ids"][window], "mask": r["mask"][window]} for r in rows]
    kept = [r for r in kept if any(r["mask"][1:])]  # (the first token is predicted by nothing)
    if len(kept) < len(rows):
        lacking = f"have no {what} within --max_length {max_length}"
        note(f"{len(rows) - len(kept)} of {len(rows)} rows in {where} {lacking}: left out")
    if not kept:
        die(f"every row in {where} has no {what} within --max_length {max_length}")
    return kept


def lay_out(rows, args, keep_end=False):
    """read_examples' Rows (read whole with --packing) as sft.py trains on them: packed (--packing; the held-out rows
    with --eval_packing), else cut to --max_length; with --shuffle_dataset shuffled by --seed (before packing too), as
    TRL prepares them."""
    if args.packing and (args.max_length is None or keep_end):
        die("--packing needs a --max_length and cuts examples from the start (not --truncation_mode keep_end)")
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    if eval_packing and not args.packing:
        die("--eval_packing needs --packing (with its --max_length)")
    parts, names = [], (args.dataset_name, args.eval_dataset_name)
    for part, packing, name in zip((rows.train, rows.held_out), (args.packing, eval_packing), names):
        if part is not None and packing:
            part = pack(shuffled(part, args.seed) if args.shuffle_dataset else part, args.max_length, args.packing_strategy)
        elif part is not None and args.packing:  # (read whole for packing)
            part = cut(part, args.max_length, keep_end, f"dataset {name!r} (split {args.eval_split!r})")
        parts.append(shuffled(part, args.seed) if part is not None and args.shuffle_dataset else part)
    return rows._replace(train=parts[0], held_out=parts[1])


def forward_packed(model, input_ids, attention_mask, wanted, hidden=False):
    """utils.forward()'s logits at the columns `wanted` marks ((rows, width) bools, taken row by row), for padded rows run
    without their padding (TRL's padding_free), packed into as few rows of the longest row's length as hold them
    (first fit, longest first; each row's tokens at the positions they have alone, placed from a packed row's end, so
    that a row alone in one is laid out as with left padding), under an attention mask that lets a token see its own
    row's up to itself. Never more columns than the padded rows (fewer where their lengths differ), and the logits of
    the wanted columns only. The same values and gradients as forward() (tested) for every model utils.can_pack() takes at
    the rows' length. Returns (wanted, vocab); hidden: the last hidden states there, (wanted, hidden), for a score head."""
    real = attention_mask.bool()
    lengths = real.sum(1).tolist()
    width, room, spans = max(lengths), [], {}  # spans: row -> (packed row, first column)
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        b = next((b for b, left in enumerate(room) if left >= lengths[r]), len(room))
        room += [width] if b == len(room) else []
        room[b] -= lengths[r]
        spans[r] = (b, room[b])
    device = input_ids.device
    ids = torch.zeros(len(room), width, dtype=input_ids.dtype, device=device)
    places, part = torch.zeros_like(ids), torch.full_like(ids, -1)  # part: each column's row (-1: padding)
    for r, (b, start) in spans.items():
        columns = slice(start, start + lengths[r])
        ids[b, columns], part[b, columns] = input_ids[r][real[r]], r
        places[b, columns] = torch.arange(lengths[r], device=device)
    col = torch.arange(width, device=device)
    sees = (part[:, None, :] == part[:, :, None]) & (col[None, None, :] <= col[None, :, None]) & (part[:, None, :] >= 0)
    attention = packed_mask(getattr(model, "module", model).config, sees)  # (packed rows, 1, width, width)
    # each wanted column's packed row and column, taken row by row; the model's logits of exactly those, in the packed
    # rows' order (a boolean logits_to_keep), put back in the wanted order
    rows, cols = wanted.nonzero(as_tuple=True)
    index = real.long().cumsum(1) - 1  # a real token's place among its row's
    where = torch.tensor([spans[r] for r in range(len(lengths))], device=device)[rows]  # (wanted, 2)
    packed_cols = where[:, 1] + index[rows, cols]
    keep = torch.zeros_like(part, dtype=torch.bool)
    keep[where[:, 0], packed_cols] = True
    if hidden:  # (a sequence-classification model takes no logits_to_keep)
        out = model(input_ids=ids, attention_mask=attention, position_ids=places, output_hidden_states=True)
        logits = out.hidden_states[-1][keep]
    else:
        logits = model(input_ids=ids, attention_mask=attention, position_ids=places, logits_to_keep=keep).logits
    places_in_order = where[:, 0] * width + packed_cols
    return logits[torch.searchsorted(places_in_order.sort().values, places_in_order)]  # (wanted, vocab)


def shares(n, processes, size):
    """n rows in order among the processes, each share in as many micro-batches of at most size rows as the largest
    share's (a forward pass under DDP or ZeRO-3 is a collective: a process with fewer passes would leave the others
    waiting for ever), cut evenly where size would make fewer: per process, its micro-batches' rows (one empty where
    a share has fewer rows than micro-batches)."""
    count, out = math.ceil(math.ceil(n / processes) / size), []
    for mine in (list(range(p, n, processes)) for p in range(processes)):
        ends = range(0, len(mine) + size, size) if math.ceil(len(mine) / size) == count else None
        ends = ends or [len(mine) * i // count for i in range(count + 1)]
        out.append([mine[a:b] for a, b in zip(ends, ends[1:])])
    return out


def check_shares(args, train, held_out, references=None):
    """One line, before any work, where the rows of a pass in order (shares) would leave a process fewer micro-batches
    than the others: the held-out rows; the training rows of dpo.py's and kto.py's --precompute_ref_log_probs and of
    reward.py's --normalize_rewards, or its --normalize_dataset_name rows (references)."""
    from accelerate.utils import get_int_from_env

    processes = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    passes = [(held_out, args.eval_batch_size, "held-out", "--eval_batch_size")]
    if getattr(args, "precompute_ref_log_probs", False):
        size = args.precompute_ref_batch_size or args.eval_batch_size
        passes.append((train, size, "training", "--precompute_ref_batch_size"))
    if getattr(args, "normalize_rewards", False):  # (the reference rows, read apart, or the training rows)
        rows, what = (references, "reference") if args.normalize_dataset_name else (train, "training")
        passes.append((rows, args.eval_batch_size, what, "--eval_batch_size"))
    for rows, size, what, flag in passes:
        if rows and not all(all(share) for share in shares(len(rows), processes, size)):
            die(f"the {len(rows)} {what} rows do not give each of the {processes} processes as many micro-batches of at "
                f"most {flag} {size} as the others: more rows, a larger {flag}, or fewer processes")  # fmt: skip
