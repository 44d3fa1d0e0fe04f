"""`GRPOExtTrainer`: TRL's `GRPOTrainer` with a few narrow seams opened. The one module that touches TRL internals.

Seams (trl 1.16, `trl/trainer/grpo_trainer.py`), each wrapped, never copied:

- `_calculate_rewards(inputs, prompts, completions, completion_ids_list) -> Tensor (N, F)`: wrapped to keep the
  gathered rewards, prompts and decoded completions of the batch on the trainer.
- `_generate_and_score_completions(inputs) -> dict`: wrapped as `out = super()...; out["advantages"] =
  estimator(batch)`. TRL's loss takes (B,) or (B, T) advantages ("conditionally unsqueeze" in `_compute_loss`).
  Rows are shuffled right after, in `_prepare_inputs`, so group maths must happen here.
- `out["tool_mask"]`: the loss masks with `completion_mask * tool_mask`; per-token loss weights are multiplied in,
  and `out["num_items_in_batch"]` (the dapo / cispo normaliser) is recomputed from the product.
- `_tokenize_prompts(prompts) -> (prompt_ids, images, multimodal_fields)`: per-row context prefixes join the prompt.
- `_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, ...) -> (completion_ids,
  logprobs)`: per-row completion prefixes; it serves transformers, continuous-batching and vLLM generation alike.
- `_save_checkpoint(model, trial)` / `_load_optimizer_and_scheduler(checkpoint)`: our state (resets, callbacks'
  counters, a reset reference) is saved beside TRL's in each checkpoint and restored on `resume_from_checkpoint`.
- `ref_model` (full fine-tuning) and the PEFT adapter named "ref" (LoRA), which TRL uses as the reference policy
  when present: overwritten by reference resets.
- `_generate(prompts)`: hands over a batch that a staged rollout generated already (ARPO); `generate_rollouts` calls
  TRL's for unscored stages. `_get_per_token_logps_and_entropies`: entropies of unscored rollouts.

`tests/test_trl_compat.py` checks every seam named here and fails, naming it, when TRL renames or reshapes one.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from .advantages import get_advantage, trl_group
from .batch import RolloutBatch
from .rewards import REWARDS, get_reward
from .sampling import splice_rows, varied_groups

logger = logging.getLogger(__name__)

# The TRL private methods this module wraps, with the parameters it relies on; tests/test_trl_compat.py checks them.
TRL_SEAMS = {
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_tokenize_prompts": ["self", "prompts"],
    "_generate_single_turn": ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
    "_save_checkpoint": ["self", "model", "trial"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_generate": ["self", "prompts"],
    "_get_per_token_logps_and_entropies": [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss",
    ],
}  # fmt: skip
# Trainer attributes read here (set by GRPOTrainer.__init__).
TRL_ATTRIBUTES = [
    "reward_weights", "reward_func_names", "reward_funcs", "num_generations", "num_generations_eval", "_logs",
    "_metrics", "_tokenizer", "eos_token_ids", "max_completion_length", "beta", "ref_model", "generation_config",
    "generation_kwargs", "_get_output_dir", "environment_factories", "_standalone_tools",
]  # fmt: skip


@dataclass
class RowPrefixes:
    """Token prefixes for the rows of the next generation call (one list of ids per row, or None)."""

    context_ids: list[list[int]] | None = None  # joins the prompt: generated after, never trained
    completion_ids: list[list[int]] | None = None  # starts the completion: continued, and trained
    num_generations: int | None = None  # the block size the generation backend sees (vLLM server: `n`)
    consumed: bool = False


class GRPOExtTrainer(GRPOTrainer):
    """`GRPOTrainer` with pluggable advantages, per-token loss weights and generation from per-row prefixes.

    A drop-in replacement: with `GRPOExtConfig` defaults (or a plain `GRPOConfig`) it trains bit for bit like
    `GRPOTrainer`. Reward functions may also be given by registry name or dotted import path
    (`reward_funcs=["tag_format", "accuracy"]`); other strings keep TRL's meaning, a reward model id.

    >>> from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer
    >>> trainer = GRPOExtTrainer(  # doctest: +SKIP
    ...     model="Qwen/Qwen2.5-0.5B-Instruct",
    ...     reward_funcs=["accuracy", "think_format"],
    ...     args=GRPOExtConfig(output_dir="out", advantage_estimator="group"),
    ...     train_dataset=dataset,
    ... )
    """

    _tag_names = ["trl", "grpo", "trl-grpo-ext"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pos, **kwargs):
        # Resolve our names before TRL loads any model, so that a typo fails in a second, not after a download.
        estimator_name = getattr(args, "advantage_estimator", "group")
        estimator = get_advantage(estimator_name)
        if callable(estimator_name):
            # The config is pickled into every checkpoint (training_args.bin); a closure would not pickle.
            args.advantage_estimator = f"{estimator_name.__module__}.{estimator_name.__qualname__}"
        reward_funcs = _resolve_rewards(reward_funcs)
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        self.advantage_estimator = estimator
        self._rewrites_advantages = estimator is not trl_group
        self._prefix_columns = (
            getattr(self.args, "context_prefix_column", None),
            getattr(self.args, "completion_prefix_column", None),
        )
        self._row_prefixes: RowPrefixes | None = None
        self.pregenerated: tuple | None = None  # a rollout generated in stages, for `_generate` to hand over
        self.last_scoring: dict | None = None
        # `{name}` in prompts is replaced by the value, and reward functions get it as a column (curriculum budget).
        self.prompt_fields: dict[str, object] = {}
        for module in (self.model, getattr(self, "ref_model", None)):
            _disable_bnb_cpu_weight_repacking(module)
        # Rewards that need the policy's tokenizer or stop tokens declare the attribute and leave it None.
        for reward in self.reward_funcs:
            for attribute, value in (("tokenizer", self._tokenizer), ("eos_token_ids", self.eos_token_ids)):
                if hasattr(reward, attribute) and getattr(reward, attribute) is None:
                    setattr(reward, attribute, value)
        self.reset_history: list[dict] = []  # applied reference / optimizer resets (ProRL)
        self._pending_reset: dict | None = None
        self._refill_generator: torch.Generator | None = None
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "attach"):
                callback.attach(self)
        if getattr(self.args, "budget_start", None) is not None:
            from .curriculum import TokenBudgetCurriculum

            self.add_callback(
                TokenBudgetCurriculum(
                    budget_start=self.args.budget_start,
                    budget_end=self.args.budget_end,
                    budget_decays=self.args.budget_decays,
                    schedule=self.args.budget_schedule,
                    total_steps=self.args.budget_total_steps,
                    cap_generation=self.args.budget_caps_generation,
                )
            )

    def add_callback(self, callback):
        """`Trainer.add_callback`, plus: a callback with an `attach(trainer)` method is handed this trainer."""
        super().add_callback(callback)
        if hasattr(callback, "attach"):
            callback.attach(self)

    def log_metric(self, name: str, value: float, mode: str = "train") -> None:
        """Log a scalar with TRL's own metrics (averaged over each logging step, sent to `report_to`)."""
        self._metrics[mode][name].append(float(value))

    def set_generation_cap(self, max_new_tokens: int) -> None:
        """Cap the next generations at `max_new_tokens`, everywhere TRL keeps the cap.

        That is `max_completion_length` (the tool-call loop's limit, and `dr_grpo`'s loss normaliser), the
        transformers generation config and kwargs, and the vLLM generation's `max_tokens`.
        """
        max_new_tokens = int(max_new_tokens)
        self.max_completion_length = max_new_tokens
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.max_new_tokens = max_new_tokens
        if isinstance(getattr(self, "generation_kwargs", None), dict):
            self.generation_kwargs["max_new_tokens"] = max_new_tokens
        if getattr(self, "vllm_generation", None) is not None:
            self.vllm_generation.max_completion_length = max_new_tokens

    def generate_stage(
        self, prompts: list, num_generations: int, max_new_tokens: int | None = None, stop_token_ids: list[int] = ()
    ) -> list[list[int]]:
        """Generate one completion per row of `prompts`, for a stage of a staged rollout (a PTA plan, say).

        Rows come in blocks of `num_generations` consecutive rows that share their prompt (vLLM server mode asks
        for `n=num_generations` per block). Nothing is scored or logged; the result is token ids per row. The
        generation cap is `max_new_tokens` for this stage only. `stop_token_ids` also end the stage's generation
        (kept as the last token) with transformers generation; other backends stop at the cap and the caller cuts.
        """
        if len(prompts) % num_generations:
            raise ValueError(f"{len(prompts)} rows cannot be split into blocks of num_generations={num_generations}.")
        cap, eos = self.max_completion_length, self.eos_token_ids
        config = getattr(self, "generation_config", None)
        config_eos = config.eos_token_id if config is not None else None
        if max_new_tokens is not None:
            self.set_generation_cap(max_new_tokens)
        if stop_token_ids and config is not None:
            # TRL's transformers path stops at generation_config.eos_token_id and masks after the first of
            # `self.eos_token_ids`: both get the stage's stop tokens, then both are restored.
            self.eos_token_ids = [*eos, *stop_token_ids]
            config.eos_token_id = list(self.eos_token_ids)
        try:
            prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)
            completion_ids, _ = self._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations)
        finally:
            self.eos_token_ids = eos
            if config is not None:
                config.eos_token_id = config_eos
            if max_new_tokens is not None:
                self.set_generation_cap(cap)
        return [_as_list(ids) for ids in completion_ids]

    def completion_entropies(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """Per-token entropy of the policy's next-token distribution over each completion (no gradient).

        Returns one (len(completion),) tensor per row; ARPO reads them after tool results to decide where to branch.
        """
        device = self.accelerator.device
        pad = self._tokenizer.pad_token_id
        prompts = [torch.tensor(p, dtype=torch.long) for p in prompt_ids]
        completions = [torch.tensor(c if c else [pad], dtype=torch.long) for c in completion_ids]
        p_len, c_len = max(len(p) for p in prompts), max(len(c) for c in completions)
        input_ids = torch.full((len(prompts), p_len + c_len), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            input_ids[i, p_len - len(p) : p_len], attention[i, p_len - len(p) : p_len] = p, 1  # left-padded prompt
            input_ids[i, p_len : p_len + len(c)], attention[i, p_len : p_len + len(c)] = c, 1  # right-padded
        with torch.no_grad():
            _, entropies, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids.to(device), attention.to(device), c_len,
                batch_size=self.args.per_device_train_batch_size, compute_entropy=True,
            )  # fmt: skip
        return [entropies[i, : len(c)].float().cpu() for i, c in enumerate(completion_ids)]

    def generate_rollouts(self, prompts: list, num_generations: int, context_ids: list[list[int]] | None = None):
        """Run TRL's whole generation (tool-call loop included) for `prompts`, unscored.

        Returns TRL's `_generate` tuple: (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields,
        images, tool_images). `context_ids` (one list per row) continue earlier token sequences: an ARPO branch
        continues its parent's trajectory after a tool result, token for token.
        """
        self._ensure_tool_dicts(len(prompts))
        self.set_row_prefixes(context_ids=context_ids, num_generations=num_generations)
        try:
            return super()._generate(prompts)
        finally:
            self._row_prefixes = None

    def _ensure_tool_dicts(self, rows: int) -> None:
        # TRL builds the per-row tool tables in `_generate_and_score_completions`, right before `_generate`; an
        # unscored rollout needs them too. Standalone tools only: environments are reset per scored batch.
        if self.environment_factories is not None:
            raise NotImplementedError("rollouts outside the scored batch do not support environment_factory yet.")
        sync = {t.__name__: t for t in self._standalone_tools if not inspect.iscoroutinefunction(t)}
        async_ = {t.__name__: t for t in self._standalone_tools if inspect.iscoroutinefunction(t)}
        self._sync_tool_dicts, self._async_tool_dicts = [sync] * rows, [async_] * rows

    def _generate(self, prompts: list):
        # Seam: GRPOTrainer._generate(prompts) -> (prompt_ids, completion_ids, tool_mask, completions, logprobs,
        # extra_fields, images, tool_images), called once by `_generate_and_score_completions`. When a multi-stage
        # rollout has already generated the batch (ARPO), it is handed over here instead of generating again.
        if self.pregenerated is not None:
            result, self.pregenerated = self.pregenerated, None
            return result
        return super()._generate(prompts)

    # ------------------------------------------------------------------ seams
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Seam: GRPOTrainer._calculate_rewards(inputs, prompts, completions, completion_ids_list) returns
        # `rewards_per_func = gather(rewards_per_func)`: (N, F) over all processes. Kept, not changed.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.last_scoring = {
            "rewards_per_func": rewards_per_func,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids_list,
        }
        return rewards_per_func

    def _tokenize_prompts(self, prompts: list):
        # Seam: GRPOTrainer._generate calls `prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)`
        # and uses prompt_ids for generation and for the loss's forward pass: context ids added here are context.
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        prefixes = self._row_prefixes
        if prefixes is not None and not prefixes.consumed and prefixes.context_ids is not None:
            if any(isinstance(v, list) for v in multimodal_fields.values()):
                raise NotImplementedError(
                    "context prefixes with per-token multimodal fields (a VLM processor) are not supported yet; "
                    "put the prefix text into the prompt itself."
                )
            prompt_ids = [_as_list(p) + c for p, c in zip(prompt_ids, prefixes.context_ids, strict=True)]
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Seam: GRPOTrainer._generate calls `completion_ids, logprobs = self._generate_single_turn(prompt_ids, images,
        # multimodal_fields, num_generations)` once, then `_tool_call_loop` calls it again for post-tool turns. Row
        # prefixes apply to that first call only (they are consumed by it).
        prefixes = self._row_prefixes
        if prefixes is None or prefixes.consumed:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        prefixes.consumed = True
        block = prefixes.num_generations or num_generations
        if prefixes.completion_ids is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, block, has_tool_images=has_tool_images
            )
        started = [_as_list(p) + c for p, c in zip(prompt_ids, prefixes.completion_ids, strict=True)]
        generated, logprobs = super()._generate_single_turn(
            started, images, multimodal_fields, block, has_tool_images=has_tool_images
        )
        completion_ids = [c + _as_list(g) for c, g in zip(prefixes.completion_ids, generated, strict=True)]
        if logprobs is not None:
            # The prefix was not sampled by the backend: no sampling log-prob (TRL maps None to NaN and gives such
            # tokens an importance ratio of 1).
            logprobs = [[None] * len(c) + list(lp) for c, lp in zip(prefixes.completion_ids, logprobs, strict=True)]
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        # Seam: `out = super()._generate_and_score_completions(inputs)`; `out["advantages"]` is (B,) for this process.
        # It runs once per generation batch, before that batch's loss: resets requested since the last batch apply
        # here, so a batch is never generated under one reference and scored against another.
        training = self.model.training
        if training and self._pending_reset is not None:
            self._apply_pending_reset()
        out = self._score_batch(self._fill_prompt_fields(inputs))
        if training and getattr(self.args, "dynamic_sampling", False):
            out = self._dynamic_sampling(out)
        return out

    def _score_batch(self, inputs):
        # Inputs arrive with their prompt fields filled. With no extension on, TRL's result is returned as it is:
        # bit-identical and free.
        if not self._rewrites_advantages and self._row_prefixes is None and self._prefix_columns == (None, None):
            return super()._generate_and_score_completions(inputs)
        if self._row_prefixes is None and self._prefix_columns != (None, None):
            self.set_row_prefixes(**self._prefixes_from_columns(inputs))
        prefixes = self._row_prefixes
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._row_prefixes = None
        batch = self.build_rollout_batch(inputs, out, prefixes)
        if batch.segment_ids is not None:
            out["segment_ids"] = batch.segment_ids
        if not self._rewrites_advantages:
            return out
        return self.apply_advantages(out, batch, self.advantage_estimator(batch))

    # ------------------------------------------------------------------ our API
    def set_row_prefixes(
        self,
        context_ids: list[list[int]] | None = None,
        completion_ids: list[list[int]] | None = None,
        num_generations: int | None = None,
    ) -> None:
        """Give the next generation batch per-row prefixes (token ids, one list per local row).

        `context_ids` join the prompt (generated after, not trained); `completion_ids` start the completion (the
        policy continues them and they are trained). `num_generations` is the block size the generation backend
        sees: rows in a block must share their prompt and prefixes (vLLM server mode generates `n` completions per
        block). By default it is the group size: pass 1 when the rows of a group have different prefixes. (The
        dataset-column path chooses for you.) Dynamic-sampling refills draw new prompts and do not get these.
        """
        self._row_prefixes = RowPrefixes(context_ids, completion_ids, num_generations)

    def _fill_prompt_fields(self, inputs: list[dict]) -> list[dict]:
        """`inputs` with `{name}` in each prompt replaced by `prompt_fields[name]`, and the fields as columns."""
        if not self.prompt_fields:
            return inputs
        return [self._fill_row(row) for row in inputs]

    def _fill_row(self, row: dict) -> dict:
        def fill(text: str) -> str:
            for name, value in self.prompt_fields.items():
                text = text.replace("{" + name + "}", str(value))
            return text

        prompt = row.get("prompt")
        if isinstance(prompt, str):
            prompt = fill(prompt)
        elif isinstance(prompt, list):
            prompt = [_fill_message(message, fill) for message in prompt]
        return {**row, **self.prompt_fields, "prompt": prompt}

    def _prefixes_from_columns(self, inputs: list[dict]) -> dict:
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        result = {}
        for key, column in zip(("context_ids", "completion_ids"), self._prefix_columns, strict=True):
            if column is None:
                continue
            if column not in inputs[0]:
                raise KeyError(
                    f"{key.replace('_ids', '_prefix_column')}={column!r}, but the dataset has no such column "
                    f"(columns: {sorted(inputs[0])}); add the column or unset the field."
                )
            texts = [row[column] or "" for row in inputs]
            result[key] = [self._tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        rows = [tuple(tuple(ids[i]) for ids in result.values()) for i in range(len(inputs))]
        # A group can span processes, and all processes must give the backend one block size (vLLM server mode
        # generates every process's rows in one call): decide on the rows of all processes, in TRL's order.
        rows = gather_object(rows)
        shared = all(len(set(rows[i : i + group])) == 1 for i in range(0, len(rows), group))
        result["num_generations"] = group if shared else 1
        return result

    def build_rollout_batch(self, inputs: list[dict], out: dict, prefixes: RowPrefixes | None = None) -> RolloutBatch:
        """The `RolloutBatch` an estimator sees, from TRL's output dict and the kept rewards."""
        scoring = self.last_scoring
        mode = "train" if self.model.training else "eval"
        rewards_per_func = scoring["rewards_per_func"]
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = self._total_rewards(rewards_per_func)
        local = len(scoring["prompts"])
        index = self.accelerator.process_index
        completion_mask = out["completion_mask"]
        segment_ids = None
        if prefixes is not None and prefixes.completion_ids is not None:
            lengths = torch.tensor([len(c) for c in prefixes.completion_ids], device=completion_mask.device)
            positions = torch.arange(completion_mask.size(1), device=completion_mask.device)
            segment_ids = (positions.unsqueeze(0) >= lengths.unsqueeze(1)).long()  # (B, T): 0 prefix, 1 generated
            segment_ids = segment_ids.masked_fill(completion_mask == 0, -1)
        columns = {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", "completion")}
        return RolloutBatch(
            rewards=rewards,
            rewards_per_func=rewards_per_func,
            reward_func_names=list(self.reward_func_names),
            reward_weights=weights,
            num_generations=self.num_generations if mode == "train" else self.num_generations_eval,
            process_slice=slice(index * local, (index + 1) * local),
            advantages=out["advantages"],
            completion_ids=out["completion_ids"],
            completion_mask=completion_mask,
            tool_mask=out.get("tool_mask"),
            segment_ids=segment_ids,
            prompts=scoring["prompts"],
            completions=scoring["completions"],
            columns=columns,
            old_per_token_logps=out.get("old_per_token_logps"),
            ref_per_token_logps=out.get("ref_per_token_logps"),
            mode=mode,
            step=self.state.global_step,
        )

    def apply_advantages(self, out: dict, batch: RolloutBatch, result) -> dict:
        """Put an estimator's result into TRL's output dict: advantages, and loss weights if it gave any."""
        advantages, loss_weights = result if isinstance(result, tuple) else (result, None)
        name = getattr(self.advantage_estimator, "__name__", repr(self.advantage_estimator))
        rows, length = batch.completion_ids.shape
        if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((rows,), (rows, length)):
            shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
            raise ValueError(
                f"advantage estimator {name!r} returned {shape}; expected a tensor of shape ({rows},) or "
                f"({rows}, {length}) for this process's rows (use `batch.local(...)` on values computed over all rows)."
            )
        out["advantages"] = torch.nan_to_num(advantages.to(batch.completion_mask.device).float(), nan=0.0)
        if loss_weights is not None:
            if tuple(loss_weights.shape) != (rows, length):
                raise ValueError(
                    f"advantage estimator {name!r} returned loss weights of shape {tuple(loss_weights.shape)}; "
                    f"expected ({rows}, {length})."
                )
            tool_mask = out.get("tool_mask")
            tool_mask = torch.ones_like(batch.completion_mask) if tool_mask is None else tool_mask
            out["tool_mask"] = tool_mask * loss_weights.to(tool_mask.device)
            loss_mask = out["completion_mask"] * out["tool_mask"]
            out["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self._log_row_advantages(out["advantages"], out["completion_mask"] * out.get("tool_mask", 1))
        return out

    def _log_row_advantages(self, advantages: torch.Tensor, mask: torch.Tensor) -> None:
        # TRL logged its own advantages into the completions table; replace them with the ones the loss will use.
        if advantages.dim() == 2:
            advantages = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)
        gathered = self.accelerator.gather(advantages).tolist()
        table = self._logs["advantages"]
        for _ in range(min(len(gathered), len(table))):
            table.pop()
        table.extend(gathered)


    def _total_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """(N,) weighted sum of the reward functions, NaN where all of them returned None (TRL's rule)."""
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    # ------------------------------------------------------------------ dynamic sampling (DAPO)
    def _local_varied_rows(self) -> torch.Tensor:
        """(B,) bool: this process's rows whose group (over all processes) has rewards that vary."""
        rewards = self._total_rewards(self.last_scoring["rewards_per_func"])  # (N,), all processes
        rows = varied_groups(rewards, self.num_generations).repeat_interleave(self.num_generations)  # (N,)
        local = len(self.last_scoring["prompts"])
        index = self.accelerator.process_index
        return rows[index * local : (index + 1) * local].clone()

    def _dynamic_sampling(self, out: dict) -> dict:
        """Drop zero-variance groups from the loss; first, if asked, refill them with fresh groups (bounded)."""
        group = self.num_generations
        keep = self._local_varied_rows().to(out["completion_mask"].device)  # (B,)
        kept_groups = self.accelerator.gather(keep.float().sum()).sum().item() / group
        total_groups = self.accelerator.gather(torch.tensor(float(keep.numel()), device=keep.device)).sum().item() / group
        self.log_metric("dynamic_sampling/kept_fraction", kept_groups / total_groups)
        max_rounds = self.args.dynamic_sampling_max_rounds
        rounds = 0
        while rounds < max_rounds:
            # Every process runs the same number of rounds (generation and scoring gather across processes).
            need = int(self.accelerator.gather(((~keep).sum() // group).reshape(1)).max().item())
            if need == 0:
                break
            rounds += 1
            extra = self._score_batch(self._draw_groups(need))
            fresh = self._local_varied_rows()
            dropped = [g for g in range(keep.numel() // group) if not keep[g * group]]
            usable = [g for g in range(need) if fresh[g * group]]
            replace = {d * group + j: u * group + j for d, u in zip(dropped, usable) for j in range(group)}
            if replace:
                out = splice_rows(out, extra, replace, self._pad_values(), left_padded={"prompt_ids", "prompt_mask"})
                keep[list(replace)] = True
        remaining = int(self.accelerator.gather((~keep).sum().reshape(1)).sum().item()) // group
        if max_rounds > 0:
            self.log_metric("dynamic_sampling/refill_rounds", rounds)
            if remaining:
                logger.warning(
                    f"dynamic sampling: {remaining} group(s) still have zero reward variance after "
                    f"dynamic_sampling_max_rounds={max_rounds} refill round(s); they are dropped from this step's "
                    "loss. Raise dynamic_sampling_max_rounds, or check that the rewards can vary within a group."
                )
        self.log_metric("dynamic_sampling/final_kept_fraction", 1.0 - remaining / total_groups)
        dropped_rows = ~keep
        out["advantages"] = out["advantages"].clone()
        out["advantages"][dropped_rows] = 0.0
        tool_mask = out.get("tool_mask")
        tool_mask = torch.ones_like(out["completion_mask"]) if tool_mask is None else tool_mask.clone()
        tool_mask[dropped_rows] = 0
        out["tool_mask"] = tool_mask
        out["num_items_in_batch"] = self.accelerator.gather((out["completion_mask"] * tool_mask).sum()).sum()
        return out

    def _draw_groups(self, num_groups: int) -> list[dict]:
        """`num_groups` prompts drawn at random from the training set, each repeated for a whole group."""
        dataset = self.train_dataset
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                "dynamic_sampling_max_rounds > 0 draws fresh prompts from train_dataset, which must then be a map-style "
                "dataset (an IterableDataset cannot be indexed); set dynamic_sampling_max_rounds=0 to only drop groups."
            )
        if self._refill_generator is None:
            # Its own generator: refills must not shift the global RNG that generation and shuffling draw from.
            self._refill_generator = torch.Generator().manual_seed(self.args.seed + 7919 * self.accelerator.process_index)
        indices = torch.randint(len(dataset), (num_groups,), generator=self._refill_generator).tolist()
        return self._fill_prompt_fields([dict(dataset[i]) for i in indices for _ in range(self.num_generations)])

    def _pad_values(self) -> dict[str, float]:
        pad = self._tokenizer.pad_token_id
        return {"prompt_ids": pad, "completion_ids": pad, "tool_mask": 1, "segment_ids": -1}

    # ------------------------------------------------------------------ reference and optimizer resets (ProRL)
    def request_reset(self, reference: bool = True, optimizer: bool = False, reason: str = "") -> None:
        """Reset the reference policy to the current policy and/or clear the optimizer state, at the next generation
        batch (never between a batch's generation and its loss). Requests before then merge."""
        if reference and self.beta == 0.0:
            raise ValueError(
                "a reference reset was requested, but beta=0.0: TRL then keeps no reference policy. Set beta > 0 "
                "(ProRL uses a small KL penalty), or reset only the optimizer."
            )
        pending = self._pending_reset or {"reference": False, "optimizer": False, "reasons": []}
        pending["reference"] |= reference
        pending["optimizer"] |= optimizer
        pending["reasons"].append(reason)
        self._pending_reset = pending

    @property
    def reset_pending(self) -> bool:
        return self._pending_reset is not None

    def _apply_pending_reset(self) -> None:
        pending, self._pending_reset = self._pending_reset, None
        if pending["reference"]:
            self.reset_reference()
        if pending["optimizer"]:
            self.reset_optimizer_state()
        record = {
            "step": self.state.global_step,
            "reference": pending["reference"],
            "optimizer": pending["optimizer"],
            "reason": "; ".join(r for r in pending["reasons"] if r),
        }
        self.reset_history.append(record)
        logger.info(f"reset at step {record['step']}: {record}")

    def reset_reference(self) -> None:
        """Make the reference policy a frozen copy of the current policy, now.

        Full fine-tuning: the reference model's weights are overwritten. LoRA: the frozen adapter "ref", which TRL
        uses as the reference when present, becomes a copy of the trained adapter (it is added the first time); no
        base weight moves, 4-bit bases included.
        """
        from peft import PeftModel

        if self.is_fsdp_enabled or (self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3):
            raise NotImplementedError("reference resets with sharded parameters (FSDP, ZeRO-3) are not supported yet.")
        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, PeftModel):
            active = model.active_adapter
            if "ref" not in model.peft_config:
                model.add_adapter("ref", model.peft_config[active])
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if f".{active}." in name:
                        model.get_parameter(name.replace(f".{active}.", ".ref.")).copy_(param)
            for name, param in model.named_parameters():
                if ".ref." in name:
                    param.requires_grad_(False)
        elif self.ref_model is not None:
            self.accelerator.unwrap_model(self.ref_model).load_state_dict(model.state_dict())
        else:
            raise ValueError("this trainer has no reference policy to reset (beta=0.0?).")

    def reset_optimizer_state(self) -> None:
        """Clear the optimizer's state (Adam moments and step counts); it is rebuilt at the next optimizer step."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps the torch optimizer
        if optimizer is None:
            return
        optimizer.state.clear()

    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        from peft import PeftModel

        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, PeftModel):
            return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if ".ref." in n}
        ref = self.accelerator.unwrap_model(self.ref_model)
        return {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}

    def _load_reference_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        from peft import PeftModel

        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, PeftModel):
            if "ref" not in model.peft_config:
                model.add_adapter("ref", model.peft_config[model.active_adapter])
            with torch.no_grad():
                for name, value in tensors.items():
                    param = model.get_parameter(name)
                    param.copy_(value.to(param.device))
                    param.requires_grad_(False)
        else:
            self.accelerator.unwrap_model(self.ref_model).load_state_dict(tensors)

    # ------------------------------------------------------------------ checkpoints
    STATE_FILE = "trl_grpo_ext_state.json"
    REFERENCE_FILE = "trl_grpo_ext_reference.pt"

    def _save_checkpoint(self, model, trial):
        # Seam: GRPOTrainer._save_checkpoint(model, trial) saves into `<output_dir>/checkpoint-<global_step>`; TRL
        # keeps its own extra state there the same way (entropy_ctrl_state.json).
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = {
            "reset_history": self.reset_history,
            "pending_reset": self._pending_reset,
            "callbacks": {type(cb).__name__: cb.state_dict() for cb in self._stateful_callbacks()},
        }
        with open(os.path.join(folder, self.STATE_FILE), "w") as f:
            json.dump(state, f, indent=2)
        if any(r["reference"] for r in self.reset_history):
            torch.save(self._reference_tensors(), os.path.join(folder, self.REFERENCE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Seam: called with the checkpoint folder on `resume_from_checkpoint`, after the model is prepared.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not os.path.exists(os.path.join(checkpoint, self.STATE_FILE)):
            return
        with open(os.path.join(checkpoint, self.STATE_FILE)) as f:
            state = json.load(f)
        self.reset_history = state["reset_history"]
        self._pending_reset = state["pending_reset"]
        for callback in self._stateful_callbacks():
            if type(callback).__name__ in state["callbacks"]:
                callback.load_state_dict(state["callbacks"][type(callback).__name__])
        reference = os.path.join(checkpoint, self.REFERENCE_FILE)
        if os.path.exists(reference):
            self._load_reference_tensors(torch.load(reference, weights_only=True))

    def _stateful_callbacks(self) -> list:
        return [cb for cb in self.callback_handler.callbacks if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")]


def _fill_message(message: dict, fill) -> dict:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": fill(content)}
    if isinstance(content, list):
        parts = [{**p, "text": fill(p["text"])} if isinstance(p.get("text"), str) else p for p in content]
        return {**message, "content": parts}
    return message


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _resolve_rewards(reward_funcs):
    if reward_funcs is None:
        return None
    items = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    resolved = []
    for item in items:
        if isinstance(item, str) and (item in REWARDS.names() or ("." in item and "/" not in item)):
            item = get_reward(item)
        if getattr(item, "segment_reward", False):
            name = getattr(item, "__name__", repr(item))
            raise ValueError(
                f"{name!r} is a segment reward (one score per segment), not a scalar reward: give it in "
                "segment_reward_funcs of SegmentGRPOTrainer, not in reward_funcs."
            )
        if callable(item):
            resolved.append(item)
        elif isinstance(item, str) and "/" not in item and not os.path.isdir(item):
            get_reward(item)  # neither a registered name nor a reward model: raises with the known names
        else:
            resolved.append(item)  # a string TRL reads as a reward-model id (Hub id or folder)
    return resolved


def _disable_bnb_cpu_weight_repacking(model) -> None:
    # bitsandbytes' Linear4bit repacks its weight for AVX512-BF16 CPUs on the first eval-mode forward without grad
    # (generation, `trainer.evaluate()`); the repacked weight then breaks every later training forward. Keeping the
    # portable layout costs some CPU speed and nothing on GPUs.
    if model is None:
        return
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
