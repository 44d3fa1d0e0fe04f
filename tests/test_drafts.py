"""Draft-conditioned RL: mismatched wrong drafts (arXiv 2605.17314) and self-refinement (ThinkTwice, 2604.01591)."""

import shutil

import pytest
import torch

from trl_grpo_ext import DraftGRPOConfig, DraftGRPOTrainer, GRPOExtConfig, get_reward
from trl_grpo_ext.methods.drafts import (
    Draft,
    DraftStore,
    choose_drafts,
    format_drafts,
    ngram_overlap,
    problem_key,
    with_drafts,
)
from trl_grpo_ext.rewards import completion_text
from trl_grpo_ext.tasks import addition_dataset, last_integer_reward
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config


# ---------------------------------------------------------------------------------------------------- selection
def test_mismatch_never_shows_a_problem_its_own_draft():
    # 500 random batches: problems with duplicates (several rows of one key), groups of one (a key seen once), drafts
    # of random correctness. A mismatched draft is never of the row's own problem; wrong-only never shows a correct
    # draft, correct-only never a wrong one; a row is left without a draft only when none qualifies.
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        problems = int(torch.randint(1, 6, (1,), generator=g))
        rows = int(torch.randint(1, 9, (1,), generator=g))
        keys = [f"p{int(k)}" for k in torch.randint(problems, (rows,), generator=g)]
        pool = [Draft(f"p{int(k)}", f"text {i}", float(c), bool(c))
                for i, (k, c) in enumerate(zip(torch.randint(problems, (12,), generator=g),
                                               torch.randint(2, (12,), generator=g), strict=True))]  # fmt: skip
        for keep in ("any", "wrong", "correct", "best"):
            chosen = choose_drafts(keys, pool, match="mismatched", keep=keep, per_row=2, best_of=3, generator=g)
            for key, picked in zip(keys, chosen, strict=True):
                assert all(pool[i].key != key for i in picked)
                assert len(set(picked)) == len(picked) <= 2
                if keep == "wrong":
                    assert all(pool[i].correct is False for i in picked)
                if keep == "correct":
                    assert all(pool[i].correct is True for i in picked)
                wanted = {"any": None, "best": None, "wrong": False, "correct": True}[keep]
                if any(d.key != key and (wanted is None or d.correct is wanted) for d in pool):
                    assert picked
            matched = choose_drafts(keys, pool, match="matched", generator=g)
            assert all(pool[i].key == key for key, picked in zip(keys, matched, strict=True) for i in picked)


def test_selection_rules_by_hand():
    pool = [Draft("a", "a1", 0.0, False), Draft("a", "a2", 1.0, True), Draft("b", "b1", 0.2, False),
            Draft("b", "b2", 0.9, True), Draft("c", "c1", None, None)]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    assert choose_drafts(["a"], pool, keep="wrong", generator=g) == [[0]]
    assert choose_drafts(["a"], pool, keep="correct", generator=g) == [[1]]
    assert choose_drafts(["c"], pool, keep="wrong", generator=g) == [[]]  # unscored drafts are never "wrong"
    assert choose_drafts(["b"], pool, keep="best", best_of=2, per_row=1, generator=g) == [[3]]
    assert sorted(choose_drafts(["a"], pool, per_row=5, generator=g)[0]) == [0, 1]
    # `accept` vetoes: the mismatched wrong drafts of "a" are b1 only once b1 is refused... none is left.
    assert choose_drafts(["a"], pool, match="mismatched", keep="wrong", accept=lambda r, i: i != 2) == [[]]
    with pytest.raises(ValueError, match="keep="):
        choose_drafts(["a"], pool, keep="worst")


@pytest.mark.parametrize("missing", [None, float("nan")], ids=["none", "nan"])
def test_best_of_never_ranks_an_unscored_draft_above_a_scored_one(missing):
    # Issue 32: with every draft drawn (best_of = the pool), the best is b1 (0.9) on every seed; an unscored draft
    # (score None or NaN) comes after every scored one, so with per_row=5 it is the last shown.
    pool = [Draft("b", "b-unscored", missing, None), Draft("b", "b0", 0.2, False), Draft("b", "b1", 0.9, True),
            Draft("b", "b2", 0.5, True), Draft("b", "b3", 0.7, True)]  # fmt: skip
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert choose_drafts(["b"], pool, keep="best", best_of=5, generator=g) == [[2]]
        assert choose_drafts(["b"], pool, keep="best", best_of=5, per_row=5, generator=g) == [[2, 4, 3, 1, 0]]
    # Only unscored drafts drawn: they are still shown (there is nothing better).
    assert choose_drafts(["b"], pool[:1], keep="best", best_of=1) == [[0]]


def test_problem_keys_tell_duplicates_apart_only_by_content():
    chat = [{"role": "user", "content": "1 + 1?"}]
    assert problem_key({"prompt": chat}) == problem_key({"prompt": [dict(chat[0])]})
    assert problem_key({"prompt": "x", "id": 3}, "id") == problem_key({"prompt": "y", "id": 3}, "id")


def test_ngram_overlap_by_hand():
    assert ngram_overlap("a b c d e", "a b c x", n=2) == 0.5  # ab, bc of ab bc cd de
    assert ngram_overlap("a a a", "a a", n=1) == pytest.approx(2 / 3)  # counts clipped: two of the three a's
    assert ngram_overlap("x y", "a b x y c", n=4) == 1.0  # shorter than n: compared on its own length (2)
    assert ngram_overlap("", "a b", n=2) == 0.0
    assert ngram_overlap("a b c", "", n=2) == 0.0


def test_the_template_places_the_drafts_before_the_question():
    template = "{drafts}\n---\n{question}"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    assert with_drafts(chat, ["5"], template) == [chat[0], {"role": "user", "content": "Draft:\n5\n---\n2 + 2?"}]
    assert chat[1]["content"] == "2 + 2?"  # the original is not touched
    assert with_drafts("2 + 2?", ["5", "4"], template) == "Draft 1:\n5\n\nDraft 2:\n4\n---\n2 + 2?"
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    content = with_drafts(parts, ["a cat"], template)[0]["content"]
    assert (
        content[0] == {"type": "text", "text": format_drafts(["a cat"]) + "\n---\n"}
        and content[1:] == parts[0]["content"]
    )
    with pytest.raises(ValueError, match="no user message"):
        with_drafts([{"role": "system", "content": "x"}], ["d"], template)


def test_the_store_is_bounded_and_round_trips():
    store = DraftStore(problems=2, per_problem=2)
    for key, text in [("a", "1"), ("a", "2"), ("a", "3"), ("b", "1"), ("a", "3"), ("c", "1")]:
        store.add(Draft(key, text, 1.0, True))
    assert len(store) == 2 and [(d.key, d.text) for d in store.pool()] == [("a", "2"), ("a", "3"), ("c", "1")]
    again = DraftStore(problems=2, per_problem=2)
    again.load_state_dict(store.state_dict())
    assert again.pool() == store.pool()


# ---------------------------------------------------------------------------------------------------- rewards
def test_improvement_and_copy_rewards_by_hand():
    improve = get_reward("draft_improvement", reward="last_integer")
    completions = [[{"role": "assistant", "content": "It is 7"}]] * 3
    drafts = [["6", "7"], ["6"], []]
    values = improve(prompts=[[{"role": "user", "content": "3 + 4?"}]] * 3, completions=completions,
                     completion_ids=None, solution=["7", "7", "7"], drafts=drafts)  # fmt: skip
    assert values == [0.0, 1.0, None]  # 1 - max(0, 1); 1 - 0; shown no draft
    copy = get_reward("draft_copy_penalty", n=2)
    assert copy(completions=["a b c d e", "x", "q"], drafts=[["zz", "a b c x"], ["x"], []]) == [-0.5, -1.0, 0.0]
    with pytest.raises(ValueError, match="drafts` column"):
        copy(completions=["a"])
    with pytest.raises(ValueError, match="n=0"):
        get_reward("draft_copy_penalty", n=0)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"draft_keep": "wrong"}, "draft_keep='wrong' is set, but draft_source=None"),
        ({"draft_source": "teacher"}, "draft_source='teacher' is not one of"),
        ({"draft_source": "model"}, "needs draft_model"),
        ({"draft_source": "self", "draft_model": "m"}, "draft_model='m' only applies with draft_source in"),
        ({"draft_source": "self", "draft_ratio": 0.3}, "draft_ratio=0.3 only applies with draft_mode"),
        ({"draft_source": "self", "draft_template": "{drafts} only"}, "draft_template="),
        ({"draft_source": "self", "draft_template": "{drafts} {question} {x}"}, "no other field"),
        ({"draft_source": "self", "draft_keep": "best", "draft_best_of": 1, "drafts_per_prompt": 2}, "draft_best_of"),
        ({"draft_source": "self", "draft_mode": "sometimes"}, "draft_mode='sometimes'"),
        ({"draft_source": "column", "draft_num": 2}, "draft_num=2 only applies"),
    ],
)
def test_bad_draft_fields_name_the_field_and_the_fix(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config(tmp_path, GRPOExtConfig, **overrides)


def test_a_missing_draft_column_fails_before_the_model_loads(tmp_path, tokenizer):
    args = make_config(tmp_path, DraftGRPOConfig, draft_source="column", draft_column="hint")
    with pytest.raises(ValueError, match="draft_column='hint', but the training dataset has no such column"):
        DraftGRPOTrainer(model="no/such-model", reward_funcs=last_integer_reward, args=args,
                         train_dataset=addition_dataset(), processing_class=tokenizer)  # fmt: skip


def test_a_draft_model_with_another_tokenizer_fails_before_training(tiny_model_path, tokenizer, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_path, other)
    theirs = type(tokenizer).from_pretrained(other)
    theirs.add_tokens(["<only-in-the-draft-model>"])
    theirs.save_pretrained(other)
    args = make_config(tmp_path, DraftGRPOConfig, draft_source="model", draft_model=str(other))
    with pytest.raises(ValueError, match="has another tokenizer than the policy"):
        DraftGRPOTrainer(model=str(tiny_model_path), reward_funcs=last_integer_reward, args=args,
                         train_dataset=addition_dataset(), processing_class=tokenizer)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- training
def parity(completions, **kwargs):
    """A correctness stand-in with variance on a random model: the text's length is odd."""
    return [float(len(completion_text(c)) % 2) for c in completions]


parity.correctness = True


def _trainer(tiny_model_path, tokenizer, tmp_path, dataset=None, rewards=parity, **overrides):
    args = make_config(tmp_path, DraftGRPOConfig, **{"per_device_train_batch_size": 8, "max_steps": 4, **overrides})
    return DraftGRPOTrainer(model=str(tiny_model_path), reward_funcs=rewards, args=args,
                            train_dataset=dataset if dataset is not None else tiny_dataset(8),
                            processing_class=tokenizer)  # fmt: skip


def _train(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    return [log for log in trainer.state.log_history if "drafts/refine_fraction" in log]


def _shown(batch, row):
    return batch.columns["drafts"][row]


@pytest.mark.parametrize("source", ["self", "model", "column"])
def test_each_source_trains_and_alternates_solve_and_refine(tiny_model_path, tokenizer, tmp_path, source):
    dataset = tiny_dataset(8)
    extra = {}
    if source == "column":
        dataset = dataset.add_column("draft", [f"col {i}" for i in range(len(dataset))])
    if source == "model":
        extra = {"draft_model": str(tiny_model_path), "draft_num": 2, "draft_temperature": 0.7}
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset, draft_source=source, **extra)
    logs = _train(trainer)
    assert [log["drafts/refine_fraction"] for log in logs] == [0.0, 1.0, 0.0, 1.0]  # solve, refine, ...
    assert all("drafts/solve_accuracy" in log for log in logs[::2]) and all(
        "drafts/refine_accuracy" in log and "drafts/copy_rate" in log and "drafts/improvement_rate" in log
        for log in logs[1::2]
    )
    batch = trainer.last_batch  # a refine batch: every row of a group was shown the same drafts, in its prompt
    for row in range(batch.num_scored):
        shown = _shown(batch, row)
        assert len(shown) == 1 and shown == _shown(batch, row - row % 4)
        content = batch.prompts[row][-1]["content"]
        assert content.index(format_drafts(shown)) < content.index("Problem: What is ")  # the drafts come first
    if source == "column":
        assert all(_shown(batch, r) == [batch.columns["draft"][r]] for r in range(8))  # matched: its own draft
    assert trainer.extension("drafts").store.pool()


def test_mismatched_wrong_drafts_are_wrong_for_the_row_and_never_its_own(tiny_model_path, tokenizer, tmp_path):
    # Drafts in a column: problem i's draft answers i's sum + (0 if i is even else 1). Mismatched wrong-only may show
    # only odd problems' drafts, never a problem's own, and never a draft whose number is the row's sum.
    dataset = addition_dataset("train").select(range(16))
    drafts = [f"Try {i}: {int(s) + (i % 2)}" for i, s in enumerate(dataset["solution"])]  # last integer: the answer
    dataset = dataset.add_column("draft", drafts)
    by_text = dict(zip(drafts, dataset["solution"], strict=True))
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset, rewards=last_integer_reward, max_steps=3,
                       draft_source="column", draft_match="mismatched", draft_keep="wrong", draft_mode="refine",
                       drafts_per_prompt=2, loss_type="dr_grpo")  # fmt: skip
    seen = 0
    original = trainer.extension("drafts").after_scoring

    def check(batch):
        nonlocal seen
        for row in range(batch.num_scored):
            solution = batch.columns["solution"][row]
            for text in _shown(batch, row):
                assert text != batch.columns["draft"][row]  # never the row's own draft
                assert int(text.split()[-1]) != int(solution)  # wrong for the row's own problem too
                assert int(text.split()[-1]) == int(by_text[text]) + 1  # wrong for its own problem
                seen += 1
        original(batch)

    trainer.extension("drafts").after_scoring = check
    trainer.train()
    assert seen >= 8  # groups that no wrong draft of another problem fits solve instead (drafts/missing)


def test_evaluation_shows_no_drafts(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, draft_mode="refine", max_steps=1,
                       per_device_eval_batch_size=8)  # fmt: skip
    trainer.train()
    assert trainer.extension("drafts").store.pool()  # there were drafts to show
    metrics = trainer.evaluate(eval_dataset=tiny_dataset(8))
    batch = trainer.last_batch
    assert batch.mode == "eval" and all(d == [] for d in batch.columns["drafts"])
    assert not any("Draft" in batch.prompts[r][-1]["content"] for r in range(batch.num_scored))
    assert not any(k.startswith("eval_drafts/") for k in metrics)


def test_mix_and_dynamic_sampling_and_resume_state(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, draft_mode="mix", draft_ratio=0.5, dynamic_sampling=True,
                       max_steps=6)  # fmt: skip
    logs = _train(trainer)
    assert {log["drafts/refine_fraction"] for log in logs} <= {0.0, 0.5, 1.0}
    assert len({log["drafts/refine_fraction"] for log in logs}) > 1  # groups drawn, not whole batches
    extension = trainer.extension("drafts")
    state = extension.state_dict()
    fresh = _trainer(tiny_model_path, tokenizer, tmp_path / "again", draft_mode="mix", draft_ratio=0.5).extension(
        "drafts"
    )
    fresh.load_state_dict(state)
    assert fresh.store.pool() == extension.store.pool() and fresh.batches == extension.batches
    assert torch.equal(fresh._generator.get_state(), extension._generator.get_state())


def test_mix_generates_drafts_only_for_the_groups_that_refine(tiny_model_path, tokenizer, tmp_path):
    # Issue 32: "mix" generated draft_num drafts for every group of every batch, even when no group was drawn to
    # refine. Draws scripted per batch (2 groups of 4): none refines, then the first, then the second.
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, draft_mode="mix", draft_ratio=0.5, draft_num=2,
                       max_steps=3, logging_steps=1)  # fmt: skip
    extension = trainer.extension("drafts")
    draws = iter([[False, False], [True, False], [False, True]])
    extension._refining = lambda groups: next(draws)
    calls, original = [], trainer.generate_stage

    def generate_stage(prompts, plan, **kwargs):
        ids, logprobs = original(prompts, plan, **kwargs)
        calls.append((list(kwargs["rows"]), sum(len(row) for row in ids)))
        return ids, logprobs

    trainer.generate_stage = generate_stage
    logs = _train(trainer)
    assert [log["drafts/refine_fraction"] for log in logs] == [0.0, 0.5, 0.5]
    # batch 1 generates nothing; then draft_num=2 drafts of the refining group's problem only (its first row)
    assert [rows for rows, _ in calls] == [[0, 0], [4, 4]]
    assert [log["drafts/generated_tokens"] for log in logs] == [0.0, *(tokens for _, tokens in calls)]


def test_plain_prompts_and_the_draft_rewards_train(tiny_model_path, tokenizer, tmp_path):
    dataset = tiny_dataset(8, conversational=False)
    dataset = dataset.add_column("draft", [["one", "two"]] * len(dataset))  # a list of drafts per problem
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset,
                       rewards=[parity, "draft_improvement:reward=last_integer", "draft_copy_penalty:n=2"],
                       draft_source="column", draft_mode="refine", drafts_per_prompt=2, draft_keep="any",
                       draft_template="{question}\n{drafts}\n", max_steps=2)  # fmt: skip
    logs = _train(trainer)
    assert all(log["drafts/refine_fraction"] == 1.0 for log in logs)
    assert all("rewards/draft_improvement/mean" in log and "rewards/draft_copy_penalty/mean" in log for log in logs)
    batch = trainer.last_batch
    for row in range(batch.num_scored):
        assert sorted(_shown(batch, row)) == ["one", "two"]
        assert batch.prompts[row].endswith(format_drafts(_shown(batch, row)) + "\n")  # the template's order
