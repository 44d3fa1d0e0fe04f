"""Two CPU processes (torchrun, gloo, accelerate's MULTI_CPU): group maths is right when groups span processes.

`per_device_train_batch_size=6` and `num_generations=4` put 12 rows, 3 groups, in each generation batch: process 0
holds rows 0-5 and process 1 rows 6-11, so group 1 (rows 4-7) is split between them. The advantage estimator
(`tests.distributed_helpers.record_advantages`, by dotted path) records what each process saw.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trl_grpo_ext.advantages import group_advantages

from .distributed_helpers import RECORD_DIR_ENV

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_two_processes_agree_on_every_group(tmp_path, tiny_cache_dir):
    records = tmp_path / "records"
    records.mkdir()
    argv = ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "trl_grpo_ext.cli", "train", "--tiny",
            "--max_steps", "2", "--per_device_train_batch_size", "6", "--num_generations", "4",
            "--max_completion_length", "8", "--logging_steps", "1",
            "--reward_funcs", "tests.conftest.varied_reward",
            "--advantage_estimator", "tests.distributed_helpers.record_advantages",
            "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", RECORD_DIR_ENV: str(records),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("Trained 2 steps") == 1  # the main process reports, once

    for step in (0, 1):
        rank0, rank1 = (json.loads((records / f"rank{r}-step{step}.json").read_text()) for r in (0, 1))
        # Both processes saw all 12 rewards, the same ones: TRL gathers them before any group maths.
        assert len(rank0["rewards"]) == 12 and rank0["rewards"] == rank1["rewards"]
        assert rank0["rows"] == [0, 6] and rank1["rows"] == [6, 12]
        prompts = rank0["prompts"] + rank1["prompts"]
        assert all(prompts[g * 4 + i] == prompts[g * 4] for g in range(3) for i in range(4))  # one prompt a group
        assert len(set(rank0["rewards"])) > 1  # the groups' rewards vary, so advantages are not all zero
        # Each process's rows are its slice of one set of group advantages, and group 1 (rows 4-7) is split.
        expected = group_advantages(torch.tensor(rank0["rewards"]), 4).tolist()
        assert rank0["all_advantages"] == rank1["all_advantages"]
        assert rank0["all_advantages"] == pytest.approx(expected, abs=1e-6)
        assert rank0["local_advantages"] + rank1["local_advantages"] == pytest.approx(expected, abs=1e-6)
        split_group = rank0["local_advantages"][4:] + rank1["local_advantages"][:2]
        assert split_group == pytest.approx(expected[4:8], abs=1e-6) and sum(split_group) == pytest.approx(0, abs=1e-5)
        # RolloutBatch.process_slice picks the same rows as TRL's own slicing: TRL's advantages agree.
        for rank in (rank0, rank1):
            assert rank["trl_local_advantages"] == pytest.approx(rank["local_advantages"], abs=1e-5)
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_prefix_block_size_is_decided_over_all_processes(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    """Process 1 of 2 holds the second half of group 1 and all of group 2: alone, its first 4 rows mix two groups.

    Every process must give the generation backend the same block size (vLLM server mode generates all processes'
    rows at once, `n` = that size), so the decision is taken on the gathered rows, group boundaries and all.
    """
    import trl_grpo_ext.trainer as trainer_module
    from trl_grpo_ext import GRPOExtTrainer, RolloutPlan
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config, varied_reward

    trainer = GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=make_config(tmp_path, context_prefix_column="hint"),
        train_dataset=tiny_dataset(4).map(lambda row: {"hint": "step"}),
        processing_class=tokenizer,
    )
    hints = ["a"] * 4 + ["b"] * 4 + ["c"] * 4  # groups 0, 1, 2, each sharing its prefix
    process_0, process_1 = [{"hint": h} for h in hints[:6]], [{"hint": h} for h in hints[6:]]

    def plan(rows):
        plan = RolloutPlan(rows=rows, mode="train", num_generations=4)
        trainer.extension("prefix_columns").prepare(plan)
        return plan

    def gather_as_process_1(rows):  # what accelerate's gather_object returns on process 1 of 2: process 0's rows first
        first = plan(process_0)
        return [(tuple(c), tuple(p), False) for c, p in zip(first.context_ids, first.prefix_ids, strict=False)] + rows

    monkeypatch.setattr(trainer_module, "gather_object", gather_as_process_1)
    assert trainer._block_size(plan(process_1), 4) == 4
    process_0[5] = {"hint": "d"}  # group 1 no longer shares its prefix, and only process 0 holds the odd row
    assert trainer._block_size(plan(process_1), 4) == 1
