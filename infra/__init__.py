"""The plumbing the scripts share, beside their method (utils.py): one call at each point of use, a module by concern.

    flags         the flag groups every script's Args inherits: the rollout, the scores, the data, the evaluation, ...
    run_flags     ... and the run's: the batch, the optimiser and its schedule, the outputs, precision, LoRA, EMA, PTX
    models        loading models and tokenizers, the processes, the policy, reference and critic a script gets
    data          datasets, prompts (chat templates, tools' schemas), the prompts' draw, the held-out set, PTX texts
    rewards       reward functions and models, loaded and called
    environments  multi-turn environments and tools (--environment); the episode loop is utils.episodes
    rollout       the Batch and the Sampler: drawing prompts, sampling and scoring a batch, dynamic sampling's rounds
    ahead         --max_staleness: the batches of the next updates sampled in a thread on a copy of the policy
    decode        the scripts' own decoder, generate(), its inverse-CDF draw by the script's sampling rule
    graphs        --cuda_graphs (on a GPU, by default): decoding steps captured in CUDA graphs
    onednn        --onednn (on a CPU, by default): the linear layers' float32 products by oneDNN
    engine        --use_vllm: a vLLM engine in the training process
    evaluation    the held-out evaluation
    outputs       output_dir, resume, checkpoints, logs, the model card and the hub
    run           start() and Run: the processes, the batch sizes and each step's plumbing
    render        TRL's rules for a dataset's row as token ids: chat templates, the completion's tokens, implicit prompts
    offline       sft.py, reward.py, dpo.py and kto.py's: their flags, datasets in TRL's formats, batches of examples,
                  pairs or labelled completions
    packing       sft.py's examples packed into rows (TRL's bfd, bfd_split, wrapped); a micro-batch run without padding
    tldr          the TL;DR benchmark's flags, held-out set, evaluation and judge (rloo_tldr.py, ppo_tldr.py)

The libraries made for each job do the work (accelerate, transformers, datasets, TensorBoard, wandb, huggingface_hub,
vLLM); what they do not give is here: a checkpoint is complete or absent, a resumed run's logs are cut back to its
checkpoint, a resume that would change the run is refused. Below: the surface the scripts use.
"""

from .argv import trl_argv
from .data import teacher_view
from .decode import generate
from .flags import (
    DataArgs,
    DynamicSamplingArgs,
    EnvArgs,
    EvalArgs,
    RefSyncArgs,
    RolloutArgs,
    at_least,
    json_object,
    router_coef,
)
from .models import load_policy, load_policy_and_critic, prepare
from .offline import (
    ExampleArgs,
    finite_number,
    load_examples,
    load_model,
    load_references,
    read_examples,
    save_reward_input,
)
from .packing import PackingArgs, forward_packed, lay_out
from .rewards import call_reward_fn, load_reward_fn
from .rollout import Sampler
from .run import CheckpointedNumber, start
from .run_flags import RunArgs
from .tldr import TldrArgs

__all__ = [
    "DataArgs", "EnvArgs", "EvalArgs", "DynamicSamplingArgs", "RefSyncArgs", "RolloutArgs", "RunArgs", "TldrArgs",
    "ExampleArgs", "PackingArgs", "lay_out",
    "load_policy", "load_policy_and_critic", "prepare", "Sampler", "teacher_view", "CheckpointedNumber", "start",
    "read_examples", "finite_number", "load_examples", "load_model", "load_references", "save_reward_input", "forward_packed",
    "json_object", "at_least", "router_coef", "trl_argv", "generate", "load_reward_fn", "call_reward_fn",
]  # fmt: skip
