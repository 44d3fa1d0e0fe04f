"""What the benchmark scripts share: how many completion tokens a logged step generated, sampling groups of
completions of a task's prompts and scoring them with its verifier, and saving a figure."""


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


def completion_mask(completions, eos_ids: set[int]):
    """1 up to and including each row's first end-of-sequence token, 0 after (TRL's completion mask)."""
    import torch

    is_eos = torch.zeros_like(completions, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completions == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.size(1))
    return (torch.arange(completions.size(1))[None] <= first[:, None]).float()


def sample_groups(model, tokenizer, rows, group_size: int, max_new_tokens: int) -> dict:
    """Each prompt of `rows` (a reasoning-gym task's rows: `prompt`, `rg_task`, `rg_index`) `group_size` times, in one
    `generate` call, sampled as GRPO trains (temperature 1, no top-p or top-k), scored by the task's verifier.

    Returns `sequences` (prompt and completion ids, left-padded prompts), `prompt_length`, `attention_mask` (the
    prompts' and the completions' up to their first end of sequence), `completion_mask` and `rewards` ((rows, G))."""
    import torch

    from trl_grpo_ext.tasks import rg_score

    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
    tokenizer.padding_side = "left"
    inputs = tokenizer([t for t in texts for _ in range(group_size)], return_tensors="pt", padding=True,
                       add_special_tokens=False)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    prompt_length = inputs["input_ids"].size(1)
    completions = out[:, prompt_length:]
    eos_ids = {tokenizer.eos_token_id, *([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])}
    mask = completion_mask(completions, eos_ids)
    replies = tokenizer.batch_decode(completions * mask.long() + tokenizer.pad_token_id * (1 - mask.long()),
                                     skip_special_tokens=True)  # fmt: skip
    rewards = [[rg_score(replies[k * group_size + j], task, index) for j in range(group_size)]
               for k, (task, index) in enumerate(zip(rows["rg_task"], rows["rg_index"], strict=True))]  # fmt: skip
    return {"sequences": out, "prompt_length": prompt_length, "completion_mask": mask,
            "attention_mask": torch.cat([inputs["attention_mask"], mask.long()], dim=1),
            "rewards": torch.tensor(rewards, dtype=torch.float32)}  # fmt: skip
