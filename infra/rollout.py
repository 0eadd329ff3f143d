"""Sampling and scoring a batch: the Batch, the Sampler (the scripts' own sampler, CUDA graphs or the vLLM engine;
episodes; dynamic sampling's rounds) and the completions of a chunk of rows.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from utils import INVALID_LOGPROB, die, episodes, pad_cat, sampling_logits

from .ahead import Ahead
from .data import cat_rows, completion_ids, draw_prompts, left_pad, select_groups, take_rows
from .decode import bind_rule, generate
from .engine import vllm_engine, vllm_generate, vllm_sampling, vllm_sync
from .environments import episode_stats
from .graphs import decoder
from .hooks import notify
from .models import zero3
from .rewards import get_scores, score_completions


@dataclass
class Prompts:
    """This process's share of an update's prompts (Sampler.draw), and the noise that samples their completions."""

    index: list  # the prompts' dataset rows
    uniforms: torch.Tensor  # (prompts * k, width): each sampled token's uniform number (inverse CDF), every turn's
    max_length: int  # this update's most tokens per completion (--response_length_min draws it)
    seeds: Optional[torch.Tensor]  # --use_vllm: the engine's seeds, one per prompt


@dataclass
class Batch:
    """An update's completions, k per prompt (row j * k + i is prompt j's i-th; a prompt's rows adjacent), truncated
    after the stop token, and every reward source's scores of them; with --environment, k episodes per prompt. Tensors
    are (rows, ...): queries (left-padded), responses and sampled (rows, width), query_responses and attention_mask
    (rows, context_length + width). sampled is True on every token the policy sampled: False on padding, and on an
    episode's observations, so that whatever a script masks with it (the loss, the KL, the entropy, the importance
    weights, the statistics) counts the policy's tokens only."""

    texts: list  # the rows' prompt texts
    index: list  # each row's prompt's place in its dataset (the held-out set's in the evaluation), k times a prompt's
    queries: torch.Tensor
    context_length: int
    responses: torch.Tensor
    lengths: torch.Tensor  # each completion's tokens, the stop token included (an episode's, observations included)
    sampled: torch.Tensor  # True where the policy sampled the token
    query_responses: torch.Tensor
    attention_mask: torch.Tensor
    per_source: torch.Tensor  # (sources, rows): each reward source's reward, NaN where it returned None
    contain_eos: torch.Tensor  # whether it produced the stop token (an episode: whether its last turn did)
    behaviour_logprobs: Optional[torch.Tensor]  # the sampler's: an engine's, or a stale copy's (--max_staleness)
    max_length: int  # this update's most tokens per completion
    stats: dict  # --dynamic_sampling's metrics; --environment's
    chunk: int  # the rows the rollout's forward passes take at a time
    group: int  # the rows that share a prompt in those chunks (utils.forward_grouped)
    conversations: Optional[list] = None  # --environment: each episode's messages, the prompt's first
    columns: Optional[dict] = None  # the rows' other dataset columns {name: values}
    info: Optional[torch.Tensor] = None  # --environment: (turns, cut off, capped, tool calls, failed calls) (rows, 5)
    version: Optional[int] = None  # --max_staleness: the updates the policy had taken when it sampled the batch


class Sampler:
    """Draws each update's prompts (draw), and samples their completions and scores them (sample): k completions of
    each of this process's share of the prompts (the scripts' own sampler, or a vLLM engine with --use_vllm, given the
    policy's weights first), truncated after the stop token, scored by every reward source; with --environment, k
    multi-turn episodes per prompt instead (utils.episodes); with a script's rule for the groups to keep (dynamic
    sampling), in rounds, until every process has enough groups the rule keeps. What a script does with the scores
    (their weighted sum, penalties, scaling) is the script's."""

    def __init__(self, run, policy, rule=sampling_logits):
        self.run, self.args, self.policy, self.k, self.env = run, run.args, policy, run.k, run.env
        args, accelerator = run.args, run.accelerator
        # the script's sampling rule with the run's settings (an engine applies utils.sampling_logits' itself)
        self.rule = bind_rule(rule, temperature=args.temperature, **args.sampling)
        self.model = None  # a copy of the policy that samples instead (--max_staleness's worker)
        self.chunk = args.local_rollout_forward_batch_size
        # a prompt's k completions run the prompt once (generate, forward_grouped) where every chunk holds whole prompts
        self.group = self.k if self.chunk % self.k == 0 else 1
        self.engine = None
        if args.use_vllm:  # a vLLM engine in this process, given the policy's weights before each batch
            self.engine = vllm_engine(accelerator, args, self.unwrapped(), vllm_sampling(self.rule), run.tokenizer)
        self.decode = decoder(run)  # CUDA graphs where they work (--cuda_graphs), else generate()
        # the most tokens an episode's context may hold, its prompt included: the model's positions, and the episode's
        # whole budget (the engine's length, with or without an engine: the same episodes either way)
        limits = [getattr(self.unwrapped().config.get_text_config(), "max_position_embeddings", None)]
        limits += [args.max_prompt_length + args.max_episode_tokens] if self.env is not None else []
        limits += [self.engine.llm_engine.model_config.max_model_len] if self.engine is not None else []
        self.context = min([n for n in limits if n], default=None)
        queries = run.queries + (run.eval_set[0] if run.eval_set is not None else [])
        if self.env is not None and self.context is not None and max(map(len, queries)) >= self.context:
            die(
                f"a prompt is {max(map(len, queries))} tokens as the model reads it (the tools' schemas included), which "
                f"leaves an episode no room in the model's {self.context} positions: lower --max_prompt_length"
            )
        # --max_staleness: the batches of the next updates sampled ahead, in a thread on a copy of the policy
        self.ahead = Ahead(self, args.max_staleness) if getattr(args, "max_staleness", 0) else None
        run.sampler = self

    def unwrapped(self):
        """the policy as a transformers (or peft) model: the one the engine gets, and generate() runs"""
        if self.model is not None:
            return self.model
        model = self.run.accelerator.unwrap_model(self.policy)
        return getattr(model, "policy", model)

    def draw(self, index=None):
        """This process's share of the next global batch of prompts: the next of the dataset's shuffled order (a new
        shuffle each pass), or index, the global batch's dataset rows as the caller picked them (the same list on every
        process); and the noise that samples them (data.draw_prompts), from the run's generator either way."""
        run = self.run
        prompts = Prompts(*draw_prompts(run.data, self.args, self.k, run.accelerator.process_index, index=index))
        notify("draw", prompts.index)
        return prompts

    def rollout(self, draw, keep=None, completions=None):
        """This update's batch: sample(draw(), keep, completions, draw) (a script's draw also draws dynamic sampling's
        later rounds); with --max_staleness N, the one draw() gave N updates ago, sampled since on a copy of the policy
        (infra.ahead; completions may be a function of the update). Episodes' metrics are reduced here, not by a worker."""
        if self.ahead is not None:
            batch = self.ahead.next(draw, keep=keep, completions=completions)
        else:
            completions = completions(self.run.update) if callable(completions) else completions
            batch = self.sample(draw(), keep=keep, completions=completions, draw=draw)
        if self.env is not None:
            batch.stats.update(episode_stats(self.run, batch.info, batch.sampled, batch.lengths))
        return batch

    def sample(self, prompts, keep=None, completions=None, draw=None):
        """The Batch of prompts' completions, without gradients and in the training precision (autocast also covers
        the reward models, which accelerate did not wrap). keep (DAPO's dynamic sampling): a rule, a Batch -> (prompts,)
        bools, the groups worth training on; further prompts are then drawn and sampled in rounds (at most
        --max_sampling_rounds, as many on every process) until every process has its share of groups the rule keeps,
        the first of them kept in order (a batch still short is filled with the others, earliest first); draw: what
        draws those prompts (a script's own pick; default self.draw, the dataset's shuffled order). completions:
        a dataset column whose completions stand in for sampled ones (distill.py's off-policy batches), scored as they
        would be."""
        run = self.run
        if self.engine is not None and completions is None:  # the engine samples with the policy's weights of now
            vllm_sync(self.engine, self.unwrapped())
        with torch.no_grad(), run.accelerator.autocast():
            if keep is not None:
                rows, stats = self.sample_groups(prompts, keep, draw or self.draw)
            else:
                rows, stats = self.sample_rows(prompts, completions), {}
            batch = self.assemble(rows, prompts.max_length, stats)
            if not self.args.vllm_importance_sampling_correction:  # trained on as if the update's policy had sampled
                batch.behaviour_logprobs = None
        notify("batch", self, batch)
        return batch

    def assemble(self, rows, max_length, stats):
        """sample_rows' rows as a Batch"""
        run, lengths = self.run, rows["lengths"]
        width = int(lengths.max())
        responses = rows["responses"][:, :width]
        queries, query_mask = (x.to(run.device) for x in left_pad(rows["ids"], run.tokenizer.pad_token_id))
        real = torch.arange(width, device=run.device)[None, :] < lengths[:, None]
        return Batch(
            texts=rows["texts"],
            index=rows["index"],
            queries=queries,
            context_length=queries.shape[1],
            responses=responses,
            lengths=lengths,
            sampled=rows["policy"][:, :width],
            query_responses=torch.cat([queries, responses], 1),
            attention_mask=torch.cat([query_mask, real.long()], 1),
            per_source=rows["per_source"],
            contain_eos=rows["contain_eos"],
            behaviour_logprobs=rows["engine"][:, :width] if rows["engine"] is not None else None,
            max_length=max_length,
            stats=stats,
            chunk=self.chunk,
            group=self.group,
            conversations=rows["messages"],
            columns=rows["columns"],
            info=rows["info"],
        )

    def sample_rows(self, prompts, completions=None):
        """k completions (or episodes) of each of the prompts, scored: a dict of the rows' prompt token ids, texts,
        dataset rows and columns, responses (rows, width) (with --environment the whole episodes), lengths, every
        source's scores (sources, rows), whether each stopped, the engine's logprobs (or None), which tokens the policy
        sampled (rows, width), and with --environment each episode's (turns, cut off, capped, tool calls, failed calls)
        (rows, 5) and conversation."""
        run, k = self.run, self.k
        idx, uniforms, seeds, max_length = prompts.index, prompts.uniforms, prompts.seeds, prompts.max_length
        ids = [run.queries[i] for i in idx for _ in range(k)]
        texts = [run.texts[i] for i in idx for _ in range(k)]
        columns = {name: [values[i] for i in idx for _ in range(k)] for name, values in run.columns.items()}
        info = messages = None
        if self.env is None:
            queries, query_mask = (x.to(run.device) for x in left_pad(ids, run.tokenizer.pad_token_id))
            if completions is not None:  # the dataset's, cut at this update's most tokens
                seqs = [completion_ids(run.tokenizer, v, completions, run.stop_token_id) for v in columns[completions]]
                seqs = [torch.tensor(s[:max_length] or [run.tokenizer.pad_token_id]) for s in seqs]
                sampled = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=run.tokenizer.pad_token_id)
                sampled, engine = sampled.to(run.device), None
            else:
                sampled, engine = self.complete(queries, query_mask, uniforms, seeds, max_length)
            raw = [run.prompts[i] for i in idx for _ in range(k)]  # (a reward model renders them as it was trained)
            responses, lengths, per_source = self.score(queries, query_mask, sampled, texts, columns, raw)
            policy = torch.arange(responses.shape[1], device=run.device)[None, :] < lengths[:, None]
        else:
            ids, responses, lengths, policy, engine, info = self.play(
                [run.prompts[i] for i in idx],
                rows=[{self.args.prompt_field: run.prompts[i], **{c: v[i] for c, v in run.columns.items()}} for i in idx],
                env_seeds=[int(u * 2**31) for u in uniforms[::k, -1].tolist()],  # from each group's own noise
                uniforms=uniforms,
                seeds=seeds,
                max_length=max_length,
            )
            messages = self.env.messages
            per_source = self.score_episodes(ids, responses, lengths, texts, columns)
        if info is not None:  # an episode stopped if its last turn did
            contain_eos = info[:, 1] == 0
        elif run.stop_token_id is not None:
            contain_eos = (responses == run.stop_token_id).any(1)
        else:  # without a stop token every completion is complete
            contain_eos = torch.ones(len(responses), dtype=torch.bool, device=run.device)
        return dict(
            ids=ids, texts=texts, index=[i for i in idx for _ in range(k)], columns=columns, responses=responses,
            lengths=lengths, per_source=per_source, contain_eos=contain_eos, policy=policy, info=info, messages=messages,
            engine=engine[:, : responses.shape[1]] if engine is not None else None,
        )  # fmt: skip

    def complete(self, queries, query_mask, uniforms, seeds, max_length, k=None, group=None, rule=None, engine=True,
                 room=None):  # fmt: skip
        """the rows' completions (by the run's sampling rule, or rule), and with --use_vllm the engine's logprobs of them;
        room (an episode's turn): each prompt's most tokens, which its context holds (the engine is asked no more; the
        scripts' sampler draws up to max_length, a row's tokens past its room thrown away, positions held at its end)"""
        return sample_completions(
            self.unwrapped(),
            self.engine if engine else None,
            queries,
            query_mask,
            k=k or self.k,
            max_length=max_length,
            rule=self.rule if rule is None else rule,
            stop_token_id=self.run.stop_token_id,
            pad_token_id=self.run.tokenizer.pad_token_id,
            uniforms=uniforms[:, :max_length] if uniforms is not None else None,
            seeds=seeds,
            chunk=self.chunk,
            group=group or self.group,
            synced=zero3(self.run.accelerator),
            decode=self.decode,
            room=room,
            max_position=None if room is None or self.context is None else self.context - 1,
        )

    def play(self, prompts, rows, env_seeds, uniforms, seeds, max_length, k=None, rule=None, engine=True):
        """--environment: k episodes of each prompt (utils.episodes; prompts as the dataset holds them, rows their dataset
        rows, the prompt's column included, as TRL passes them), each environment reset from its prompt's row, its
        random stream seeded by env_seeds (one per prompt: a prompt's k episodes start alike, so that they make a
        group). uniforms (rows, max_turns x response_length): each turn's sampling noise (None: torch's generator);
        seeds: the engine's, one per prompt. An episode's context (prompt and tokens) stays within self.context, the
        model's positions and the engine's length. Returns the rows' prompt token ids, episodes (rows, width), their
        lengths (observations included), which tokens the policy sampled, the engine's logprobs (or None) and (turns,
        cut off, capped, tool calls, failed calls) (rows, 5)."""
        run, args, k = self.run, self.args, k or self.k
        prompts = self.env.start(
            [p for p in prompts for _ in range(k)],
            rows=[r for r in rows for _ in range(k)],
            seeds=[s for s in env_seeds for _ in range(k)],
        )
        if any(prompts[j] != prompts[j - j % k] for j in range(len(prompts))):
            die("--environment's reset() gave a prompt's episodes different prompts; a group must share its prompt")
        longest = max(map(len, prompts), default=0)
        if self.context is not None and longest >= self.context:
            die(
                f"an episode's prompt is {longest} tokens (the tools' schemas and reset()'s text included), which leaves "
                f"no room in a context of {self.context} (the model's positions, or --max_prompt_length + "
                "--max_episode_tokens): shorten reset()'s text or raise --max_episode_tokens"
            )
        pad, stride = run.tokenizer.pad_token_id, args.response_length

        def sample(rows, seqs, turn, room):
            queries, query_mask = (x.to(run.device) for x in left_pad(seqs, pad))
            # up to the largest room (under ZeRO-3, where each process takes the others' decoding steps, max_length),
            # a row's tokens past its own thrown away
            length = max_length if zero3(run.accelerator) else min(max_length, max(room))
            noise = uniforms[rows, turn * stride : turn * stride + length] if uniforms is not None else None
            if turn == 0 and len(rows) == len(prompts):  # every episode's first turn: k completions of each prompt
                group = k if self.chunk % k == 0 else 1
                room = [min(length, r) for r in room[::k]]
                return self.complete(queries, query_mask, noise, seeds, length, k, group, rule, engine, room)
            # one completion of each row, which the engine seeds by its prompt's seed, the turn and the row's place in
            # its group (so that a row's seed is the same whichever process plays it)
            row_seeds = None if seeds is None else [(int(seeds[r // k]) + 7919 * turn + r % k) % 2**31 for r in rows]
            room = [min(length, r) for r in room]
            return self.complete(queries, query_mask, noise, row_seeds, length, 1, 1, rule, engine, room)

        tokens, policy, engine_logprobs, turns, cut, capped = episodes(
            sample,
            prompts,
            self.env.respond,
            max_turns=args.max_turns,
            max_tokens=args.max_episode_tokens,
            stop_token_id=run.stop_token_id,
            context=self.context,
            reduce=(lambda n: run.reduce_sum(torch.tensor(n, device=run.device)).item()) if zero3(run.accelerator) else None,
        )
        notify("episodes", tokens, policy)
        rewards, calls, failures = self.env.finish()
        self.env_rewards = torch.tensor(rewards, device=run.device).reshape(len(rewards), len(tokens))
        responses = torch.full((len(tokens), max(map(len, tokens))), pad, dtype=torch.long)
        mask = torch.zeros(responses.shape, dtype=torch.bool)
        logprobs = torch.full(responses.shape, INVALID_LOGPROB) if engine_logprobs is not None else None
        for j, (t, p) in enumerate(zip(tokens, policy)):
            responses[j, : len(t)], mask[j, : len(t)] = torch.tensor(t, dtype=torch.long), torch.tensor(p)
            if logprobs is not None:
                logprobs[j, : len(t)] = torch.tensor(engine_logprobs[j])
        info = torch.tensor([turns, cut, capped, calls, failures], dtype=torch.float).T
        logprobs = logprobs.to(run.device) if logprobs is not None else None
        lengths = torch.tensor([len(t) for t in tokens], device=run.device)
        return prompts, responses.to(run.device), lengths, mask.to(run.device), logprobs, info.to(run.device)

    def score(self, queries, query_mask, completions, texts, columns, raw):
        """the completions truncated after the stop token, their lengths and every source's scores (sources, rows)"""
        return score_completions(
            self.run.sources,
            self.run.tokenizer,
            queries,
            query_mask,
            completions,
            prompts=texts,
            columns=columns,
            stop_token_id=self.run.stop_token_id,
            chunk=self.chunk,
            raw=raw,
        )

    def score_episodes(self, ids, responses, lengths, texts, columns):
        """every source's scores of the episodes (sources, rows): the environment's reward; the reward models read the
        whole episode, the functions get its last policy turn as the completion and the conversation as `messages`"""
        run = self.run
        queries, query_mask = (x.to(run.device) for x in left_pad(ids, run.tokenizer.pad_token_id))
        real = torch.arange(responses.shape[1], device=run.device)[None, :] < lengths[:, None]
        return get_scores(
            run.sources,
            tokenizer=run.tokenizer,
            query_responses=torch.cat([queries, responses], 1),
            mask=torch.cat([query_mask, real.long()], 1),
            context_length=queries.shape[1],
            lengths=lengths,
            prompts=texts,
            columns={**columns, "messages": self.env.messages, "environments": self.env.live},
            stop_token_id=run.stop_token_id,
            completions=[next(m["content"] for m in reversed(c) if m["role"] == "assistant") for c in self.env.messages],
            env_rewards=self.env_rewards,
        )

    def sample_groups(self, prompts, keep, draw):
        """Dynamic sampling's rounds (DAPO, Yu et al. 2025): the groups of prompts, then of further prompts (draw's; at
        most --max_sampling_rounds rounds, as many on every process), until every process has local_prompts groups that
        keep marks; the first of them kept, in order (a batch still short is filled with the unmarked, earliest first).
        Each completion is scored once, as it is generated. Returns the kept groups' rows (sample_rows) and the
        metrics."""
        run, args, k = self.run, self.args, self.k
        reduce_sum = functools.partial(run.accelerator.reduce, reduction="sum")
        rounds_rows, groups, marked = [], [], []  # each round's rows; (round, group) per group; whether keep marked it
        for rounds in range(1, args.max_sampling_rounds + 1):
            if rounds > 1:  # every round generates up to the update's max_length
                prompts = dataclasses.replace(draw(), max_length=prompts.max_length)
            rows = self.sample_rows(prompts)
            marked += keep(self.assemble(rows, prompts.max_length, {})).tolist()
            groups += [(len(rounds_rows), j) for j in range(len(prompts.index))]
            rounds_rows.append(rows)
            short = reduce_sum(torch.tensor(float(sum(marked) < args.local_prompts), device=run.device))
            if short.item() == 0:  # every process has enough
                break
        chosen, filled = select_groups(marked, args.local_prompts)
        parts = []
        for r, rows in enumerate(rounds_rows):  # in generation order
            picked = [j * k + i for g in chosen if groups[g][0] == r for j in [groups[g][1]] for i in range(k)]
            if picked:
                parts.append(take_rows(rows, picked))
        counts = torch.tensor([len(marked), len(marked) - sum(marked), filled], device=run.device, dtype=torch.float)
        generated, dropped, filled = reduce_sum(counts).tolist()  # groups, on all processes
        stats = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/generated": generated}
        stats.update({"dynamic_sampling/dropped": dropped, "dynamic_sampling/filled": filled})
        return cat_rows(parts, run.tokenizer.pad_token_id), stats


def sample_completions(
    model,
    engine,
    queries,
    query_mask,
    *,
    k,
    max_length,
    rule,
    stop_token_id,
    pad_token_id,
    uniforms,
    seeds,
    chunk,
    group=1,
    synced=False,
    decode=generate,
    room=None,
    max_position=None,
):
    """A rollout's completions of its rows (queries, query_mask: (prompts * k, query_len), left-padded, a prompt's k rows
    adjacent), up to max_length tokens by the sampling rule: the vLLM engine's (--use_vllm; it must hold model's weights:
    vllm_sync), which gets each prompt once with its seed and its most tokens (room: one per prompt; None: max_length),
    else decode's (generate(), or a GraphDecoder) on model, chunk rows at a time with their uniforms, positions past
    max_position held there. Returns (responses (rows, width) padded with pad_token_id, the engine's logprobs of them
    or None)."""
    if engine is not None:
        return vllm_generate(
            engine,
            queries[::k],
            query_mask[::k],
            k=k,
            max_tokens=max_length if room is None else room,
            rule=rule,
            stop_token_id=stop_token_id,
            seeds=seeds,
            pad_token_id=pad_token_id,
        )
    responses, starts = [], list(range(0, len(queries), chunk))
    mine = len(starts)
    if synced:  # ZeRO-3: each generation needs every process, so each runs as many as the most any runs (a copy fills)
        most = torch.tensor(mine, device=queries.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        starts += [0] * (int(most) - mine)
    for i in starts:
        rows = slice(i, i + chunk)
        responses.append(
            decode(
                model,
                queries[rows],
                query_mask[rows],
                response_length=max_length,
                rule=rule,
                stop_token_id=stop_token_id,
                uniforms=uniforms[rows] if uniforms is not None else None,
                group=group,
                synced=synced,
                max_position=max_position,
            )
        )
    return pad_cat(responses[:mine], pad_token_id), None
