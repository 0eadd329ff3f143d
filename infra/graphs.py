"""--cuda_graphs (on by default, on a CUDA device): decoding with each step captured in a CUDA graph over a static KV
cache, checked against the plain forward pass; where a model cannot have graphs, the plain sampler, with one line.
"""

import functools

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from utils import forward, logprobs_from_logits

from .decode import as_rule, generate, sample_tokens, seen_tokens
from .engine import error_line, logprobs_differ
from .models import zero3


class Refused(Exception):
    """why a model cannot decode from CUDA graphs"""


def decoder(run):
    """The sampler's decoding: a GraphDecoder where --cuda_graphs (the default) can work, the model whole on a CUDA
    device; else generate(), with one line where it is a GPU run that cannot (ZeRO-3: each step gathers the weights)."""
    if not run.args.cuda_graphs or run.accelerator.device.type != "cuda":
        return generate
    if zero3(run.accelerator):
        print("note: the plain sampler decodes: --cuda_graphs needs the model whole on each GPU, not under ZeRO-3")
        return generate
    return GraphDecoder()


class GraphDecoder:
    """--cuda_graphs: generate() with each decoding step (one token per row through the model over a static KV cache,
    and its draw) captured once in a CUDA graph and replayed, one launch per step instead of one per kernel: a small
    model's decoding is bound by its launches. The prompts prefill the cache in a plain forward pass. One graph per
    model, rows, cache length (prompt + response, rounded up to 128 tokens), sampling rule and precision, made on first
    use and then checked against the plain forward pass (the run stops in one line where it differs, or where the
    model cannot be captured); the `kept` most recently used are kept, each with its cache. Called as generate(), the
    same tokens up to rounding, but each row prefills its own prompt (group is not used; synced, ZeRO-3, is refused).
    capture=False runs the same steps without a graph (a CPU test of everything but the capture). A model that cannot
    have graphs (a cache with windows, ALiBi, a step that cannot be captured, a graph that differs from the plain pass)
    is decoded by generate() from then on, the reason printed once (and kept in `off`)."""

    def __init__(self, capture=True, kept=4):
        self.capture, self.kept, self.graphs, self.pool, self.off = capture, kept, {}, None, None

    def __call__(self, model, queries, query_mask, response_length, rule, stop_token_id=None, uniforms=None,
                 max_position=None, **rest):  # fmt: skip
        args = (model, queries, query_mask, response_length, rule, stop_token_id, uniforms)
        if self.off is None:
            # autocast keeps one cast of each trainable weight per region, and a model that opens its own region
            # inside (accelerate's bf16 forward) would have the graph read a cast made once, outside it, for good:
            # the weights are read as frozen while the graphs decode, so that every replay casts them anew
            trainable = [p for p in model.parameters() if p.requires_grad]
            try:
                for p in trainable:
                    p.requires_grad_(False)
                return self.decode(*args, max_position=max_position)
            except (Refused, torch.OutOfMemoryError) as why:
                if isinstance(why, torch.OutOfMemoryError):  # (the graphs' static caches: the plain one grows as needed)
                    why = "out of GPU memory for the graphs' static caches"
                self.off = f"--cuda_graphs: {why}"
                self.graphs.clear()
                torch.cuda.empty_cache()
                print(f"note: the plain sampler decodes from now on: {self.off}", flush=True)
            finally:
                for p in trainable:
                    p.requires_grad_(True)
        return generate(*args, max_position=max_position, **rest)

    @torch.no_grad()
    def decode(self, model, queries, query_mask, response_length, rule, stop_token_id=None, uniforms=None,
               max_position=None):  # fmt: skip
        rows, width = queries.shape
        device = queries.device
        uniforms = (torch.rand(rows, response_length) if uniforms is None else uniforms).to(device)
        precision = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        size = -(-(width + response_length) // 128) * 128
        rule = as_rule(rule)
        # (a rule made anew with the same settings, functools.partial's, is the same graph's)
        same = (rule.func, rule.args, tuple(sorted(rule.keywords.items()))) if isinstance(rule, functools.partial) else rule
        key = (id(model), rows, size, same, precision)
        weights = [p.data_ptr() for p in model.parameters()]
        kind = model.config.model_type
        g = self.graphs.pop(key, None)  # (put back last: the most recently used)
        if g is not None and g.weights != weights:  # (moved or reallocated weights: a graph reads them where they were)
            self.graphs.clear()
            g = None
        if g is None:
            attention = model.config._attn_implementation
            if attention not in ("sdpa", "eager"):
                raise Refused(f"it takes sdpa or eager attention, not {attention}")
            cache = StaticCache(config=model.config, max_cache_len=size)
            if any(type(layer) is not StaticLayer for layer in cache.layers):
                raise Refused(f"this {kind} model's cache is not a plain static one (sliding windows?)")
            cache.layers = [OneTypeLayer(size) for _ in cache.layers]
            g = StaticBuffers(rows, size, device, weights, cache, eager=attention == "eager")

        # the keys each row may read: its prompt's real tokens, then every generated one (the causal limit per step)
        g.keys[:, :width] = query_mask.bool()
        g.keys[:, width:] = True
        # where each layer writes next: transformers' static layers keep their own count and ignore cache_position, so
        # g.at (the position written, for the masks) follows it: the prefill's width, then one more per step
        for layer in g.cache.layers:
            layer.cumulative_length.zero_()
        span = g.span[:width]
        # prefill, (rows, 1, width, size): each position reads its row's real keys up to it, and a padding position
        # itself: no row of the attention is empty, which some kernels answer with NaN, and NaN in a padding position's
        # keys would reach every later position through its zero weight
        seen = g.keys[:, None, :] & (g.span[None, None, :] <= span[None, :, None]) | (g.span == span[:, None])[None]
        try:
            out = model(
                input_ids=queries,
                attention_mask=g.mask(seen[:, None], model.dtype),
                position_ids=query_mask.cumsum(1) - query_mask,
                cache_position=span,
                past_key_values=g.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (a family that builds its own masks or biases: ALiBi's, say)
            if g.checked:
                raise
            raise Refused(f"this {kind} model cannot decode over a static cache ({error_line(e)})") from e
        present = seen_tokens(queries, query_mask, out.logits.shape[-1], rule)  # (None: the rule reads none)
        if g.present is None:
            g.present = present
        elif present is not None:
            g.present.copy_(present)  # (into the tensor the graph reads)
        token = sample_tokens(out.logits[:, -1], rule, uniforms[:, 0], g.present)
        if g.present is not None:
            g.present.scatter_(1, token, True)
        tokens = [token]
        g.position.copy_((query_mask.sum(1, keepdim=True) - 1).clamp(min=0))  # (generate()'s, an empty prompt too)
        g.at.fill_(width - 1)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        logprobs = []

        def step():
            seen = g.keys & (g.span <= g.at)  # (rows, size)
            logits = model(
                input_ids=g.token,
                attention_mask=g.mask(seen[:, None, None], model.dtype),
                position_ids=g.position,
                cache_position=g.at,
                past_key_values=g.cache,
                use_cache=True,
            ).logits[:, -1]
            chosen = sample_tokens(logits, rule, g.uniform, g.present)  # (rows, 1)
            if g.present is not None:
                g.present.scatter_(1, chosen, True)
            return chosen, torch.log_softmax(logits.float(), -1).gather(-1, chosen)[:, 0]  # (for the check)

        for t in range(1, response_length):
            if stop_token_id is not None:
                done |= token[:, 0] == stop_token_id
                if done.all():
                    break
            g.token.copy_(token)
            g.position.add_(1)
            if max_position is not None:  # (generate()'s: positions past a row's context held at its end)
                g.position.clamp_(max=max_position)
            g.at.add_(1)
            g.uniform.copy_(uniforms[:, t])
            if not self.capture:
                token, logprob = step()
            else:
                if g.graph is None:
                    self.record(g, step, kind)
                g.graph.replay()
                token, logprob = g.outputs[0].clone(), g.outputs[1].clone()
            tokens.append(token)
            logprobs.append(logprob)
        tokens = torch.cat(tokens, dim=1)
        if not g.checked and logprobs:
            self.check(model, queries, query_mask, tokens, logprobs, kind)
            g.checked = True
        self.graphs[key] = g
        while len(self.graphs) > self.kept:  # the least recently used goes, its cache and graph with it
            self.graphs.pop(next(iter(self.graphs)))
        return tokens

    def record(self, g, step, kind):
        """Capture step() in g.graph, after two runs on a side stream (which CUDA graphs need); those write the cache's
        next position, which the step after them writes again, and the tokens present, which are put back."""
        lengths = [layer.cumulative_length.clone() for layer in g.cache.layers]
        present = g.present.clone() if g.present is not None else None
        # (autocast's cache of cast weights off: the graph must cast the weights at each replay, not keep one cast)
        uncached = functools.partial(torch.autocast, "cuda", enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        stream = torch.cuda.current_stream()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), uncached():
                for _ in range(2):
                    step()
                    for layer, n in zip(g.cache.layers, lengths):
                        layer.cumulative_length.copy_(n)
                    if present is not None:
                        g.present.copy_(present)
            torch.cuda.current_stream().wait_stream(side)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            g.graph = torch.cuda.CUDAGraph()
            # (thread_local: the training thread may run beside a sampler working ahead, --max_staleness)
            with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"), uncached():
                g.outputs = step()
        except Exception as e:  # noqa: BLE001 (a copy to the CPU or a sync inside the step, say)
            torch.cuda.set_stream(stream)  # (a capture that failed at its end leaves its stream current)
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise Refused(f"this {kind} model's decoding step cannot be captured ({error_line(e)})") from e

    @staticmethod
    def check(model, queries, query_mask, tokens, logprobs, kind):
        """Refused unless the graph's logprob of each token it drew is the plain forward pass's (logprobs_differ; bf16:
        autocast's or the model's own)."""
        drawn = tokens[:, 1 : 1 + len(logprobs)]
        ids = torch.cat([queries, tokens], 1)
        mask = torch.cat([query_mask, torch.ones_like(tokens)], 1)
        plain = []
        for rows in torch.arange(len(ids)).split(8):  # (a few rows at a time: the logits are rows x width x vocab)
            logits = forward(model, ids[rows], mask[rows], logits_to_keep=tokens.shape[1]).logits[:, : drawn.shape[1]]
            plain.append(logprobs_from_logits(logits, drawn[rows]))
        plain = torch.cat(plain)
        diff = (plain - torch.stack(logprobs, 1)).abs()
        low = torch.is_autocast_enabled(queries.device.type) or next(model.parameters()).dtype != torch.float32
        if logprobs_differ(diff, low):
            raise Refused(
                f"the captured decoding of this {kind} model differs from its plain forward pass (logprobs by up to "
                f"{diff.max():.3g})"
            )


class OneTypeLayer(StaticLayer):
    """transformers' static cache layer, keys and values stored in the narrower of their two types: under autocast a
    rotated key comes out in float32 (the rotation follows the embeddings' precision) beside a bfloat16 value, where the
    static layer holds one type; autocast casts the key to bfloat16 for the attention anyway, so the numbers are
    those of a dynamic cache"""

    def update(self, key_states, value_states, *args, **kwargs):
        dtype = min(key_states.dtype, value_states.dtype, key=lambda d: d.itemsize)
        return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)


class StaticBuffers:
    """A GraphDecoder graph's inputs, held where the graph reads them: each row's current token, position and uniform
    number, the cache position being written, which of the cache's keys each row may read, and the tokens present in
    each row (prompt and completion so far: the repetition penalty's), (rows, vocab), made at the first prefill where
    the rule reads them."""

    def __init__(self, rows, size, device, weights, cache, eager):
        self.weights, self.cache, self.eager = weights, cache, eager  # (eager attention: masks added to the scores)
        self.graph, self.outputs, self.checked = None, None, False
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.uniform = torch.zeros(rows, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)
        self.keys = torch.zeros(rows, size, dtype=torch.bool, device=device)
        self.span = torch.arange(size, device=device)
        self.present = None

    def mask(self, seen, dtype):
        """the attention mask the model takes as given (4D): booleans for sdpa, added to the scores for eager"""
        if not self.eager:
            return seen
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)
