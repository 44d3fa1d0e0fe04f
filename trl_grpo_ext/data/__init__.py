"""Dataset builders: turn your data into the formats the methods train on."""

from .pta import pta_sft_dataset, pta_sft_example
from .trees import (
    SAMPLE_OMEGAPRM,
    SAMPLE_TREES,
    PrefixTree,
    build_prefix_trees,
    from_omegaprm,
    load_prefix_trees,
    prefixes_from_mcts,
    questions_dataset,
    write_prefix_trees,
)

__all__ = [
    "pta_sft_example",
    "pta_sft_dataset",
    "PrefixTree",
    "load_prefix_trees",
    "write_prefix_trees",
    "prefixes_from_mcts",
    "questions_dataset",
    "from_omegaprm",
    "build_prefix_trees",
    "SAMPLE_TREES",
    "SAMPLE_OMEGAPRM",
]
