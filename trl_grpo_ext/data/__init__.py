"""Dataset builders: turn your data into the formats the methods train on."""

from .pta import pta_sft_dataset, pta_sft_example

__all__ = ["pta_sft_example", "pta_sft_dataset"]
