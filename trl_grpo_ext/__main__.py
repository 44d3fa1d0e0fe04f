"""`trl-grpo-ext` (and `python -m trl_grpo_ext`): the light front door of the command line.

It answers `--help`, `--version` and a misspelled command without importing torch or TRL (in well under a second),
quietens the libraries' chatter that is not the user's concern, and only then imports `trl_grpo_ext.cli`, where the
commands live.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings

# name -> one line of help (the functions are `trl_grpo_ext.cli.<name>`)
COMMANDS = {
    "train": "train a named trainer (no arguments: the offline main job); `train --help` lists every flag",
    "sft": "PTA-GRPO's cold start: SFT on (question, plan, reasoning, answer) rows in the plan format",
    "trees": "grow Tree-OPO prefix trees with a teacher model (resumable): `trees --output trees.jsonl`",
    "push": "upload a saved run with its model card: `push OUTPUT_DIR REPO_ID`",
    "sweep": "run a recipe over a grid of settings and compare the cells: `sweep --grid loss_type=grpo,dapo`",
}
DESCRIPTION = "trl-grpo-ext: the newest RL methods for LLMs on TRL's GRPOTrainer, from the command line."


def quiet_libraries() -> None:
    """Silence what the libraries say that is not the user's concern, in this process (the command line's) only.

    Deprecation notices that TRL, transformers and the others raise at each other (`is_gradient_checkpointing`,
    `torch.jit`) are theirs to fix, not the user's; DeepSpeed's "Setting accelerator to CPU" on a machine without a GPU
    states the obvious (DS_ACCELERATOR=cpu is what it would choose). Warnings from the user's own code still show."""
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        for module in ("transformers", "trl", "peft", "accelerate", "torch", "datasets", "bitsandbytes", "deepspeed"):
            warnings.filterwarnings("ignore", category=category, module=rf"{module}(\.|$)")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import torch  # the commands import it anyway

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-grpo-ext", description=DESCRIPTION)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        subparsers.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        make_parser().print_help()
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"trl-grpo-ext {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(f"trl-grpo-ext: unknown command {argv[0]!r}; {hint}use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    quiet_libraries()
    from . import cli

    try:
        result = getattr(cli, argv[0])(argv[1:])
    except cli.CLIError as exc:
        print(f"trl-grpo-ext {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0  # `sweep` returns its status; the others what they made


if __name__ == "__main__":
    sys.exit(main())
