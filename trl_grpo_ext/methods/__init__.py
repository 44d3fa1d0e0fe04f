"""One module per method: its config section, its extension, its rewards, and its `Method` record.

Importing a module registers its method (`trl_grpo_ext.extension.list_methods()`); `trl_grpo_ext` imports them all.
"""

from . import arpo, curriculum, dynamic_sampling, prefixes, prorl, pta, segments, tree_opo  # noqa: I001
from . import bicc  # registered after the first methods: the methods list keeps the order they were added in
from . import drafts, hima, monitor, nord

__all__ = [
    "arpo",
    "bicc",
    "curriculum",
    "drafts",
    "dynamic_sampling",
    "hima",
    "monitor",
    "nord",
    "prefixes",
    "prorl",
    "pta",
    "segments",
    "tree_opo",
]
