#!/usr/bin/env bash
# The GPU check: at most 8 minutes on one H100 / H200, offline. Usage: benchmarks/gpu_check.sh OUT_DIR
#
# 1. preflight: a CUDA device, vLLM, bitsandbytes, DeepSpeed and this package; anything missing fails the check
#    (exit 1, naming it): nothing is skipped.
# 2. QLoRA GRPO of a 7B-class model (Qwen2.5-7B's layer shape, random weights, built offline: gpu_check.py), vLLM
#    colocate generation, TRL's own GRPOTrainer against our named trainers for a few steps each: time per step,
#    generated tokens per second, peak CUDA memory (benchmarks/overhead.py) into OUT_DIR/throughput.{json,md}.
# 3. DeepSpeed ZeRO-3 in one process: ProRL's reference and optimizer resets, the curriculum, a checkpoint and its
#    resume, a LoRA reference reset (the worker and checks of tests/test_sharded.py, in bf16 on the GPU) into
#    OUT_DIR/zero3_prorl.{json,md}.
#
# GPU_CHECK_LAYERS (default 8 of the 28) sizes the model, GPU_CHECK_ARMS the trainers, GPU_CHECK_STEPS the steps.
set -euo pipefail
OUT_DIR=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

python benchmarks/gpu_check.py preflight
python benchmarks/gpu_check.py build "$OUT_DIR/models"

# ---- QLoRA + vLLM colocate: TRL's GRPOTrainer against each named trainer, same settings
timeout 330 python benchmarks/overhead.py --model "$OUT_DIR/models/qwen2.5-7b-shaped" --vllm colocate \
    --variants 4bit --arms ${GPU_CHECK_ARMS:-trl grpo_ext pta arpo tree_opo hima} --rounds 1 \
    --steps "${GPU_CHECK_STEPS:-3}" --threads 0 --out-json "$OUT_DIR/throughput.json" --out-md "$OUT_DIR/throughput.md"

# ---- DeepSpeed ZeRO-3, one process: ProRL resets (reference + optimizer), curriculum, checkpoint + resume, LoRA reset
ZERO3_DIR="$OUT_DIR/zero3_prorl"
mkdir -p "$ZERO3_DIR"
python - "$ZERO3_DIR" <<'PY'
import sys
from pathlib import Path

from tests.test_sharded import write_zero3_config
from trl_grpo_ext.testing import build_tiny_model

out = Path(sys.argv[1])
write_zero3_config(out)
build_tiny_model(out / "tiny")
PY
ZERO3_START=$(date +%s)
timeout 150 accelerate launch --config_file "$ZERO3_DIR/zero3.yaml" --num_processes 1 --num_machines 1 \
    --machine_rank 0 --mixed_precision bf16 --main_process_port 0 \
    -m tests.test_sharded "$ZERO3_DIR" "$ZERO3_DIR/tiny" zero3 cuda
python - "$ZERO3_DIR" "$OUT_DIR" "$(( $(date +%s) - ZERO3_START ))" <<'PY'
import json
import sys
from pathlib import Path

from tests.test_sharded import _check_resets_and_curriculum

folder, out, seconds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
record = json.loads((folder / "rank0.json").read_text())
_check_resets_and_curriculum([record], "DistributedType.DEEPSPEED", "Parameter", kl_tolerance=1e-3)  # raises
kl = {log["step"]: log["kl"] for log in record["logs"] if "kl" in log}
summary = {"check": "zero3_prorl", "passed": True, "seconds": seconds, "world_size": record["world_size"],
           "resets": record["resets"], "history": record["resumed_history"], "adam_step": record["adam_step"],
           "kl": kl, "lora_reset": record["lora_reset"]}
(out / "zero3_prorl.json").write_text(json.dumps(summary, indent=2))
with open(out / "zero3_prorl.md", "w") as f:
    f.write("## ZeRO-3, one process: ProRL resets\n\n| step | kl | Adam step |\n|---|---|---|\n")
    for step in sorted(kl):
        f.write(f"| {step} | {kl[step]:.3g} | {record['adam_step'][str(step)]:g} |\n")
    f.write(f"\nResets at steps {[r['step'] for r in record['resets']]}: reference equal to the policy after each "
            f"(max |diff| {max(r['policy_minus_reference_after'] for r in record['resets'])}), optimizer state "
            f"cleared; LoRA reset at step {record['lora_reset']['step']}; {seconds} s.\n")
print(f"zero3_prorl: passed in {seconds} s")
PY
rm -rf "$OUT_DIR/models" "$ZERO3_DIR/tiny"
echo "gpu_check: passed in $(( $(date +%s) - START )) s; results in $OUT_DIR (throughput.md, zero3_prorl.md)"
