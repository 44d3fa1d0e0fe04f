"""TRL's own `trl/scripts/grpo.py`, with GRPOTrainer and GRPOConfig swapped for ours and nothing else changed, runs.

This is what users do: paste our classes into a script like TRL's. The swap is textual, on the installed TRL's
script; if TRL's script stops importing either class from `trl`, the test fails saying so.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import trl

from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

from .distributed_helpers import RECORD_DIR_ENV

SWAP = {"GRPOTrainer": "GRPOExtTrainer", "GRPOConfig": "GRPOExtConfig"}
REPO = Path(__file__).resolve().parent.parent


def swap_imports(source: str) -> str:
    """`source` with GRPOTrainer / GRPOConfig imported from trl_grpo_ext (as the same names) instead of trl."""
    swapped = set()

    def swap(match):
        indent, names = match.group(1), [n.strip() for n in match.group(2).split(",")]
        ours = [n for n in names if n in SWAP]
        swapped.update(ours)
        rest = [n for n in names if n not in SWAP]
        lines = [f"{indent}from trl import {', '.join(rest)}"] if rest else []
        return "\n".join(lines + [f"{indent}from trl_grpo_ext import {SWAP[n]} as {n}" for n in ours])

    result = re.sub(r"^([ \t]*)from trl import ([^\n(]+)$", swap, source, flags=re.MULTILINE)
    assert swapped == set(SWAP), f"TRL's grpo.py no longer imports {set(SWAP) - swapped} from trl on one line"
    return result


def test_trl_grpo_script_runs_with_our_classes(tmp_path, tiny_model_path):
    script = tmp_path / "grpo.py"
    script.write_text(swap_imports((Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()))
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in tiny_dataset(8)))
    records = tmp_path / "records"
    records.mkdir()
    argv = [
        "--model_name_or_path", str(tiny_model_path),
        "--dataset_name", str(data),  # a local folder: `load_dataset` reads train.jsonl offline
        "--reward_funcs", "trl_grpo_ext.rewards.contains_solution_reward", "tests.conftest.varied_reward",
        "--advantage_estimator", "tests.distributed_helpers.record_advantages",  # a GRPOExtConfig field
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8",
        *[arg for key, value in cpu_test_config_kwargs().items() for arg in (f"--{key}", str(value))],
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", RECORD_DIR_ENV: str(records), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training completed" in result.stdout and (tmp_path / "out" / "model.safetensors").exists()
    # Our config's field reached our trainer through TRL's own parser: the estimator ran on the batch.
    assert [p.name for p in records.iterdir()] == ["rank0-step0.json"]
