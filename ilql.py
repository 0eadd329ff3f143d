"""ILQL: implicit language Q-learning, offline RL from completions labelled with a reward (trlX's ILQL).

No sampling during training: the model learns from a fixed dataset of (prompt, completion, reward) rows. Each
completion token is an action taken in the state of the tokens before it; the reward comes at the completion's last
token (the rewards centred and scaled by their standard deviation over the dataset, as trlX). Heads on the causal
LM's last hidden states give Q(s, a) over the vocabulary (two, --two_qs) and V(s); frozen target copies of the Q heads
follow them by Polyak averaging (--alpha, every --steps_for_target_q_sync optimiser steps). The loss, over every action
of the step:
    Q:    (Q(s, a) - r - gamma V(s'))^2 for each Q head, V(s') 0 after the last action
    V:    the expectile regression of V(s) to min of the target Qs at (s, a): weight tau above V, 1 - tau below
    CQL:  --cql_scale x the cross-entropy of each Q head's values over the vocabulary against the action taken
    AWAC: --awac_scale x the LM's negative log-likelihood of the action, weighted by exp(beta (Q_target - V))
Sampling then shapes the LM by the values (trlX's generate): log_softmax(logits) + --gen_beta (min target Q - V), then
--top_k and --temperature (the script's `Shaped` model and sampling rule; --gen_beta 0: the LM's own top-k sampling).

Paper: Snell et al. 2022, "Offline RL for Natural Language Generation with Implicit Language Q Learning"
(https://arxiv.org/abs/2206.11871); trlX's ILQL (names and defaults).

Run (offline, on a CPU: SmolLM2-135M-Instruct's own completions of the shipped prompts, scored by VADER sentiment):
    python ilql.py
The model saved loads with transformers' AutoModelForCausalLM; the heads are in ilql_heads.safetensors beside it
(`load` below), for sampling as the values shape it (`sample`).
"""

import copy
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import tyro

import infra
import utils


@dataclass
class ILQLArgs:
    """ILQL's own flags (trlX's names and defaults)."""

    tau: float = 0.7
    """the expectile V is regressed to: errors where min Q_target is above V weigh tau, below 1 - tau"""
    gamma: float = 0.99
    """the discount per completion token"""
    cql_scale: float = 0.1
    """the weight of the conservative (CQL) term: each Q head's cross-entropy against the action taken"""
    awac_scale: float = 1.0
    """the weight of the language-model term, each action's NLL weighted by exp(beta (Q_target - V))"""
    alpha: float = 0.001
    """the Polyak rate of the target Q heads: target <- alpha online + (1 - alpha) target"""
    beta: float = 0.0
    """the AWAC temperature in training (0: the plain NLL of the actions)"""
    steps_for_target_q_sync: int = 5
    """move the target Q heads every this many optimiser steps (trlX 0.7's rule, the paper's)"""
    two_qs: bool = True
    """two Q heads (and targets), the target the smaller of the two, against overestimation"""
    gen_beta: float = 1.0
    """how much the values shape sampling: log_softmax(logits) + gen_beta (min Q_target - V) (trlX's gen_kwargs beta)"""
    top_k: int = 20
    """sample among the k likeliest tokens of the shaped logits (0: all)"""
    temperature: float = 1.0
    """the shaped logits divided by this before sampling (0: greedy)"""
    eval_reward_fn: Optional[str] = "sentiment"
    """each evaluation samples a completion of every held-out row's prompt, shaped by the values, and scores it with
    this reward function (`sentiment`, `accuracy`, `file.py:function`; None: the held-out loss only)"""
    response_length: int = 48
    """the most tokens of such a completion"""


@dataclass
class Args(infra.ExampleArgs, ILQLArgs):
    """ILQL's flags, then the run's, the model's and the data's (infra/offline.py), with trlX's defaults below."""

    dataset_name: str = "data/scored.jsonl"
    """reward-labelled completions: `prompt`, `completion` (strings or chat messages) and a number `reward`"""
    eval_dataset_name: Optional[str] = "auto"
    """held-out rows (the same format): the loss on them, and samples of their prompts scored (--eval_reward_fn); auto:
    data/scored_test.jsonl with the shipped --dataset_name, else none"""
    learning_rate: float = 5e-5
    """the AdamW learning rate at its peak (trlX's ILQL default; --lr_scheduler_type)"""
    adam_beta2: float = 0.95
    """AdamW's beta2 (trlX's)"""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (trlX's)"""
    weight_decay: float = 1e-6
    """AdamW's weight decay (trlX's)"""
    max_grad_norm: float = 0.0
    """clip the gradients' norm to this (0: never, as trlX)"""

    def __post_init__(self):
        if self.eval_dataset_name == "auto":  # (another set's rows are not held out from the shipped one)
            shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "scored.jsonl")
            same = self.dataset_name == "data/scored.jsonl" or os.path.realpath(self.dataset_name) == shipped
            self.eval_dataset_name = "data/scored_test.jsonl" if same else None
        super().__post_init__()


def head(hidden, out):
    """trlX's head: Linear(hidden, 2 hidden), ReLU, Linear(2 hidden, out)"""
    return nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, out))


class ILQLModel(utils.PolicyAndValue):
    """The policy (a causal LM) and ILQL's heads on its last hidden states, in one module (one optimiser, one DDP
    wrapper): V (value_head), Q over the vocabulary (q_heads) and their frozen targets (target_q_heads)."""

    heads_file = "ilql_heads.safetensors"  # (saved beside the model by save_policy, infra/models.py)

    def __init__(self, policy, two_qs=True):
        hidden, vocab = policy.config.hidden_size, policy.get_output_embeddings().weight.shape[0]
        super().__init__(policy, value_head=head(hidden, 1))
        self.q_heads = nn.ModuleList(head(hidden, vocab) for _ in range(1 + two_qs))
        self.target_q_heads = copy.deepcopy(self.q_heads).requires_grad_(False)

    def forward(self, input_ids, attention_mask, logits_to_keep):
        """(logits, [Q of each head], min of the target Qs (no gradient), V), at the last logits_to_keep positions:
        (rows, keep, vocab) each but V, (rows, keep)"""
        out = utils.forward(self.policy, input_ids, attention_mask, logits_to_keep=logits_to_keep, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -logits_to_keep:]
        return out.logits, [q(hidden) for q in self.q_heads], self.target(hidden), self.value_head(hidden).squeeze(-1)

    @torch.no_grad()
    def target(self, hidden):
        """the smaller of the target Qs at each position, over the vocabulary (no gradient)"""
        return torch.stack([q(hidden) for q in self.target_q_heads]).amin(0)


def ilql_loss(logits, qs, target, values, actions, mask, rewards, tokens, args):
    """trlX's ILQLConfig.loss. logits, each of qs, target (rows, T, vocab) at the states before each action; values
    (rows, T + 1), the last the state after the last action; actions, mask (real actions), rewards (rows, T); tokens:
    what the sums are divided by (the step's actions). Returns (loss, its terms)."""
    mask = mask.float()
    q = [x.gather(-1, actions[..., None]).squeeze(-1) for x in qs]  # (rows, T) each: Q(s, a)
    q_target = target.gather(-1, actions[..., None]).squeeze(-1)
    v = values[:, :-1]
    # the next state's value, 0 after the last action (an action is followed by another where the next one is real)
    following = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    backup = rewards + args.gamma * (values[:, 1:] * following).detach()
    loss_q = sum(((qi - backup) ** 2 * mask).sum() for qi in q) / tokens
    gap = q_target - v  # the expectile: errors above V weigh tau, below 1 - tau
    loss_v = (torch.where(gap >= 0, args.tau, 1 - args.tau) * gap**2 * mask).sum() / tokens
    # CQL: each Q head's values over the vocabulary as logits, their cross-entropy against the action taken
    loss_cql = sum((-utils.logprobs_from_logits(x, actions) * mask).sum() for x in qs) / tokens
    weight = torch.exp(args.beta * gap).detach()  # AWAC (1 at beta 0)
    loss_awac = (-utils.logprobs_from_logits(logits, actions) * weight * mask).sum() / tokens
    loss = loss_q + loss_v + args.cql_scale * loss_cql + args.awac_scale * loss_awac
    terms = {"loss/q": loss_q, "loss/v": loss_v, "loss/cql": loss_cql, "loss/awac": loss_awac}
    return loss, terms, q, v


def ilql_forward(model, batch, rewards, tokens, args):
    """The micro-batch's loss: the completions' tokens the actions, each state the position before its token; the
    normalised reward at each completion's last token. Returns ilql_loss's answer."""
    width = batch.input_ids.shape[1] - batch.context_length
    logits, qs, target, values = model(batch.input_ids, batch.attention_mask, logits_to_keep=width + 1)
    actions = batch.input_ids[:, batch.context_length :]  # (rows, width)
    mask = batch.logprob_mask  # the completions' tokens a real token precedes
    per_token = torch.zeros(mask.shape, device=mask.device)
    per_token[torch.arange(len(mask), device=mask.device), batch.lengths - 1] = rewards  # at the last action
    return ilql_loss(logits[:, :-1], [q[:, :-1] for q in qs], target[:, :-1], values, actions, mask, per_token, tokens, args)


class Shaped(nn.Module):
    """The policy shaped by ILQL's values, as a model the sampler calls: log_softmax(logits) + beta (min target Q - V)
    at each position it returns (trlX's generate); the script's sampling rule then applies top-k and temperature."""

    def __init__(self, model, beta):
        super().__init__()
        self.model, self.beta = model, beta

    def forward(self, **kwargs):
        out = self.model.policy(**kwargs, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -out.logits.shape[1] :]
        advantage = self.model.target(hidden) - self.model.value_head(hidden)
        out.logits = out.logits.float().log_softmax(-1) + self.beta * advantage.float()
        return out


@torch.no_grad()
def sample(model, tokenizer, prompts, args, response_length=48):
    """Completions of chat prompts (lists of messages) sampled as the values shape them: a list of strings."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    queries = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.policy.device)
    rule = functools.partial(utils.sampling_logits, temperature=args.temperature, top_k=args.top_k)
    tokens = infra.generate(Shaped(model, args.gen_beta), queries["input_ids"], queries["attention_mask"],
                            response_length, rule, stop_token_id=tokenizer.eos_token_id)  # fmt: skip
    return [t.strip() for t in tokenizer.batch_decode(tokens, skip_special_tokens=True)]


def load(folder):
    """A saved run's ILQLModel: the model (AutoModelForCausalLM) and its heads (ilql_heads.safetensors), as many Q
    heads as the run trained (--two_qs), every one of them read from the file"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    heads = load_file(f"{folder}/{ILQLModel.heads_file}")
    model = ILQLModel(AutoModelForCausalLM.from_pretrained(folder), two_qs=any(k.startswith("q_heads.1.") for k in heads))
    missing, unexpected = model.load_state_dict(heads, strict=False)  # (the policy's weights are the model's own)
    if unexpected or [k for k in missing if not k.startswith("policy.")]:
        raise ValueError(f"{folder}/{ILQLModel.heads_file} does not match ILQL's heads: {unexpected or missing}")
    return model.eval()


def main(args):
    if not 0 < args.tau < 1 or args.gamma < 0 or args.cql_scale < 0 or args.awac_scale < 0 or not 0 <= args.alpha <= 1:
        utils.die("--tau must be in (0, 1), --alpha in [0, 1], --gamma, --cql_scale and --awac_scale at least 0")
    infra.at_least(args, 1, "steps_for_target_q_sync", "response_length")
    infra.at_least(args, 0, "top_k", "temperature", "beta", "gen_beta")
    # the tokenizer and every row rendered and checked (a missing column, a reward not a finite number: one line),
    # before anything is written or any model loads
    rows = infra.read_examples(args, labelled=True, block=None, scored=True)
    true_score = infra.load_reward_fn(args.eval_reward_fn, []) if args.eval_reward_fn else None
    rewards = torch.tensor([r["reward"] for r in rows.train], dtype=torch.float64)
    # trlX's normalisation: centred, over the (unbiased) standard deviation of the whole training set
    center, scale = rewards.mean().item(), (rewards.std().item() if len(rewards) > 1 else 0.0) + 2.220446049250313e-16
    run = infra.start(args, examples=len(rows.train))  # processes, seeding, batch sizes (epochs over them), output_dir
    data = infra.load_examples(run, rows)  # their batches, each row's prompt left-padded, its completion after it
    policy, _ = infra.load_model(run)
    model = ILQLModel(policy, args.two_qs).to(run.device)
    # AdamW on the trainable weights (the targets are frozen), weight decay on all but the biases and norms
    params = utils.decay_groups(model, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)
    model, optimizer, _ = infra.prepare(run, model, optimizer)
    accelerator = run.accelerator
    unwrapped = accelerator.unwrap_model(model)
    share = args.gradient_accumulation_steps * args.world_size  # a micro-batch's sums over the step's count, times this

    def normalised(batch):
        return ((batch.reward.double() - center) / scale).float()

    rule = functools.partial(utils.sampling_logits, temperature=args.temperature, top_k=args.top_k)

    @torch.no_grad()
    def evaluate():  # the loss's terms over the held-out rows' actions, and the true score of samples of their prompts
        totals = torch.zeros(9, device=run.device)  # the loss's 5 sums, the actions, the rows' and the samples' scores, rows
        seeded = torch.Generator().manual_seed(args.seed)
        noise = torch.rand(len(data.held_out_rows or []), args.response_length, generator=seeded)
        for batch in data.held_out():
            with accelerator.autocast():
                loss, terms, *_ = ilql_forward(model, batch, normalised(batch), 1.0, args)  # (sums over the actions)
                sampled = torch.zeros((), device=run.device)
                if true_score is not None:  # each row's prompt, its noise the same at every evaluation and on any process
                    queries, mask = batch.input_ids[:, : batch.context_length], batch.attention_mask[:, : batch.context_length]
                    shaped, uniforms = Shaped(unwrapped, args.gen_beta), noise[batch.index.cpu()]
                    completions = infra.generate(shaped, queries, mask, args.response_length, rule,
                                                 stop_token_id=run.tokenizer.eos_token_id, uniforms=uniforms)  # fmt: skip
                    texts = [run.tokenizer.batch_decode(x, skip_special_tokens=True) for x in (queries, completions)]
                    sampled += sum(infra.call_reward_fn(true_score, *texts, {}))
            sums = [loss, *terms.values(), batch.logprob_mask.sum(), batch.reward.sum(), sampled, len(batch.reward)]
            totals += torch.stack([torch.as_tensor(x, device=run.device).float() for x in sums])
        if data.held_out_rows is None:
            return None
        *sums, actions, rewards, sampled, rows = run.reduce_sum(totals).tolist()
        out = {f"eval/{name}": total / actions for name, total in zip(["loss/ilql", *terms], sums)}
        out["eval/rewards/data"] = rewards / rows  # (the held-out completions' own mean score)
        spec = args.eval_reward_fn or ""  # (named as the other scripts name a source: a built-in by its name, a function
        name = getattr(true_score, "__name__", spec) if ":" in spec else spec  # of a file or module by its own)
        return out | ({f"eval/rewards/{name}": sampled / rows} if true_score is not None else {})

    for update in run.updates(evaluate=evaluate):  # from the one after the newest checkpoint with --resume
        # the learning rate's schedule over the updates (--lr_scheduler_type, --warmup_steps: transformers' by name)
        warmup, low = args.warmup_updates, args.min_lr_rate
        lr = args.learning_rate * utils.lr_factor(args.lr_scheduler_type, update - 1, args.num_updates, warmup, low)
        for group in optimizer.param_groups:
            group["lr"] = lr

        model.train(args.gradient_checkpointing)
        stats = utils.Stats()
        for mb, mini_batch in enumerate(data.update()):  # this process's share of each mini-batch, in micro-batches
            # every term a sum over the actions of the mini-batch on all processes, over their count (trlX: the batch's)
            tokens = run.reduce_sum(sum(b.logprob_mask.sum() for b in mini_batch)).clamp(min=1)
            for batch in mini_batch:
                with accelerator.accumulate(model):
                    loss, terms, q, v = ilql_forward(model, batch, normalised(batch), tokens, args)
                    loss = loss * share  # (what accelerate divides by: the step's micro-batches on all processes)
                    run.check_finite(loss)
                    accelerator.backward(loss)
                    run.clip_gradients(model)  # --max_grad_norm; stops on a non-finite gradient
                    optimizer.step()
                    optimizer.zero_grad()
                    run.update_ema(model)  # --ema_beta

                    stats.add(**{"loss/ilql": loss}, **{name: term * share for name, term in terms.items()})
                    stats.add_tokens(batch.logprob_mask, **{"values/v": v, "values/q": q[0]})
            # the target Q heads follow the online ones (Polyak), every steps_for_target_q_sync optimiser steps
            if ((update - 1) * args.num_mini_batches + mb + 1) % args.steps_for_target_q_sync == 0:
                utils.sync_reference(unwrapped.target_q_heads, unwrapped.q_heads, args.alpha)
        model.eval()

        run.log_stats(stats, lr=lr)  # metrics.jsonl, TensorBoard, wandb
        run.evaluate_and_checkpoint(update)  # --eval_every, --checkpoint_every

    run.finish(__doc__, algorithm="ILQL")  # the model, its heads (ilql_heads.safetensors), tokenizer and card; the hub


if __name__ == "__main__":
    main(tyro.cli(Args, args=infra.trl_argv(Args), use_underscores=True))  # (TRL's `--switch True` too)
