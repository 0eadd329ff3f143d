"""--max_staleness N: sampling ahead. The prompts of the next N updates are drawn on the training thread, in the run's
order, and sampled and scored while the training thread updates: sampled in a thread of their own on a copy of the
policy (or by the vLLM engine, given the copy's weights), then scored in a second thread while the first samples the
next batch, so that a slow judge's waiting overlaps both the update and the sampling.

The order is fixed, not timed: the batch trained on at update u was drawn at update u - N (the first N + 1 at the
first update) and sampled with the weights the policy had then, version max(0, u - 1 - N) (the updates taken; with
--weight_sync_steps K, the weights of every K-th update only, so drawn and sampled up to K - 1 updates later), so that
a run is the same however fast either side is, on one process or several, killed and resumed. The copy records its
logprobs of every token it sampled (the behaviour policy's, the trainer's own function on the copy's weights): the
scripts weigh each token's loss by the policy of the update's start over them, as they weigh an engine's samples
(decoupled PPO; docs/algorithms.md).

Threads, not processes: the reward sources, the environment and the tokenizer are the run's own (nothing is loaded
twice), torch releases the interpreter's lock in its kernels, and a reward server's or a tool's waiting overlaps the
update. The evaluation, which shares the environment and the reward models, waits for the sampler to be idle (settle).
"""

import collections
import copy
import functools
import os
import queue
import threading
import time
from concurrent.futures import Future

import torch

from utils import rollout_logprobs

from .data import truncate_response
from .graphs import GraphDecoder


def own(sampler):
    """a copy of sampler (the same reward sources, environment and policy) whose run is a copy with a tokenizer of its
    own: a thread's, since a fast tokenizer that changes its truncation while another thread reads it raises"""
    mine = copy.copy(sampler)
    mine.run = copy.copy(sampler.run)
    mine.run.tokenizer = copy.deepcopy(sampler.run.tokenizer)
    return mine


class Ahead:
    """The batches in flight (update, weights version, future) of a Sampler with --max_staleness n, sampled by a copy of
    it (the same reward sources and environment; the run's copy with a tokenizer of its own) on a copy of the policy
    in one worker thread, and scored in another."""

    def __init__(self, sampler, n):
        self.sampler, self.n, self.run = sampler, n, sampler.run
        policy = sampler.unwrapped()
        self.trained = [name for name, p in policy.named_parameters() if p.requires_grad]  # (LoRA: the adapters)
        self.worker = own(sampler)
        if self.run.env is not None:  # the worker drives it (the evaluation only once the worker is idle): its tokenizer
            self.run.env.tokenizer = self.worker.run.tokenizer
        shared = {id(p): p for p in policy.parameters() if not p.requires_grad}  # (LoRA's frozen base: read, not copied)
        self.worker.model = copy.deepcopy(policy, shared).eval().requires_grad_(False)
        self.worker.decode = GraphDecoder() if isinstance(sampler.decode, GraphDecoder) else sampler.decode  # its own graphs
        self.worker.ahead = None
        # (a new thread's current GPU is the first: the workers take this process's)
        self.gpu = torch.cuda.current_device() if self.run.device.type == "cuda" else None
        self.loaded = 0  # the weights version the copy holds
        self.pending = collections.deque()
        self.planned = None  # the update whose batch is drawn next
        # a second stage, so that a slow judge's waiting overlaps the sampling of the next batch: the sampler leaves the
        # scores to a scorer thread and goes on; an episode's scores stay with the sampler (its environments are live
        # objects, which the next batch resets)
        self.scorer = own(self.worker)
        if self.run.env is None:
            self.worker.score = self.later
        # daemon threads: a run that stops (an error, Ctrl-C) does not wait for the batches still queued
        self.jobs, self.scoring = queue.Queue(), queue.Queue()
        threading.Thread(target=self.work, name="sampler", daemon=True).start()
        threading.Thread(target=self.judge, name="scorer", daemon=True).start()

    def work(self):
        """The sampler thread: each batch sampled, handed to the scorer, then its behaviour logprobs computed (while the
        scorer scores it). An error (utils.die's SystemExit too) is raised where the batch is waited for."""
        if self.gpu is not None:
            torch.cuda.set_device(self.gpu)
        while True:
            future, args = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                batch = self.sample(*args)
            except BaseException as e:  # noqa: BLE001
                future.set_exception(e)
                continue
            logprobs = Future()
            self.scoring.put((future, batch, logprobs))
            try:
                logprobs.set_result(self.behaviour(batch, completions=args[-1]))
            except BaseException as e:  # noqa: BLE001
                logprobs.set_exception(e)

    def judge(self):
        """The scorer thread: each batch's scores, which the sampler left to it; the batch is ready once its behaviour
        logprobs are too."""
        if self.gpu is not None:
            torch.cuda.set_device(self.gpu)
        while True:
            future, batch, logprobs = self.scoring.get()
            try:
                if callable(batch.per_source):
                    with torch.no_grad(), self.run.accelerator.autocast():  # (as Sampler.sample scores)
                        batch.per_source = batch.per_source()[2]
                behaviour = logprobs.result()
                if behaviour is not None:
                    batch.behaviour_logprobs = behaviour
                future.set_result(batch)
            except BaseException as e:  # noqa: BLE001
                future.set_exception(e)

    def later(self, queries, query_mask, completions, texts, columns, raw):
        """The sampler's Sampler.score: the completions truncated after their stop token now, their scores (sources,
        rows) a function that the scorer calls"""
        run = self.worker.run
        responses, lengths = truncate_response(completions, run.stop_token_id, run.tokenizer.pad_token_id)
        scores = functools.partial(self.scorer.score, queries, query_mask, completions, texts, columns, raw)
        return responses[:, : int(lengths.max())], lengths, scores

    def next(self, draw, keep=None, completions=None):
        """This update's batch: first the prompts of the updates up to n ahead are drawn (draw(), here, in order) and
        handed to the worker with the policy's weights of now; then the oldest batch, waited for. completions: as
        Sampler.sample's, or a function of the update it is for."""
        run = self.run
        if self.planned is None:  # the run's first update, or a resumed run's: its batches in flight come back
            self.planned = run.update
            if run.args.resume and run.last_checkpoint is not None:
                saved = os.path.join(run.last_checkpoint, f"ahead_{run.accelerator.process_index}.pt")
                device = "cpu" if run.device.type == "cpu" else run.device  # (torch.load takes no "cpu:0")
                for update, version, batch in torch.load(saved, weights_only=False, map_location=device):
                    self.pending.append((update, version, self.done(batch)))
                    self.planned = update + 1
        weights, version = None, run.update - 1  # the updates the policy has taken
        while self.planned <= run.args.num_updates and self.version(self.planned) <= version:
            if weights is None:  # (cloned now: the update about to run changes the policy in place)
                named = dict(self.sampler.unwrapped().named_parameters())
                weights = {name: named[name].detach().clone() for name in self.trained}
            wanted = completions(self.planned) if callable(completions) else completions
            job = Future()
            self.jobs.put((job, (draw(), weights, version, keep, wanted)))
            self.pending.append((self.planned, version, job))
            self.planned += 1
        update, version, job = self.pending.popleft()
        assert update == run.update, f"the batch of update {update} at update {run.update}"
        start = time.perf_counter()
        try:
            batch = job.result()
        except BaseException:
            for _, _, later in self.pending:  # the sampler's error, once: the run stops
                later.cancel()
            raise
        batch.stats["async/staleness"] = run.update - 1 - version
        batch.stats["async/wait_s"] = time.perf_counter() - start  # the update's wait for its batch
        return batch

    def version(self, update):
        """the weights that sample update's batch: the oldest at most n updates older than the update, among those the
        sampler is given (every --weight_sync_steps k updates; k <= n + 1, so they exist by then): k * ceil((u - 1 - n)
        / k), from 0"""
        k = self.run.args.weight_sync_steps
        return k * -(-max(0, update - 1 - self.n) // k)

    def sample(self, prompts, weights, version, keep, completions):
        """In the worker: the batch of prompts sampled with the given weights (with --use_vllm by the engine, given the
        copy's weights, which reports the behaviour's logprobs as it samples), its scores a function for the scorer
        (episodes: scored)"""
        worker = self.worker
        if version != self.loaded:
            with torch.no_grad():
                named = dict(worker.model.named_parameters())
                for name in self.trained:
                    named[name].copy_(weights[name])
            self.loaded = version
        batch = worker.sample(prompts, keep=keep, completions=completions)  # (--use_vllm: the engine given the copy's)
        batch.version = version
        return batch

    def behaviour(self, batch, completions):
        """In the worker, with --vllm_importance_sampling_correction: the copy's logprobs of each token it sampled (the
        behaviour policy's; None where an engine reported them or the dataset's completions stand in)"""
        worker, args = self.worker, self.run.args
        if completions is not None or worker.engine is not None or not args.vllm_importance_sampling_correction:
            return None
        with torch.no_grad(), self.run.accelerator.autocast():
            return rollout_logprobs(worker.model, batch, args.temperature)

    def settle(self):
        """Wait until every batch in flight is sampled and scored (the evaluation shares the sampler's environment and reward
        models), and return them: (update, weights version, Batch), oldest first."""
        return [(update, version, job.result()) for update, version, job in self.pending]

    def save(self, path):
        """The batches in flight, into the checkpoint being written at path: a resumed run trains on them as this one
        would have (their prompts were drawn before the checkpoint, with weights older than its own)."""
        torch.save(self.settle(), os.path.join(path, f"ahead_{self.run.accelerator.process_index}.pt"))

    @staticmethod
    def done(batch):
        """a finished future holding batch"""
        future = Future()
        future.set_result(batch)
        return future
