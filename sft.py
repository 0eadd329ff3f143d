"""SFT: supervised fine-tuning of a causal language model on demonstrations, the first step of RLHF.

The model learns to write the dataset's completions: the loss is the mean negative log-likelihood of the tokens it
should write (--loss_type dft: each weighted by its probability, detached), over every such token of the batch (TRL's
SFTTrainer): a prompt-completion row's completion, a
conversation's assistant messages with --assistant_only_loss, else every token. The data is in TRL's formats: a
`messages` column of conversations (with an optional `tools` column of the tools' schemas), `prompt` and `completion`
columns (strings or chat messages), or a `text` column. Filtered fine-tuning (rejection sampling, offline): with
--keep, only the best-scored of reward-labelled rows (a `reward` column) are learnt; raft.py does it online.

Paper: Ouyang et al. 2022, "Training language models to follow instructions with human feedback" (its SFT step).

Run (offline, on a CPU: SmolLM2-135M-Instruct learns to call the calculator tool from synthetic traces, the first step
of docs/pipeline.md's tool-use run):
    python sft.py --chat_template examples/environments/chatml_tools.jinja --assistant_only_loss \
        --total_episodes 256 --learning_rate 1e-4
Filtered fine-tuning on the best of four scored completions of each prompt (data/scored.jsonl):
    python sft.py --dataset_name data/scored.jsonl --keep best
With a hub dataset, on GPUs:
    accelerate launch sft.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --dataset_name trl-lib/tldr --eval_dataset_name trl-lib/tldr --eval_split validation
"""

import json
import math
import random
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro

import infra
import utils


@dataclass
class SFTArgs:
    """SFT's own flags."""

    completion_only_loss: Optional[bool] = None
    """learn a prompt-completion row's completion only (TRL's); None: True for prompt-completion data"""
    assistant_only_loss: bool = False
    """learn only the assistant's messages of a conversation (the tools' answers and the user's are context)"""
    padding_free: bool = False
    """run each micro-batch without its padding, packed into rows (TRL's name): the same loss and gradients, less
    compute where rows differ in length; for the models whose attention takes a packed row exactly (refused elsewhere)"""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    """a row over --max_length keeps its first tokens, or its last (TRL's)"""
    router_aux_loss_coef: Optional[float] = None
    """an MoE model's router load-balancing loss times this joins the loss (TRL's; None: the model config's own)"""
    loss_type: Literal["nll", "dft"] = "nll"
    """nll: each learnt token's negative log-likelihood; dft: times its probability, detached (Dynamic Fine-Tuning)"""
    dataset_text_field: str = "text"
    """the column of language-modeling rows (TRL's)"""
    keep: Literal["all", "best", "top", "random"] = "all"
    """filtered fine-tuning on reward-labelled rows (a number `reward` beside `prompt` and `completion`): learn the
    best-scored completion of each prompt, the --keep_rows best-scored rows, or --keep_rows rows at random (a control)"""
    keep_rows: Optional[int] = None
    """how many rows top and random keep (None: as many as best does, one per prompt)"""


@dataclass
class Args(infra.ExampleArgs, infra.PackingArgs, SFTArgs):
    """SFT's flags, then the run's, the model's and the data's (infra/offline.py, packing.py), SFT's defaults below."""

    dataset_name: str = "data/calculator_sft.jsonl"
    """a hub dataset id or a local .jsonl/.json/.parquet/.csv file or folder, in one of TRL's formats: `messages`
    (conversations), `prompt` and `completion`, or `text` (docs/pipeline.md)"""
    learning_rate: float = 2e-5
    """the AdamW learning rate at its peak (TRL's SFT default; --lr_scheduler_type)"""


def learnt_tokens(batch):
    """(rows, width - 1): True where token t + 1 is learnt, predicted by a real token t (never a row's first token)"""
    real = batch.attention_mask.bool()
    return batch.loss_mask[:, 1:] & real[:, 1:] & real[:, :-1]


def nll(model, batch, padding_free=False, router=False):
    """The negative log-likelihood of each token the loss covers (0 elsewhere), those tokens, and whether the model's
    most likely token was each; all (rows, keep): the last `keep` tokens of the left-padded rows, from the first column
    any row learns (a prompt's logits are never computed: TL;DR's prompts are 10x their summaries). router: then also
    an MoE model's router load-balancing loss over the micro-batch's real tokens (TRL's aux_loss)."""
    learnt = learnt_tokens(batch)  # (rows, width - 1): token t + 1 is learnt
    keep = learnt.shape[1] - int(learnt.any(0).float().argmax())
    targets, mask = batch.input_ids[:, -keep:], learnt[:, -keep:]
    if padding_free:  # the logits of the positions that predict a learnt token, from packed rows: (learnt, vocab)
        wanted = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
        wanted[:, -keep - 1 : -1] = mask
        logits = infra.forward_packed(model, batch.input_ids, batch.attention_mask, wanted)
        logprobs = utils.logprobs_from_logits(logits[None], targets[mask][None])[0]
        losses = torch.zeros(mask.shape, device=logits.device).masked_scatter(mask, -logprobs)  # back to (rows, keep)
        return losses, mask, torch.zeros_like(mask).masked_scatter(mask, logits.argmax(-1) == targets[mask])
    # position t predicts token t + 1: the logits of the last keep + 1 positions, less the last
    extra = dict(output_router_logits=True) if router else {}
    out = utils.forward(model, batch.input_ids, batch.attention_mask, logits_to_keep=keep + 1, **extra)
    logits = out.logits[:, :-1]
    logprobs = utils.logprobs_from_logits(logits, targets)
    losses, right = -logprobs.masked_fill(~mask, 0.0), (logits.argmax(-1) == targets) & mask
    return (losses, mask, right, out.aux_loss) if router else (losses, mask, right)


def kept(ds, args):
    """--keep: the training rows filtered fine-tuning learns from, ranked by their `reward` (rejection sampling's
    selection, offline; raft.py samples, ranks and learns online). Ties: the first row."""
    if args.keep == "all":
        return ds
    if not {"prompt", "reward"} <= set(ds.column_names):
        utils.die(f"--keep {args.keep} ranks rows by `reward` within `prompt`: the dataset has {ds.column_names}")
    rewards = ds["reward"]
    for i, r in enumerate(rewards):
        if not infra.finite_number(r):
            utils.die(f"--keep {args.keep}: row {i}'s `reward` must be a finite number, got {r!r}")
    best = {}  # each prompt's best row
    for i, prompt in enumerate(ds["prompt"]):
        key = json.dumps(prompt, sort_keys=True)
        best[key] = i if key not in best or rewards[i] > rewards[best[key]] else best[key]
    if args.keep_rows is not None and args.keep_rows > len(ds):
        utils.die(f"--keep_rows {args.keep_rows}: the dataset has {len(ds)} rows")
    n = args.keep_rows or len(best)  # (at most the rows: a larger --keep_rows is refused above)
    if args.keep == "best":
        rows = best.values()
    elif args.keep == "top":
        rows = sorted(range(len(ds)), key=lambda i: -rewards[i])[:n]
    else:  # the control: as many rows, whatever their scores
        rows = random.Random(args.seed).sample(range(len(ds)), n)
    return ds.select(sorted(rows))


def main(args):
    infra.at_least(args, 0, "router_aux_loss_coef")
    infra.at_least(args, 1, "keep_rows")
    if args.keep_rows is not None and args.keep not in ("top", "random"):
        utils.die(f"--keep_rows counts the rows --keep top or random keeps, not --keep {args.keep}")
    # the tokenizer and every row rendered and checked (with no token to learn within --max_length: left out, as TRL),
    # before anything is written
    rows = infra.read_examples(
        args,
        completion_only_loss=args.completion_only_loss,
        assistant_only_loss=args.assistant_only_loss,
        text_field=args.dataset_text_field,
        keep_end=args.truncation_mode == "keep_end",
        whole=args.packing,
        select=lambda ds: kept(ds, args),  # --keep
    )
    rows = infra.lay_out(rows, args, keep_end=args.truncation_mode == "keep_end")  # --packing, --shuffle_dataset
    run = infra.start(args, examples=len(rows.train))  # processes, seeding, batch sizes (epochs over them), output_dir
    data = infra.load_examples(run, rows)  # their batches
    model, _ = infra.load_model(run)  # (LoRA, gradient checkpointing)
    if args.padding_free and not utils.can_pack(model.config, args.max_length or math.inf):
        utils.die(f"--padding_free: this {model.config.model_type} model's attention cannot run a packed row exactly")
    router = infra.router_coef(model, args.router_aux_loss_coef)  # 0 but for a mixture of experts
    if router and args.padding_free:
        utils.die("--padding_free packs rows, whose router loss would mix them: an MoE's runs padded")
    # --packing's bfd: its examples run apart (TRL's padding-free), where the model can (else padded: the same values)
    bfd = args.packing and args.packing_strategy != "wrapped" and not router
    padding_free = args.padding_free or (bfd and utils.can_pack(model.config, args.max_length))
    # AdamW on the trainable weights (LoRA: the adapters), weight decay on all but the biases and norms (as
    # transformers'); fused: about 4x the default's speed on a CPU
    params = utils.decay_groups(model, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    model, optimizer, _ = infra.prepare(run, model, optimizer)
    accelerator = run.accelerator

    @torch.no_grad()
    def evaluate():  # the held-out loss per token, the next-token accuracy over those tokens (an MoE's router loss
        totals = torch.zeros(5, device=run.device)  # per micro-batch, as TRL's eval aux_loss), on all processes
        for batch in data.held_out():
            with accelerator.autocast():
                losses, mask, right, *aux = nll(model, batch, padding_free, router=router != 0)
            losses = losses * torch.exp(-losses) if args.loss_type == "dft" else losses
            aux = aux[0] if aux else torch.zeros((), device=run.device)
            totals += torch.stack([losses.sum(), right.sum(), mask.sum(), aux, torch.ones_like(aux)]).float()
        if data.held_out_rows is None:
            return None
        loss, right, tokens, aux, batches = run.reduce_sum(totals).tolist()
        out = {"eval/loss": loss / tokens, "eval/mean_token_accuracy": right / tokens}
        return out | ({"eval/aux_loss": aux / batches} if router else {})

    for update in run.updates(evaluate=evaluate):  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr

        model.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for mini_batch in data.update():  # this process's share of each mini-batch, in micro-batches
            # the mean over every learnt token of the mini-batch, on all processes (TRL's num_items_in_batch): a
            # micro-batch's sum over that count, times what accelerate divides by (the micro-batches, the processes)
            tokens = run.reduce_sum(sum(learnt_tokens(b).sum() for b in mini_batch))
            for batch in mini_batch:
                with accelerator.accumulate(model):
                    losses, mask, right, *aux = nll(model, batch, padding_free, router=router != 0)
                    if args.loss_type == "dft":  # DFT (Wu et al. 2025): each token's NLL times its probability
                        losses = losses * torch.exp(-losses).detach()
                    loss = losses.sum() / tokens * args.gradient_accumulation_steps * args.world_size
                    loss = loss + router * aux[0] if aux else loss  # (an MoE's router loss, TRL's aux_loss)
                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(model)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(model)  # --ema_beta

                    stats.add_tokens(mask, **{"loss/sft": losses, "train/mean_token_accuracy": right})
                    stats.add(**{"train/num_tokens": mask.sum()}, **({"aux_loss": aux[0]} if aux else {}))
        model.eval()

        run.log_stats(stats, lr=lr)  # metrics.jsonl, TensorBoard, wandb
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="SFT")  # the model, tokenizer (and its chat template) and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
