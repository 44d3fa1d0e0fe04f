"""SegmentGRPOTrainer end to end: a scripted tool, ARPO branching, hard / soft / reward advantages."""

import copy

import pytest
import torch
from trl import GRPOTrainer
from trl.chat_template_utils import add_response_schema

from trl_grpo_ext import GRPOExtConfig, SegmentGRPOTrainer, get_reward
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "3 * 4".
    """
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


@pytest.fixture
def tool_tokenizer(tokenizer):
    return add_response_schema(copy.deepcopy(tokenizer))


@pytest.fixture
def scripted_model(monkeypatch, tool_tokenizer):
    """The policy's generation, scripted: first a calculator call, then (after the tool result) an answer.

    Answers alternate 12 / 13 over the rows of a call, so rewards vary within a group. Everything else (the tool
    loop, the tool-result tokens, entropies, the loss) is TRL's and the tiny model's own.
    """
    tok = tool_tokenizer
    response = tok.convert_tokens_to_ids("<tool_response>")
    call = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>',
               add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # fmt: skip
    answers = [tok(f"<answer>{n}</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for n in (12, 13)]
    calls = []

    def backend(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append([list(p) for p in prompt_ids])
        out = [answers[i % 2] if response in list(p) else call for i, p in enumerate(prompt_ids)]
        return [list(o) for o in out], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", backend)
    return calls


def _trainer(tiny_model_path, tool_tokenizer, tmp_path, **overrides):
    args = GRPOExtConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
        max_steps=2, learning_rate=1e-2, seed=0,
        **{"segment_by": "tool_calls", **cpu_test_config_kwargs(), **overrides},
    )  # fmt: skip
    return SegmentGRPOTrainer(model=str(tiny_model_path), reward_funcs=[get_reward("contains_solution")], args=args,
                              train_dataset=tiny_dataset(8).map(lambda r: {"solution": "12"}),
                              processing_class=tool_tokenizer, tools=[calculator])  # fmt: skip


def _rows(n_prompts=2, group=4):
    return [dict(row, solution="12") for row in tiny_dataset(n_prompts) for _ in range(group)]


def test_arpo_branches_share_their_prefix_and_hard_mode_averages(tiny_model_path, tool_tokenizer, tmp_path,
                                                                   scripted_model):  # fmt: skip
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, arpo=True, arpo_initial_rollouts=2, arpo_branches=1,
                       arpo_alpha=1.0, arpo_beta=0.0, segment_advantage="hard")  # fmt: skip (always branch)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    cols = trainer.last_scoring
    ids, mask, tool_mask = out["completion_ids"], out["completion_mask"], out["tool_mask"]
    # Rows 0-1 of each group are full rollouts (call, tool result, answer); rows 2-3 branch after the tool result.
    for g in (0, 4):
        for parent, branch in ((g, g + 2), (g + 1, g + 3)):
            n = int(mask[parent].sum())
            point = int((tool_mask[parent][:n] == 0).nonzero().max()) + 1  # first token after the tool result
            prefix = ids[parent, :point].tolist()
            prompt = out["prompt_ids"][branch][out["prompt_mask"][branch].bool()].tolist()
            assert prompt[-point:] == prefix  # token for token: the branch continues its parent's trajectory
            # the branch's completion is only its continuation (an answer), so no tool tokens in it
            assert tool_mask[branch][mask[branch].bool()].eq(1).all()
    # Tool-result tokens get zero weight in the loss.
    assert tool_mask[0][mask[0].bool()].eq(0).any()
    # Hard mode: the parent's shared tokens get the mean of parent and branch advantages; the rest keep their own.
    adv = out["advantages"]
    rewards = cols["rewards_per_func"][:, 0]
    assert rewards[:4].std() > 0, "answers 12 and 13 alternate, so rewards vary"
    leaf = (rewards[:4] - rewards[:4].mean()) / (rewards[:4].std() + 1e-4)
    n0 = int(mask[0].sum())
    point0 = int((tool_mask[0][:n0] == 0).nonzero().max()) + 1
    assert torch.allclose(adv[0, :point0], ((leaf[0] + leaf[2]) / 2).expand(point0), atol=1e-5)
    assert torch.allclose(adv[0, point0:n0], leaf[0].expand(n0 - point0), atol=1e-5)
    assert torch.allclose(adv[2][mask[2].bool()], leaf[2].expand(int(mask[2].sum())), atol=1e-5)
    metrics = trainer._metrics["train"]
    assert metrics["tree/branches"] == [4] and metrics["tree/generated_tokens_saved"][0] > 0
    assert metrics["segments/per_completion"][0] > 1


def test_arpo_trains_and_logs(tiny_model_path, tool_tokenizer, tmp_path, scripted_model):
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, arpo=True, segment_advantage="hard")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    log = trainer.state.log_history[0]
    for key in ("segments/per_completion", "tree/branches", "tree/generated_tokens_saved"):
        assert key in log


def test_segment_reward_mode_with_tool_validity(tiny_model_path, tool_tokenizer, tmp_path, scripted_model):
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, segment_advantage="reward",
                       segment_reward_funcs=["tool_call_validity"], segment_reward_lambda=0.5)  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    adv, mask, tool_mask = out["advantages"], out["completion_mask"], out["tool_mask"]
    assert adv.shape == out["completion_ids"].shape
    # Every tool call was valid (score 1 on turn 0) and the answer turn has no call (None): pooled over the group
    # the scored segments are all 1, std 0, so the segment term is 0 and tokens carry the outcome advantage.
    rewards = trainer.last_scoring["rewards_per_func"][:4, 0]
    leaf = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    model_tokens = (mask * tool_mask).bool()
    for row in range(4):
        assert torch.allclose(adv[row][model_tokens[row]], leaf[row].expand(int(model_tokens[row].sum())), atol=1e-5)


def test_bad_segment_reward_and_regex_are_clear_errors(tiny_model_path, tool_tokenizer, tmp_path, scripted_model):
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, segment_advantage="reward",
                       segment_reward_funcs=["tests.test_segment_trainer.three_scores"])  # fmt: skip
    trainer.model.train()
    with pytest.raises(ValueError, match="returned 3 score\\(s\\) for completion 0, which has 2 trainable segment"):
        trainer._generate_and_score_completions(_rows())
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, segment_by="regex:^NEVER")
    trainer.model.train()
    with pytest.raises(ValueError, match="NEVER"):
        trainer._generate_and_score_completions(_rows())


def three_scores(completions, **kwargs):
    return [[1.0, 1.0, 1.0] for _ in completions]


def test_config_errors(tmp_path, tiny_model_path, tokenizer):
    kwargs = dict(output_dir=str(tmp_path), **cpu_test_config_kwargs())
    with pytest.raises(ValueError, match="arpo_branches=5 cannot fit"):
        GRPOExtConfig(arpo=True, arpo_branches=5, **kwargs)
    with pytest.raises(ValueError, match="segment_by='words' is not one of"):
        GRPOExtConfig(segment_by="words", **kwargs)
    with pytest.raises(ValueError, match="needs a GRPOExtConfig with segment_by"):
        SegmentGRPOTrainer(model=str(tiny_model_path), reward_funcs=[], args=GRPOExtConfig(**kwargs),
                           train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="needs reward_funcs"):
        SegmentGRPOTrainer(model=str(tiny_model_path), args=GRPOExtConfig(segment_by="tags", **kwargs),
                           train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="pass tools="):
        SegmentGRPOTrainer(model=str(tiny_model_path), reward_funcs=["contains_solution"],
                           args=GRPOExtConfig(segment_by="tool_calls", arpo=True, **kwargs),
                           train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip


def test_segment_reward_in_reward_funcs_is_a_clear_error(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import GRPOExtTrainer

    with pytest.raises(ValueError, match="'tool_call_validity' is a segment reward .* segment_reward_funcs"):
        GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=["tool_call_validity"],
                       args=GRPOExtConfig(output_dir=str(tmp_path), **cpu_test_config_kwargs()),
                       train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
