"""The offline world both sides of a benchmark share: a byte-level BPE tokenizer, a GPT-NeoX of pythia-14m's shape
(random weights), prompts and a reward function, written to one folder in a few seconds.

    python benchmark/synthetic/world.py [FOLDER] [VOCAB_SIZE]     # default benchmark/.world, 4096"""

import glob
import json
import os
import sys

REWARD = '''
def vowels(prompts, completions, **kwargs):
    """The share of vowels in each completion: dense, and learnable by a small random model."""
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]
'''


def build(folder, vocab_size=4096, num_prompts=512, seed=0):
    """Write folder/model (tokenizer + policy), folder/reward_model, folder/prompts.jsonl and folder/reward.py, unless
    already there."""
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    from pydoc_data.topics import topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoTokenizer,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    os.makedirs(folder, exist_ok=True)
    texts = ["\n".join(topics.values())]  # Python's own documentation: English prose present in every Python
    if vocab_size > 8192:
        # the documentation yields about 9,000 tokens; pythia's 50,304 take the standard library's sources too (32 MB)
        lib = os.path.dirname(os.__file__)
        for path in sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True)):
            if "site-packages" not in path:
                with open(path, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|pad|>"],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    special = dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>", pad_token="<|pad|>")
    model_dir = os.path.join(folder, "model")
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    # pythia-14m's shape: 6 layers, hidden 128, 4 heads
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    GPTNeoXForCausalLM(config).save_pretrained(model_dir)
    # a reward model (and PPO's critic init) of the same shape, random: the PPO benchmark measures speed
    config.num_labels = 1
    torch.manual_seed(seed + 1)
    GPTNeoXForSequenceClassification(config).save_pretrained(os.path.join(folder, "reward_model"))
    tokenizer.save_pretrained(os.path.join(folder, "reward_model"))

    # prompts: the first words of each documentation topic, about 16 to 32 tokens each
    prompts = []
    for body in topics.values():
        words = body.split()
        for start in range(0, min(len(words), 400), 40):
            prompts.append(" ".join(words[start : start + 20]))
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts[:num_prompts])
    with open(os.path.join(folder, "reward.py"), "w") as f:
        f.write(REWARD)
    open(os.path.join(folder, "done"), "w").close()
    return folder


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "benchmark/.world", int(sys.argv[2]) if len(sys.argv) > 2 else 4096))
