"""What differs between the TRL releases trl_grpo_ext supports, in one place; used by `trainer.py` only.

The supported range is the `trl` requirement in `pyproject.toml`; CI runs the test suite on its newest release and a
subset of it on its oldest (`.ci/run`). Each shim names the release that changed the seam. A signature shim decides by
the parameters of the function it calls (`TRL_SEAMS` in `trainer.py` lists each range's, and `tests/test_trl_compat.py`
checks the installed release against them); an attribute shim by the release, so that a later release that drops the
attribute fails the compatibility test instead of getting the old behaviour.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

from packaging.version import Version
from trl.chat_template_utils import parse_response as _trl_parse_response

_PARSE_RESPONSE = inspect.signature(_trl_parse_response).parameters
TRL_VERSION = Version(version("trl"))


def generate_single_turn(trainer, generate, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
    """`generate(prompt_ids, images, multimodal_fields, ...)`, TRL's `_generate_single_turn` (bound, from `super()`),
    with the block size `num_generations` in the form that `generate` takes it.

    trl 1.14.1 added the parameter `num_generations` (the block of rows that vLLM server mode asks `n` completions
    for). trl 1.11.0 to 1.14.0 read it from the trainer instead: `num_generations = self.num_generations if mode ==
    "train" else self.num_generations_eval`; so that attribute holds the block size for the call. Those releases' own
    `_generate` passes none (`num_generations` None): the block is then the group size, as trl 1.14.1 passes it. The
    form is read from `generate` itself, so that a stand-in for TRL's backend (a test's) may take either.
    """
    params = inspect.signature(generate).parameters
    name = "num_generations" if trainer.model.training else "num_generations_eval"
    block = getattr(trainer, name) if num_generations is None else num_generations
    if "num_generations" in params or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return generate(prompt_ids, images, multimodal_fields, block, has_tool_images=has_tool_images)
    saved = getattr(trainer, name)
    setattr(trainer, name, block)
    try:
        return generate(prompt_ids, images, multimodal_fields, has_tool_images=has_tool_images)
    finally:
        setattr(trainer, name, saved)


def parse_response(tokenizer, ids: list[int], prefix: list[int] | None, tools):
    """`trl.chat_template_utils.parse_response`: trl 1.16.0 added `tools=` (tool-call arguments typed by each tool's
    JSON schema); before, TRL's own `_generate` parses without them, and so does this."""
    if "tools" in _PARSE_RESPONSE:
        return _trl_parse_response(tokenizer, ids, prefix=prefix, tools=tools)
    return _trl_parse_response(tokenizer, ids, prefix=prefix)


def check_shared_prefix_forward() -> None:
    """`shared_prefix_forward` needs trl 1.15.0: its packed prefix tree is scored through TRL's fused LM head with
    pre-shifted labels (`add_fused_lm_head`: `labels = shift_labels`); before, TRL takes each token's log-prob from the
    logits of the position before it in the row, which a packed tree does not keep."""
    if TRL_VERSION < Version("1.15.0"):
        raise ValueError(
            f"shared_prefix_forward=True needs trl>=1.15 (TRL's fused LM head scores the packed prefix tree), but trl "
            f"{TRL_VERSION} is installed; upgrade trl, or set shared_prefix_forward=False."
        )


def set_missing_attributes(trainer) -> None:
    """Trainer attributes that `GRPOTrainer.__init__` of an older release does not set, as that release behaves.

    `eos_token_ids` (trl 1.14.2): every EOS id the model's generation config declares, and the tokenizer's. Before,
    a completion ends at the tokenizer's alone (`is_eos = completion_ids == self._tokenizer.eos_token_id`).
    """
    if TRL_VERSION < Version("1.14.2"):
        trainer.eos_token_ids = [trainer._tokenizer.eos_token_id]
