"""Run records and model cards: the methods that trained a model, their papers, its configuration and metrics.

`GRPOExtTrainer.create_model_card` (which TRL's and transformers' `push_to_hub` call) writes the run record
(`trl_grpo_ext_run.json`) and the model card (`README.md`) into `output_dir`. The card is TRL's own
(`trl.trainer.utils.generate_model_card`, with the trainer's `_tag_names` and the methods as tags) followed by our
sections: the methods and their papers, how to load the result, the configuration, the final metrics. `trl-grpo-ext
push OUTPUT_DIR REPO_ID` rewrites the card for the repository and uploads a saved run with `HfApi.upload_folder`.
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
    """ "grpo", then the registered methods whose extension `trainer` runs, in registration order."""
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


def run_record(trainer, *, model: str | None = None, dataset: str | None = None, config: dict | None = None) -> dict:
    """What a trained `trainer` records about its run (`config`: the settings it was given, as a recipe holds them)."""
    folder = Path(trainer.args.output_dir)
    return {
        "trainer": getattr(trainer, "cli_name", None),
        "trainer_class": type(trainer).__name__,
        "methods": methods_used(trainer),
        "model": model or getattr(trainer.model.config, "_name_or_path", None),
        "dataset": dataset,
        "output_dir": str(folder.resolve()),
        "adapter": (folder / "adapter_config.json").exists(),
        "adapters": _row_adapters(trainer),
        "reward_funcs": list(trainer.reward_func_names),
        "steps": trainer.state.global_step,
        "config": config or {},
        "metrics": final_metrics(trainer.state.log_history),
        "versions": _versions(),
    }


def load_run(output_dir) -> dict:
    """The run record saved in `output_dir`; raises FileNotFoundError naming the fix."""
    path = Path(output_dir) / RUN_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{output_dir} has no {RUN_FILE}: push uploads runs saved by `trl-grpo-ext train` (or a trainer's "
            "`create_model_card()`); give the run's output_dir, or upload other folders with `hf upload`"
        )
    return json.loads(path.read_text())


def write_run(record: dict, output_dir, tags=(), repo_id: str | None = None, title: str | None = None) -> None:
    """Write the run record and its model card into `output_dir`."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps(record, indent=2))
    model_card(record, repo_id=repo_id, tags=tags, title=title).save(folder / "README.md")


def model_card(record: dict, repo_id: str | None = None, tags=(), title: str | None = None):
    """TRL's model card for a run record, followed by the methods and papers, usage, configuration and metrics.

    `repo_id` is where the card is pushed to; without it, the card describes the local output directory.
    """
    import yaml
    from trl.trainer.utils import generate_model_card

    base = _hub_id(record["model"])
    dataset = _hub_id(record["dataset"])
    title = title or (repo_id.split("/")[-1] if repo_id else Path(record["output_dir"]).name)
    methods = [k for k in record["methods"] if k != "grpo"]
    card = generate_model_card(
        base_model=base, model_name=title, hub_model_id=repo_id or record["output_dir"], dataset_name=dataset,
        tags=sorted({"trl", "grpo", "trl-grpo-ext", *tags, *methods}), wandb_url=None, trackio_url=None,
        trainer_name=f"trl-grpo-ext's {record['trainer_class']}", paper_title=GRPO[0], paper_id=GRPO[1],
    )  # fmt: skip
    card.data.library_name = "peft" if record["adapter"] else "transformers"
    card.data.datasets = [dataset] if dataset else None
    card.data.pipeline_tag = "text-generation"
    kind = "A LoRA adapter for" if record["adapter"] else "A fine-tune of"
    base_text = f"[{base}](https://huggingface.co/{base})" if base else _describe_local(record["model"])
    if dataset:
        data_text = f"[{dataset}](https://huggingface.co/datasets/{dataset})"
    else:
        data_text = {
            "built-in": "the built-in arithmetic dataset",
            "mixture": "the `datasets` mixture below",
            "addition": "the built-in addition task (`trl_grpo_ext.tasks`)",
            "driving": "the built-in text-only driving task (`trl_grpo_ext.tasks`, `trl_grpo_ext.data.driving`)",
        }.get(record["dataset"], f"`{record['dataset']}`")
    if str(record["dataset"]).startswith("rg:"):
        data_text = f"the reasoning-gym task `{record['dataset']}` (`trl_grpo_ext.tasks.RGTask`)"
    rows = "\n".join(_method_row(key) for key in record["methods"])
    metrics = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(record["metrics"].items())) or "| (none logged) | |"
    rewards = ", ".join(f"`{r}`" for r in record["reward_funcs"])
    recipe = yaml.safe_dump(record["config"], sort_keys=False, allow_unicode=True).strip()
    versions = "\n".join(f"- {package}: {v}" for package, v in record["versions"].items())
    results = ""
    for metric, what in (("accuracy", "accuracy"), ("driving_score", "driving score")):
        if f"heldout_{metric}_before" in record:
            results = (f"\n\nHeld-out {what} (greedy, the task's held-out set): "
                       f"{record[f'heldout_{metric}_before']:.3f} before training, "
                       f"{record[f'heldout_{metric}_after']:.3f} after.")  # fmt: skip
    card.text += f"""
## trl-grpo-ext

{kind} {base_text}, trained with [trl-grpo-ext]({REPOSITORY_URL}) (`{record["trainer_class"]}`, built on TRL's
`GRPOTrainer`) on {data_text} for {record["steps"]} steps.{results}

### Methods

| method | paper |
|---|---|
{rows}

### Usage

```python
{_usage(repo_id or record["output_dir"], base, record["adapter"], record.get("adapters") or {})}
```

### Training configuration

Rewards: {rewards}. The settings the run was given, as a recipe for `trl-grpo-ext train --config recipe.yaml`:

```yaml
{recipe}
```

### Final metrics

The last logged value of each metric. A method's own metrics carry its prefix (`curriculum/`, `prorl/`, ...).

| metric | value |
|---|---|
{metrics}

### Package versions

{versions}
"""
    return card


def check_push(output_dir, repo_id: str) -> dict:
    """What can be checked before any request: a saved run with a model in `output_dir` (its record is returned) and
    a valid `repo_id`. Raises FileNotFoundError / ValueError naming the fix."""
    from huggingface_hub.utils import validate_repo_id

    folder = Path(output_dir)
    record = load_run(folder)
    if not any((folder / f).exists() for f in ("config.json", "adapter_config.json")):
        raise FileNotFoundError(
            f"{folder} has a run record but no model (config.json) or adapter (adapter_config.json); save the model "
            "there (`trainer.save_model`) before pushing"
        )
    validate_repo_id(repo_id)
    return record


def push(output_dir, repo_id: str, *, private: bool | None = None, token: str | None = None) -> str:
    """Write the model card for `repo_id` into `output_dir` and upload the folder; return the repository URL.

    The repository is created if missing. Raises FileNotFoundError / ValueError (nothing uploaded) when the folder
    holds no saved run or no model, or `repo_id` is not a valid repository id.
    """
    from huggingface_hub import HfApi

    folder = Path(output_dir)
    record = check_push(folder, repo_id)
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


def offline_reason() -> str | None:
    """Why nothing can be uploaded before trying (HF_HUB_OFFLINE is set), or None."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it on a machine that reaches the Hub"
    return None


def push_failure(exc: BaseException) -> str:
    """What went wrong in an upload and what to do, from the error: no network, no login or no rights, or other."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    text = " ".join(f"{exc}".split())[:300]
    chain, cause = [], exc
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(e, OfflineModeIsEnabled) for e in chain):
        return f"{text}; unset HF_HUB_OFFLINE on a machine that reaches the Hub"
    status = next((e.response.status_code for e in chain if isinstance(e, HfHubHTTPError) and e.response is not None),
                  None)  # fmt: skip
    if status in (401, 403):
        return f"{text}; log in with a token that can write there (`hf auth login`), or fix the repo id"
    if any(isinstance(e, (ConnectionError, TimeoutError, OSError)) for e in chain) or "connect" in text.lower():
        return f"the Hub could not be reached ({text}); check the network or proxy"
    return f"{text}; check the repo id and your rights to it (`hf auth whoami`)"


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


def _hub_id(name: str | None) -> str | None:
    # A Hub id is "owner/name" and not a local path; "tiny", "built-in", builders ("json") and paths are not.
    if not name or name.count("/") != 1 or name.startswith((".", "/", "~")) or Path(name).exists():
        return None
    return name


def _describe_local(model: str | None) -> str:
    if model == "tiny":
        return "the tiny random Qwen2 of `trl_grpo_ext.testing` (an offline test model)"
    return f"the local model `{model}`"


def _row_adapters(trainer) -> dict[str, list[str]]:
    """The LoRA adapters beside the policy's (saved in subfolders named after them), each with what uses it."""
    users: dict[str, list[str]] = {}
    for extension in getattr(trainer, "extensions", []):
        for adapter, user in getattr(extension, "adapter_users", {}).items():
            users.setdefault(adapter, []).extend(user)
    return {name: users.get(name, []) for name in (getattr(trainer, "adapters", None) or [])[1:]}


def _usage(name: str, base: str | None, adapter: bool, adapters: dict | None = None) -> str:
    if adapter:
        text = (
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
            f'base = AutoModelForCausalLM.from_pretrained("{base or "BASE_MODEL"}")\n'
            f'model = PeftModel.from_pretrained(base, "{name}")'
        )
        for adapter_name, users in (adapters or {}).items():
            used = f"  # {', '.join(users)}" if users else ""
            text += f'\nmodel.load_adapter("{name}", adapter_name="{adapter_name}", subfolder="{adapter_name}"){used}'
        if adapters:
            text += f'\nmodel.set_adapter("{next(iter(adapters))}")  # switch per call, as in training'
        return text
    return f'from transformers import pipeline\n\ngenerator = pipeline("text-generation", model="{name}")'


def _versions() -> dict[str, str]:
    result = {}
    for package in ("trl-grpo-ext", "trl", "transformers", "peft", "torch"):
        try:
            result[package] = version(package)
        except PackageNotFoundError:
            continue
    return result
