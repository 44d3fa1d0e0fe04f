"""Segments and ARPO end to end, on a scripted tool-calling backend: whole-trajectory branches, their credit, limits."""

import copy

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import add_response_schema

from trl_grpo_ext import GRPOExtConfig, SegmentGRPOTrainer, get_reward
from trl_grpo_ext.advantages import tree_estimator
from trl_grpo_ext.methods.arpo import branches, entropy_delta, turn_entropy
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


def _script(monkeypatch, tok, calls_before_answer=1, answer_padding=0):
    """The policy's generation, scripted: a calculator call per turn until `calls_before_answer` tool results are in
    the context, then an answer. Answers alternate 12 / 13 over the rows of a call, so rewards vary within a group.
    Everything else (the tool loop, tool-result tokens, entropies, the loss) is TRL's and the tiny model's own."""
    response = tok.convert_tokens_to_ids("<tool_response>")
    call = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>',
               add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # fmt: skip
    pad = tok("x", add_special_tokens=False)["input_ids"] * answer_padding
    answers = [tok(f"<answer>{n}</answer>", add_special_tokens=False)["input_ids"] + pad + [tok.eos_token_id]
               for n in (12, 13)]  # fmt: skip
    calls = []

    def backend(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append([list(p) for p in prompt_ids])
        out = [
            answers[i % 2] if list(p).count(response) >= calls_before_answer else call
            for i, p in enumerate(prompt_ids)
        ]
        return [list(o) for o in out], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", backend)
    return calls


class Recorder:
    """A reward that records what it is given: contains_solution, and the completions it scored."""

    def __init__(self):
        self.seen = []
        self.score = get_reward("contains_solution")
        self.__name__ = "recorded_solution"

    def __call__(self, completions, completion_ids, **kwargs):
        self.seen.append((completions, completion_ids))
        return self.score(completions=completions, **kwargs)


def _trainer(tiny_model_path, tool_tokenizer, tmp_path, reward=None, dataset=None, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=96,
        max_steps=2, learning_rate=1e-2, seed=0, segment_by="tool_calls", **cpu_test_config_kwargs(),
    )  # fmt: skip
    return SegmentGRPOTrainer(model=str(tiny_model_path), reward_funcs=[reward or get_reward("contains_solution")],
                              args=GRPOExtConfig(**{**settings, **overrides}),
                              train_dataset=dataset or tiny_dataset(8).map(lambda r: {"solution": "12"}),
                              processing_class=tool_tokenizer, tools=[calculator])  # fmt: skip


def _rows(n_prompts=2, group=4, **columns):
    return [dict(row, solution="12", **columns) for row in tiny_dataset(n_prompts) for _ in range(group)]


ALWAYS = dict(arpo=True, arpo_initial_rollouts=2, arpo_beam_size=2, arpo_alpha=1.0, arpo_beta=0.0)  # always branch


def _resume_point(tool_mask, length):
    return int((tool_mask[:length] == 0).nonzero().max()) + 1  # the first token after the (last) tool result


def test_branches_are_whole_trajectories_and_rewards_see_them_whole(tiny_model_path, tool_tokenizer, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    _script(monkeypatch, tool_tokenizer)
    recorder = Recorder()
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, reward=recorder, segment_advantage="hard", **ALWAYS)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    ids, mask, tool_mask = out["completion_ids"], out["completion_mask"], out["tool_mask"]
    rollout = trainer.last_batch.rollout
    # Rows 0-1 of each group are full rollouts; rows 2-3 branch from them after the tool result.
    assert rollout.parents == [-1, -1, 0, 1, -1, -1, 4, 5]
    for parent, branch in ((0, 2), (1, 3), (4, 6), (5, 7)):
        point = _resume_point(tool_mask[parent], int(mask[parent].sum()))
        assert rollout.shared[branch] == point
        # The branch holds its parent's trajectory up to the point, token for token, tool result and its mask kept.
        assert ids[branch, :point].tolist() == ids[parent, :point].tolist()
        assert tool_mask[branch, :point].tolist() == tool_mask[parent, :point].tolist()
        assert tool_mask[branch, :point].eq(0).any()  # the tool result is in the branch, masked out of the loss
        # Its prompt is the parent's prompt: the prefix is completion, not context.
        assert out["prompt_ids"][branch].tolist() == out["prompt_ids"][parent].tolist()
    # Every completion a reward function saw is a whole trajectory: the call, the tool result, then the answer.
    ((completions, completion_ids),) = recorder.seen
    for row, completion in enumerate(completions):
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"], row
        assert completion[0]["tool_calls"][0]["function"]["name"] == "calculator" and completion[1]["content"] == "12"
        assert completion_ids[row] == ids[row][mask[row].bool()].tolist()
    # Hard credit: every copy of a shared token gets the mean of the trajectories through it; the rest their own.
    leaf = trainer.last_batch.advantages
    adv = out["advantages"]
    point = rollout.shared[2]
    assert torch.allclose(adv[0, :point], ((leaf[0] + leaf[2]) / 2).expand(point), atol=1e-6)
    assert torch.allclose(adv[2, :point], adv[0, :point])
    assert torch.allclose(adv[2, point : int(mask[2].sum())], leaf[2].expand(int(mask[2].sum()) - point), atol=1e-6)
    metrics = trainer._metrics["train"]
    assert metrics["arpo/branches"] == [4] and metrics["arpo/fresh"] == [0] and metrics["arpo/depth"] == [1]
    assert metrics["arpo/generated_tokens_saved"] == [sum(rollout.shared)]
    assert metrics["segments/per_completion"][0] == 3  # model turn, tool result, model turn


def test_soft_credit_is_grpo_over_the_full_sequences(tiny_model_path, tool_tokenizer, tmp_path, monkeypatch):
    _script(monkeypatch, tool_tokenizer)
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, segment_advantage="soft", **ALWAYS)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    rollout, rewards = trainer.last_batch.rollout, trainer.last_batch.rewards
    # A plain TRL GRPOTrainer on the same eight whole sequences, advantages computed by hand from the rewards.
    plain = GRPOTrainer(model=str(tiny_model_path), reward_funcs=[get_reward("contains_solution")],
                        args=GRPOConfig(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=8,
                                        num_generations=4, max_completion_length=96, **cpu_test_config_kwargs()),
                        train_dataset=tiny_dataset(8), processing_class=tool_tokenizer)  # fmt: skip
    pad = tool_tokenizer.pad_token_id
    width = max(len(c) for c in rollout.completion_ids)
    left = max(len(p) for p in rollout.prompt_ids)
    grouped = rewards.view(2, 4)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    inputs = {
        "prompt_ids": torch.tensor([[pad] * (left - len(p)) + p for p in rollout.prompt_ids]),
        "prompt_mask": torch.tensor([[0] * (left - len(p)) + [1] * len(p) for p in rollout.prompt_ids]),
        "completion_ids": torch.tensor([c + [pad] * (width - len(c)) for c in rollout.completion_ids]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in rollout.completion_ids]),
        "tool_mask": torch.tensor([m + [1] * (width - len(m)) for m in rollout.tool_mask]),
        "advantages": advantages,
    }
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * inputs["tool_mask"]).sum()
    assert torch.equal(out["completion_ids"][:, :width], inputs["completion_ids"])
    assert torch.allclose(out["advantages"], advantages, atol=1e-6)

    def grads(t, batch):
        t.current_gradient_accumulation_steps = 1
        t.model.zero_grad()
        t.compute_loss(t.model, batch).backward()
        return torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])

    assert torch.allclose(grads(trainer, out), grads(plain, inputs), atol=1e-6)


def test_branches_branch_again_and_limits_count_the_whole_trajectory(tiny_model_path, tool_tokenizer, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    _script(monkeypatch, tool_tokenizer, calls_before_answer=2)  # call, result, call, result, answer
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, max_completion_length=256,
                       **{**ALWAYS, "arpo_initial_rollouts": 1})  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(n_prompts=1))
    rollout = trainer.last_batch.rollout
    # Round 1: row 0 branches at its first tool result (row 1). Round 2: row 0 at its second (row 2), and row 1 at
    # its own first, which is the trajectory's second (row 3, depth 2).
    assert rollout.parents == [-1, 0, 0, 1]
    width = out["tool_mask"].size(1)
    points = [t for t in range(1, width) if out["tool_mask"][0, t] == 1 and out["tool_mask"][0, t - 1] == 0]
    assert rollout.shared == [0, points[0], points[1], points[1]]
    assert trainer._metrics["train"]["arpo/depth"] == [2]
    # Depth-2 hard credit, by hand: the first turn is shared by all four rows, the second by rows 1 and 3.
    leaf = trainer.last_batch.advantages
    tree = tree_estimator(trainer.last_batch)  # this run credits softly; its tree is in the batch all the same
    assert torch.allclose(tree[0, : points[0]], leaf.mean().expand(points[0]), atol=1e-6)
    assert torch.allclose(tree[1, points[0] : points[1]], ((leaf[1] + leaf[3]) / 2).expand(points[1] - points[0]))
    assert torch.allclose(tree[0, points[0] : points[1]], ((leaf[0] + leaf[2]) / 2).expand(points[1] - points[0]))
    # Every trajectory made exactly two tool calls, whether it was generated whole or branched.
    assert all([m["role"] for m in c].count("tool") == 2 for c in trainer.last_batch.completions)


def test_branch_limits(tiny_model_path, tool_tokenizer, tmp_path, monkeypatch):
    _script(monkeypatch, tool_tokenizer, calls_before_answer=2)
    # One tool-calling turn at most: a branch after the first tool result has none left, so its call is not run.
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, max_tool_calling_iterations=1,
                       max_completion_length=256, **{**ALWAYS, "arpo_initial_rollouts": 1})  # fmt: skip
    trainer.model.train()
    trainer._generate_and_score_completions(_rows(n_prompts=1))
    assert all([m["role"] for m in c].count("tool") == 1 for c in trainer.last_batch.completions)
    # max_completion_length counts the whole trajectory: a branch's answer is cut to what its prefix leaves.
    _script(monkeypatch, tool_tokenizer, answer_padding=80)
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, max_completion_length=110,
                       **{**ALWAYS, "arpo_initial_rollouts": 1})  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(n_prompts=1))
    rollout = trainer.last_batch.rollout
    assert rollout.parents[1] == 0 and out["completion_mask"].sum(1).max().item() == 110
    assert len(rollout.completion_ids[1]) == 110 < rollout.shared[1] + 80  # not the prefix plus a whole answer


def test_arpo_generates_the_completion_prefix(tiny_model_path, tool_tokenizer, tmp_path, monkeypatch):
    calls = _script(monkeypatch, tool_tokenizer)
    dataset = tiny_dataset(8).map(lambda r: {"solution": "12", "start": "Sure."})
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, dataset=dataset, completion_prefix_column="start",
                       **ALWAYS)  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(start="Sure."))
    start = tool_tokenizer("Sure.", add_special_tokens=False)["input_ids"]
    n = len(start)
    assert calls[0][0][-n:] == start  # the initial rollouts were generated after the prefix
    assert out["completion_ids"][:, :n].eq(torch.tensor(start)).all()  # every row, branches included, starts with it
    segments = trainer.last_batch.segment_ids
    assert segments[:, :n].eq(0).all() and segments[:, n].eq(1).all()
    assert trainer.last_batch.rollout.parents == [-1, -1, 0, 1, -1, -1, 4, 5]


def test_arpo_trains_and_logs(tiny_model_path, tool_tokenizer, tmp_path, monkeypatch):
    _script(monkeypatch, tool_tokenizer)
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, arpo=True, segment_advantage="hard")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    log = trainer.state.log_history[0]
    for key in ("segments/per_completion", "arpo/branches", "arpo/branch_probability", "arpo/generated_tokens_saved"):
        assert key in log
    # The reference rule: at a first tool result ΔH = 0, so each branch is drawn with probability α = 0.5.
    assert log["arpo/branch_probability"] == pytest.approx(0.5)


def test_reference_entropy_rule_by_hand():
    # Entropies of a trajectory: turn 0 at positions 0-2, a tool result at 3-4, turn 1 at 5-7, a tool result at 8,
    # turn 2 at 9-10.
    entropies = torch.tensor([1.0, 2.0, 3.0, 9.0, 9.0, 4.0, 4.0, 4.0, 9.0, 0.5, 0.5])
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1]
    starts = [0, 5, 9]  # its start, then its resume points
    assert turn_entropy(entropies, mask, 0, k=20) == 6.0  # 1 + 2 + 3: the turn ends at the tool result
    assert turn_entropy(entropies, mask, 5, k=2) == 8.0  # 4 + 4: the first k = 2 tokens only
    log_v = 2.0
    # At the first tool result the reference compares the first turn with itself: ΔH = 0.
    assert entropy_delta(entropies, mask, starts, 1, 20, "reference", log_v) == 0.0
    # At the second: the turn that made that call (turn 1, 12) against the first (6), over log V: (12 - 6) / 2 = 3.
    assert entropy_delta(entropies, mask, starts, 2, 20, "reference", log_v) == 3.0
    # The relative reading: mean entropy after the tool result against the first turn's: (4 - 2) / 2 = 1, then
    # (0.5 - 2) / 2 = -0.75.
    assert entropy_delta(entropies, mask, starts, 1, 20, "relative", log_v) == 1.0
    assert entropy_delta(entropies, mask, starts, 2, 20, "relative", log_v) == -0.75
    # Branch when clip(u - β·ΔH, 0, 1) <= α: with ΔH = 3, β = 0.2, α = 0.5 every u <= 1.1 branches.
    assert branches(0.99, 3.0, 0.5, 0.2) and not branches(0.71, 0.0, 0.5, 0.2) and branches(0.5, 0.0, 0.5, 0.2)
    assert not branches(0.0, -10.0, 0.5, 0.2)  # clip(0 + 2) = 1 > 0.5: no branch


def test_segment_reward_mode_with_tool_validity(tiny_model_path, tool_tokenizer, tmp_path, monkeypatch):
    _script(monkeypatch, tool_tokenizer)
    trainer = _trainer(tiny_model_path, tool_tokenizer, tmp_path, segment_advantage="reward",
                       segment_reward_funcs=["tool_call_validity"], segment_reward_lambda=0.5)  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    adv, mask, tool_mask = out["advantages"], out["completion_mask"], out["tool_mask"]
    assert adv.shape == out["completion_ids"].shape
    # Every tool call was valid (score 1 on turn 0) and the answer turn has no call (None): pooled over the group
    # the scored segments are all 1, std 0, so the segment term is 0 and tokens carry the outcome advantage.
    rewards = trainer.last_batch.rewards_per_func[:4, 0]
    leaf = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    model_tokens = (mask * tool_mask).bool()
    for row in range(4):
        assert torch.allclose(adv[row][model_tokens[row]], leaf[row].expand(int(model_tokens[row].sum())), atol=1e-5)


def test_bad_segment_reward_and_regex_are_clear_errors(tiny_model_path, tool_tokenizer, tmp_path, monkeypatch):
    _script(monkeypatch, tool_tokenizer)
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
    with pytest.raises(ValueError, match="arpo_initial_rollouts=8 must be between 1 and num_generations - 1"):
        GRPOExtConfig(arpo=True, arpo_initial_rollouts=8, **kwargs)
    with pytest.raises(ValueError, match="arpo_beam_size=1 never branches"):
        GRPOExtConfig(arpo=True, arpo_beam_size=1, **kwargs)
    with pytest.raises(ValueError, match="arpo_entropy_delta='abs' is not one of"):
        GRPOExtConfig(arpo=True, arpo_entropy_delta="abs", **kwargs)
    with pytest.raises(ValueError, match="segment_by='words' is not one of"):
        GRPOExtConfig(segment_by="words", **kwargs)
    with pytest.raises(ValueError, match="needs reward_funcs"):
        SegmentGRPOTrainer(model=str(tiny_model_path), args=GRPOExtConfig(segment_by="tags", **kwargs),
                           train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    # Before any model loads (the model path does not exist):
    missing = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match="pass tools="):
        SegmentGRPOTrainer(model=missing, reward_funcs=["contains_solution"],
                           args=GRPOExtConfig(segment_by="tags", arpo=True, **kwargs),
                           train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="segment_by='tool_calls' cuts completions at tool results"):
        SegmentGRPOTrainer(model=missing, reward_funcs=["contains_solution"], args=GRPOExtConfig(**kwargs),
                           train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip


def test_segment_reward_in_reward_funcs_is_a_clear_error(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import GRPOExtTrainer

    with pytest.raises(ValueError, match="'tool_call_validity' is a segment reward .* segment_reward_funcs"):
        GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=["tool_call_validity"],
                       args=GRPOExtConfig(output_dir=str(tmp_path), **cpu_test_config_kwargs()),
                       train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip


def test_arpo_refuses_several_processes_with_sharded_parameters():
    # Sharded parameters make every forward collective, and processes branch differently: refused at setup, naming
    # the fix. `sharded_parameters` reads accelerate's state as the trainer has it.
    from types import SimpleNamespace

    from trl_grpo_ext import GRPOExtTrainer
    from trl_grpo_ext.methods.arpo import ARPO

    def trainer(processes, fsdp=False, zero_stage=None):
        plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
        fake = SimpleNamespace(is_fsdp_enabled=fsdp, is_deepspeed_enabled=plugin is not None, use_vllm=False,
                               accelerator=SimpleNamespace(num_processes=processes,
                                                           state=SimpleNamespace(deepspeed_plugin=plugin)),
                               tokenizer=list(range(50)))  # fmt: skip
        fake.sharded_parameters = GRPOExtTrainer.sharded_parameters.fget(fake)
        return fake

    for sharded in (trainer(2, fsdp=True), trainer(2, zero_stage=3)):
        with pytest.raises(NotImplementedError, match="sharded parameters .* use DDP"):
            ARPO(initial_rollouts=2).setup(sharded)
    for fine in (trainer(1, fsdp=True), trainer(1, zero_stage=3), trainer(2, zero_stage=2), trainer(2)):
        ARPO(initial_rollouts=2).setup(fine)  # one process, ZeRO-2 or DDP: branches as usual
