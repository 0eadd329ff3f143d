"""--use_vllm: a vLLM engine in the training process, made for the model (or refused in one line), given the policy's
weights before each rollout, and sampling completions with its logprobs.
"""

import copy
import functools
import logging
import math
import os
import random
import tempfile
import time
import warnings
from contextlib import nullcontext

import numpy as np
import torch

from utils import INVALID_LOGPROB, die, forward, logprobs_from_logits, sampling_logits

from .data import left_pad
from .decode import as_rule


def vllm_engine(accelerator, args, policy, sampling=None, tokenizer=None):
    """A vLLM engine in this process (TRL's colocate mode) with the policy's architecture and random weights (sampling:
    the sampling rule's settings, vllm_sampling's, refused in one line before it starts where vLLM refuses them):
    vllm_sync gives it the policy's before each rollout. With several processes each has an engine that samples
    its share of the prompts (vLLM's external_launcher: the engines join the processes' torch.distributed world). It
    reads no tokenizer (prompts go in as token ids; with --vllm_structured_outputs_regex it reads tokenizer's, which its
    grammar needs, and keeps the regex as engine.regex) and reports the logprobs of the distribution it samples from
    (the sampling rule's: vllm_sampling). On a machine without CUDA it is vLLM's CPU build, given a KV cache of
    VLLM_CPU_KVCACHE_SPACE GiB (default here 2) and this process's share of the cores. vLLM logs its errors only
    (VLLM_LOGGING_LEVEL=INFO shows the rest). A model the engine cannot run stops the run here, in one line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, to sync in place
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // accelerator.num_processes)
        mine = cores[accelerator.local_process_index * share :][:share] or cores[-share:]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
        # vLLM's CPU attention in bf16 uses the AMX tiles of CPUs that have them without asking Linux for them, and the
        # process dies of an illegal instruction; torch asks (once per process; nothing where the CPU has none)
        getattr(torch.cpu, "_init_amx", lambda: None)()
    # (its loggers, before vLLM sets them up as it imports: some log as it does)
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    start = time.time()
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        die("--use_vllm needs vLLM: see the README's 'vLLM rollouts' for the one install command")
    try:
        SamplingParams(**(sampling or {}))
    except Exception as e:  # noqa: BLE001 (vLLM's own checks)
        die(f"--use_vllm: vLLM refuses the sampling settings {sampling} ({error_line(e)})")
    backend = "uni" if args.vllm_tensor_parallel_size == 1 else None
    if accelerator.num_processes > 1:
        backend = "external_launcher"
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy  # (LoRA: the model under peft)
    config = copy.deepcopy(base.config)
    # the longest context: a prompt and its completion; with --environment a prompt (rendered with the tools) and its
    # episode, within the model's positions (an episode ends at the context's end)
    context = args.max_prompt_length + args.response_length
    if getattr(args, "environment", None):
        positions = getattr(config.get_text_config(), "max_position_embeddings", None)
        context = min(args.max_prompt_length + args.max_episode_tokens, positions or math.inf)
    length = getattr(args, "vllm_max_model_length", None)  # (a longer one only takes memory; a shorter one would cut)
    if length is not None:
        if length < context:
            die(f"--vllm_max_model_length {length} is less than the {context} tokens a prompt and its completion may take"
                " (--max_prompt_length and --response_length): lower those instead")  # fmt: skip
        context = length
    config.architectures = [type(base).__name__]  # (a model built from a config has none): the engine's model class
    # vLLM seeds the random, numpy and torch streams of the process it starts in (and its checks below draw from them):
    # the run's own are kept as they were (each process's, from setup)
    streams = random.getstate(), np.random.get_state()
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else []
    with tempfile.TemporaryDirectory() as folder, torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (vLLM's own use of deprecated torch names)
        config.save_pretrained(folder)
        regex = getattr(args, "vllm_structured_outputs_regex", None)
        if regex is not None:
            tokenizer.save_pretrained(folder)
        engine = vllm_or_die(
            LLM,
            config.model_type,
            model=folder,
            load_format="dummy",
            skip_tokenizer_init=regex is None,
            dtype="bfloat16" if args.bf16 else "float32",
            seed=args.seed,
            max_model_len=context,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            enforce_eager=args.vllm_enforce_eager,
            model_impl=getattr(args, "vllm_model_impl", "vllm"),
            distributed_executor_backend=backend,
        )
        check_vllm_engine(engine, config.model_type)
        check_vllm_logprobs(engine, policy, config.model_type, bf16=args.bf16)
        engine.regex = regex
    random.setstate(streams[0])
    np.random.set_state(streams[1])
    if accelerator.is_main_process:
        mode = "eager" if args.vllm_enforce_eager else "compiled"
        model = engine.llm_engine.model_config  # (as vLLM took it: its implementation, its context)
        print(f"vLLM engine ready in {time.time() - start:.1f} s ({config.model_type}, {mode}, model_impl "
              f"{model.model_impl}, max_model_len {model.max_model_len})")  # fmt: skip
    return engine


def check_vllm_engine(engine, model_type):
    """Make the trainer's models and the engine live side by side, or stop in one line. A family vLLM has no model of
    runs on transformers' own classes, which vLLM changes in place for its compiler (a __call__ that reads an attribute
    only the engine's instances have): the trainer's instances of those classes run as before, uncompiled. A head size
    vLLM's CPU attention lacks, and anything else the engine cannot run, is found here by generating one token, not
    deep inside the first rollout."""
    from vllm import SamplingParams
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    for cls in TorchCompileWithNoGuardsWrapper.__subclasses__():
        if cls.__module__.startswith("transformers.") and "do_not_compile" not in vars(cls):
            cls.do_not_compile = True
    if not torch.cuda.is_available():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = engine.llm_engine.model_config.get_head_size()
        if not CPUAttentionBackend.supports_head_size(head):
            sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
            die(f"--use_vllm: vLLM's CPU attention takes head sizes {sizes}; this {model_type} model's is {head}")
    vllm_or_die(engine.generate, model_type, [{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    engine.reset_prefix_cache()
    # whether the engine's model has an output projection of its own to sync (some compute the logits from the
    # embeddings they tie it to)
    engine.has_lm_head = all(engine.collective_rpc(has_lm_head))


def logprobs_differ(diff, bf16):
    """Whether two computations of the same logprobs disagree (diff: their absolute differences): in fp32 any by more
    than 1e-2 (where they agree, they do within 1e-5); in bf16, which differs by rounding, their mean by more than 0.05
    (rounding: about 0.01). The bound of --use_vllm's and --cuda_graphs' checks."""
    return bool(diff.mean() > 0.05) if bf16 else bool(diff.max() > 1e-2)


@torch.no_grad()
def check_vllm_logprobs(engine, policy, model_type, bf16):
    """Stop the run in one line unless the engine, given the policy's weights, samples from the policy's distribution:
    its logprobs of 16 tokens it samples from two prompts against the policy's own. A family that vLLM computes or
    loads in place otherwise (an ALiBi or mixture-of-experts layer on vLLM's CPU build, say) is refused here. In fp32
    every logprob must agree (logprobs_differ)."""
    vllm_or_die(vllm_sync, model_type, engine, policy)
    device = next(policy.parameters()).device
    queries, mask = left_pad([[1, 2, 3, 4], [5, 6]], pad_token_id=0)
    generate_or_die = functools.partial(vllm_or_die, vllm_generate, model_type)
    responses, engine_logprobs = generate_or_die(engine, queries, mask, k=2, max_tokens=8, rule=1.0,
                                                 stop_token_id=None, seeds=[1, 2], pad_token_id=0)  # fmt: skip
    queries, mask = queries.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    ids, mask = torch.cat([queries, responses], 1).to(device), torch.cat([mask, torch.ones_like(responses)], 1).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = forward(policy, ids, mask).logits[:, queries.shape[1] - 1 : -1]
    diff = (logprobs_from_logits(logits, responses.to(device)) - engine_logprobs.to(device)).abs()
    if logprobs_differ(diff, bf16):
        die(
            f"--use_vllm: vLLM's logprobs of this {model_type} model differ from the trainer's (by up to {diff.max():.3g} "
            "with the same weights): it computes or loads the model otherwise; train without --use_vllm"
        )


def has_lm_head(worker):
    """(run by each of an engine's workers) whether its model has an lm_head parameter"""
    params = worker.model_runner.model.named_parameters(remove_duplicate=False)  # (one tied to the embeddings too)
    return any(name.startswith("lm_head.") for name, _ in params)


def vllm_or_die(fn, model_type, *args, **kwargs):
    """fn(*args, **kwargs) of vLLM's, or the run stopped in one line when vLLM cannot run the model."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (vLLM raises many kinds)
        die(f"--use_vllm: vLLM cannot run this {model_type} model ({error_line(e)}); train without --use_vllm")


def error_line(e):
    """an exception's message on one line (its type's name when it has none), cut to 200 characters, for die()"""
    return " ".join(str(e).split())[:200] or type(e).__name__


def vllm_sync(engine, model):
    """Load model's weights (an unwrapped transformers model, or a peft model) into the vLLM engine in place, and drop
    the engine's cached prompts (computed with the old weights). The output projection is sent even when tied to the
    embeddings: the engine keeps its own copy. Under ZeRO-3 the weights are gathered whole for the copy (each process
    holds the full model for a moment, as when saving). With LoRA the engine gets each adapted weight plus its
    adapters' product, computed aside: merging into the model and out again would leave rounding errors in the frozen
    weights, which are also the reference."""
    params = list(model.parameters())
    gathered = nullcontext()
    if hasattr(params[0], "ds_id"):  # ZeRO-3: every process gathers the same parameters in the same order
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered, torch.no_grad():
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        state = dict(base.state_dict())
        for name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a LoRA layer
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
                state[f"{name}.base_layer.weight"] = module.base_layer.weight + delta
        # peft's names back to the model's: q_proj.base_layer.weight -> q_proj.weight, adapters' own weights dropped
        state = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
        head = base.get_output_embeddings()
        if head is not None and "lm_head.weight" not in state:
            state["lm_head.weight"] = head.weight
        if not getattr(engine, "has_lm_head", True):  # (an engine that computes the logits from the embeddings)
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        # the checkpoint's names and layout, which the engine loads: transformers fuses some weights as it loads them
        # (a mixture of experts' into one tensor per layer) and splits them again as it saves
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(base, state)
        engine.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(state.items())))
    engine.reset_prefix_cache()


def vllm_sampling(rule):
    """The SamplingParams of a sampling rule: utils.sampling_logits's settings, which vLLM applies in the same order
    (a script's own rule, which vLLM cannot run, is refused in one line)."""
    rule = as_rule(rule)
    if not isinstance(rule, functools.partial) or rule.func is not sampling_logits or rule.args:
        name = getattr(getattr(rule, "func", rule), "__name__", rule)
        die(f"--use_vllm samples by utils.sampling_logits's settings, which vLLM applies; the rule {name} runs on "
            "the scripts' own sampler: leave out --use_vllm")  # fmt: skip
    return dict(rule.keywords)  # (a setting left out: SamplingParams' default, the rule's too)


def vllm_generate(engine, queries, query_mask, k, max_tokens, rule, stop_token_id, seeds, pad_token_id):
    """k completions of each of the prompts (queries, query_mask: (prompts, query_len), left-padded) sampled by the vLLM
    engine by the sampling rule (vllm_sampling), each prompt sent once with n = k and at most max_tokens tokens (a
    number, or one per prompt); the engine seeds prompt j's k samples with seeds[j], seeds[j] + 1, ... Stops at stop_token_id
    (kept, as generate() keeps it). Returns responses (prompts * k, longest), padded with pad_token_id, and the
    engine's logprobs of their tokens (INVALID_LOGPROB on padding), on the queries' device; row j * k + i is prompt
    j's i-th completion. A completion the engine cut at its context's end stops the run in one line: its padding would
    read as a stop token the engine never sampled (the callers ask no more than the context holds)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": q[m.bool()].tolist()} for q, m in zip(queries, query_mask)]
    stop = [stop_token_id] if stop_token_id is not None else None
    most = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else [int(n) for n in max_tokens]
    sampling = vllm_sampling(rule)
    if getattr(engine, "regex", None) is not None:  # --vllm_structured_outputs_regex: each completion matches it
        from vllm.sampling_params import StructuredOutputsParams

        sampling["structured_outputs"] = StructuredOutputsParams(regex=engine.regex)
    params = [
        # ignore_eos: the engine would also stop at the EOS token of the model's config, which generate() does not
        SamplingParams(
            n=k, max_tokens=n, logprobs=0, seed=int(s), stop_token_ids=stop, ignore_eos=True, **sampling
        )  # fmt: skip
        for s, n in zip(seeds, most)
    ]
    outputs = engine.generate(prompts, params, use_tqdm=False)
    rows = [(c, n) for out, n in zip(outputs, most) for c in sorted(out.outputs, key=lambda c: c.index)]
    for (c, n), prompt in zip(rows, [p for p in prompts for _ in range(k)]):
        stopped = stop_token_id is not None and c.token_ids[-1:] == [stop_token_id]
        if len(c.token_ids) < n and not stopped:
            context = engine.llm_engine.model_config.max_model_len
            die(
                f"--use_vllm: the engine cut a completion at {len(c.token_ids)} of its {n} tokens, at the end of its "
                f"context of {context} (a prompt of {len(prompt['prompt_token_ids'])}); lower --max_prompt_length"
            )
    width = max(len(c.token_ids) for c, _ in rows)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    logprobs = torch.full((len(rows), width), INVALID_LOGPROB)
    for i, (c, _) in enumerate(rows):
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        logprobs[i, : len(c.token_ids)] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return responses.to(queries.device), logprobs.to(queries.device)
