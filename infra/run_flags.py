"""The flag groups of the run, which every script's Args inherits: TrainArgs (the batch, the optimiser and its
schedule, the experiment and its outputs, precision, LoRA and EMA: every script's) and RunArgs (the RL scripts': the
samples they print, LightRFT's PTX loss). Each checks its own flags as they are parsed (flags.Checked).
"""

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal, Optional

import tyro

from utils import die

from .data import check_paths
from .flags import Checked, at_least


@dataclass
class TrainArgs(Checked):
    """The batch and its optimisation, the experiment and its outputs, precision, LoRA and EMA, and the sizes filled in
    at runtime (no flags): every script's."""

    # the batch and its optimisation
    total_episodes: int = 384
    """total completions to train on, a multiple of the batch"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 2
    """micro-batches accumulated per optimiser step"""
    num_mini_batches: int = 1
    """optimiser steps per epoch over the batch"""
    learning_rate: float = 5e-5
    """the AdamW learning rate, at its peak (--lr_scheduler_type)"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr"] = "linear"
    """the learning rate's schedule over its steps, the optimiser's in grpo.py and rloo.py (TRL's), else the updates
    (transformers' names, after the warmup): linear to zero, a cosine to zero (cosine_with_min_lr: to --min_lr_rate
    times the rate), or constant (which has no warmup)"""
    warmup_ratio: float = 0.0
    """the share of the schedule's steps over which the rate first rises linearly from zero"""
    warmup_steps: int = 0
    """the schedule's steps over which the rate first rises linearly from zero (over --warmup_ratio where above 0)"""
    min_lr_rate: float = 0.0
    """cosine_with_min_lr's last rate, a share of --learning_rate (transformers' lr_scheduler_kwargs' min_lr_rate)"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on every trainable weight but the biases and the norms' (as transformers')"""
    adam_beta1: float = 0.9
    """AdamW's beta1"""
    adam_beta2: float = 0.999
    """AdamW's beta2"""
    adam_epsilon: float = 1e-5
    """AdamW's epsilon (TRL's old PPO and RLOO trainers'; transformers' default is 1e-8)"""

    # experiment
    exp_name: str = dataclasses.field(default_factory=lambda: os.path.splitext(os.path.basename(sys.argv[0]))[0])
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, checkpoints and the trained model go; None: output/{exp_name}__{seed}__{time}"""
    quiet: bool = False
    """print no line per update, configuration or sample table: only where the run writes, evaluations, notes and errors"""
    track: bool = False
    """log to Weights and Biases"""
    wandb_project_name: str = "rlhf-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    checkpoint_every: int = 0
    """write a checkpoint to output_dir every this many updates (0: never)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""
    resume: bool = False
    """continue the run in --output_dir from its newest complete checkpoint"""
    save_model: bool = True
    """save the trained model and tokenizer to output_dir at the end, with a model card (output_dir/README.md)"""
    push_to_hub: bool = False
    """at the end, upload output_dir (model, tokenizer, card, args.json, metrics.jsonl; no checkpoints) to the hub"""
    hub_model_id: Optional[str] = None
    """the hub repo --push_to_hub uploads to, e.g. your-name/model-name (created if missing)"""
    hub_private: bool = False
    """create the hub repo as a private one"""
    trust_remote_code: bool = False
    """let transformers run model code shipped with the checkpoint"""

    # optimisation
    max_grad_norm: float = 1.0
    """gradient clipping norm (0: no clipping, as TRL)"""
    bf16: bool = False
    """bf16 mixed precision, for every model (the same as `accelerate launch --mixed_precision bf16`)"""
    onednn: bool = True
    """on a CPU, the float32 products of the models' linear layers by oneDNN, forward and backward, instead of torch's
    BLAS (MKL, at half the rate on AMD processors): the same products, float32's last bits summed in another order
    (infra/onednn.py). No effect on a GPU, under --bf16 (oneDNN already) or ZeRO-3; --no_onednn: off"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass instead of storing them: less memory, about a third more compute"""
    use_peft: bool = False
    """train LoRA adapters (peft) on the --lora_target_modules instead of all the model's weights; a script's
    reference is then the model with its adapters switched off, so no second copy is held"""
    lora_r: int = 16
    """the LoRA rank"""
    lora_alpha: int = 32
    """the LoRA scale numerator: the adapters' product is scaled by lora_alpha / lora_r"""
    lora_target_modules: Optional[list[str]] = None
    """the modules LoRA adapts, by name (TRL's); None: peft's default for the model's family, as TRL (q_proj and
    v_proj on Llama); all-linear: every linear layer but the output layer"""
    lora_modules_to_save: Optional[list[str]] = None
    """modules trained whole beside the adapters, by name (TRL's; e.g. embed_tokens)"""
    lora_dropout: float = 0.0
    """TRL's (default 0.05): 0 only, the scripts running no dropout (docs/flags.md, disable_dropout)"""
    use_rslora: bool = False
    """rank-stabilised LoRA: the adapters' product scaled by lora_alpha / sqrt(lora_r) (TRL's)"""
    use_dora: bool = False
    """DoRA, weight-decomposed LoRA (TRL's)"""
    merge_lora: bool = False
    """with --use_peft, save the policy with the adapters merged into its weights, instead of the adapters alone"""
    ema_beta: Optional[float] = None
    """keep ema = ema_beta * ema + (1 - ema_beta) * policy weights after each optimiser step, saved to output_dir/ema
    (LightRFT's EMA model; the language model alone: not PPO's critic or ILQL's heads); in [0, 1), None: off"""
    ema_cpu: bool = False
    """with --ema_beta, hold the EMA weights in CPU memory instead of the accelerator's"""
    # to be filled in at runtime
    distributed_type: tyro.conf.Suppress[str] = ""
    """how accelerate runs the processes (NO, MULTI_GPU, DEEPSPEED, ...)"""
    world_size: tyro.conf.Suppress[int] = 0
    """the number of processes"""
    local_mini_batch_size: tyro.conf.Suppress[int] = 0
    """completions per optimiser step on each process"""
    local_batch_size: tyro.conf.Suppress[int] = 0
    """completions per update on each process"""
    batch_size: tyro.conf.Suppress[int] = 0
    """completions per update on all processes"""
    num_updates: tyro.conf.Suppress[int] = 0
    """the number of updates of the run"""
    local_prompts: tyro.conf.Suppress[int] = 0
    """prompts per update on each process"""

    @property
    def warmup_updates(self):
        """the updates of the learning rate's warmup: --warmup_steps, else --warmup_ratio of the run's (transformers')"""
        return self.warmup_of(self.num_updates)

    def warmup_of(self, total):
        """the steps of the learning rate's warmup in a schedule of total steps: --warmup_steps, else --warmup_ratio of
        them (transformers')"""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total)

    def lora_config(self, modules_to_save=None):
        """peft's LoraConfig keywords of the flags (TRL's get_peft_config); modules_to_save: the script's own (a new head)"""
        targets = self.lora_target_modules
        return dict(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            target_modules="all-linear" if targets == ["all-linear"] else targets,  # (None: peft's default, as TRL)
            modules_to_save=(modules_to_save or []) + (self.lora_modules_to_save or []) or None,
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
        )

    def __post_init__(self):  # the checks of these flags, right after parsing (the scripts check their own)
        at_least(self, 1, "total_episodes", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches")
        at_least(self, 0, "learning_rate", "max_grad_norm", "checkpoint_every")  # (max_grad_norm 0: no clipping)
        at_least(self, 0, "warmup_steps", "weight_decay")
        if not self.adam_epsilon > 0:  # (0 divides by 0 where a weight has had no gradient)
            die(f"--adam_epsilon must be positive, got {self.adam_epsilon}")
        for name, in_range, words in [
            ("warmup_ratio", lambda v: 0 <= v <= 1, "[0, 1]"),
            ("min_lr_rate", lambda v: 0 <= v <= 1, "[0, 1]"),
            ("adam_beta1", lambda v: 0 <= v < 1, "[0, 1)"),
            ("adam_beta2", lambda v: 0 <= v < 1, "[0, 1)"),
        ]:
            if not in_range(getattr(self, name)):
                die(f"--{name} must be in {words}, got {getattr(self, name)}")
        at_least(self, 1, "keep_checkpoints", *(["lora_r", "lora_alpha"] if self.use_peft else []))
        if not 0 <= self.seed < 2**32:
            die(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.ema_beta is not None and not 0 <= self.ema_beta < 1:
            die(f"--ema_beta must be in [0, 1), got {self.ema_beta}")
        if self.lora_dropout != 0:  # (a policy that samples and one that trains must be one function)
            die(f"--lora_dropout must be 0: the scripts run no dropout (docs/flags.md), got {self.lora_dropout}")
        if self.ema_beta is not None and self.use_peft:  # LoRA's saves would each need an EMA twin
            die("--ema_beta does not work with --use_peft yet")
        if self.push_to_hub:  # a valid repo id, a saved model and the huggingface_hub package
            if not self.hub_model_id:
                die("--push_to_hub needs --hub_model_id, the repo to upload to (e.g. your-name/rloo-smollm2)")
            if not self.save_model:
                die("--push_to_hub uploads the saved model; drop --no_save_model")
            try:
                from huggingface_hub.utils import validate_repo_id
            except ImportError:
                die("--push_to_hub needs the huggingface_hub package: pip install huggingface_hub")
            try:
                validate_repo_id(self.hub_model_id)
            except ValueError as e:
                die(f"--hub_model_id {self.hub_model_id!r} is not a hub repo id: {str(e).strip().splitlines()[0]}")
        super().__post_init__()


@dataclass
class RunArgs(TrainArgs):
    """The RL scripts' run: TrainArgs, then the samples they print and write, and LightRFT's PTX loss."""

    steps_per_generation: Optional[int] = None
    """TRL's: the micro-batches (of --per_device_train_batch_size) one rollout is trained in, which sets
    --num_mini_batches to it / --gradient_accumulation_steps (a multiple of it); None: --num_mini_batches'"""
    generation_batch_size: Optional[int] = None
    """TRL's: the completions of one rollout on all processes, which sets --steps_per_generation to it /
    (--per_device_train_batch_size x processes); None: --num_mini_batches'"""
    num_sample_generations: int = 10
    """how many times per run to print a table of sample completions (0: never)"""
    num_completions_to_print: Optional[int] = 4
    """the completions in each table of samples (TRL's name; None: the whole batch of the main process)"""
    log_completions: bool = False
    """write every completion (prompt, completion, each source's reward, advantage) to output_dir/completions.jsonl,
    and with --track a wandb table of each update's"""
    log_unique_prompts: bool = False
    """the wandb table of --log_completions holds each prompt's first completion only (TRL's)"""
    cast_lm_head_to_fp32: bool = False
    """the policy's and reference's output projection in float32, its logits computed in float32 under --bf16 too
    (ScaleRL's recipe; TRL's name): a model whose projection is tied to its input embeddings is refused, as TRL's"""
    ptx_coef: float = 0.0
    """add ptx_coef times the policy's next-token loss on --ptx_dataset texts to each micro-batch's loss (LightRFT's PTX
    loss); 0: off"""
    ptx_dataset: Optional[str] = None
    """the PTX texts: a hub dataset id or a local .jsonl/.json/.parquet/.csv file or folder (needed when ptx_coef > 0)"""
    ptx_split: str = "train"
    """the split of --ptx_dataset"""
    ptx_text_field: str = "text"
    """the column of --ptx_dataset holding the texts"""
    ptx_max_length: Optional[int] = None
    """PTX texts are cut to this many tokens; None: max_prompt_length + response_length"""

    def __post_init__(self):
        at_least(self, 0, "num_sample_generations", "ptx_coef")
        at_least(self, 1, "steps_per_generation", "generation_batch_size", "num_completions_to_print")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            die("give --steps_per_generation or --generation_batch_size, not both (one sets the other, as TRL's)")
        if (self.steps_per_generation or self.generation_batch_size) and self.num_mini_batches != 1:
            die("--steps_per_generation and --generation_batch_size set --num_mini_batches: give one of them")
        if self.ptx_coef > 0 and not self.ptx_dataset:
            die("--ptx_coef needs --ptx_dataset (a hub id or a local .jsonl/.json/.parquet/.csv file of texts)")
        if self.ptx_max_length is not None and self.ptx_max_length < 2:
            die(f"--ptx_max_length must be at least 2 (a next-token loss needs two tokens), got {self.ptx_max_length}")
        check_paths(self, "ptx_dataset")
        super().__post_init__()
