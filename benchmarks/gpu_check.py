"""What `benchmarks/gpu_check.sh` runs on a GPU machine: the preflight, and a 7B-class model built offline.

    python benchmarks/gpu_check.py preflight            # exit 1, naming each missing piece, unless all is there
    python benchmarks/gpu_check.py build OUT_DIR        # a Qwen2.5-7B-shaped model with random weights, offline

The model has the body of Qwen2.5-7B (hidden 3584, MLP 18944, 28 query and 4 key-value heads, `GPU_CHECK_LAYERS` of
its 28 layers, default 8) and the tiny offline tokenizer of `trl_grpo_ext.testing` (its 400-token vocabulary: no
Hub download), saved in bf16. Random weights: the check measures speed and memory, not answers.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (module, what it is for, how to install it)
NEEDED = [
    ("vllm", "generation (colocate mode)", "pip install 'trl-grpo-ext[vllm]'"),
    ("bitsandbytes", "the 4-bit base (QLoRA)", "pip install bitsandbytes"),
    ("deepspeed", "the ZeRO-3 check", "pip install deepspeed"),
    ("trl_grpo_ext", "the trainers", "pip install -e '.[dev,vllm]'"),
]


def preflight() -> list[str]:
    """What is missing, one line each (empty when the check can run)."""
    problems = []
    import torch

    if not torch.cuda.is_available():
        problems.append(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    for module, purpose, fix in NEEDED:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an import that fails for any reason (a missing CUDA library too) is missing
            problems.append(f"{module} ({purpose}) does not import: {type(exc).__name__}: {exc}; {fix}")
    return problems


def build(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    from trl_grpo_ext.testing import build_tiny_model

    tiny = build_tiny_model(out / "tiny")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny)
    layers = int(os.environ.get("GPU_CHECK_LAYERS", "8"))
    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=len(tokenizer), max_position_embeddings=4096,
                         rope_theta=1e6, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    # a CPU builds it too (GPU_CHECK_LAYERS=1: a smoke run of the build and of overhead.py on it, without vLLM)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = out / "qwen2.5-7b-shaped"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {folder}: {layers} layers of Qwen2.5-7B's shape, {params / 1e9:.2f}B parameters (bf16)")
    return folder


def main(argv: list[str]) -> int:
    if argv[:1] == ["preflight"]:
        problems = preflight()
        for problem in problems:
            print(f"gpu_check: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if argv[:1] == ["build"] and len(argv) == 2:
        build(Path(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
