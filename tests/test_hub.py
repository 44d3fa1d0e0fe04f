"""Model cards and Hub pushes, offline: only HfApi's two network calls (create_repo, upload_folder) are replaced."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import HfApi, RepoUrl, constants
from safetensors.torch import load_file

from trl_grpo_ext import list_methods
from trl_grpo_ext.cli import main
from trl_grpo_ext.hub import model_card

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _record(**overrides):
    record = {
        "trainer": "curriculum",
        "trainer_class": "CurriculumGRPOTrainer",
        "methods": ["grpo", "curriculum"],
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "dataset": "trl-lib/DeepMath-103K",
        "output_dir": "/runs/curriculum-grpo",
        "adapter": True,
        "reward_funcs": ["accuracy_reward", "budget_length_triangular"],
        "steps": 600,
        "config": {"trainer": "curriculum", "budget_start": 256, "budget_end": 87, "use_peft": True},
        "metrics": {"reward": 0.71234, "curriculum/budget": 87, "train_loss": 0.0125},
        "versions": {"trl": "1.16.0"},
    }
    return {**record, **overrides}


def test_card_names_methods_papers_config_and_metrics():
    card = model_card(_record(), repo_id="me/qwen-curriculum")
    text = str(card)
    assert card.data.base_model == "Qwen/Qwen2.5-7B-Instruct"
    assert card.data.library_name == "peft" and card.data.datasets == ["trl-lib/DeepMath-103K"]
    assert {"trl", "grpo", "trl-grpo-ext", "curriculum"} <= set(card.data.tags)
    assert "| GRPO (DeepSeekMath) | [arXiv:2402.03300](https://arxiv.org/abs/2402.03300) |" in text
    curriculum = "| Curriculum GRPO (Train Long, Think Short) | [arXiv:2508.08940](https://arxiv.org/abs/2508.08940) |"
    assert curriculum in text
    assert "trainer: curriculum\nbudget_start: 256\nbudget_end: 87\nuse_peft: true" in text  # the recipe, as given
    assert "| `curriculum/budget` | 87 |" in text and "| `reward` | 0.7123 |" in text  # 4 significant digits
    assert 'PeftModel.from_pretrained(base, "me/qwen-curriculum")' in text
    assert "`CurriculumGRPOTrainer`" in text and "for 600 steps" in text


def test_card_of_a_full_model_on_local_data():
    card = model_card(_record(adapter=False, model="tiny", dataset="built-in", methods=["grpo"]))
    text = str(card)
    assert card.data.base_model is None and card.data.datasets is None and card.data.library_name == "transformers"
    assert "tiny random Qwen2" in text and "built-in arithmetic dataset" in text
    assert 'pipeline("text-generation", model="/runs/curriculum-grpo")' in text
    assert "Curriculum" not in text.split("## Methods")[1].split("## Usage")[0]


def test_every_method_row_has_a_name_and_an_arxiv_id():
    for method in list_methods():
        if method.arxiv is not None:  # engine pieces (per-row prefixes) have no paper
            assert method.title and method.arxiv.count(".") == 1 and method.arxiv.replace(".", "").isdigit(), method


@pytest.fixture(scope="module")
def hub_calls():
    """HfApi's network calls, recorded: what was created and what was uploaded (README as it was then)."""
    calls = {"create": [], "upload": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create"].append({"repo_id": repo_id, **kwargs})
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder_path = Path(folder_path)
        files = sorted(p.name for p in folder_path.iterdir())
        readme = (folder_path / "README.md").read_text()
        calls["upload"].append({"repo_id": repo_id, "folder": folder_path, "files": files, "readme": readme, **kwargs})
        return f"https://huggingface.co/{repo_id}/commit/0"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", False)  # the stubs below are the (online) Hub
        patch.setattr(HfApi, "create_repo", create_repo)
        patch.setattr(HfApi, "upload_folder", upload_folder)
        yield calls


@pytest.fixture(scope="module")
def pushed_run(hub_calls, tiny_cache_dir, tmp_path_factory):
    """Curriculum GRPO with LoRA on the tiny model for 2 steps, pushed at the end with --push_to_hub."""
    out = tmp_path_factory.mktemp("hub") / "tiny-curriculum"
    argv = ["train", "--config", str(RECIPES / "curriculum_grpo.yaml"), "--tiny", "--use_peft", "--lora_r", "4",
            "--reward_funcs", "tests.conftest.varied_reward", "budget_length", "--reward_weights", "1.0", "0.2",
            "--budget_start", "24", "--budget_end", "6", "--max_steps", "2", "--logging_steps", "1",
            "--learning_rate", "5e-2", "--push_to_hub", "--hub_model_id", "me/tiny-curriculum",
            "--hub_private_repo", "true", "--output_dir", str(out), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    return out


def test_push_to_hub_uploads_the_adapter_once_with_the_card(pushed_run, hub_calls):
    assert [c["repo_id"] for c in hub_calls["create"]] == ["me/tiny-curriculum"]
    assert hub_calls["create"][0]["private"] is True and hub_calls["create"][0]["exist_ok"] is True
    [upload] = hub_calls["upload"]
    assert upload["repo_id"] == "me/tiny-curriculum" and upload["folder"] == pushed_run
    uploaded = set(upload["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "trl_grpo_ext_run.json"} <= uploaded
    assert "checkpoint-*" in upload["ignore_patterns"]
    readme = upload["readme"]
    assert "# Model Card for tiny-curriculum" in readme and "A LoRA adapter for" in readme
    assert "arXiv:2402.03300" in readme and "arXiv:2508.08940" in readme
    assert "budget_start: 24" in readme and "use_peft: true" in readme and "push_to_hub: true" in readme
    assert "| `curriculum/budget` | 24 |" in readme and "| `reward` |" in readme
    assert "hub_token" not in readme


def test_adapter_loads_back_with_peft(pushed_run, tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), pushed_run)
    saved = load_file(pushed_run / "adapter_model.safetensors")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert loaded and len(loaded) == len(saved)
    lora_b = [name for name in saved if "lora_B" in name]
    assert lora_b and any(saved[name].abs().sum() > 0 for name in lora_b)  # trained: LoRA's B starts at zero
    for name, tensor in saved.items():
        match = [p for n, p in loaded.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor), name


def test_push_command_rewrites_the_card_for_the_repo(pushed_run, hub_calls, capsys):
    assert main(["push", str(pushed_run), "someone/renamed"]) == 0
    assert "Pushed" in capsys.readouterr().out and "someone/renamed" in hub_calls["create"][-1]["repo_id"]
    upload = hub_calls["upload"][-1]
    assert upload["repo_id"] == "someone/renamed" and "# Model Card for renamed" in upload["readme"]
    assert 'PeftModel.from_pretrained(base, "someone/renamed")' in upload["readme"]
    record = json.loads((pushed_run / "trl_grpo_ext_run.json").read_text())
    assert record["methods"] == ["grpo", "curriculum"] and record["steps"] == 2


def test_push_failure_leaves_the_run_and_says_how_to_retry(pushed_run, monkeypatch, capsys):
    def offline(self, repo_id, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    assert main(["push", str(pushed_run), "me/tiny-curriculum"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no network" in err and "could not be reached" in err
    assert "login" not in err  # no network is not a login problem
    assert f"trl-grpo-ext push {pushed_run} me/tiny-curriculum" in err


def test_offline_push_says_offline_before_trying(pushed_run, monkeypatch, capsys):
    """With HF_HUB_OFFLINE set, `push` and `train --push_to_hub` refuse at once, naming the setting, not a login."""
    tried = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: tried.append(a))
    assert main(["push", str(pushed_run), "me/tiny-curriculum"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HF_HUB_OFFLINE" in err and "login" not in err and not tried
    assert main(["train", "--tiny", "--push_to_hub", "--output_dir", str(pushed_run.parent / "never")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--push_to_hub: HF_HUB_OFFLINE is set" in err and not (pushed_run.parent / "never").exists()


def test_push_without_rights_says_to_log_in(pushed_run, monkeypatch, capsys):
    from huggingface_hub.errors import HfHubHTTPError

    def unauthorised(self, repo_id, **kwargs):
        error = HfHubHTTPError.__new__(HfHubHTTPError)  # as the Hub raises it, whichever HTTP client it is built on
        Exception.__init__(error, "401 Client Error: Unauthorized for url: https://huggingface.co/api/repos/create")
        error.response = SimpleNamespace(status_code=401)
        raise error

    monkeypatch.setattr(HfApi, "create_repo", unauthorised)
    assert main(["push", str(pushed_run), "me/tiny-curriculum"]) == 2
    assert "hf auth login" in capsys.readouterr().err


def test_hima_agent_adapters_push_every_adapter_with_one_card(hub_calls, tiny_cache_dir, tmp_path, tiny_model_path):
    """HiMA with an adapter per agent: the output holds them all (subfolders), one card says how to load each."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tiny-hima"
    argv = ["train", "--config", str(RECIPES / "hima_adapters.yaml"), "--tiny", "--lora_r", "4",
            "--lora_target_modules", "q_proj", "v_proj", "--hima_alternatives", "2", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--max_steps", "1",
            "--hima_accuracy_reward", "last_integer", "--push_to_hub", "--hub_model_id", "me/tiny-hima",
            "--output_dir", str(out), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    upload = hub_calls["upload"][-1]
    assert upload["repo_id"] == "me/tiny-hima"
    assert {"adapter_config.json", "router", "calc", "qa", "README.md"} <= set(upload["files"])
    for agent in ("router", "calc", "qa"):
        assert (out / agent / "adapter_model.safetensors").exists()
        assert f'adapter_name="{agent}", subfolder="{agent}")  # agent {agent}' in upload["readme"]
    record = json.loads((out / "trl_grpo_ext_run.json").read_text())
    assert record["adapters"] == {"router": ["agent router"], "calc": ["agent calc"], "qa": ["agent qa"]}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), out)
    model.load_adapter(str(out), adapter_name="calc", subfolder="calc")
    saved = load_file(out / "calc" / "adapter_model.safetensors")
    loaded = {n.replace(".calc", ""): p for n, p in model.named_parameters() if ".calc." in n}
    assert saved and all(torch.equal(loaded[name].detach(), tensor) for name, tensor in saved.items())
