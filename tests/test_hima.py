"""HiMA-R1's model-free pieces: the hierarchy's validation, node-group maths and the memory store, by hand."""

import json
import math

import pytest
import torch

from trl_grpo_ext.methods.hima import Agent, Hierarchy, MemoryStore, node_group_advantages, select_node_groups


def toy(**changes):
    agents = {"router": {"role": "Route.", "routes": ["calc", "qa"]}, "calc": {"role": "Compute."},
              "qa": {"role": "Answer."}}  # fmt: skip
    for name, fields in changes.items():
        agents[name] = {**agents.get(name, {"role": "x"}), **fields}
    return {"master": "router", "agents": agents}


def test_hierarchy_from_a_mapping():
    h = Hierarchy.from_dict({**toy(), "max_calls": 3})
    assert h.order() == ["router", "calc", "qa"] and h.max_calls == 3
    assert h.agent("calc").routes == []


@pytest.mark.parametrize(
    "spec, message",
    [
        (toy(router={"routes": ["calc", "search"]}), "routes to 'search', which does not exist"),
        (toy(calc={"routes": ["qa"]}, qa={"routes": ["calc"]}), r"cycle \((calc -> qa -> calc|qa -> calc -> qa)\)"),
        (toy(qa={"routes": ["router"]}), "routes back to the master 'router'"),
        (toy(extra={"role": "Never called."}), r"agents \['extra'\] are never called"),
        ({**toy(), "master": "boss"}, "master='boss' is not one of the agents"),
        (toy(calc={"temperature": 0.3}), r"unknown fields \['temperature'\]"),
        ({**toy(), "max_calls": 0}, "max_calls=0 must be a whole number >= 1"),
    ],
    ids=["unknown_route", "cycle", "back_to_master", "unreachable", "no_master", "unknown_field", "max_calls"],
)
def test_bad_hierarchies_fail_before_training(spec, message):
    with pytest.raises(ValueError, match=message):
        Hierarchy.from_dict(spec)


def test_bad_agents():
    with pytest.raises(ValueError, match="agent name 'my agent'"):
        Agent("my agent", "Route.")
    with pytest.raises(ValueError, match="two agents are named 'a'"):
        Hierarchy([Agent("a", "x"), Agent("a", "y")], master="a")


def test_node_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.2])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = node_group_advantages(rewards, groups)
    half = 0.5 / (math.sqrt(0.5) + 1e-4)  # group 0: mean 0.5, unbiased std sqrt(0.5)
    assert adv.tolist() == pytest.approx([half, -half, 0.0, 0.0, 0.0])  # group 1 does not vary; group 2 is alone
    assert node_group_advantages(rewards, groups, scale=False).tolist() == pytest.approx([0.5, -0.5, 0, 0, 0])


# Node groups of 2 (rows 0-1, 2-3, 4-5, 6-7): means 0.5, 1, 0.25, 0.5, so centred: 0.5, -0.5, 0, 0, 0.25, -0.25, 0.5, -0.5.
# "group": each by its group's std (sqrt(0.5), 0, sqrt(0.125), sqrt(0.5)): +-0.5 / (0.70711 + 1e-4), +-0.25 / (0.35355 +
# 1e-4). "batch": every one by the std of all 8 rewards: mean 4.5 / 8 = 0.5625, squares 4 * 0.4375^2 + 3 * 0.5625^2 +
# 0.0625^2 = 1.71875, sample var 1.71875 / 7, std 0.49552. "none": centred only.
SCALE_CASES = {
    "group": [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4), 0.0, 0.0,
              0.25 / (math.sqrt(0.125) + 1e-4), -0.25 / (math.sqrt(0.125) + 1e-4),
              0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)],
    "batch": [c / (math.sqrt(1.71875 / 7) + 1e-4) for c in (0.5, -0.5, 0.0, 0.0, 0.25, -0.25, 0.5, -0.5)],
    "none": [0.5, -0.5, 0.0, 0.0, 0.25, -0.25, 0.5, -0.5],
}  # fmt: skip


@pytest.mark.parametrize("scale_rewards", sorted(SCALE_CASES))
def test_node_groups_follow_trls_scale_rewards(scale_rewards):
    """Issue 32: "batch" was read as "group". TRL's "batch": centred per group, divided by the batch's std."""
    from types import SimpleNamespace

    from trl_grpo_ext import RolloutBatch
    from trl_grpo_ext.methods.hima import HiMA

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.0])
    assert node_group_advantages(rewards, torch.arange(8) // 2, scale_rewards).tolist() == pytest.approx(
        SCALE_CASES[scale_rewards], abs=1e-5
    )
    # The extension reads the trainer's scale_rewards: 2 questions of 4 rows, 2 node slots of 2 alternatives.
    hima = HiMA("toy", alternatives=2)
    hima.trainer = SimpleNamespace(args=SimpleNamespace(scale_rewards=scale_rewards), log_metric=lambda *a, **k: None,
                                   model=SimpleNamespace(training=True))  # fmt: skip
    hima.memories, hima._owners = {}, ["router", "router", "qa", "qa"] * 2
    batch = RolloutBatch(rewards=rewards, rewards_per_func=rewards[:, None], reward_func_names=["r"],
                         reward_weights=torch.ones(1), num_generations=4, process_slice=slice(0, 8),
                         advantages=torch.zeros(8), completion_ids=torch.zeros(8, 3, dtype=torch.long),
                         completion_mask=torch.ones(8, 3, dtype=torch.long))  # fmt: skip
    hima.after_scoring(batch)
    assert batch.current_advantages.tolist() == pytest.approx(SCALE_CASES[scale_rewards], abs=1e-5)
    with pytest.raises(ValueError, match="scale_rewards='std' is not one of 'group', 'batch', 'none'"):
        node_group_advantages(rewards, torch.arange(8) // 2, "std")


def test_top_k_node_groups_by_variance():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.9, 0.1])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # variances 0.5, 0, 0.125, 0.32
    assert select_node_groups(rewards, groups, k=1) == [0]
    assert select_node_groups(rewards, groups, k=2) == [0, 3]
    assert select_node_groups(rewards, groups, k="all") == [0, 2, 3]  # group 1 carries no signal
    assert select_node_groups(rewards, groups, k=9) == [0, 2, 3]
    with pytest.raises(ValueError, match="hima_top_k=0"):
        select_node_groups(rewards, groups, k=0)


def test_memory_decisions_on_a_hand_built_stream():
    memory = MemoryStore(warmup=4, window=10, capacity=3)
    decisions = [memory.observe(k, f"{k} worked", r, step=i) for i, (k, r) in
                 enumerate([("a", 0.2), ("b", 0.4), ("c", 0.6), ("d", 0.8)])]  # fmt: skip
    assert decisions == ["add"] * 4  # warm-up: the store fills
    assert sorted(memory.entries) == ["b", "c", "d"]  # capacity 3: 'a' (oldest, lowest reward) went
    # rewards seen 0.2 0.4 0.6 0.8: q_2.5 = 0.2 + 0.075 * 0.2 = 0.215, q_97.5 = 0.8 - 0.075 * 0.2 = 0.785
    assert memory.thresholds() == pytest.approx((0.215, 0.785))
    assert memory.observe("c", "c again", 0.5, step=5) == "update"  # between the quantiles: reward mean (0.6+0.5)/2
    assert memory.entries["c"].reward == pytest.approx(0.55) and memory.entries["c"].content == "c worked"
    assert memory.observe("zz", "new", 0.5, step=6) == "keep"  # ordinary and unknown: not added
    assert memory.observe("b", "failed", 0.0, step=7) == "delete"  # below q_2.5
    assert "b" not in memory.entries
    assert memory.observe("e", "great", 1.0, step=8) == "add"  # above q_97.5
    assert memory.entries["e"].content == "great"
    # score = 0.5 * 0.5 ** (age / 50) + 0.5 * reward
    assert memory.score(memory.entries["d"], now=53) == pytest.approx(0.5 * 0.5 + 0.5 * 0.8)


def test_memory_resume_is_exact():
    memory = MemoryStore(warmup=3, capacity=4)
    stream = [("what is 2 + 3", "add them", 1.0), ("what is 4 + 4", "add", 0.0), ("capital of france", "paris", 0.7),
              ("what is 9 + 1", "add them", 0.9), ("what is 1 + 1", "guess", 0.1)]  # fmt: skip
    for i, (k, c, r) in enumerate(stream):
        memory.observe(k, c, r, step=i)
    restored = MemoryStore(warmup=3, capacity=4)
    restored.load_state_dict(json.loads(json.dumps(memory.state_dict())))  # through a checkpoint's JSON
    assert restored.state_dict() == memory.state_dict()
    assert [e.key for e in restored.retrieve("what is 2 + 2")] == [e.key for e in memory.retrieve("what is 2 + 2")]
    assert restored.observe("what is 5 + 5", "add", 0.95, step=9) == memory.observe(
        "what is 5 + 5", "add", 0.95, step=9
    )
    assert restored.state_dict() == memory.state_dict()


# ---------------------------------------------------------------------------------------------- training
SCRIPTS = {  # per agent, the outputs it cycles through: right and wrong routes, tool calls and answers
    "router": ["<route>calc</route>", "<route>qa</route>", "<route>calc</route>", "no route"],
    "calc": ['<tool_call>{"name": "calculator", "arguments": {"expression": "A + B"}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"expression": "A - B"}}</tool_call>'],
    "qa": ["SUM", "0"],
}  # fmt: skip


def scripted_agents(monkeypatch, trainer):
    """Each agent call writes the next of its scripts (A, B and SUM filled from the question)."""
    import itertools
    import re

    tokenizer = trainer.processing_class
    counters = {name: itertools.count() for name in SCRIPTS}
    roles = {a.name: a.role for a in trainer.extension("hima").hierarchy.agents}
    calls = []

    def generate_stage(prompts, plan, *, num_generations, max_new_tokens=None, stop=(), rows=None):
        out = []
        for messages in prompts:
            agent = next(name for name, role in roles.items() if messages[0]["content"].startswith(role))
            a, b = map(int, re.findall(r"\d+", messages[-1]["content"])[:2])
            text = SCRIPTS[agent][next(counters[agent]) % len(SCRIPTS[agent])]
            text = text.replace("SUM", str(a + b)).replace("A", str(a)).replace("B", str(b))
            out.append(
                tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
            )
            calls.append(agent)
        return out, None

    monkeypatch.setattr(trainer, "generate_stage", generate_stage)
    return calls


def hima_trainer(tiny_model_path, tokenizer, tmp_path, **overrides):
    from trl_grpo_ext import HiMAConfig, HiMATrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config

    settings = {"num_generations": 4, "per_device_train_batch_size": 8, "hima_alternatives": 2,
                "max_completion_length": 32, "max_steps": 2, **overrides}  # fmt: skip
    args = make_config(tmp_path, HiMAConfig, **settings)
    return HiMATrainer(str(tiny_model_path), args=args, train_dataset=tiny_dataset(16), processing_class=tokenizer,
                       hierarchy="toy", reward_funcs=["last_integer", "hima_format", "hima_efficiency"])  # fmt: skip


@pytest.mark.parametrize("top_k", ["all", "1"])
def test_node_groups_top_k_and_updates(tiny_model_path, tokenizer, tmp_path, monkeypatch, top_k):
    trainer = hima_trainer(tiny_model_path, tokenizer, tmp_path, hima_top_k=top_k)
    calls = scripted_agents(monkeypatch, trainer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    hima, batch = trainer.extension("hima"), trainer.last_batch
    # 2 questions x 2 node slots x 2 alternatives; slot 0 is the router's call, slot 1 the agent it routed to
    owners = hima._owners
    assert owners[0] == owners[1] == "router" and owners[4] == owners[5] == "router"
    assert set(calls) == {"router", "calc", "qa"}
    rewards = batch.rewards
    groups = torch.arange(8) // 2
    expected = select_node_groups(rewards[:4], groups[:4], "all" if top_k == "all" else 1)
    expected += select_node_groups(rewards[4:], groups[4:], "all" if top_k == "all" else 1)
    kept = torch.isin(groups, torch.tensor(expected, dtype=torch.long))
    assert torch.equal(~kept, batch.dropped.cpu())  # the rows of the groups left out are out of the loss
    adv = node_group_advantages(rewards, groups)
    assert batch.current_advantages.cpu().tolist() == pytest.approx(adv.tolist(), abs=1e-5)
    if top_k == "1":
        assert sum(1 for g in range(4) if g in expected) <= 2  # one group per question at most
    # a trained row's prompt is its agent's prompt at that node; rewards saw the system's final answer
    text = tokenizer.decode(batch._output["prompt_ids"][0][batch._output["prompt_mask"][0].bool()])
    assert "You route questions." in text and "<route>NAME</route>" in text
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"hima/node_groups", "hima/selected_groups", "hima/selected_calc", "hima/memory_size_qa"} <= logs
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed  # kept groups with varying rewards moved the shared weights


def test_the_tool_and_the_answer_reach_the_reward(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    trainer = hima_trainer(tiny_model_path, tokenizer, tmp_path, max_steps=1)
    scripted_agents(monkeypatch, trainer)
    trainer.train()
    systems = trainer.extension("hima")._systems
    by_path = {tuple(c.agent for c in s.calls): s for s in systems}
    calc = next(s for path, s in by_path.items() if path == ("router", "calc"))
    a, b = calc.question.split("What is ")[1].rstrip("?").split(" + ")
    assert calc.answer in (str(int(a) + int(b)), str(int(a) - int(b)))  # the calculator's result is the answer
    assert all(s.format_ok for s in systems if s.calls[0].text.startswith("<route>"))
    unrouted = [s for s in systems if s.bad_route]
    assert all(len(s.calls) == 1 and s.answer == "no route" for s in unrouted)
    accuracy = trainer.last_batch.rewards_per_func[:, 0]
    for s, r in zip(systems, accuracy.tolist(), strict=True):
        a, b = s.question.split("What is ")[1].rstrip("?").split(" + ")
        assert r == (1.0 if s.answer == str(int(a) + int(b)) else 0.0)


def test_memory_survives_a_checkpoint(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    trainer = hima_trainer(tiny_model_path, tokenizer, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    scripted_agents(monkeypatch, trainer)
    trainer.train()
    stored = trainer.extension("hima").memories["qa"].state_dict()
    assert stored["entries"]  # the QA agent was called and remembered (warm-up: every answer is added)
    from trl_grpo_ext.methods.hima import HiMA
    from trl_grpo_ext.trainer import STATE_FILE

    saved = torch.load(tmp_path / "out" / "checkpoint-2" / STATE_FILE, weights_only=True)  # what resume loads
    fresh = HiMA("toy")
    fresh.load_state_dict(saved["hima"])
    assert fresh.memories["qa"].state_dict() == stored
    # resume_from_checkpoint: a new trainer's stores are the saved ones
    resumed = hima_trainer(tiny_model_path, tokenizer, tmp_path, max_steps=2)
    assert not resumed.extension("hima").memories["qa"].entries
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.extension("hima").memories["qa"].state_dict() == stored


def test_hima_config_errors(tmp_path):
    from trl_grpo_ext import GRPOExtTrainer, HiMAConfig

    from .conftest import make_config

    with pytest.raises(ValueError, match="hima_top_k is set, but hima_hierarchy is not"):
        GRPOExtTrainer("unused", ["accuracy"], args=make_config(tmp_path, HiMAConfig, hima_top_k="2"))
    with pytest.raises(ValueError, match="num_generations=4 must be a multiple of hima_alternatives=3"):
        make_config(tmp_path, HiMAConfig, hima_hierarchy="toy", hima_alternatives=3)
    with pytest.raises(ValueError, match="hima_top_k='some'"):
        make_config(tmp_path, HiMAConfig, hima_hierarchy="toy", hima_alternatives=2, hima_top_k="some")
    bad = tmp_path / "h.yaml"
    bad.write_text("master: router\nagents:\n  router: {role: Route., routes: [search]}\n")
    with pytest.raises(ValueError, match="routes to 'search', which does not exist"):
        make_config(tmp_path, HiMAConfig, hima_hierarchy=str(bad), hima_alternatives=2)


# ---------------------------------------------------------------------------------------------- per-agent adapters
def adapter_trainer(tiny_model_path, tokenizer, tmp_path, quantization_config=None, **overrides):
    from peft import LoraConfig

    from trl_grpo_ext import HiMAConfig, HiMATrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config

    settings = {"num_generations": 4, "per_device_train_batch_size": 8, "hima_alternatives": 2,
                "max_completion_length": 32, "max_steps": 1, "hima_agent_adapters": True, **overrides}  # fmt: skip
    args = make_config(tmp_path, HiMAConfig, **settings)
    return HiMATrainer(str(tiny_model_path), args=args, train_dataset=tiny_dataset(16), processing_class=tokenizer,
                       hierarchy="toy", reward_funcs=["last_integer", "hima_format", "hima_efficiency"],
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                       quantization_config=quantization_config)  # fmt: skip


def adapter_weights(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def changed_adapters(trainer, before) -> set:
    names = set(trainer.adapters)
    moved = set()
    for key, param in trainer.model.named_parameters():
        if key in before and not torch.equal(param, before[key]):
            moved |= names & set(key.split("."))
    return moved


@pytest.mark.parametrize("top_k", ["all", "1"])
def test_agent_adapters_only_the_selected_ones_change(tiny_model_path, tokenizer, tmp_path, monkeypatch, top_k):
    trainer = adapter_trainer(tiny_model_path, tokenizer, tmp_path, hima_top_k=top_k)
    assert trainer.adapters == ["default", "router", "calc", "qa"]
    scripted_agents(monkeypatch, trainer)
    before = adapter_weights(trainer)
    trainer.train()
    hima, batch = trainer.extension("hima"), trainer.last_batch
    kept = ~batch.dropped.cpu()
    updated = {hima.hierarchy.agent(owner).adapter for owner, keep in zip(hima._owners, kept.tolist(), strict=True)
               if keep}  # fmt: skip
    assert updated  # some node group's rewards varied
    # each kept row trained its own agent's adapter; the others (and the policy's `default`) stayed as they were
    assert changed_adapters(trainer, before) == updated
    if top_k == "1":
        assert len(updated) <= 2  # one node group per question
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if ".default." in n)


def test_agent_adapters_train_on_a_4bit_base(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    """QLoRA: PEFT's mixed-adapter forward adds into the 4-bit base layer's output in place, a view autograd refuses
    to modify ("Output 0 of MatMul4Bit is a view"); the trainer hands PEFT a copy, as PEFT's own forward does."""
    from transformers import BitsAndBytesConfig

    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    trainer = adapter_trainer(tiny_model_path, tokenizer, tmp_path, quantization_config=quantized)
    assert getattr(trainer.model, "is_loaded_in_4bit", False)
    scripted_agents(monkeypatch, trainer)
    before = adapter_weights(trainer)
    trainer.train()
    assert changed_adapters(trainer, before) - {"default"}


def test_agent_adapters_under_gradient_checkpointing(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    """Checkpointing recomputes each layer in the backward pass: with the same per-row adapters, the same update."""
    weights = []
    for checkpointing in (False, True):
        trainer = adapter_trainer(tiny_model_path, tokenizer, tmp_path / str(checkpointing), max_steps=2,
                                  gradient_checkpointing=checkpointing)  # fmt: skip
        scripted_agents(monkeypatch, trainer)
        before = adapter_weights(trainer)
        trainer.train()
        assert changed_adapters(trainer, before)
        weights.append(adapter_weights(trainer))
    for key, value in weights[0].items():
        assert torch.allclose(value, weights[1][key], atol=1e-6), key


def test_agent_adapters_give_each_row_its_own_forward(tiny_model_path, tokenizer, tmp_path):
    """A row's log-probs under the mixed-adapter forward equal those of its adapter alone (PEFT's set_adapter)."""
    trainer = adapter_trainer(tiny_model_path, tokenizer, tmp_path)
    model = trainer.model
    with torch.no_grad():  # make the adapters differ
        for key, param in model.named_parameters():
            if "lora_B" in key:
                param.normal_(0, 0.5 if ".calc." in key else 0.05)
    ids = torch.randint(5, 100, (3, 9))
    mask, prompt = torch.ones_like(ids), ids[:, :4]
    names = ["calc", "qa", "default"]
    with trainer._adapters.by_row(trainer._adapters.indices(names)):
        mixed = trainer.completion_logps(prompt, mask[:, :4], ids[:, 4:], mask[:, 4:])
    for row, name in enumerate(names):
        model.set_adapter(name)
        alone = trainer.completion_logps(prompt[row : row + 1], mask[:1, :4], ids[row : row + 1, 4:], mask[:1, 4:])
        assert torch.allclose(mixed[row], alone[0], atol=1e-5), name
    model.set_adapter("default")
    assert not torch.allclose(mixed[0], mixed[1])  # the calc adapter really differs


def test_agent_adapters_generate_with_their_own(tiny_model_path, tokenizer, tmp_path):
    """Real generation (no script): each agent's calls run under its adapter, and training runs end to end."""
    trainer = adapter_trainer(tiny_model_path, tokenizer, tmp_path, max_completion_length=8)
    seen = []
    base = trainer.model.get_base_model()
    base.get_decoder().register_forward_pre_hook(  # after the trainer's: the adapters each forward runs with
        lambda module, args: seen.append(tuple(sorted(set(trainer._adapters._current or ["-"]))))
    )
    trainer.train()
    assert ("router",) in seen  # the router's generation, alone under its adapter
    assert any(len(names) >= 1 and set(names) <= {"router", "calc", "qa"} for names in seen)
    assert trainer.last_batch._output["trl_grpo_ext_row_adapters"].tolist()


def test_agent_adapters_need_a_lora_policy(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import HiMAConfig, HiMATrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config

    args = make_config(tmp_path, HiMAConfig, num_generations=4, hima_alternatives=2, hima_hierarchy="toy",
                       hima_agent_adapters=True)  # fmt: skip
    with pytest.raises(ValueError, match="need a LoRA policy: pass peft_config"):
        HiMATrainer(str(tiny_model_path), args=args, train_dataset=tiny_dataset(8), processing_class=tokenizer)


def test_a_tool_call_cut_short_is_a_protocol_failure():
    from trl_grpo_ext.methods.hima import HiMA, _Call, _System

    hima = HiMA("toy")
    for text, ok, answer in [('<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>',
                              True, "7"),
                             ('<tool_call>{"name": "calculator", "arguments": {"expression": "3 +', False, None),
                             ("7", True, "7")]:  # fmt: skip
        system = _System(0, "What is 3 + 4?", calls=[_Call("calc", [], text=text)])
        hima._advance(system)
        assert system.format_ok == [ok] and system.answer == (answer or text)
