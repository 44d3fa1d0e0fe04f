"""`shared_prefix_forward`: shared prefixes run once in the loss's forward, with the plain path's numbers."""

import inspect

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.masking_utils import _preprocess_mask_arguments
from trl import GRPOTrainer

from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, PTAGRPOConfig, PTAGRPOTrainer
from trl_grpo_ext import trainer as trainer_module
from trl_grpo_ext.shared_prefix import check_shared_prefix_model, group_order, prefix_tree
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward


def test_prefix_tree_by_hand():
    # Prompt `4 5` (2 columns), completions of 3 columns: rows 0 and 1 are the same; row 2 shares `6` with them but
    # continues with 9; row 3 has an empty completion.
    ids = torch.tensor([[4, 5, 6, 7, 8], [4, 5, 6, 7, 8], [4, 5, 6, 9, 0], [4, 5, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    tree = prefix_tree(ids, mask, logits_to_keep=3)
    # One packed row (one prompt). Rows in lexicographic order of their padded content: row 3 (4 5), rows 0-1
    # (4 5 6 7 8), row 2 (4 5 6 9). A token is shared when the next column is too: row 3's 5 predicts nothing, the
    # others' 5 predicts 6, so 5 is laid out twice; 6 predicts 7 in rows 0-1 and 9 in row 2, so 6 is too.
    assert tree.input_ids.tolist() == [[4, 5, 5, 6, 7, 8, 6, 9]]
    assert tree.position_ids.tolist() == [[0, 1, 1, 2, 3, 4, 2, 3]]  # each token's column in TRL's batch
    assert tree.shift_labels.tolist() == [[-100, -100, 6, 7, 8, -100, 9, -100]]  # completion tokens only
    # Pre-order subtree ends: 4 is every row's ancestor (8); row 3's 5 has no child (2); the second 5 covers 6 7 8 and
    # 6 9 (8); the first 6 covers 7 8 (6).
    assert tree.subtree_end.tolist() == [[8, 2, 8, 6, 6, 6, 8, 8]]
    # The tokens predicting completion columns 2, 3, 4; -1 where TRL's log-prob is 0 (padding).
    assert tree.source.tolist() == [[2, 3, 4], [2, 3, 4], [2, 6, -1], [-1, -1, -1]]
    assert (tree.row_tokens, tree.tokens) == (5 + 5 + 4 + 2, 8)
    # Rows padded differently have their tokens at other positions: nothing is shared, each has a packed row.
    left = prefix_tree(torch.tensor([[0, 4, 5, 6], [4, 4, 5, 6]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), 1)
    assert left.input_ids.tolist() == [[4, 5, 6, 0], [4, 4, 5, 6]]  # padding (-1) sorts first
    assert left.subtree_end.tolist() == [[3, 3, 3, 4], [4, 4, 4, 4]]  # the padding (q = 3) attends to itself only
    assert left.position_ids.tolist() == [[1, 2, 3, 0], [0, 1, 2, 3]]
    assert left.source.tolist() == [[1], [6]]


def test_group_order_keeps_shuffled_groups_together():
    # Prompts A B A C B A after TRL's shuffle: groups in order of first appearance (A, B, C), each sorted by its
    # completions (A: [3] row 2, [4] row 5, [5] row 0).
    a, b, c = [1, 1], [2, 2], [3, 3]
    prompts = torch.tensor([a, b, a, c, b, a])
    completions = torch.tensor([[5], [2], [3], [1], [9], [4]])
    order = group_order(prompts, torch.ones(6, 2), completions, torch.ones(6, 1))
    assert order.tolist() == [2, 5, 0, 1, 4, 3]


def test_models_the_tree_mask_cannot_serve_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2' does not take"):
        make_config(
            tmp_path, shared_prefix_forward=True, model_init_kwargs={"attn_implementation": "flash_attention_2"}
        )
    config = Qwen2Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"\(qwen2\) has sliding_attention layers"):
        check_shared_prefix_model(config)
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2'.*shared_prefix_forward=False"):
        check_shared_prefix_model(config)


def test_trl_and_transformers_code_the_tree_forward_relies_on():
    from trl.trainer.utils import add_fused_lm_head  # trl 1.15; older releases refuse shared_prefix_forward

    fused = inspect.getsource(add_fused_lm_head)
    assert "labels = shift_labels" in fused, "add_fused_lm_head no longer scores pre-shifted `shift_labels`"
    logps = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "fused_lm_head=True" in logps and "with self.accelerator.autocast():" in logps
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    for code in ("split_tensor_dict(generation_batch, self.args.steps_per_generation)",
                 "self._buffered_inputs[self._step % self.args.steps_per_generation]"):  # fmt: skip
        assert code in prepare, f"GRPOTrainer._prepare_inputs no longer has `{code}`"
    assert "len(attention_mask.shape) == 4" in inspect.getsource(_preprocess_mask_arguments), (
        "transformers no longer passes a custom 4D attention mask through as it is"
    )


def _loss_batch(tokenizer, plans: bool):
    """Two groups of 4 rows (prompts of different lengths, left-padded); with `plans`, rows 2k and 2k+1 share their
    first 3 completion tokens. Completions of random tokens and lengths, right-padded."""
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
               for row in tiny_dataset(2)]  # fmt: skip
    width, keep = max(len(p) for p in prompts), 9
    ids = torch.randint(3, 400, (8, width + keep), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(8):
        prompt = prompts[row // 4]
        ids[row, : width - len(prompt)], mask[row, : width - len(prompt)] = 0, 0
        ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        if plans and row % 2:
            ids[row, width : width + 3] = ids[row - 1, width : width + 3]
        length = int(torch.randint(4, keep + 1, (1,), generator=generator))
        ids[row, width + length :], mask[row, width + length :] = 0, 0
    return ids, mask, keep


@pytest.mark.parametrize("variant", ["sdpa", "eager", "lora"])
def test_log_probs_and_gradients_equal_the_plain_path(tiny_model_path, tokenizer, tmp_path, variant):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=variant.replace("lora", "sdpa"))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    args = make_config(tmp_path, shared_prefix_forward=True, temperature=0.7, gradient_checkpointing=variant == "lora")
    trainer = GRPOExtTrainer(model, varied_reward, args, train_dataset=tiny_dataset(4), processing_class=tokenizer,
                             peft_config=lora if variant == "lora" else None)  # fmt: skip
    trainer.model.train()
    weights = torch.linspace(-1.0, 1.0, 9)

    def run(ids, mask, keep, shared, batch_size=None):
        args.shared_prefix_forward = shared
        trainer.model.zero_grad(set_to_none=True)
        seam = trainer._get_per_token_logps_and_entropies
        logps, entropies, _ = seam(trainer.model, ids, mask, keep, batch_size=batch_size, compute_entropy=True)
        ((logps * weights).sum() + entropies.sum()).backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        return logps.detach(), entropies.detach(), grads

    for plans in (False, True):  # GRPO groups, then PTA plans
        ids, mask, keep = _loss_batch(tokenizer, plans)
        tree = prefix_tree(ids, mask, keep)
        assert tree.input_ids.size(0) == 2 and tree.tokens < 0.6 * tree.row_tokens  # two groups, prompts once
        plain = run(ids, mask, keep, shared=False)
        assert plain[0].ne(0).sum() == mask[:, -keep:].sum()  # every completion token has a log-prob
        for batch_size in (None, 4):  # the loss's one forward; TRL's chunks for the old / reference log-probs
            shared = run(ids, mask, keep, shared=True, batch_size=batch_size)
            torch.testing.assert_close(shared[0], plain[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(shared[1], plain[1], atol=1e-5, rtol=1e-5)
            assert shared[2].keys() == plain[2].keys() and len(plain[2]) == (8 if variant == "lora" else 26)
            for name, grad in plain[2].items():
                torch.testing.assert_close(shared[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _train(trainer_cls, args, tiny_model_path, tokenizer, reward_funcs):
    trainer = trainer_cls(model=str(tiny_model_path), reward_funcs=reward_funcs, args=args,
                          train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    micro_batches = []
    loss = trainer._compute_loss

    def spy(model, inputs):
        micro_batches.append(inputs["prompt_ids"].masked_fill(inputs["prompt_mask"] == 0, -1))
        return loss(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return params, rewards, micro_batches


@pytest.mark.parametrize("method", ["grpo", "pta"])
def test_training_with_shared_prefixes_ends_where_the_plain_path_does(tiny_model_path, tokenizer, tmp_path, method,
                                                                       monkeypatch):  # fmt: skip
    # Two generations of 2 groups of 4, cut into 2 micro-batches, each used twice (num_iterations=2, so that TRL also
    # computes old log-probs), with a KL term (reference log-probs): every forward of the pipeline is a tree. SGD, as
    # Adam's first steps move an element whose gradient is float noise by about the learning rate.
    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=2,
                    num_iterations=2, beta=0.1, max_steps=4, max_completion_length=6, optim="sgd",
                    learning_rate=0.1)  # fmt: skip
    cls, config = GRPOExtTrainer, GRPOExtConfig
    if method == "pta":  # 2 plans of at most 3 tokens, each continued twice
        cls, config = PTAGRPOTrainer, PTAGRPOConfig
        settings.update(num_plans=2, continuations_per_plan=2, num_generations=4, plan_max_tokens=3)
    trees = []

    def layout(*args):
        trees.append(prefix_tree(*args))
        return trees[-1]

    monkeypatch.setattr(trainer_module, "prefix_tree", layout)
    runs = {}
    for shared in (False, True):
        args = make_config(tmp_path / str(shared), config_cls=config, shared_prefix_forward=shared, **settings)
        runs[shared] = _train(cls, args, tiny_model_path, tokenizer, [varied_reward])
    (plain, plain_rewards, shuffled), (shared, shared_rewards, micro_batches) = runs[False], runs[True]
    # Per generation: old and reference log-probs in TRL's chunks of 4 rows (2 + 2), the loss's 4 micro-batches.
    assert len(trees) == 2 * (2 + 2 + 4)
    assert all(t.input_ids.size(0) == 1 and t.tokens < 0.6 * t.row_tokens for t in trees)  # one group, shared
    assert len(micro_batches) == len(shuffled) == 8
    assert any((prompts != prompts[0]).any() for prompts in shuffled)  # TRL's shuffle mixes groups
    assert all((prompts == prompts[0]).all() for prompts in micro_batches)  # regrouped: one whole group each
    assert shared_rewards == pytest.approx(plain_rewards) and len(plain_rewards) == 2  # logged when generating
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    assert max((shared[name] - value).abs().max() for name, value in initial.items()) > 1e-3  # it did train
    for name, value in plain.items():
        torch.testing.assert_close(shared[name], value, atol=1e-6, rtol=1e-5, msg=name)
