"""Tiny offline world for the tests: a BPE tokenizer, a policy, a reward model and prompts, all built in seconds."""

import json
import os
import shlex
import sys

import pytest
from warm import Server

# Set before transformers/datasets are imported anywhere, so nothing ever reaches for the network.
for _name, _value in [
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
    ("WANDB_MODE", "disabled"),
]:
    os.environ.setdefault(_name, _value)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = Server(REPO)


def pytest_sessionfinish(session, exitstatus):
    WARM.close()


def run_script(command, cwd, timeout=600):
    """Run a repo script in a process of its own, as a user would type it ("rloo.py --rloo_k 4 ..."), forked from a
    server that has imported torch and the rest once (tests/warm.py); the caller inspects returncode/stdout/stderr."""
    script, *args = shlex.split(command)
    cmd = [sys.executable, os.path.join(REPO, script), *args]
    return WARM.run(cmd, cwd=cwd, env=os.environ.copy(), timeout=timeout)


def descendants(pid):
    """Every live process below pid, from /proc. torchrun starts each worker in a session of its own, so killing the
    launcher's process group does not reach the workers; a test that means to kill a whole run must kill these."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "(name)": state, ppid, ...
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid):
    """pid runs and is not a zombie"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_after_rows(proc, output_dir, rows, group=False):
    """SIGKILL a running script once it has written `rows` rows of metrics.jsonl, as a crash would, possibly
    mid-checkpoint or mid-row; with group=True a launcher with every process below it (the training processes
    included, which torchrun puts in sessions of their own). Returns the number of rows then on disk, after checking
    that no process of the run is left."""
    import contextlib
    import signal
    import time

    path = os.path.join(output_dir, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= rows:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    victims = [proc.pid]
    if group:  # stop them all first, so that none goes on while the others die
        victims += descendants(proc.pid)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        victims = [proc.pid, *descendants(proc.pid)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while any(alive(v) for v in victims[1:]):
        assert time.time() < deadline, "a process of the killed run is still alive"
        time.sleep(0.05)
    return len(open(path).read().splitlines())


@pytest.fixture(autouse=True)
def onednn_off():
    """--onednn switched off after each test: a test that runs a script's main() in this process (start() switches it
    on) leaves no later test's models routed"""
    yield
    if "infra.onednn" in sys.modules:
        sys.modules["infra.onednn"].ON = False


@pytest.fixture
def run():
    return run_script


def train_bpe(text, vocab_size, special_tokens):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on `text` in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=special_tokens)
    tok.train_from_iterator([text], trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # Python's own docs are always installed: real English prose with no download.
    tok = train_bpe("\n".join(topics.values()), 512, ["<|endoftext|>", "<|pad|>"])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    path = str(tmp_path_factory.mktemp("tiny_tokenizer"))
    wrapped.save_pretrained(path)

    # Fail here, loudly, rather than deep inside a script if the saved tokenizer is unusable.
    loaded = AutoTokenizer.from_pretrained(path)
    assert len(loaded) > 300
    assert loaded.decode(loaded("hello world")["input_ids"]) == "hello world"
    assert isinstance(loaded.eos_token_id, int) and isinstance(loaded.pad_token_id, int)
    assert loaded.eos_token_id != loaded.pad_token_id
    return path


def _tiny_config(tokenizer, **kwargs):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **kwargs,
    )


def _save_with_tokenizer(model_class, config, seed, tokenizer, path):
    import torch

    torch.manual_seed(seed)
    model_class(config).save_pretrained(path)
    # Tokenizer beside the weights, so one path works like a hub name for both Auto classes.
    tokenizer.save_pretrained(path)
    return path


def with_chat_template(model_dir, path, template):
    """model_dir's model and tokenizer saved to path, the tokenizer with this chat template"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer_dir, tmp_path_factory):
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    path = str(tmp_path_factory.mktemp("tiny_model"))
    return _save_with_tokenizer(GPTNeoXForCausalLM, _tiny_config(tokenizer), 0, tokenizer, path)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_tokenizer_dir, tmp_path_factory):
    from transformers import AutoTokenizer, GPTNeoXForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    path = str(tmp_path_factory.mktemp("tiny_reward_model"))
    config = _tiny_config(tokenizer, num_labels=1)
    return _save_with_tokenizer(GPTNeoXForSequenceClassification, config, 1, tokenizer, path)


@pytest.fixture(scope="session")
def tiny_prompts_file(tmp_path_factory):
    verbs = [
        "Tell me about",
        "Describe",
        "Write a poem about",
        "Explain",
        "Give advice on",
        "Summarize the story of",
        "Ask a question about",
        "Share a fact about",
    ]
    subjects = [
        "the river",
        "the old house",
        "a quiet morning",
        "the mountain",
        "my garden",
        "the city at night",
        "a lost dog",
        "the winter sea",
    ]
    prompts = [f"{verb} {subject}" for verb in verbs for subject in subjects]
    assert len(prompts) == 64 == len(set(prompts))
    path = tmp_path_factory.mktemp("tiny_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


@pytest.fixture(scope="session")
def tldr_dir(tmp_path_factory):
    """train.parquet and validation.parquet with trl-lib/tldr's columns and prompt shape."""
    from pydoc_data.topics import topics

    import datasets

    subreddits = ["relationships", "AskReddit", "personalfinance", "tifu", "cooking", "running"]
    rows = []
    for i, (title, text) in enumerate(sorted(topics.items())[:72]):
        words = text.split()
        post = " ".join(words[:30])
        prompt = f"SUBREDDIT: r/{subreddits[i % 6]}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
        rows.append({"prompt": prompt, "completion": " " + " ".join(words[30 : 33 + i % 7])})
    path = tmp_path_factory.mktemp("tldr")
    datasets.Dataset.from_list(rows[:56]).to_parquet(str(path / "train.parquet"))
    datasets.Dataset.from_list(rows[56:]).to_parquet(str(path / "validation.parquet"))
    return str(path)


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny policy made to produce its EOS token about a third of the time (a constant direction added to the final
    hidden state, read by the EOS row of the output layer): rows and processes stop at different steps."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("eos_model"))
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return stop_a_third_of_the_time(tiny_model_dir, path)


def stop_a_third_of_the_time(model_dir, path):
    """A GPT-NeoX of model_dir, saved to path, made to produce its EOS token about a third of the time: a constant
    direction added to the final hidden state, read by the EOS row of the output layer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        norm = model.gpt_neox.final_layer_norm
        direction = torch.ones_like(norm.bias) / norm.bias.numel() ** 0.5
        norm.weight.mul_(0.1)
        norm.bias.copy_(direction)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = 5.5 * direction
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_tokenizer_dir, tmp_path_factory):
    """A tiny Llama for the vLLM tests: vLLM's CPU attention takes head sizes from 32 up (the GPT-NeoX above has 16)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return _save_with_tokenizer(LlamaForCausalLM, config, 0, tokenizer, str(tmp_path_factory.mktemp("tiny_llama")))


# whole tool calls, each one token of the caller model's vocabulary: a tiny model calls its tools from the first update
CALLS = [
    '<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
]


@pytest.fixture(scope="session")
def caller_model_dir(tiny_tokenizer_dir, tmp_path_factory):
    """A GPT-NeoX with vLLM-sized heads and 1024 positions whose vocabulary holds two whole tool calls (CALLS: the
    calculator's and an `add` tool's) as tokens, made to produce each of them and its EOS token about a fifth of the
    time (stop_a_third_of_the_time's direction): its turns call tools, end, or run on, so episodes have several turns."""
    import torch
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_tokens(CALLS)
    config = _tiny_config(tokenizer)
    config.hidden_size, config.intermediate_size, config.max_position_embeddings = 64, 128, 1024
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    with torch.no_grad():
        norm = model.gpt_neox.final_layer_norm
        direction = torch.ones_like(norm.bias) / norm.bias.numel() ** 0.5
        norm.weight.mul_(0.1)
        norm.bias.copy_(direction)
        for token in [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(CALLS)]:
            model.get_output_embeddings().weight[token] = 5.5 * direction
    path = str(tmp_path_factory.mktemp("caller_model"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
