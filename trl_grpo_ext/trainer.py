"""`GRPOExtTrainer`: TRL's `GRPOTrainer` with an extension pipeline. The one module that touches TRL internals.

Seams (trl 1.16, `trl/trainer/grpo_trainer.py`), each wrapped, never copied:

- `_generate_and_score_completions(inputs) -> dict`: the pipeline runs around it (`score_rows`): extensions prepare
  the rows, TRL generates and scores them, then the estimator and the extensions write advantages, loss weights and
  dropped rows into its output. Rows are shuffled right after, in `_prepare_inputs`, so group maths happens here.
  With no extension on and the default estimator, TRL's result is returned as it is: bit for bit, and free.
- `_generate(prompts) -> (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images,
  tool_images)`, called once by `_generate_and_score_completions`: the rollout-owning extension generates here, and
  its `Rollout` record is turned into this tuple; otherwise TRL's own `_generate` runs from the plan's prefixes.
- `_tokenize_prompts(prompts) -> (prompt_ids, images, multimodal_fields)`: per-row context ids join the prompt.
- `_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)`: per-row
  completion prefixes, a stage's token cap and stop strings, and rows that are already finished; it serves
  transformers, continuous-batching and vLLM generation alike. TRL's tool loop calls it again, unchanged.
- `_tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields)`: run on
  branch rows that continue a trajectory after a tool result (ARPO), so that TRL's limits count the whole trajectory.
- `_calculate_rewards(inputs, prompts, completions, completion_ids_list) -> Tensor (N, F)`: kept for the batch; for
  the call, each reward function is guarded (`rewards/guard.py`): an exception becomes a `RewardFunctionError` naming
  the function and the first failing row, and `train()` saves the last completed step before it re-raises.
- `_compute_loss(model, inputs)`: rescaled when rows were dropped or added, so that per-row-normalised losses (grpo,
  sapo, dr_grpo, luspo) average over the kept rows of the whole generation batch (all micro-batches, all processes).
- `_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size)`: called for
  log-probs of rows TRL did not build (`completion_logps`: rows added after scoring, RCC's log-ratio); wrapped only
  while rows carry their own LoRA adapters (`Rollout.adapters`): it runs the model over `input_ids` in chunks of
  `batch_size` rows, in order, so each forward gets the adapters of its rows (PEFT's mixed-adapter batches). With
  `shared_prefix_forward`, each chunk of text rows runs once as a prefix tree (`shared_prefix.py`): shared tokens
  once, a tree attention mask, pre-shifted labels for TRL's fused LM head; the log-probs come back in TRL's layout.
- `_prepare_inputs(generation_batch)`: with `shared_prefix_forward`, the micro-batches TRL cuts from its shuffled
  generation batch (`_buffered_inputs`) are cut again from the rows ordered by prompt, groups in their shuffled order,
  so that a group's rows share micro-batches.
- `GRPOTrainer.__init__` builds a reference model only when `beta != 0`: an estimator that needs one at `beta = 0`
  (RCC) gets TRL's own, built with a stand-in beta that is set back to 0 before training.
- `out["tool_mask"]`: the loss masks with `completion_mask * tool_mask`; per-token loss weights and dropped rows are
  multiplied in, and `out["num_items_in_batch"]` (the dapo / cispo normaliser) is recomputed from the product.
- `_save_checkpoint(model, trial)` / `_load_optimizer_and_scheduler(checkpoint)`: extension state is saved beside
  TRL's in each checkpoint and restored on `resume_from_checkpoint`; so are TRL's step count and generation buffer
  (`_step`, `_buffered_inputs`) of a checkpoint taken between two generations, so that a resumed run is exact.
- `_get_train_sampler(dataset)`: TRL's `RepeatSampler`, given the `set_epoch` it lacks, so that a run resumed in a
  later epoch draws that epoch's permutation (uninterrupted, it yields what TRL's yields).
- Per-row state that TRL builds for a batch before `_generate` (`_sync_tool_dicts`, `_async_tool_dicts`,
  `_batch_environments`): sliced while a generation call covers a subset of the batch's rows.

`tests/test_trl_compat.py` checks every seam named here and fails, naming it, when TRL renames or reshapes one.
Where an older supported release (`pyproject.toml`'s range) differs, `TRL_SEAMS` lists that range's signature and
`_trl_compat.py` bridges it; nothing else here knows which release is installed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os

import torch
import transformers
from accelerate.utils import gather_object, is_peft_model
from packaging.version import Version
from transformers import TrainerCallback
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import split_tensor_dict, use_adapter

from . import _trl_compat
from .advantages import get_advantage, trl_group
from .batch import RolloutBatch
from .extension import Extension, TrainerInputs, list_methods
from .rewards import resolve_rewards
from .rewards.guard import RewardFunctionError, check_reward_columns, guard_rewards
from .rollout import Rollout, RolloutPlan, turn_messages
from .shared_prefix import check_shared_prefix_model, group_order, prefix_tree, tree_mask_function
from .tools import with_time_limit

logger = logging.getLogger(__name__)

# The TRL private methods this module wraps or calls, with the parameters it relies on; tests/test_trl_compat.py checks
# them. A seam whose signature differs between the supported releases maps each release range to its own (the shims
# are in `_trl_compat.py`); `*args` is a variadic parameter.
TRL_SEAMS = {
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_tokenize_prompts": ["self", "prompts"],
    "_generate_single_turn": {
        ">=1.14.1": ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
        "<1.14.1": ["self", "prompt_ids", "images", "multimodal_fields", "has_tool_images"],
    },
    "_tool_call_loop": [
        "self", "prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images", "multimodal_fields",
    ],
    "_generate": ["self", "prompts"],
    "_compute_loss": ["self", "model", "inputs"],
    "_get_per_token_logps_and_entropies": {
        "!=1.14.*": ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"],
        "==1.14.*": ["self", "model", "*args", "batch_size"],  # it hands `*args` on to the full-logits path
    },
    "_save_checkpoint": ["self", "model", "trial"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_get_train_sampler": ["self", "dataset"],
    "_prepare_inputs": ["self", "generation_batch"],
}  # fmt: skip
# Trainer attributes read here (set by GRPOTrainer.__init__ or per batch by _generate_and_score_completions).
TRL_ATTRIBUTES = [
    "reward_weights", "reward_func_names", "reward_funcs", "num_generations", "num_generations_eval", "_logs",
    "_metrics", "_tokenizer", "eos_token_ids", "max_completion_length", "beta", "ref_model", "generation_config",
    "generation_kwargs", "_get_output_dir", "environment_factories", "tools", "max_tool_calling_iterations",
    "temperature", "loss_type", "use_vllm", "vllm_mode", "vllm_tensor_parallel_size",
    "use_transformers_continuous_batching", "rollout_func", "num_iterations", "_step", "_buffered_inputs",
]  # fmt: skip
# Losses that average per row (or divide by the number of rows): rows taken out of the loss must leave the count too.
ROW_NORMALISED_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")
# The keys of TRL's output dict that mark the rows kept in the loss when some were dropped or added: (B,) float per
# row, and a scalar, the kept rows of the whole generation batch over all processes.
KEPT_ROWS = "trl_grpo_ext_kept_rows"
KEPT_TOTAL = "trl_grpo_ext_kept_total"
# Keys of TRL's output dict that `add_rows` cannot extend yet (images and their per-token fields).
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)
# TRL's output dict key of the per-row LoRA adapter (B,) long, an index into `trainer.adapters`, when rows have their own.
ROW_ADAPTERS = "trl_grpo_ext_row_adapters"
STATE_FILE = "trl_grpo_ext_state.pt"
# A checkpoint taken between two generations: TRL's step count and generation buffer, one file per process.
GENERATION_FILE = "trl_grpo_ext_generation-{}.pt"
# The beta TRL's __init__ sees while it builds a reference that only an estimator reads (never a loss coefficient).
_REFERENCE_ONLY_BETA = 1.0


class _EpochSampler(torch.utils.data.Sampler):
    """TRL's `RepeatSampler` with the `set_epoch` it lacks: the pass of epoch e draws the permutation TRL's sampler
    draws at its e-th pass, whatever epoch iteration starts at (a resumed run starts at the checkpoint's).

    Uninterrupted, it yields what TRL's sampler yields. accelerate and transformers call `set_epoch(epoch)` before
    each epoch's pass (through the batch sampler), and accelerate keeps `generator` in step across processes.
    """

    def __init__(self, sampler):
        self.sampler = sampler
        self._seeded = sampler.generator.get_state()

    @property
    def generator(self) -> torch.Generator:
        return self.sampler.generator

    def set_epoch(self, epoch: int) -> None:
        self.sampler.generator.set_state(self._seeded)
        for _ in range(epoch):
            next(iter(self.sampler), None)  # a pass draws its permutation before it yields its first index

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _Stage:
    """What the next TRL generation call applies: per-row context and completion prefixes, a cap, stop strings."""

    def __init__(
        self, context_ids, prefix_ids, block, finished=None, max_new_tokens=None, stop=(), prefix_logprobs=None
    ):
        self.context_ids, self.prefix_ids, self.block = context_ids, prefix_ids, block
        self.finished = finished or [False] * len(prefix_ids)
        self.max_new_tokens, self.stop, self.prefix_logprobs = max_new_tokens, list(stop), prefix_logprobs
        self.consumed = False  # prefixes apply to the first call only; the tool loop's later calls are TRL's


class GRPOExtTrainer(GRPOTrainer):
    """`GRPOTrainer` with an extension pipeline: methods, estimators, per-token loss weights, per-row prefixes.

    A drop-in replacement: with `GRPOExtConfig` defaults (or a plain `GRPOConfig`) it trains bit for bit like
    `GRPOTrainer`. Methods switch on through their config fields, or come as `extensions=[...]` (or as callbacks that
    are extensions, such as `ProRLResetCallback`). Reward functions may be given by registry name, `name:key=value`,
    `{name: {params}}` or dotted import path (`reward_funcs=["tag_format", "accuracy"]`); other strings keep TRL's
    meaning, a reward model id.

    >>> from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer
    >>> trainer = GRPOExtTrainer(  # doctest: +SKIP
    ...     model="Qwen/Qwen2.5-0.5B-Instruct",
    ...     reward_funcs=["accuracy", "think_format"],
    ...     args=GRPOExtConfig(output_dir="out", advantage_estimator="group"),
    ...     train_dataset=dataset,
    ... )
    """

    _tag_names = ["trl", "grpo", "trl-grpo-ext"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pos, extensions=None, **kwargs):
        # Resolve our names and check every extension before TRL loads any model: a typo fails in a second.
        estimator_name = getattr(args, "advantage_estimator", "group")
        estimator = get_advantage(estimator_name)
        if callable(estimator_name) and hasattr(estimator_name, "__qualname__"):
            # The config is pickled into every checkpoint (training_args.bin); a closure would not pickle, its import
            # path does. (A `functools.partial` of a module-level function pickles as it is.)
            args.advantage_estimator = f"{estimator_name.__module__}.{estimator_name.__qualname__}"
        reward_funcs = resolve_rewards(reward_funcs)
        if getattr(args, "shared_prefix_forward", False):
            _trl_compat.check_shared_prefix_forward()
        self.extensions = _build_extensions(args, kwargs.get("callbacks"), extensions)
        kwargs = _limit_tool_time(args, kwargs)
        inputs = TrainerInputs(
            args=args, reward_funcs=reward_funcs, train_dataset=kwargs.get("train_dataset", pos[0] if pos else None),
            eval_dataset=kwargs.get("eval_dataset"), tools=kwargs.get("tools"),
            environment_factory=kwargs.get("environment_factory"), rollout_func=kwargs.get("rollout_func"),
        )  # fmt: skip
        for extension in self.extensions:
            extension.check(inputs)
        if inputs.rollout_func is None:  # a rollout_func's extra fields reach the rewards as columns too
            provided = [column for extension in self.extensions for column in getattr(extension, "columns", ())]
            for dataset, where in ((inputs.train_dataset, "train_dataset"), (inputs.eval_dataset, "eval_dataset")):
                check_reward_columns(reward_funcs, dataset, where, provided)
        # An estimator that reads the log-ratio to the reference (RCC) needs a reference even at beta = 0, where TRL
        # builds none: TRL builds its own (a copy from the model's path, or the PEFT "ref" adapter, prepared for
        # DeepSpeed / FSDP) under a stand-in beta, set back to 0 right after, so the loss has no KL term.
        needs_reference = getattr(estimator, "needs_log_ratio", False) and args is not None and args.beta == 0.0
        if needs_reference:
            logger.warning(
                f"advantage estimator {estimator_name!r} reads the log-ratio to the reference policy: with beta=0 a "
                "frozen reference is built anyway and its log-probs are computed for every batch (one more forward "
                "pass per generation batch; the loss has no KL term)."
            )
            args.beta = _REFERENCE_ONLY_BETA
        try:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        finally:
            if needs_reference:
                args.beta = 0.0
        if needs_reference:
            self.beta = 0.0
        _trl_compat.set_missing_attributes(self)  # `eos_token_ids` before trl 1.14.2
        self.advantage_estimator = estimator
        self.last_batch: RolloutBatch | None = None
        self.run_info: dict | None = None  # for the model card: trainer name, model, dataset, config as given
        self._plan: RolloutPlan | None = None  # the rows being scored, while TRL scores them
        self._rollout: Rollout | None = None  # their generation record, from `_generate` on
        self._scores: tuple | None = None  # their gathered (N, F) rewards, and the prompts and completions scored
        self._stage: _Stage | None = None
        self._adapters: _RowAdapters | None = None  # per-row LoRA adapters, once `add_adapters` switched them on
        if getattr(self.args, "shared_prefix_forward", False):
            check_shared_prefix_model(self.accelerator.unwrap_model(self.model).config)
            if getattr(self, "aux_loss_enabled", False):  # TRL: `compute_aux_loss=self.aux_loss_enabled`
                raise ValueError(
                    "shared_prefix_forward=True does not support a mixture-of-experts model's load-balancing loss "
                    "(its router sees each shared token once, not once per row); set shared_prefix_forward=False."
                )
        for module in (self.model, getattr(self, "ref_model", None)):
            _disable_bnb_cpu_weight_repacking(module)
        # Rewards that need the policy's tokenizer, stop tokens or the trainer declare the attribute and leave it None.
        for reward in self.reward_funcs:
            for attribute, value in (("tokenizer", self._tokenizer), ("eos_token_ids", self.eos_token_ids),
                                     ("trainer", self)):  # fmt: skip
                if hasattr(reward, attribute) and getattr(reward, attribute) is None:
                    setattr(reward, attribute, value)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "attach"):
                callback.attach(self)
        for extension in self.extensions:
            self._setup_extension(extension)

    # ------------------------------------------------------------------ extensions
    def _setup_extension(self, extension: Extension) -> None:
        if isinstance(extension, TrainerCallback) and extension not in self.callback_handler.callbacks:
            super().add_callback(extension)
        extension.setup(self)  # a callback is in the list by now: setup may place it (the monitor goes first)

    @property
    def _plain(self) -> bool:
        return not self.extensions and self.advantage_estimator is trl_group

    def extension(self, name: str) -> Extension:
        """The extension of this trainer named `name` (`trainer.extension("prorl").history`)."""
        for extension in self.extensions:
            if extension.name == name:
                return extension
        raise KeyError(
            f"this trainer has no {name!r} extension; it has: {[e.name for e in self.extensions] or 'none'}."
        )

    def add_extension(self, extension: Extension) -> Extension:
        """Switch an extension on after construction (before training)."""
        self.extensions = _check_extensions([*self.extensions, extension])
        extension.check(TrainerInputs(
            args=self.args, reward_funcs=self.reward_funcs, train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset, tools=self.tools, environment_factory=self.environment_factories,
            rollout_func=self.rollout_func,
        ))  # fmt: skip
        self._setup_extension(extension)
        return extension

    def add_callback(self, callback):
        """`Trainer.add_callback`, plus: an extension is switched on, and an `attach(trainer)` method is called."""
        if isinstance(callback, Extension) and callback not in self.extensions:
            self.add_extension(callback)
        else:
            super().add_callback(callback)
        if hasattr(callback, "attach"):
            callback.attach(self)

    @property
    def _rollout_owner(self) -> Extension | None:
        return next((e for e in self.extensions if e.owns_rollout), None)

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`. When a reward function raises (`RewardFunctionError`), the last completed optimizer step
        is first saved as `checkpoint-<global_step>` (unless `save_strategy="no"`, no step was completed, or that
        checkpoint exists), so that `train(resume_from_checkpoint=...)` continues from it; the error names the folder.
        """
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        except RewardFunctionError as error:
            self._checkpoint_after_reward_error(error, trial)
            raise

    def _checkpoint_after_reward_error(self, error: RewardFunctionError, trial) -> None:
        # A reward function runs while a batch is generated and scored, before its loss: the model, optimizer and
        # scheduler are those of the last completed optimizer step (`state.global_step`), as a periodic save there
        # would have written them (gradients accumulated since are not part of a checkpoint), into the folder where
        # `resume_from_checkpoint` (or `True`: the last one) finds it (`_checkpoint_folder`).
        step, folder = self.state.global_step, self._checkpoint_folder(trial)
        if self.args.save_strategy == "no" or step == 0:
            return
        if os.path.isdir(folder):
            note = f"The checkpoint of the last completed step is {folder}; resume with resume_from_checkpoint."
        elif self.accelerator.num_processes > 1:
            # Saving is collective, and the other processes wait in the batch's gather: only periodic checkpoints.
            note = (f"No checkpoint of step {step} was written: with {self.accelerator.num_processes} processes the "
                    "others cannot join the save; resume from the last periodic checkpoint.")  # fmt: skip
            folder = None
        else:
            try:
                self._save_checkpoint(self.model_wrapped, trial)
                note = f"The last completed step was saved to {folder}; resume with resume_from_checkpoint."
            except Exception as save_error:  # the reward's error is the one to raise; say why nothing was saved
                logger.exception("saving a checkpoint after the reward function's error failed")
                note = f"Saving step {step} to {folder} failed too ({type(save_error).__name__}: {save_error})."
                folder = None
        error.checkpoint = folder
        error.args = (f"{error.args[0]} {note}", *error.args[1:])

    # ------------------------------------------------------------------ engine API for extensions
    def log_metric(self, name: str, value: float, mode: str = "train") -> None:
        """Log a scalar with TRL's own metrics (averaged over each logging step, sent to `report_to`)."""
        self._metrics[mode][name].append(float(value))

    @property
    def sharded_parameters(self) -> bool:
        """Whether the policy's parameters are sharded over the processes (DeepSpeed ZeRO-3, FSDP): every forward
        pass, generation included, is then collective."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return bool(self.is_fsdp_enabled or (self.is_deepspeed_enabled and plugin and plugin.zero_stage == 3))

    def any_process(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true where it is true on any process: one gather, so every process must call it (as given on
        one process). What a process does next in a collective step (a generation call, a gather) must not depend
        on its own rows alone: `trainer.any_process(bool(pending))` decides on all processes' rows at once."""
        if self.accelerator.num_processes == 1:
            return tuple(bool(f) for f in flags)
        local = torch.tensor([float(f) for f in flags], device=self.accelerator.device)
        return tuple(bool(f) for f in self.accelerator.gather(local).view(-1, len(flags)).amax(dim=0))

    @property
    def tokenizer(self):
        """The policy's tokenizer (the processor's, for a VLM)."""
        return self._tokenizer

    @property
    def current_rollout(self) -> Rollout | None:
        """The `Rollout` being scored: reward functions that need its tree (PTA's plan value) read it."""
        return self._rollout

    def set_generation_cap(self, max_new_tokens: int) -> None:
        """Cap the next generations at `max_new_tokens`, everywhere TRL keeps the cap.

        That is `max_completion_length` (the whole trajectory's limit in the tool loop, and `dr_grpo`'s loss
        normaliser), the transformers generation config and kwargs, and the vLLM generation's `max_tokens`.
        """
        self.max_completion_length = int(max_new_tokens)
        self._set_backend_cap(int(max_new_tokens))

    def _set_backend_cap(self, max_new_tokens: int) -> None:
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.max_new_tokens = max_new_tokens
        if isinstance(getattr(self, "generation_kwargs", None), dict):
            self.generation_kwargs["max_new_tokens"] = max_new_tokens
        if getattr(self, "vllm_generation", None) is not None:
            self.vllm_generation.max_completion_length = max_new_tokens

    # ------------------------------------------------------------------ per-row LoRA adapters
    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters rows may train: the policy's own first, then those `add_adapters` created."""
        return list(self._adapters.names) if self._adapters is not None else []

    def add_adapters(self, names: list[str]) -> list[str]:
        """Give the PEFT policy more LoRA adapters (the config of its active one, fresh weights), all trained.

        After this, a `Rollout` may name each row's adapter (`Rollout.adapters`): its log-probs and its loss use that
        adapter (PEFT's mixed-adapter batches), and generation inside `with trainer.use_adapter(name):` samples with
        it. An adapter none of whose rows is in an optimizer step's loss gets no gradient, so that step leaves its
        weights as they are (Adam's moments do not move it). Call before training (the optimizer is built then).
        """
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            raise ValueError(
                f"per-row LoRA adapters {list(names)} need a LoRA policy: pass peft_config=LoraConfig(...) (or a "
                "PeftModel) to the trainer, or leave the adapters out so that every row trains the same weights."
            )
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError(
                "per-row LoRA adapters generate with transformers' `generate` (PEFT switches them per call); vLLM and "
                "continuous batching serve one policy: set use_vllm=False and use_transformers_continuous_batching=False."
            )
        if self.state.global_step > 0 or getattr(self, "optimizer", None) is not None:
            raise RuntimeError("add_adapters must be called before training starts (the optimizer is built then).")
        if self._adapters is None:
            self._adapters = _RowAdapters(model, model.active_adapter, self.any_process)
            super().add_callback(self._adapters)
        for name in names:
            self._adapters.add(name)
        return self.adapters

    @contextlib.contextmanager
    def use_adapter(self, name: str | None):
        """Every forward pass inside (generation included) uses LoRA adapter `name` (None: the policy's own)."""
        if self._adapters is None:
            if name is not None:
                raise ValueError(f"adapter {name!r}: this trainer has no per-row adapters; call add_adapters first.")
            yield
            return
        with self._adapters.uniform(name):
            yield

    def generate_stage(
        self,
        prompts: list,
        plan: RolloutPlan,
        *,
        num_generations: int,
        max_new_tokens: int | None = None,
        stop: list[str] = (),
        rows: list[int] | None = None,
    ) -> tuple[list[list[int]], list[list[float | None]] | None]:
        """One completion per row of `prompts`, single turn, unscored: a stage of a staged rollout (a PTA plan).

        `plan` holds the rows' context and completion prefixes (`plan.select(rows)` of the batch's plan); the result
        starts with each row's completion prefix. Rows come in blocks of `num_generations` consecutive rows that share
        their prompt and prefixes (vLLM server mode asks for `n=num_generations` per block). `max_new_tokens` caps this
        stage (within `max_completion_length`); generation stops at the first of `stop` (transformers: stop strings
        with the policy's tokenizer; vLLM: `stop`), whatever the number of tokens it takes, and at EOS. `rows` are the
        batch rows the prompts belong to (default: all). Returns token ids and sampling log-probs (None without them).
        """
        block = self._block_size(plan, num_generations)
        stage = _Stage(plan.context_ids, plan.prefix_ids, block, max_new_tokens=max_new_tokens, stop=stop)
        with self._staged(stage), self._rows_view(rows), profiling_context(self, "generate_stage"):
            prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)
            completion_ids, logprobs = self._generate_single_turn(prompt_ids, images, multimodal_fields, block)
        return [_as_list(ids) for ids in completion_ids], logprobs

    def generate_rollouts(
        self,
        prompts: list,
        plan: RolloutPlan,
        *,
        num_generations: int | None = None,
        rows: list[int] | None = None,
        finished: list[bool] | None = None,
        prefix_logprobs: list[list[float | None]] | None = None,
    ) -> Rollout:
        """TRL's whole generation (tool-call loop included) for `prompts`, unscored, from the plan's prefixes.

        `num_generations` is the block size asked for (default: the group size; 1 when the rows of a group differ);
        it falls to 1 when the rows of a block do not share their prefixes. Rows marked `finished` are not generated
        further (a PTA plan that ended with EOS): their completion is their prefix. `prefix_logprobs` are the sampling
        log-probs of the prefixes, where a backend sampled them. `rows` are the batch rows the prompts belong to.
        """
        if self.rollout_func is not None and (any(plan.context_ids) or any(plan.prefix_ids)):
            raise ValueError(
                "rollout_func generates the rollouts itself, so per-row context / completion prefixes cannot reach it; "
                "unset rollout_func, or the extension or column that adds prefixes."
            )
        block = self._block_size(plan, num_generations or plan.num_generations, finished)
        stage = _Stage(plan.context_ids, plan.prefix_ids, block, finished=finished, prefix_logprobs=prefix_logprobs)
        with self._staged(stage), self._rows_view(rows), profiling_context(self, "generate_rollouts"):
            result = super()._generate(prompts)
        return _rollout_from_trl(result, [len(p) for p in plan.prefix_ids])

    def continue_rollouts(
        self,
        prompts: list,
        source: Rollout,
        branches: list[tuple[int, int]],
        *,
        rows: list[int] | None = None,
        tool_iterations: int | None = None,
    ) -> Rollout:
        """Continue trajectories of `source` from inside them: one new whole trajectory per `(row, point)`.

        Each new row repeats row `row` of `source` up to completion position `point` (the start of a model turn
        after a tool result), with its tool mask, sampling log-probs and messages, then the policy generates the rest,
        TRL's tool loop included. TRL's limits count the whole trajectory: `max_completion_length` tokens, and
        `tool_iterations` more tool-calling turns (default: what `max_tool_calling_iterations` leaves after the
        source's turns). `prompts` are the new rows' prompts (TRL's messages); `rows` their batch rows (tool tables).
        The new rows have no parents set: the caller knows where they go.
        """
        if self.environment_factories is not None:
            raise NotImplementedError(
                "continuing a trajectory needs a copy of its environment's state; use tools= with environment-free "
                "functions for branching rollouts."
            )
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError("continue_rollouts continues conversations: the prompts must be lists of messages.")
        prompt_ids = [list(source.prompt_ids[r]) for r, _ in branches]
        prefixes = [list(source.completion_ids[r][:p]) for r, p in branches]
        masks = [list(source.tool_mask[r][:p]) if source.tool_mask else [1] * p for r, p in branches]
        lps = [list(source.logprobs[r][:p]) if source.logprobs else None for r, p in branches]
        turns = [_turns_before(mask + [1], p) for mask, (_, p) in zip(masks, branches, strict=True)]
        history = [turn_messages(source.completions[r], turn) for (r, _), turn in zip(branches, turns, strict=True)]
        budgets = [self.max_completion_length - len(prefix) for prefix in prefixes]
        if min(budgets, default=1) < 1:
            raise ValueError("a trajectory can only be continued where it has not reached max_completion_length yet.")
        started = [p + prefix for p, prefix in zip(prompt_ids, prefixes, strict=True)]
        with self._rows_view(rows), profiling_context(self, "continue_rollouts"):
            with self._backend_cap(max(budgets)):
                generated, logprobs = _trl_compat.generate_single_turn(
                    self, super()._generate_single_turn, started, None, {}, 1, False
                )
            generated = [_as_list(ids)[:budget] for ids, budget in zip(generated, budgets, strict=True)]
            completions = [[self._parse_turn(ids, started[i])] for i, ids in enumerate(generated)]
            completion_ids = [prefix + ids for prefix, ids in zip(prefixes, generated, strict=True)]
            if logprobs is not None:
                logprobs = [(lp or [None] * len(prefix)) + list(new)[: len(ids)]
                            for lp, prefix, new, ids in zip(lps, prefixes, logprobs, generated, strict=True)]  # fmt: skip
            tool_mask = [mask + [1] * len(ids) for mask, ids in zip(masks, generated, strict=True)]
            if self.tools:
                loop_prompts = [list(p) + h for p, h in zip(prompts, history, strict=True)]
                left = (
                    tool_iterations if tool_iterations is not None else self.max_tool_calling_iterations - min(turns)
                )
                with _attribute(self, "max_tool_calling_iterations", max(0, left)):
                    tool_mask, completions, completion_ids, logprobs, *_ = super()._tool_call_loop(
                        loop_prompts, prompt_ids, completion_ids, completions, logprobs, None, {}
                    )
                # The loop starts every row's mask at ones; the continued prefix keeps its own tool results masked.
                tool_mask = [mask + list(m[len(mask) :]) for mask, m in zip(masks, tool_mask, strict=True)]
        completions = [h + list(c) for h, c in zip(history, completions, strict=True)]
        return Rollout(
            prompt_ids=prompt_ids, completion_ids=completion_ids, completions=completions, tool_mask=tool_mask,
            logprobs=logprobs, prefix_lengths=[min((source.prefix_lengths or [0] * len(source))[r], p) for r, p in branches],
        )  # fmt: skip

    def token_entropies(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], top_k: int | None = None):
        """Per row, the entropy of the policy's next-token distribution at each completion token (no gradient).

        With `top_k`, only the k most likely tokens enter the sum, -Σ_top-k p·log p (what a backend that returns
        top-k log-probs sees; ARPO's reference uses k = 10). Logits are divided by the sampling temperature, as in
        TRL's log-probs. Returns one (len(completion),) float tensor per row.
        """
        device = self.accelerator.device
        pad = self._tokenizer.pad_token_id
        out = []
        size = self.args.per_device_train_batch_size
        with torch.no_grad(), profiling_context(self, "token_entropies"):
            for start in range(0, len(prompt_ids), size):
                prompts = [torch.tensor(p, dtype=torch.long) for p in prompt_ids[start : start + size]]
                completions = [
                    torch.tensor(c or [pad], dtype=torch.long) for c in completion_ids[start : start + size]
                ]
                p_len, c_len = max(len(p) for p in prompts), max(len(c) for c in completions)
                input_ids = torch.full((len(prompts), p_len + c_len), pad, dtype=torch.long)
                attention = torch.zeros_like(input_ids)
                for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
                    input_ids[i, p_len - len(p) : p_len], attention[i, p_len - len(p) : p_len] = p, 1  # left-padded
                    input_ids[i, p_len : p_len + len(c)], attention[i, p_len : p_len + len(c)] = c, 1  # right-padded
                logits = self.model(
                    input_ids=input_ids.to(device), attention_mask=attention.to(device), logits_to_keep=c_len + 1
                ).logits[:, :-1]  # (b, c_len, V): the distribution each completion token was sampled from
                for i, c in enumerate(completion_ids[start : start + size]):
                    logp = torch.log_softmax(logits[i, : len(c)].float() / self.temperature, dim=-1)  # (L, V)
                    if top_k is not None:
                        logp = logp.topk(min(top_k, logp.size(-1)), dim=-1).values
                    out.append(-(logp.exp() * logp).sum(-1).cpu())
        return out

    def tokenize_prompts(self, prompts: list, rows: list[int] | None = None) -> list[list[int]]:
        """Token ids of `prompts` as TRL tokenizes them for generation (chat template and generation prompt applied).

        Text prompts only (plain or conversational); `rows` are the batch rows they belong to (per-row tool schemas).
        """
        with self._rows_view(rows):
            prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        if images is not None or multimodal_fields:
            raise NotImplementedError("tokenize_prompts takes text prompts; these carry images or multimodal fields.")
        return [_as_list(ids) for ids in prompt_ids]

    def completion_logps(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """(B, T) log-probs of each completion token after its prompt, without gradient, as TRL computes them.

        Prompts left-padded, completions right-padded (TRL's output dict layout); logits divided by the sampling
        temperature. `reference=True` uses the reference policy: TRL's `ref_model`, or for a PEFT model the "ref"
        adapter (re-trained adapters) or the base model with the adapter disabled, as TRL's own reference does.
        """
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        train = self.model.training
        size = self.args.per_device_train_batch_size if train else self.args.per_device_eval_batch_size
        model, scope = self.model, contextlib.nullcontext()
        if reference:
            unwrapped = self.accelerator.unwrap_model(self.model)
            if self.ref_model is not None:
                model = self.ref_model
            elif is_peft_model(unwrapped):
                scope = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
            else:
                raise RuntimeError(
                    "this trainer has no reference policy (beta=0 and no PEFT adapter): set beta > 0, or use an "
                    "advantage estimator that declares `needs_log_ratio = True` so that one is built."
                )
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            with scope, profiling_context(self, "completion_logps"):
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, completion_ids.size(1), batch_size=size
                )
        return logps

    def add_rows(
        self, batch: RolloutBatch, sources: list[int], prompt_ids: list[list[int]], prompts: list | None = None
    ) -> RolloutBatch:
        """Append training rows after scoring: row k repeats this process's scored row `sources[k]` after a new context.

        The new row's completion is the source's (token ids, completion and tool masks, advantages, per-token loss
        weights, dropped flag); its prompt is `prompt_ids[k]` (token ids, unpadded) and only its completion is in the
        loss. No reward is computed and no group statistic changes: rewards and `batch.local(...)` still cover the
        scored rows, which come first; `batch.added_from` lists the new rows' sources. Where TRL's output holds
        log-probs of the old policy (`num_iterations > 1`, generation not aligned with optimizer steps, or vLLM
        importance sampling) or of the reference (`beta != 0`), they are computed for the new context. A new row was
        never sampled under its context, so its vLLM importance-sampling ratio is 1 and its sampling log-probs are
        the policy's under the new context. `prompts` (default: the sources') are what the completions table shows.

        In training, the rows are spread over TRL's micro-batches with the others (`steps_per_generation` equal
        slices after a shuffle); the trainer pads the batch with out-of-loss filler rows to a multiple of
        `steps_per_generation` and normalises per-row losses over the kept rows of the whole batch.
        """
        out = batch._output
        carried = [key for key in _MULTIMODAL_KEYS if out.get(key) is not None]
        if carried:
            raise NotImplementedError(f"rows cannot be added to batches with images yet (TRL's output has {carried}).")
        if len(sources) != len(prompt_ids):
            raise ValueError(f"add_rows got {len(sources)} sources and {len(prompt_ids)} prompts; give one each.")
        scored = batch.num_scored
        if any(not 0 <= s < scored for s in sources):
            raise ValueError(
                f"add_rows: sources must be scored rows of this process (0..{scored - 1}), got {sources}."
            )
        if not sources:
            return batch
        device = out["completion_ids"].device
        src = torch.tensor(sources, dtype=torch.long, device=device)
        rows = out["completion_ids"].size(0)
        pad = self._tokenizer.pad_token_id
        width = max(out["prompt_ids"].size(1), max(len(ids) for ids in prompt_ids))
        new_ids = torch.full((len(sources), width), pad, dtype=out["prompt_ids"].dtype, device=device)
        new_mask = torch.zeros((len(sources), width), dtype=out["prompt_mask"].dtype, device=device)
        for k, ids in enumerate(prompt_ids):
            if ids:
                new_ids[k, width - len(ids) :] = torch.tensor(ids, dtype=new_ids.dtype, device=device)
                new_mask[k, width - len(ids) :] = 1
        completion_ids, completion_mask = out["completion_ids"][src], out["completion_mask"][src]
        logps = {}
        scope = contextlib.nullcontext()
        if ROW_ADAPTERS in out:  # the new rows' log-probs under their sources' adapters
            scope = self._adapters.by_row(out[ROW_ADAPTERS][src].tolist())
        with scope:
            if out.get("old_per_token_logps") is not None:
                old = self.completion_logps(new_ids, new_mask, completion_ids, completion_mask)
                logps["old_per_token_logps"] = old
            if out.get("ref_per_token_logps") is not None:
                logps["ref_per_token_logps"] = self.completion_logps(
                    new_ids, new_mask, completion_ids, completion_mask, reference=True
                )
        for key, value in list(out.items()):
            if key in ("prompt_ids", "prompt_mask"):
                new = new_ids if key == "prompt_ids" else new_mask
                out[key] = torch.cat([_pad(value, width, pad if key == "prompt_ids" else 0, left=True), new])
            elif not isinstance(value, torch.Tensor) or value.dim() == 0:
                if key not in ("num_items_in_batch", KEPT_TOTAL):
                    raise NotImplementedError(f"add_rows cannot extend TRL's output {key!r} ({type(value).__name__}).")
            elif value.size(0) != rows:
                raise NotImplementedError(
                    f"add_rows cannot extend TRL's output {key!r} of shape {tuple(value.shape)}."
                )
            elif key in logps:
                out[key] = torch.cat([value, logps[key].to(value.dtype)])
            elif key == "importance_sampling_ratio":
                out[key] = torch.cat([value, torch.ones_like(value[src])])
            elif key == "sampling_per_token_logps" and "old_per_token_logps" in logps:
                out[key] = torch.cat([value, logps["old_per_token_logps"].to(value.dtype)])
            else:
                out[key] = torch.cat([value, value[src]])
        for name in ("loss_advantages", "loss_weights", "dropped", "segment_ids"):
            value = getattr(batch, name)
            if value is not None:
                setattr(batch, name, torch.cat([value, value[src.to(value.device)]]))
        if batch.owners is not None:
            own = torch.arange(rows, rows + len(sources), device=batch.owners.device).unsqueeze(1)
            mine = torch.where(completion_mask.to(own.device).bool(), own, torch.full_like(own, -1))
            batch.owners = torch.cat([batch.owners, mine.expand(-1, batch.owners.size(1))])
        new_prompts = list(prompts) if prompts is not None else [batch.prompts[s] for s in sources]
        batch.prompts.extend(new_prompts)
        batch.completions.extend(batch.completions[s] for s in sources)
        for values in (*batch.columns.values(), *batch.notes.values()):
            values.extend([values[s] for s in sources])
        batch.completion_ids, batch.completion_mask = out["completion_ids"], out["completion_mask"]
        batch.tool_mask, batch.advantages = out.get("tool_mask"), out["advantages"]
        batch.old_per_token_logps, batch.ref_per_token_logps = (
            out.get("old_per_token_logps"),
            out.get("ref_per_token_logps"),
        )
        batch.added_from.extend(sources)
        return batch

    def _seq_log_ratio(self, batch: RolloutBatch) -> torch.Tensor:
        """(N,) per completion, sum over its loss tokens of log pi_theta - log pi_ref (the sampling policy's)."""
        out = batch._output
        args = (out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])
        policy = out.get("old_per_token_logps")
        policy = self.completion_logps(*args) if policy is None else policy
        ref = out.get("ref_per_token_logps")
        ref = self.completion_logps(*args, reference=True) if ref is None else ref
        ratio = ((policy - ref) * batch.loss_mask).sum(dim=1)
        return self.accelerator.gather(ratio)

    def score_rows(self, rows: list[dict], until: Extension | None = None) -> RolloutBatch:
        """Generate and score `rows` (whole groups, TRL's order) through the pipeline; returns the scored batch.

        Extensions prepare the rows, the rollout owner (if any) generates them, TRL scores them, then the estimator
        and every extension's `after_scoring` run, those before `until` only when it is given (an extension scoring
        extra rows for itself: dynamic-sampling refills). TRL's metrics for these rows are logged as for any batch.
        """
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        plan = RolloutPlan(rows=[dict(row) for row in rows], mode=mode, num_generations=group)
        for extension in self.extensions:
            extension.prepare(plan)
        saved = (self._plan, self._rollout, self._scores)
        saved_rows = self._adapters.rows if self._adapters is not None else None
        if self._adapters is not None:
            self._adapters.rows = None  # until this batch's rollout names its rows' adapters (`_generate`)
        self._plan = plan
        try:
            out = super()._generate_and_score_completions(plan.rows)
            batch = self._scored_batch(plan, out, self._rollout, self._scores)
            if getattr(self.advantage_estimator, "needs_log_ratio", False):
                batch.seq_log_ratio = self._seq_log_ratio(batch)
            if self.advantage_estimator is not trl_group:
                name = getattr(self.advantage_estimator, "__name__", repr(self.advantage_estimator))
                result = self.advantage_estimator(batch)
                advantages, weights = result if isinstance(result, tuple) else (result, None)
                batch.set_advantages(advantages, source=f"advantage estimator {name!r}")
                if weights is not None:
                    batch.scale_loss_weights(weights, source=f"advantage estimator {name!r}")
            for extension in sorted(self.extensions, key=lambda e: e.order):
                if until is not None and (extension is until or extension.order >= until.order):
                    continue
                extension.after_scoring(batch)
            for name, value in batch.metrics.items():
                self.log_metric(name, value, mode)
        finally:
            self._plan, self._rollout, self._scores = saved
            if self._adapters is not None:
                self._adapters.rows = saved_rows
        return batch

    def splice_rows(self, batch: RolloutBatch, extra: RolloutBatch, replace: dict[int, int]) -> RolloutBatch:
        """`batch` with its local row i replaced by row `replace[i]` of `extra` (both from `score_rows`).

        Replace whole trees (whole groups, say): a row whose tokens are another row's needs that row too. Every
        process must call this once per round (it gathers the new rows' rewards), with `{}` when it replaces nothing.
        """
        targets = torch.tensor(list(replace), dtype=torch.long)
        sources = torch.tensor(list(replace.values()), dtype=torch.long)
        pad = self._tokenizer.pad_token_id
        pads = {"prompt_ids": pad, "completion_ids": pad, "tool_mask": 1}
        out = _splice_tensors(batch._output, extra._output, targets, sources, pads, {"prompt_ids", "prompt_mask"})
        rows, width = len(batch.prompts), out["completion_ids"].size(1)
        if batch.owners is not None or extra.owners is not None:
            # Owners are row indices: the spliced rows' owners move with them.
            where = torch.full((len(extra.prompts),), -1, dtype=torch.long)
            where[sources] = targets
            theirs = _owners(extra).cpu()
            moved = torch.where(theirs >= 0, where[theirs.clamp(min=0)], theirs)
            if bool(((theirs >= 0) & (moved < 0))[sources].any()):
                raise ValueError("splice_rows: a replacing row shares tokens with a row that is not spliced in.")
            batch.owners = _splice_one(_owners(batch).cpu(), moved, targets, sources, -1, width).to(
                out["completion_ids"].device
            )
        for name, fill in (("loss_advantages", 0.0), ("loss_weights", 1.0), ("segment_ids", -1)):
            mine, theirs = getattr(batch, name), getattr(extra, name)
            if mine is None and theirs is None:
                continue
            if mine is not None and theirs is not None and mine.dim() == theirs.dim() == 1:
                setattr(batch, name, _splice_one(mine, theirs, targets, sources, fill))
                continue
            mine, theirs = _dense(mine, batch, fill), _dense(theirs, extra, fill)
            setattr(batch, name, _splice_one(mine, theirs, targets, sources, fill, width))
        if batch.dropped is not None or extra.dropped is not None:
            mine = batch.dropped if batch.dropped is not None else torch.zeros(rows, dtype=torch.bool)
            theirs = extra.dropped if extra.dropped is not None else torch.zeros(len(extra.prompts), dtype=torch.bool)
            batch.dropped = _splice_one(mine, theirs, targets, sources, False)
        for values, new in [(batch.prompts, extra.prompts), (batch.completions, extra.completions),
                            *((batch.columns[k], extra.columns[k]) for k in batch.columns),
                            *((batch.notes[k], extra.notes[k]) for k in batch.notes if k in extra.notes)]:  # fmt: skip
            for t, s in replace.items():
                values[t] = new[s]
        local = batch.local(batch.rewards_per_func).clone()
        local[targets.to(local.device)] = extra.local(extra.rewards_per_func)[sources.to(local.device)]
        batch.rewards_per_func = self.accelerator.gather(local)
        batch.rewards = self._total_rewards(batch.rewards_per_func)
        batch.completion_ids, batch.completion_mask = out["completion_ids"], out["completion_mask"]
        batch.tool_mask, batch.advantages = out.get("tool_mask"), out["advantages"]
        batch.old_per_token_logps, batch.ref_per_token_logps = (
            out.get("old_per_token_logps"),
            out.get("ref_per_token_logps"),
        )
        batch.rollout = None  # the generation record no longer describes these rows
        batch._output = out
        return batch

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        """Write the run record and the model card (TRL's, with our methods, configuration and metrics) into
        `output_dir`. `push_to_hub` calls it before uploading; `run_info` (set by the command line) adds the
        `--trainer` name, the model and dataset as given, and the settings as a recipe."""
        from . import hub

        if not self.is_world_process_zero():
            return
        info = dict(self.run_info or {})
        record = hub.run_record(self, model=info.get("model"), dataset=info.get("dataset") or dataset_name,
                                config=info.get("config"))  # fmt: skip
        record["trainer"] = info.get("trainer")
        record.update(info.get("results", {}))
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        repo_id = self.hub_model_id if getattr(self, "hub_model_id", None) else None
        hub.write_run(record, self.args.output_dir, tags=[*self._tag_names, *tags], repo_id=repo_id, title=model_name)

    # ------------------------------------------------------------------ seams
    def _generate_and_score_completions(self, inputs):
        # Seam: `_prepare_inputs` calls this once per generation batch, before that batch's loss, and shuffles the
        # rows right after. With nothing switched on, TRL's result is returned as it is: bit-identical and free.
        if self._plain:
            return super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        for extension in self.extensions:
            extension.before_batch(mode)
        batch = self.score_rows(inputs)
        self.last_batch = batch
        return self._trl_output(batch)

    def _generate(self, prompts: list):
        # Seam: GRPOTrainer._generate(prompts) -> (prompt_ids, completion_ids, tool_mask, completions, logprobs,
        # extra_fields, images, tool_images), called once by `_generate_and_score_completions` after it has built the
        # batch's tool tables and environments. The rollout owner generates here; else TRL, from the plan's prefixes.
        plan = self._plan
        if plan is None:
            return super()._generate(prompts)
        owner = self._rollout_owner
        rollout = owner.rollout(plan, prompts) if owner is not None else None
        if rollout is None:
            rollout = self.generate_rollouts(prompts, plan)
        rollout.check_tree()
        self._rollout = rollout
        if rollout.adapters is not None:
            if self._adapters is None:
                raise ValueError("the rollout names per-row adapters, but the trainer has none: call add_adapters.")
            self._adapters.rows = self._adapters.indices(rollout.adapters)  # TRL's old / ref log-probs come next
        return (rollout.prompt_ids, rollout.completion_ids, rollout.tool_mask, rollout.completions, rollout.logprobs,
                rollout.extra_fields, rollout.images, rollout.tool_images or [])  # fmt: skip

    def _tokenize_prompts(self, prompts: list):
        # Seam: GRPOTrainer._generate calls `prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)`
        # and uses prompt_ids for generation and for the loss's forward pass: context ids added here are context.
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        stage = self._stage
        if stage is not None and not stage.consumed and any(stage.context_ids):
            if any(isinstance(v, list) for v in multimodal_fields.values()):
                raise NotImplementedError(
                    "context prefixes with per-token multimodal fields (a VLM processor) are not supported yet; "
                    "put the prefix text into the prompt itself."
                )
            prompt_ids = [_as_list(p) + c for p, c in zip(prompt_ids, stage.context_ids, strict=True)]
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations=None, has_tool_images=False
    ):
        # Seam: GRPOTrainer._generate calls `completion_ids, logprobs = self._generate_single_turn(prompt_ids, images,
        # multimodal_fields, num_generations)` once, then `_tool_call_loop` calls it again for post-tool turns. A
        # stage applies to that first call only. Before trl 1.14.1 both call it without `num_generations`; TRL's is
        # called through `_trl_compat.generate_single_turn`, which passes the block size as the release takes it.
        stage = self._stage
        if stage is None or stage.consumed:
            return _trl_compat.generate_single_turn(self, super()._generate_single_turn, prompt_ids, images,
                                                    multimodal_fields, num_generations, has_tool_images)  # fmt: skip
        stage.consumed = True
        prefixes = stage.prefix_ids
        budgets = [self.max_completion_length - len(p) for p in prefixes]
        if stage.max_new_tokens is not None:
            budgets = [min(b, stage.max_new_tokens) for b in budgets]
        wanted = [i for i, (done, b) in enumerate(zip(stage.finished, budgets, strict=True)) if not done and b > 0]
        # vLLM server mode (and colocate mode with tensor parallelism) gathers every process's prompts into one call
        # and gives each its share back: `VLLMGeneration.generate` runs `all_prompts = gather_object(prompts)`, then
        # `process_slice = slice(accelerator.process_index * len(prompts), (accelerator.process_index + 1) *
        # len(prompts))`. With sharded parameters (ZeRO-3, FSDP) transformers generation is collective too: TRL
        # generates inside `unwrap_model_for_generation(self.model_wrapped, self.accelerator, gather_deepspeed3_params=
        # ...)`, which gathers the shards from every process. With several processes each one must then send all of
        # its rows, and call even when none of them needs generating: finished rows are generated, their output dropped.
        gathered = self.accelerator.num_processes > 1 and (
            (self.use_vllm and (self.vllm_mode == "server" or self.vllm_tensor_parallel_size > 1))
            or (not self.use_vllm and self.sharded_parameters)
        )
        active = list(range(len(prompt_ids))) if gathered else wanted
        generated, sampled = {}, ({} if self.use_vllm else None)
        if active:
            if len(active) < len(prompt_ids) and (images is not None or multimodal_fields):
                raise NotImplementedError("rows that are already finished are not supported with images yet.")
            started = [_as_list(prompt_ids[i]) + prefixes[i] for i in active]
            # The rows of a block share their prefix and finished flag (`_block_size`): active rows are whole blocks.
            cap = max((budgets[i] for i in wanted), default=1)
            if gathered:  # vLLM: the main process's `max_tokens` is the one request's, for every process's rows
                cap = max(gather_object([cap]))
            with self._backend_cap(cap), self._stop_strings(stage.stop):
                ids, logprobs = _trl_compat.generate_single_turn(
                    self, super()._generate_single_turn, started, images, multimodal_fields, stage.block,
                    has_tool_images,
                )  # fmt: skip
            sampled = None if logprobs is None else {}
            keep = set(wanted)
            for k, i in enumerate(active):
                if i not in keep:
                    continue
                generated[i] = _as_list(ids[k])[: budgets[i]]
                if sampled is not None:
                    sampled[i] = list(logprobs[k])[: len(generated[i])]
        completion_ids = [list(prefix) + generated.get(i, []) for i, prefix in enumerate(prefixes)]
        if sampled is None:
            return completion_ids, None
        # A given prefix was not sampled by the backend: no sampling log-prob (TRL maps None to NaN, ratio 1).
        known = stage.prefix_logprobs or [[None] * len(prefix) for prefix in prefixes]
        return completion_ids, [list(known[i]) + sampled.get(i, []) for i in range(len(prefixes))]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Seam: GRPOTrainer._calculate_rewards(inputs, prompts, completions, completion_ids_list) returns
        # `rewards_per_func = gather(rewards_per_func)`: (N, F) over all processes. Kept, not changed. It loops over
        # `zip(self.reward_funcs, self.reward_processing_classes, self.reward_func_names)` and calls each function as
        # `reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs)`
        # (awaited on its event loop when `is_async_callable`): for this call only, each one is guarded, so that an
        # exception names the function and the first failing row (`RewardFunctionError`); reward models are left as
        # they are, and `self.reward_funcs` keeps the user's objects everywhere else.
        with _attribute(self, "reward_funcs", guard_rewards(self.reward_funcs, self.reward_func_names)):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scores = (rewards_per_func, prompts, completions)
        return rewards_per_func

    def _compute_loss(self, model, inputs):
        # Seam: GRPOTrainer._compute_loss(model, inputs) -> loss. Dropped rows have an all-zero loss mask, so they add
        # nothing to any loss; the per-row losses still divide by the n rows of the micro-batch (grpo, sapo, luspo:
        # mean over rows; dr_grpo: rows * max_completion_length), then by the accumulation steps, and DDP averages
        # over processes. Rescaled by n * slices * processes / K, the sum over a generation batch's slices and
        # processes is the mean over its K kept rows: exact when slices differ in kept rows, or processes in rows.
        if ROW_ADAPTERS in inputs:  # this micro-batch's rows (shuffled by TRL with the rest) and their adapters
            rows = inputs[ROW_ADAPTERS]
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            if self.model.training:
                self._adapters.in_loss(rows[mask.sum(-1) > 0].tolist())
            with self._adapters.by_row(rows.tolist()):
                loss = super()._compute_loss(model, inputs)
        else:
            loss = super()._compute_loss(model, inputs)
        kept = inputs.get(KEPT_ROWS)
        if kept is not None and self.loss_type in ROW_NORMALISED_LOSSES:
            slices = self.args.steps_per_generation if self.model.training else 1
            total = inputs[KEPT_TOTAL].clamp(min=1.0)
            loss = loss * (kept.numel() * slices * self.accelerator.num_processes / total)
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # Seam: GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
        # batch_size=None, ...) runs `model(**model_inputs)` over `input_ids[start:end]` for start in range(0, B,
        # batch_size), in order. With per-row adapters on, each forward takes the next rows' adapters; TRL's reference
        # (the "ref" adapter, or the adapters disabled) is left as it is. With shared_prefix_forward, each chunk runs
        # as a prefix tree (`_shared_prefix_logps`).
        adapters = self._adapters
        if adapters is None or adapters.rows is None:
            if getattr(self.args, "shared_prefix_forward", False):
                names = ("batch_size", "compute_entropy", "compute_aux_loss")  # TRL's order after `logits_to_keep`
                options = dict(zip(names, args, strict=False), **kwargs)
                if _text_only(options, len(args)):
                    size, entropy = options.get("batch_size"), options.get("compute_entropy", False)
                    return self._shared_prefix_logps(model, input_ids, attention_mask, logits_to_keep, size, entropy)
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                              **kwargs)  # fmt: skip
        if adapters.model.active_adapter == "ref":
            with adapters.uniform("ref"):
                return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                  *args, **kwargs)  # fmt: skip
        if len(adapters.rows) != input_ids.size(0):
            raise RuntimeError(f"{input_ids.size(0)} rows reach the model, but {len(adapters.rows)} per-row adapters "
                               "were set for them.")  # fmt: skip
        adapters.start()
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                          **kwargs)  # fmt: skip

    def _shared_prefix_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
        # TRL's `_get_per_token_logps_and_entropies`, per chunk of `batch_size` rows, in order: `labels =
        # input_ids_batch.masked_fill(attention_mask_batch == 0, -100)`, `labels[:, :-logits_to_keep] = -100`, then
        # `with self.accelerator.autocast(): outputs = model(**model_inputs, labels=labels, fused_lm_head=True)` and
        # `outputs.log_probs[:, -logits_to_keep:]` (and `outputs.entropy`). Here each chunk runs once as a prefix tree
        # (`trl_grpo_ext.shared_prefix`): positions, a tree mask built by transformers' mask function for the model's
        # attention, and pre-shifted labels, which TRL's fused head (`add_fused_lm_head`) scores as they are: `else:
        # hidden_states = backbone_outputs.last_hidden_state; labels = shift_labels`.
        batch_size = batch_size or input_ids.size(0)
        config = self.accelerator.unwrap_model(model).config
        make_mask = ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            tree = prefix_tree(input_ids[start : start + batch_size], attention_mask[start : start + batch_size],
                               logits_to_keep)  # fmt: skip
            packed_rows, size = tree.input_ids.shape
            mask = make_mask(batch_size=packed_rows, q_length=size, kv_length=size, allow_is_causal_skip=False,
                             mask_function=tree_mask_function(tree.subtree_end), attention_mask=None,
                             dtype=self.accelerator.unwrap_model(model).dtype, device=input_ids.device)  # fmt: skip
            with self.accelerator.autocast():
                outputs = model(input_ids=tree.input_ids, attention_mask=mask, position_ids=tree.position_ids,
                                shift_labels=tree.shift_labels, fused_lm_head=True)  # fmt: skip
            logps.append(tree.gather(outputs.log_probs))
            if compute_entropy:
                entropies.append(tree.gather(outputs.entropy))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _prepare_inputs(self, generation_batch):
        # Seam: GRPOTrainer._prepare_inputs(generation_batch), training, once per generation: `generation_batch =
        # self._generate_and_score_completions(generation_batch)`, `shuffle_sequence_dict(generation_batch)`, then
        # `split_tensor_dict(generation_batch, self.args.steps_per_generation)` into `self._buffered_inputs`, and it
        # returns `self._buffered_inputs[self._step % self.args.steps_per_generation]`. With shared_prefix_forward, a
        # new buffer's rows are put back together, ordered by prompt (`group_order`: the groups keep their shuffled
        # order), and cut again, so that a group's rows share micro-batches and their prefixes run once.
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        slices = self._buffered_inputs
        if not getattr(self.args, "shared_prefix_forward", False) or slices is buffered:
            return inputs
        if any(slices[0].get(key) is not None for key in _MULTIMODAL_KEYS):
            return inputs  # rows with images run TRL's forward (`_text_only`): nothing to share
        whole = {key: _join([piece[key] for piece in slices]) for key in slices[0]}
        order = group_order(whole["prompt_ids"], whole["prompt_mask"], whole["completion_ids"],
                            whole["completion_mask"])  # fmt: skip
        whole = {key: _take(value, order) for key, value in whole.items()}
        self._buffered_inputs = split_tensor_dict(whole, len(slices))
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _get_train_sampler(self, dataset=None):
        # Seam: GRPOTrainer._get_train_sampler(dataset) returns `RepeatSampler(..., shuffle=self.shuffle_dataset,
        # seed=self.args.seed)`, whose generator is seeded once and draws `torch.randperm(self.num_samples,
        # generator=self.generator)` at each pass: epoch e gets the e-th permutation. A resumed run builds a new
        # sampler and starts at the checkpoint's epoch, so without `set_epoch` it would draw the first one again.
        sampler = super()._get_train_sampler(dataset)
        return _EpochSampler(sampler) if getattr(sampler, "generator", None) is not None else sampler

    def _save_checkpoint(self, model, trial):
        # Seam: GRPOTrainer._save_checkpoint(model, trial) saves into `<output_dir>/checkpoint-<global_step>`; TRL
        # keeps its own extra state there the same way (entropy_ctrl_state.json).
        super()._save_checkpoint(model, trial)
        folder = self._checkpoint_folder(trial)
        # TRL's `_prepare_inputs` generates when `self._step % generate_every == 0 or self._buffered_inputs is None`
        # ("self._buffered_inputs=None can occur when resuming from a checkpoint") and trains on
        # `self._buffered_inputs[self._step % self.args.steps_per_generation]`; a new trainer starts at `_step = 0`.
        # A checkpoint between two generations (steps_per_generation > gradient_accumulation_steps, or
        # num_iterations > 1) would make the resumed run generate again, from the updated policy, and train on the
        # wrong slices: each process keeps its step count and the slices it has not trained on yet (unless the
        # checkpoint holds the model alone, `save_only_model`, which transformers cannot resume from).
        between = self._step % (self.args.steps_per_generation * self.num_iterations)
        if between and self._buffered_inputs is not None and not self.args.save_only_model:
            os.makedirs(folder, exist_ok=True)
            torch.save({"step": self._step, "buffer": self._buffered_inputs},
                       os.path.join(folder, GENERATION_FILE.format(self.accelerator.process_index)))  # fmt: skip
        states = {e.name: e.state_dict() for e in self.extensions}
        if not self.args.should_save or not any(states.values()):
            return
        torch.save(states, os.path.join(folder, STATE_FILE))

    def _checkpoint_folder(self, trial) -> str:
        # Where Trainer._save_checkpoint writes this step's checkpoint: `checkpoint_folder =
        # f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"` in `run_dir = self._get_output_dir(trial=trial)`.
        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Seam: called with the checkpoint folder on `resume_from_checkpoint`, after the model is prepared.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, GENERATION_FILE.format(self.accelerator.process_index))
        if os.path.exists(path):
            saved = torch.load(path, weights_only=True, map_location=self.accelerator.device)
            self._step, self._buffered_inputs = saved["step"], saved["buffer"]
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.exists(path):
            return
        states = torch.load(path, weights_only=True)
        for extension in self.extensions:
            if extension.name in states:
                extension.load_state_dict(states[extension.name])

    # ------------------------------------------------------------------ conversion to and from TRL
    def _scored_batch(self, plan: RolloutPlan, out: dict, rollout: Rollout | None, scores: tuple) -> RolloutBatch:
        """The `RolloutBatch` of TRL's output dict, the kept rewards and the generation record."""
        scores, prompts, completions = scores
        mode = plan.mode
        local = len(plan.rows)
        index = self.accelerator.process_index
        mask = out["completion_mask"]
        width = mask.size(1)
        owners = segment_ids = None
        if rollout is not None and rollout.parents is not None:
            owners = rollout.owners(width).to(mask.device)
        if rollout is not None and any(rollout.prefix_lengths or []):
            lengths = torch.tensor(rollout.prefix_lengths, device=mask.device)
            positions = torch.arange(width, device=mask.device)
            segment_ids = (positions.unsqueeze(0) >= lengths.unsqueeze(1)).long()  # (B, T): 0 prefix, 1 generated
            segment_ids = segment_ids.masked_fill(mask == 0, -1)
        columns = {k: [row.get(k) for row in plan.rows] for k in plan.rows[0] if k not in ("prompt", "completion")}
        if self._adapters is not None:  # every row names its adapter; shuffled and split with the rows by TRL
            adapters = rollout.adapters if rollout is not None and rollout.adapters is not None else [None] * local
            out[ROW_ADAPTERS] = torch.tensor(self._adapters.indices(adapters), dtype=torch.long, device=mask.device)
        batch = RolloutBatch(
            rewards=self._total_rewards(scores),
            rewards_per_func=scores,
            reward_func_names=list(self.reward_func_names),
            reward_weights=self.reward_weights.to(scores.device),
            num_generations=plan.num_generations,
            process_slice=slice(index * local, (index + 1) * local),
            advantages=out["advantages"],
            completion_ids=out["completion_ids"],
            completion_mask=mask,
            tool_mask=out.get("tool_mask"),
            segment_ids=segment_ids,
            owners=owners,
            prompts=list(prompts),
            completions=list(completions),
            columns=columns,
            old_per_token_logps=out.get("old_per_token_logps"),
            ref_per_token_logps=out.get("ref_per_token_logps"),
            mode=mode,
            step=self.state.global_step,
            rollout=rollout,
            notes={key: list(values) for key, values in plan.notes.items()},
        )
        batch._output = out
        return batch

    def _trl_output(self, batch: RolloutBatch) -> dict:
        """TRL's output dict with the batch's advantages, loss weights, dropped and added rows written in."""
        out = batch._output
        added = bool(batch.added_from)
        masked = batch.loss_weights is not None or batch.dropped is not None or added
        # The gathers below are collective, and one process may drop or add rows where another does not (dynamic
        # sampling drops a process's zero-variance groups, BiCC adds rows for its mixed ones): every process takes
        # the branches that any process takes, so that all of them gather, and all of them rescale the loss.
        changed, masked, rescaled = self.any_process(
            batch.loss_advantages is not None or masked, masked,
            added or (batch.dropped is not None and bool(batch.dropped.any())),
        )  # fmt: skip
        if not changed:
            return out
        if rescaled and batch.mode == "train":  # collective: where any process added rows, every process pads
            self._pad_to_micro_batches(batch)
        advantages = batch.current_advantages.clone()
        out["advantages"] = advantages
        if masked:
            mask = out.get("tool_mask")
            mask = torch.ones_like(out["completion_mask"]) if mask is None else mask
            mask = mask * (batch.loss_weights if batch.loss_weights is not None else 1)
            dropped = batch.dropped
            if dropped is not None and bool(dropped.any()):
                dropped = dropped.to(mask.device)
                mask = mask * (~dropped).unsqueeze(1)
                advantages[dropped] = 0.0
            if rescaled:
                kept = torch.ones(mask.size(0), device=mask.device) if dropped is None else (~dropped).float()
                out[KEPT_ROWS] = kept
                out[KEPT_TOTAL] = self.accelerator.gather(kept.sum().reshape(1)).sum()
            out["tool_mask"] = mask
            out["num_items_in_batch"] = self.accelerator.gather((out["completion_mask"] * mask).sum()).sum()
        scored = batch.num_scored
        self._log_row_advantages(advantages[:scored], (out["completion_mask"] * out.get("tool_mask", 1))[:scored])
        return out

    def _pad_to_micro_batches(self, batch: RolloutBatch) -> None:
        # TRL's `_prepare_inputs` splits the generation batch into `steps_per_generation` slices of rows // spg rows
        # (`split_tensor_dict`), losing the rest, and `_compute_loss` gathers per-row values of a slice over the
        # processes (`self.accelerator.gather(masked_seq_mean(is_low_clipped.float()))`), which needs slices of one
        # size on every process: filler rows (copies of row 0, out of the loss) fill each process's batch up to the
        # same multiple of spg (processes add different numbers of rows).
        chunks = self.args.steps_per_generation
        rows = batch.completion_ids.size(0)
        if self.accelerator.num_processes > 1:
            rows = int(self.accelerator.gather(torch.tensor([rows], device=self.accelerator.device)).max())
        missing = rows + (-rows % chunks) - batch.completion_ids.size(0)
        if not missing:
            return
        out = batch._output
        ids = out["prompt_ids"][0][out["prompt_mask"][0].bool()].tolist()
        self.add_rows(batch, [0] * missing, [ids] * missing)
        filler = torch.zeros(batch.completion_ids.size(0), dtype=torch.bool, device=batch.completion_ids.device)
        filler[-missing:] = True
        batch.drop_rows(filler)
        self.log_metric("added_rows/filler", missing)

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

    def _parse_turn(self, ids: list[int], prefix: list[int]):
        # As TRL's `_generate` decodes a first turn ("Decode completions"): `parse_response`, which reads tool calls,
        # when the tokenizer has a response schema; plain decoding otherwise.
        tokenizer = self._tokenizer
        if Version(transformers.__version__) >= Version("5.0.0") and (
            getattr(tokenizer, "response_template", None) is not None
            or getattr(tokenizer, "response_schema", None) is not None
        ):
            return _trl_compat.parse_response(tokenizer, ids, prefix, self.tools)
        return {"role": "assistant", "content": self.processing_class.decode(ids, skip_special_tokens=True)}

    def _block_size(self, plan: RolloutPlan, requested: int, finished: list[bool] | None = None) -> int:
        """`requested`, if every block of that many consecutive rows shares its prefixes (on every process), else 1.

        vLLM server mode gathers the prompts of all processes, keeps every `num_generations`-th one and asks for `n`
        completions of it: rows of a block must be the same row. All processes must agree on one block size.
        """
        if requested <= 1:
            return 1
        finished = finished or [False] * len(plan.rows)
        rows = list(zip(map(tuple, plan.context_ids), map(tuple, plan.prefix_ids), finished, strict=True))
        rows = gather_object(rows)
        shared = len(rows) % requested == 0 and all(
            len(set(rows[i : i + requested])) == 1 for i in range(0, len(rows), requested)
        )
        return requested if shared else 1

    # ------------------------------------------------------------------ scoped state
    @contextlib.contextmanager
    def _staged(self, stage: _Stage):
        saved, self._stage = self._stage, stage
        try:
            yield
        finally:
            self._stage = saved

    @contextlib.contextmanager
    def _rows_view(self, rows: list[int] | None):
        # TRL builds per-row tool tables (and environment names) for the whole batch before `_generate`; a call over
        # some of the batch's rows must see theirs, in its own row order.
        names = [n for n in ("_sync_tool_dicts", "_async_tool_dicts", "_batch_environments") if hasattr(self, n)]
        saved = {n: getattr(self, n) for n in names}
        try:
            if rows is not None:
                for name, values in saved.items():
                    if values is not None:
                        setattr(self, name, [values[i] for i in rows])
            yield
        finally:
            for name, values in saved.items():
                setattr(self, name, values)

    @contextlib.contextmanager
    def _backend_cap(self, max_new_tokens: int):
        # The backend's cap for one call; `max_completion_length` (the trajectory's limit) stays as it is.
        config, kwargs = getattr(self, "generation_config", None), getattr(self, "generation_kwargs", None)
        vllm = getattr(self, "vllm_generation", None)
        saved = (
            config.max_new_tokens if config is not None else None,
            kwargs.get("max_new_tokens") if isinstance(kwargs, dict) else None,
            vllm.max_completion_length if vllm is not None else None,
        )
        self._set_backend_cap(max_new_tokens)
        try:
            yield
        finally:
            if config is not None:
                config.max_new_tokens = saved[0]
            if isinstance(kwargs, dict):
                kwargs["max_new_tokens"] = saved[1]
            if vllm is not None:
                vllm.max_completion_length = saved[2]

    @contextlib.contextmanager
    def _stop_strings(self, stop: list[str]):
        # transformers: `generate` builds its StopStringCriteria only with a tokenizer, and TRL calls
        # `unwrapped_model.generate(**generate_inputs, generation_config=self.generation_config)` without one; so the
        # unwrapped model's `generate` gets it for this call. vLLM: `VLLMGeneration.generate` sends its
        # `generation_kwargs` with every request: to the server as `"generation_kwargs": self.generation_kwargs` (the
        # client: `sampling_params.update(generation_kwargs or {})`), and in colocate mode through
        # `generation_kwargs.update(self.generation_kwargs)` into `SamplingParams(**generation_kwargs)`; vLLM then
        # stops at `stop`, keeping the string (`tests/test_vllm.py` checks both). Continuous batching takes neither:
        # the stage then runs to its cap and the caller cuts at the stop string.
        if not stop:
            yield
            return
        if self.use_vllm:
            kwargs = self.vllm_generation.generation_kwargs
            saved = dict(kwargs)
            kwargs.update(stop=list(stop), include_stop_str_in_output=True)
            try:
                yield
            finally:
                kwargs.clear()
                kwargs.update(saved)
            return
        if self.use_transformers_continuous_batching:
            yield
            return
        model = self.accelerator.unwrap_model(self.model_wrapped)
        own = "generate" in vars(model)
        original = model.generate
        saved_stop = self.generation_config.stop_strings
        self.generation_config.stop_strings = list(stop)
        model.generate = functools.partial(original, tokenizer=self._tokenizer)
        try:
            yield
        finally:
            self.generation_config.stop_strings = saved_stop
            if own:
                model.generate = original
            else:
                del model.generate


# ---------------------------------------------------------------------------------------------------- helpers
class _RowAdapters(TrainerCallback):
    """The policy's LoRA adapters by row: PEFT's mixed-adapter forward (`adapter_names=`, one name per row), which PEFT
    allows only in eval mode at the model level, passed to each LoRA layer directly so that it trains too.

    A pre-hook on the base model's decoder sets, per forward, the adapters of its rows: `uniform(name)` (every row, every
    forward: generation), or `rows` (one index per row; each forward takes the next rows, from `start()` on). The
    adapters stay set until the next forward, so gradient checkpointing's recomputation in the backward pass sees
    the same ones. As a callback it drops, before each optimizer step, the gradients of adapters none of whose rows
    was in the step's loss.
    """

    def __init__(self, model, policy: str, any_process):
        from peft.tuners.lora import LoraLayer

        self.model, self.names = model, [policy]
        self.any_process = any_process  # `trainer.any_process`: a flag over all processes
        self.rows: list[int] | None = None  # per-row indices into `names`, while a batch's rows are being run
        self._uniform: str | None = None
        self._cursor = 0
        self._current: list[str] | None = None
        self._stepped: set[int] = set()
        # Once per forward, by __call__, on the loss's path (PeftModel -> LoraModel -> `model.forward`) and
        # generation's (`generate` -> `model(...)`) alike: the base model's decoder (its transformer body).
        base = model.get_base_model()
        body = base.get_decoder() if hasattr(base, "get_decoder") else base
        body.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.register_forward_pre_hook(self._before_layer, with_kwargs=True)
                module.get_base_layer().register_forward_hook(self._after_base_layer)

    def add(self, name: str) -> None:
        if not isinstance(name, str) or not name or "." in name or name == "ref":
            raise ValueError(f"adapter name {name!r} must be a non-empty name without '.' (and not 'ref').")
        if name not in self.model.peft_config:
            self.model.add_adapter(name, copy.deepcopy(self.model.peft_config[self.names[0]]))
            self.model.set_adapter(self.names[0])  # the policy's stays the active one (what is saved at the root)
        if name not in self.names:
            self.names.append(name)
        self.trainable()

    def trainable(self) -> None:
        # PEFT's `set_adapter` leaves only the active adapter trainable; every row adapter trains.
        names = set(self.names)
        for key, param in self.model.named_parameters():
            parts = key.split(".")
            if any(p.startswith("lora_") for p in parts) and names & set(parts):
                param.requires_grad_(True)

    def indices(self, adapters: list) -> list[int]:
        out = []
        for name in adapters:
            name = self.names[0] if name is None else name
            if name not in self.names:
                raise ValueError(f"adapter {name!r} is not one of the trainer's ({', '.join(self.names)}); add it "
                                 "with trainer.add_adapters first.")  # fmt: skip
            out.append(self.names.index(name))
        return out

    def parameters(self, name: str):
        for key, param in self.model.named_parameters():
            parts = key.split(".")
            if name in parts and any(p.startswith("lora_") for p in parts):
                yield param

    @contextlib.contextmanager
    def uniform(self, name: str | None):
        saved, self._uniform = self._uniform, self.names[0] if name is None else name
        try:
            yield
        finally:
            self._uniform = saved

    @contextlib.contextmanager
    def by_row(self, rows: list[int]):
        saved, self.rows = self.rows, list(rows)
        try:
            yield
        finally:
            self.rows = saved

    def start(self) -> None:
        self._cursor = 0
        self.trainable()

    def in_loss(self, rows: list[int]) -> None:
        self._stepped.update(rows)

    def _before_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if self._uniform is not None:
            self._current = [self._uniform] * ids.size(0)
        elif self.rows is not None:
            chunk = self.rows[self._cursor : self._cursor + ids.size(0)]
            if len(chunk) != ids.size(0):
                raise RuntimeError(f"a forward over {ids.size(0)} rows found {len(chunk)} per-row adapters left.")
            self._cursor += ids.size(0)
            self._current = [self.names[i] for i in chunk]
        else:
            self._current = None

    def _before_layer(self, module, args, kwargs):
        if self._current is None:
            return None
        return args, {**kwargs, "adapter_names": self._current}

    def _after_base_layer(self, module, args, output):
        # PEFT's mixed-adapter forward adds each adapter's output into the base layer's in place (`result[rows] +=
        # output`, peft/tuners/lora/bnb.py `_mixed_batch_forward`); a 4-bit base returns a view of bitsandbytes'
        # MatMul4Bit, which autograd forbids modifying in place. PEFT's own training forward clones it for that reason
        # ("for 4bit, we need to defensively clone here"); its mixed path, meant for inference, does not.
        if self._current is not None and torch.is_grad_enabled() and isinstance(output, torch.Tensor):
            return output.clone() if output._is_view() else None
        return None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # Gradients are averaged over the processes by now: an adapter with rows in any process's loss steps on
        # every process, or the copies of the model would part.
        stepped = self.any_process(*(index in self._stepped for index in range(len(self.names))))
        for index, name in enumerate(self.names):
            if not stepped[index]:
                for param in self.parameters(name):
                    param.grad = None
        self._stepped = set()


def _build_extensions(args, callbacks, extensions) -> list[Extension]:
    built = [e for e in (m.extension(args) for m in list_methods() if m.extension is not None) if e is not None]
    built += [c for c in callbacks or [] if isinstance(c, Extension)]
    built += list(extensions or [])
    return _check_extensions(built)


def _limit_tool_time(args, kwargs: dict) -> dict:
    """The trainer's keyword arguments with each of its `tools=` under the config's `tool_timeout` (`time_limited`:
    one process per call, killed at the limit). Environment methods keep their state in this process: not limited."""
    seconds = getattr(args, "tool_timeout", None)
    if seconds is None:
        return kwargs
    if kwargs.get("environment_factory") is not None:
        logger.warning(
            f"tool_timeout={seconds!r} limits the functions in tools= only: environment methods "
            "(environment_factory=) keep their state in the trainer's process and run without a time limit."
        )
    if not kwargs.get("tools"):
        return kwargs
    return {**kwargs, "tools": with_time_limit(list(kwargs["tools"]), seconds)}


def _check_extensions(extensions: list[Extension]) -> list[Extension]:
    names = {}
    for extension in extensions:
        if not isinstance(extension, Extension):
            raise TypeError(f"extensions holds {extension!r}, which is not a trl_grpo_ext.Extension.")
        if extension.name in names:
            raise ValueError(
                f"two extensions are named {extension.name!r} ({type(names[extension.name]).__name__} and "
                f"{type(extension).__name__}): a method is switched on once; keep one of them."
            )
        names[extension.name] = extension
    owners = [e for e in extensions if e.owns_rollout]
    if len(owners) > 1:
        raise ValueError(
            f"{owners[0].name!r} and {owners[1].name!r} both generate the rollout themselves; only one extension of a "
            "trainer may own the rollout: switch one of them off."
        )
    return extensions


def _rollout_from_trl(result: tuple, prefix_lengths: list[int]) -> Rollout:
    prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = result
    return Rollout(
        prompt_ids=[_as_list(p) for p in prompt_ids], completion_ids=[_as_list(c) for c in completion_ids],
        completions=completions, tool_mask=tool_mask, logprobs=logprobs, prefix_lengths=prefix_lengths,
        images=images, tool_images=tool_images or None, extra_fields=extra_fields or {},
    )  # fmt: skip


def _splice_tensors(base: dict, extra: dict, targets, sources, pad_values: dict, left_padded: set) -> dict:
    """`base` with rows `targets` replaced by rows `sources` of `extra`, padding (B, T) tensors to a common T."""
    if base.keys() != extra.keys():
        raise ValueError(f"cannot splice batches with different keys: {sorted(base.keys() ^ extra.keys())}")
    out = {}
    for key, value in base.items():
        other = extra[key]
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            out[key] = value  # scalars (num_items_in_batch) are recomputed by the caller
            continue
        if not isinstance(value, torch.Tensor) or not isinstance(other, torch.Tensor):
            raise NotImplementedError(f"rows of batches carrying {key!r} ({type(value).__name__}) cannot be replaced")
        width = max(value.size(1), other.size(1)) if value.dim() >= 2 else None
        out[key] = _splice_one(value, other, targets, sources, pad_values.get(key, 0), width, key in left_padded)
    return out


def _splice_one(value, other, targets, sources, fill, width=None, left=False):
    if width is not None and value.dim() >= 2:
        value, other = (_pad(t, width, fill, left) for t in (value, other))
    value = value.clone()
    value[targets.to(value.device)] = other[sources.to(other.device)].to(value.dtype).to(value.device)
    return value


def _pad(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    fill = tensor.new_full((tensor.size(0), missing, *tensor.shape[2:]), value)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)


def _owners(batch: RolloutBatch) -> torch.Tensor:
    if batch.owners is not None:
        return batch.owners
    rows, width = batch.completion_ids.shape
    return torch.arange(rows, device=batch.completion_ids.device).unsqueeze(1).expand(rows, width)


def _dense(value, batch: RolloutBatch, fill: float) -> torch.Tensor:
    # A (B, T) view of an optional (B,) or (B, T) field, for splicing; a missing one is its neutral value.
    rows, width = batch.completion_ids.shape
    if value is None:
        return torch.full((rows, width), fill, device=batch.completion_ids.device)
    return value.unsqueeze(1).expand(rows, width) if value.dim() == 1 else value


def _turns_before(tool_mask: list[int], point: int) -> int:
    """The model turn that starts at `point`: how many times the mask goes from tool (0) back to model (1) by then."""
    return sum(1 for t in range(1, point + 1) if tool_mask[t] == 1 and tool_mask[t - 1] == 0)


def _text_only(options: dict, positional: int) -> bool:
    """Whether a `_get_per_token_logps_and_entropies` call can run as a prefix tree: text rows, no MoE aux loss."""
    if positional > 3:  # multimodal inputs given by position, after TRL's `compute_aux_loss`
        return False
    other = set(options) - {"batch_size", "compute_entropy", "compute_aux_loss"}
    return not options.get("compute_aux_loss") and all(options[key] is None for key in other)


def _join(values: list):
    # The inverse of TRL's `split_tensor_dict` (tensors and lists cut along rows, 0-dim tensors and None copied).
    first = values[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return torch.cat(values)
    if isinstance(first, list):
        return [item for value in values for item in value]
    return first


def _take(value, order: torch.Tensor):
    # TRL's `shuffle_sequence_dict` permutation, for any row order.
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return value[order.to(value.device)]
    if isinstance(value, list):
        return [value[i] for i in order.tolist()]
    return value


@contextlib.contextmanager
def _attribute(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _disable_bnb_cpu_weight_repacking(model) -> None:
    # bitsandbytes' Linear4bit repacks its weight for AVX512-BF16 CPUs on the first eval-mode forward without grad
    # (generation, `trainer.evaluate()`); the repacked weight's matmul has no backward, so every later training forward
    # passes no gradient to the layers below (with a bias it raises; bitsandbytes 0.50). Keeping the portable layout
    # costs CPU speed (docs/benchmarks.md, the 4-bit rows) and nothing on GPUs.
    if model is None:
        return
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
