"""Helpers that training subprocesses import by dotted path (`--advantage_estimator tests.distributed_helpers...`)."""

import json
import os
from pathlib import Path

from trl_grpo_ext.advantages import group_advantages

RECORD_DIR_ENV = "TRL_GRPO_EXT_RECORD_DIR"


def record_advantages(batch):
    """GRPO's group advantages from the gathered rewards, recorded per process for the test to compare.

    Writes `<$TRL_GRPO_EXT_RECORD_DIR>/rank<r>-step<s>.json`: its row slice and its rows' prompts, the rewards of all N
    rows as this process saw them, the advantages of all rows it computed, and its own rows' advantages (returned to
    the trainer) and TRL's.
    """
    advantages = group_advantages(batch.rewards, batch.num_generations)  # (N,) over all processes
    local = batch.local(advantages)  # (B,)
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "num_generations": batch.num_generations,
        "rows": [batch.process_slice.start, batch.process_slice.stop],
        "prompts": batch.prompts,
        "rewards": batch.rewards.tolist(),
        "all_advantages": advantages.tolist(),
        "local_advantages": local.tolist(),
        "trl_local_advantages": batch.advantages.tolist(),
    }
    path = Path(os.environ[RECORD_DIR_ENV]) / f"rank{rank}-step{batch.step}.json"
    path.write_text(json.dumps(record))
    return local
