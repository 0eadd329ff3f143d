"""The TL;DR benchmark's specifics (rloo_tldr.py, ppo_tldr.py): its flags and their defaults (the SFT policy, the reward
model, the dataset and its splits), its held-out set (the first --eval_examples prompts of --eval_split with their
reference summaries), its evaluation (greedy summaries scored by the reward model alone, as the published win rates),
and the judge's command it prints at the end.
"""

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import tyro

from utils import die

from .data import check_paths, load_prompts
from .flags import ScoreArgs, set_config

JUDGE = (
    "judge the final summaries against the references: python tools/judge_tldr.py --samples {output_dir}"
    " --judge_base_url https://api.openai.com/v1 --judge_model gpt-4o-mini"
)


@dataclass
class TldrArgs(ScoreArgs):
    """The TL;DR benchmark's policy, prompts, reward model and evaluation (rloo_tldr.py, ppo_tldr.py)."""

    sft_model_path: str = "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT policy (init and reference): a hub id or a folder"""
    reward_model_path: str = "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr"
    """the reward model, a sequence-classification model with num_labels=1: a hub id or a folder"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """reward functions besides the reward model: 'sentiment', 'accuracy', 'path/to/file.py:function' or
    'package.module:function', called as fn(prompts, completions, **columns) (examples/reward_server.py asks an HTTP
    server); repeatable"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward source, in the order: the reward model, then functions (each as given); default all 1"""
    dataset_name: str = "trl-lib/tldr"
    """a hub dataset id, or a local folder of split files (train.parquet, validation.jsonl, ...) or a single file"""
    dataset_config: Optional[str] = None
    """the configuration of a hub dataset that has several (TRL's), wherever --dataset_name is read (held out too)"""
    dataset_split: str = "train"
    """the split to train on"""
    eval_split: str = "validation"
    """the split to evaluate on"""
    prompt_field: str = "prompt"
    """the column holding the prompts ("SUBREDDIT: r/... TITLE: ... POST: ... TL;DR:")"""
    reference_field: str = "completion"
    """the column holding the reference summaries the judge compares against"""
    max_prompt_length: int = 512
    """prompts longer than this many tokens are dropped"""
    missing_eos_penalty: Optional[float] = 1.0
    """subtracted from the score of a summary that never produced the stop token"""
    eval_every: int = 100_000
    """evaluate every this many episodes, besides before training and at the end (0: only then)"""
    eval_examples: int = 1000
    """how many eval-split prompts to summarise (the published win rates use the first 1,000)"""
    eval_batch_size: int = 64
    """summaries generated per forward pass in the evaluation, per process"""
    eval_long_prompts: Literal["drop", "truncate"] = "drop"
    """eval prompts longer than --max_prompt_length: drop them (the N+ study's filter), or keep their last
    max_prompt_length tokens (TRL's evaluation takes the first eval_examples prompts, none dropped)"""

    # the evaluation of the published win rates: greedy summaries only, scored by the reward model alone (no flags)
    num_eval_generations: ClassVar[int] = 0
    eval_sources: ClassVar[int] = 1

    def __post_init__(self):
        if self.eval_every < 0 or self.eval_examples < 1 or self.eval_batch_size < 1 or self.max_prompt_length < 1:
            die("--eval_every must be >= 0, --eval_examples, --eval_batch_size and --max_prompt_length >= 1")
        check_paths(self, "sft_model_path", "reward_model_path", "reward_fn", "dataset_name")
        set_config(self)
        super().__post_init__()

    @property
    def model_name_or_path(self):  # the name the plumbing reads
        return self.sft_model_path

    @property
    def reward_model_paths(self):
        return (self.reward_model_path,)


def load_eval(args, tokenizer):
    """The held-out set as data.load_eval gives one: the first --eval_examples prompts of the dataset's --eval_split and
    their reference summaries (the reward model, which scores them, reads no column)."""
    raw = []  # the prompts as the dataset holds them (a reward model of reward.py renders them)
    queries, texts, references, _ = load_prompts(
        args.dataset_name,
        split=args.eval_split,
        prompt_field=args.prompt_field,
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
        reference_field=args.reference_field,
        long_prompts=args.eval_long_prompts,
        raw=raw,
    )
    first = slice(args.eval_examples)
    return queries[first], texts[first], references[first], {}, raw[first]
