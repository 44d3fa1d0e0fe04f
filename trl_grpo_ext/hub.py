"""Model cards and Hub uploads for saved runs: the method(s) that trained the model, their papers, config, metrics.

`trl-grpo-ext train` calls `save_run` after saving the model: it writes the run record (`trl_grpo_ext_run.json`) and a
model card (`README.md`) into the output directory. `trl-grpo-ext push OUTPUT_DIR REPO_ID`, and `--push_to_hub` at
the end of training, call `push`: it rewrites the card for the repository and uploads the folder (the model, or the
LoRA adapter) with `HfApi.upload_folder`.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .extension import get_method, list_methods

RUN_FILE = "trl_grpo_ext_run.json"
REPOSITORY_URL = "https://github.com/trl-grpo-ext/trl-grpo-ext"
# Not uploaded: intermediate checkpoints (and their optimizer states), as Trainer.push_to_hub leaves them out.
IGNORE_PATTERNS = ["checkpoint-*", "_*"]
GRPO = ("GRPO (DeepSeekMath)", "2402.03300")


def methods_used(trainer) -> list[str]:
    """The names of the registered methods whose extension `trainer` runs, after "grpo", in registration order."""
    names = {extension.name for extension in getattr(trainer, "extensions", [])}
    return ["grpo", *(m.name for m in list_methods() if m.name in names and m.arxiv)]


def final_metrics(log_history: list[dict]) -> dict[str, float]:
    """The last logged value of every metric (TRL logs each as its mean over a logging interval)."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        for key, value in entry.items():
            if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[key] = value
    return metrics


def save_run(trainer, output_dir, *, trainer_name: str, model: str, dataset: str, config: dict) -> dict:
    """Write the run record and the model card into `output_dir` (after `trainer.save_model(output_dir)`).

    Args:
        trainer: the trained trainer (its methods, reward names, steps and logged metrics are recorded).
        trainer_name: the `--trainer` name.
        model: the base model as given (a Hub id or a local path), or "tiny" for the offline test model.
        dataset: the dataset as given (a Hub id, a local path or builder), "built-in", or "mixture".
        config: the settings the run was given, as a YAML recipe would hold them.
    """
    folder = Path(output_dir)
    record = {
        "trainer": trainer_name,
        "trainer_class": type(trainer).__name__,
        "methods": methods_used(trainer),
        "model": model,
        "dataset": dataset,
        "output_dir": str(folder.resolve()),
        "adapter": (folder / "adapter_config.json").exists(),
        "reward_funcs": list(trainer.reward_func_names),
        "steps": trainer.state.global_step,
        "config": config,
        "metrics": final_metrics(trainer.state.log_history),
        "versions": _versions(),
    }
    (folder / RUN_FILE).write_text(json.dumps(record, indent=2))
    model_card(record).save(folder / "README.md")
    return record


def load_run(output_dir) -> dict:
    """The run record saved by `save_run` in `output_dir`; raises FileNotFoundError naming the fix."""
    path = Path(output_dir) / RUN_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{output_dir} has no {RUN_FILE}: push uploads runs saved by `trl-grpo-ext train` (or "
            "`trl_grpo_ext.hub.save_run`); give the run's output_dir, or upload other folders with `hf upload`"
        )
    return json.loads(path.read_text())


def model_card(record: dict, repo_id: str | None = None):
    """A `huggingface_hub.ModelCard` for a run record: methods and papers, usage, the config, the final metrics.

    `repo_id` is where the card is pushed to; without it, the card describes the local output directory.
    """
    import yaml
    from huggingface_hub import ModelCard, ModelCardData

    base = _hub_id(record["model"])
    dataset = _hub_id(record["dataset"])
    title = repo_id.split("/")[-1] if repo_id else Path(record["output_dir"]).name
    data = ModelCardData(
        base_model=base,
        datasets=[dataset] if dataset else None,
        library_name="peft" if record["adapter"] else "transformers",
        pipeline_tag="text-generation",
        tags=["trl", "grpo", "trl-grpo-ext", *(k for k in record["methods"] if k != "grpo")],
        model_name=title,
    )
    kind = "A LoRA adapter for" if record["adapter"] else "A fine-tune of"
    base_text = f"[{base}](https://huggingface.co/{base})" if base else _describe_local(record["model"])
    if dataset:
        data_text = f"[{dataset}](https://huggingface.co/datasets/{dataset})"
    elif record["dataset"] == "built-in":
        data_text = "the built-in arithmetic dataset"
    elif record["dataset"] == "mixture":
        data_text = "the `datasets` mixture of the configuration below"
    else:
        data_text = f"`{record['dataset']}`"
    methods = "\n".join(_method_row(key) for key in record["methods"])
    metrics = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(record["metrics"].items())) or "| (none logged) | |"
    rewards = ", ".join(f"`{r}`" for r in record["reward_funcs"])
    recipe = yaml.safe_dump(record["config"], sort_keys=False, allow_unicode=True).strip()
    versions = "\n".join(f"- {package}: {v}" for package, v in record["versions"].items())
    usage = _usage(repo_id or record["output_dir"], base, record["adapter"])
    trainer_class, steps = record["trainer_class"], record["steps"]
    body = f"""
# {title}

{kind} {base_text}, trained with [trl-grpo-ext]({REPOSITORY_URL}) (`{trainer_class}`, built on TRL's `GRPOTrainer`)
on {data_text} for {steps} steps.

## Methods

| method | paper |
|---|---|
{methods}

## Usage

```python
{usage}
```

## Training configuration

Rewards: {rewards}. The settings the run was given, as a recipe for `trl-grpo-ext train --config recipe.yaml`:

```yaml
{recipe}
```

## Final metrics

The last logged value of each metric. A method's own metrics carry its prefix (`curriculum/`, `prorl/`, ...).

| metric | value |
|---|---|
{metrics}

## Framework versions

{versions}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def _method_row(key: str) -> str:
    if key == "grpo":
        title, arxiv = GRPO
    else:
        try:
            method = get_method(key)
        except KeyError:  # a record from a version that knew a method this one does not
            return f"| {key} | |"
        title, arxiv = method.title, method.arxiv
    return f"| {title} | [arXiv:{arxiv}](https://arxiv.org/abs/{arxiv}) |"


def push(output_dir, repo_id: str, *, private: bool | None = None, token: str | None = None) -> str:
    """Write the model card for `repo_id` into `output_dir` and upload the folder; return the repository URL.

    The repository is created if missing. Raises FileNotFoundError / ValueError (nothing uploaded) when the folder
    holds no saved run or no model, or `repo_id` is not a valid repository id.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.utils import validate_repo_id

    folder = Path(output_dir)
    record = load_run(folder)
    if not any((folder / f).exists() for f in ("config.json", "adapter_config.json")):
        raise FileNotFoundError(
            f"{folder} has a run record but no model (config.json) or adapter (adapter_config.json); save the model "
            "there (`trainer.save_model`) before pushing"
        )
    validate_repo_id(repo_id)
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    model_card(record, repo_id=repo.repo_id).save(folder / "README.md")
    api.upload_folder(
        repo_id=repo.repo_id,
        folder_path=folder,
        commit_message=f"Upload {record['trainer_class']} run ({', '.join(record['methods'])})",
        ignore_patterns=IGNORE_PATTERNS,
    )
    return str(repo)


def _hub_id(name: str | None) -> str | None:
    # A Hub id is "owner/name" and not a local path; "tiny", "built-in", builders ("json") and paths are not.
    if not name or name.count("/") != 1 or name.startswith((".", "/", "~")) or Path(name).exists():
        return None
    return name


def _describe_local(model: str) -> str:
    if model == "tiny":
        return "the tiny random Qwen2 of `trl_grpo_ext.testing` (an offline test model)"
    return f"the local model `{model}`"


def _usage(name: str, base: str | None, adapter: bool) -> str:
    if adapter:
        return (
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
            f'base = AutoModelForCausalLM.from_pretrained("{base or "BASE_MODEL"}")\n'
            f'model = PeftModel.from_pretrained(base, "{name}")'
        )
    return f'from transformers import pipeline\n\ngenerator = pipeline("text-generation", model="{name}")'


def _versions() -> dict[str, str]:
    result = {}
    for package in ("trl-grpo-ext", "trl", "transformers", "peft", "torch"):
        try:
            result[package] = version(package)
        except PackageNotFoundError:
            continue
    return result
