"""What the benchmark scripts share: how many completion tokens a logged step generated."""


def step_tokens(logs: dict, rows: int) -> float:
    """The completion tokens one step generated, from its logged metrics.

    PTA counts each plan once (`pta/generated_tokens`); HiMA every call of the references, the alternatives and their
    finishes; ARPO's branches do not count the prefix they share with their parent (`arpo/generated_tokens_saved`);
    drafts the policy (or the draft model) wrote for the batch count too; dynamic sampling counts its refills
    (`dynamic_sampling/generated_tokens`).
    """
    if "pta/generated_tokens" in logs:
        return logs["pta/generated_tokens"]
    if "hima/generated_tokens" in logs:
        return logs["hima/generated_tokens"]
    if "dynamic_sampling/generated_tokens" in logs:  # refills included
        return logs["dynamic_sampling/generated_tokens"]
    drafts = logs.get("drafts/generated_tokens", 0.0)
    return logs.get("completions/mean_length", 0.0) * rows - logs.get("arpo/generated_tokens_saved", 0.0) + drafts


def save_figure(fig, axes, path) -> None:
    """Grid and legend on each of `axes`, then write `fig` to `path` and free it (the learning and lab plots)."""
    import matplotlib.pyplot as plt

    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
