"""The benchmark scripts' own checks that run without a GPU."""

import json
import subprocess
import sys
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


def test_overhead_measures_each_arm_against_its_baseline(tmp_path):
    """`overhead.py` on the tiny model: a baseline arm runs for every arm named, the table has a row each, PTA's shared
    plans are counted against independent sampling, the default path gets its verdict."""
    out_json, out_md = tmp_path / "o.json", tmp_path / "o.md"
    # Not `segment`: its baseline, `trl_tools`, would add two processes of about 13 s each; the pairing is the same.
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--arms", "grpo_ext", "pta",
                           "--rounds", "1", "--steps", "2", "--out-json", str(out_json), "--out-md",
                           str(out_md)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out_json.read_text())["runs"]["full"]
    assert list(runs) == ["trl", "grpo_ext", "pta"]  # the baseline first
    for arm, run in runs.items():
        assert len(run["step_times"]) == 1 and run["step_times"][0] > 0, arm  # 2 steps, the first dropped
        assert run["peak_mib"][0] > 100, arm
    # PTA generates each plan once: fewer tokens than its rows hold, fewer than sampling each row's plan alone
    pta = runs["pta"]
    assert pta["generated_tokens"][0] < pta["independent_tokens"][0]
    assert pta["generated_tokens"][0] < pta["trained_tokens"][0]
    table = out_md.read_text()
    assert "| `pta` | full |" in table and "| `trl` | full |" in table
    assert "PTA (full): " in done.stdout and "independently" in done.stdout
    assert "default path grpo_ext / trl: " in done.stdout


def test_bnb_cpu_layout_drops_the_gradient_where_it_repacks():
    """The claim docs/benchmarks.md makes about the 4-bit rows: after bitsandbytes' CPU repack a 4-bit layer passes no
    gradient to its input, the portable layout that our trainers keep does. When a bitsandbytes release fixes the
    repack, this fails: then the docs and `_disable_bnb_cpu_weight_repacking` can go."""
    from bitsandbytes.functional import has_avx512bf16

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bnb_cpu_layout.py"), "--size", "256",
                           "--repeats", "2"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    allowed, portable = (line for line in done.stdout.splitlines() if "layout" in line)
    assert "layout portable" in portable and "mean |grad|" in portable
    if has_avx512bf16():
        assert "layout packed" in allowed and "gradient after a training backward: None" in allowed
    else:
        assert "layout portable" in allowed and "mean |grad|" in allowed
