"""The benchmark scripts' own checks that run without a GPU."""

import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_fails_loudly_on_a_machine_without_what_it_needs(tmp_path):
    if torch.cuda.is_available():  # this check is of the preflight; on a GPU machine run the script itself
        return
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "gpu_check: no CUDA device" in done.stderr
    assert "gpu_check: vllm (generation (colocate mode)) does not import" in done.stderr
    assert not (tmp_path / "out" / "throughput.json").exists()  # it stopped before measuring anything
