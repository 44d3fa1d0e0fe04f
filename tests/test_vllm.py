"""vLLM generation for every rollout-owning method, checked on the requests TRL's own client sends.

Server mode runs against `tests/vllm_standin.py`, a stand-in for `trl vllm-serve` backed by the tiny model: each test
trains a step and asserts the recorded `/v1/completions` requests, stage by stage: the prompts' token ids (prompt,
context, completion prefix), `n` (the stage's block size), `max_tokens` (the stage's cap), `stop`, and the sampling
fields TRL sends for plain GRPO. Colocate mode runs with a stand-in `vllm.LLM` and asserts its `SamplingParams`.
"""

import contextlib
import copy
import itertools
import os

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import add_response_schema

from trl_grpo_ext import (
    DraftGRPOConfig,
    DraftGRPOTrainer,
    GRPOExtConfig,
    GRPOExtTrainer,
    HiMAConfig,
    HiMATrainer,
    PTAGRPOConfig,
    PTAGRPOTrainer,
    RolloutPlan,
    TreeOPOConfig,
    TreeOPOTrainer,
)
from trl_grpo_ext.data.trees import SAMPLE_TREES
from trl_grpo_ext.rewards import completion_text
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset
from trl_grpo_ext.tools import calculator

from .conftest import make_config, varied_reward
from .vllm_standin import Engine, StandinServer, patch_trl

# What TRL's client sends for plain GRPO (`VLLMGeneration.generate` -> `VLLMClient.generate`); the first test checks
# these against a run of TRL's own GRPOTrainer.
TRL_FIELDS = {"model", "prompt", "return_token_ids", "return_tokens_as_token_ids", "n", "repetition_penalty",
              "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs"}  # fmt: skip
SAMPLING = {"model": "standin", "return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": 0,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}  # fmt: skip
STOP_FIELDS = {"stop", "include_stop_str_in_output"}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    server = StandinServer(Engine(tiny_model_path))
    yield server
    server.close()


@pytest.fixture
def standin(server, monkeypatch):
    server.reset()
    patch_trl(monkeypatch, server)
    return server


def _vllm(server):
    return {
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_server_base_url": server.base_url,
        "vllm_server_timeout": 10,
    }


def _check(body, *, prompts, n, max_tokens, stop=None):
    """One `/v1/completions` request: TRL's fields and values, plus `stop` (with the stop string kept) for a stage."""
    assert set(body) == TRL_FIELDS | (STOP_FIELDS if stop else set())
    assert {k: body[k] for k in SAMPLING} == SAMPLING
    assert (body["prompt"], body["n"], body["max_tokens"]) == (prompts, n, max_tokens)
    if stop:
        assert body["stop"] == stop and body["include_stop_str_in_output"] is True


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _choices(response, key="token_ids"):
    if key == "logprobs":
        return [c["logprobs"]["token_logprobs"] for c in response["choices"]]
    return [c[key] for c in response["choices"]]


def _dataset_prompts(trainer, n):
    return trainer.tokenize_prompts([row["prompt"] for row in tiny_dataset(n)])


def _sampling_logps(batch, row):
    logps, mask = batch._output["sampling_per_token_logps"][row], batch.completion_mask[row].bool()
    return logps[mask].tolist()


# ---------------------------------------------------------------------------------------------- plain GRPO
def test_plain_grpo_sends_what_trl_sends_and_syncs_weights(standin, tiny_model_path, tokenizer, tmp_path):
    def train(trainer_cls, config_cls):
        args = make_config(tmp_path / trainer_cls.__name__, config_cls, max_steps=1, **_vllm(standin))
        trainer = trainer_cls(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                              train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
        trainer.train()
        return trainer

    train(GRPOTrainer, GRPOConfig)
    trl_requests = standin.completions()
    standin.reset()
    trainer = train(GRPOExtTrainer, GRPOExtConfig)
    assert standin.completions() == trl_requests  # the same requests, field for field
    # The server's sampling log-probs are the policy's own (TRL compares them for its importance-sampling ratio).
    assert trainer.state.log_history[0]["sampling/sampling_logp_difference/max"] < 1e-4
    (body,) = trl_requests
    # One group of 4: its prompt (chat template and generation prompt applied) once, n = num_generations.
    assert len(body["prompt"]) == 1 and body["prompt"][0] in _dataset_prompts(trainer, 8)
    _check(body, prompts=body["prompt"], n=4, max_tokens=8)
    # TRL's weight-sync protocol ran before the generation: the transfer group, then one update and a cache reset.
    assert standin.paths() == ["/health", "/v1/models", "/server_info", "/get_world_size",
                               "/init_weight_transfer_engine", "/server_info", "/start_weight_update",
                               "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
                               "/v1/completions"]  # fmt: skip
    # A sync after the step carries the trained weights, by their names, into the served model.
    initial = {n: p.detach().clone() for n, p in standin.engine.model.named_parameters()}
    trainer.vllm_generation.sync_weights()
    trained = dict(trainer.model.named_parameters())
    assert standin.loaded[-1] == list(trained)
    for name, param in standin.engine.model.named_parameters():
        assert torch.equal(param, trained[name].detach()), name
    assert any(not torch.equal(initial[n], trained[n].detach()) for n in trained)
    # The chat route: the server renders the template with the generation prompt; n samples with their log-probs.
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    out = trainer.vllm_generation.vllm_client.chat([messages], n=2, max_tokens=3)
    assert out["prompt_ids"] == [tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                               return_dict=False)]  # fmt: skip
    assert len(out["completion_ids"]) == 2
    assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]


# ---------------------------------------------------------------------------------------------- PTA-GRPO
def _pta_script(tokenizer):
    """Plans alternate between one that closes (then more text, which `</plan>` must cut) and one that ends with EOS;
    a continuation is a fixed answer."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    close = tokenizer.convert_tokens_to_ids("</plan>")
    plans = itertools.cycle([_ids(tokenizer, "<plan>add them</plan><think>"), _ids(tokenizer, "<plan>x") + [eos]])
    answer = _ids(tokenizer, "<think>3 + 4</think><answer>7</answer>") + [eos]
    return lambda prompt_ids, index: answer if close in prompt_ids else next(plans)


def _pta_trainer(tiny_model_path, tokenizer, tmp_path, **overrides):
    args = PTAGRPOConfig(output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
                         per_device_train_batch_size=8, max_completion_length=12, plan_max_tokens=6, max_steps=1,
                         learning_rate=1e-2, seed=0, **cpu_test_config_kwargs(), **overrides)  # fmt: skip
    return PTAGRPOTrainer(model=str(tiny_model_path), args=args, train_dataset=tiny_dataset(8),
                          processing_class=tokenizer)  # fmt: skip


class _Processes:
    """The trainer's accelerator, as one of `n` processes sees it (for the rows a gathering backend is sent)."""

    def __init__(self, accelerator, n):
        self._accelerator, self.num_processes = accelerator, n

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def test_pta_plans_then_continuations(standin, tiny_model_path, tokenizer, tmp_path, monkeypatch):
    standin.engine.script = _pta_script(tokenizer)
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, **_vllm(standin))
    trainer.train()
    batch = trainer.last_batch
    questions = trainer.tokenize_prompts([batch.prompts[r] for r in (0, 4)])
    plans, answers = standin.completions()
    # Stage 1: one prompt per question, n = m plans, capped at plan_max_tokens, stopped at </plan> (kept).
    _check(plans, prompts=questions, n=2, max_tokens=6, stop=["</plan>"])
    closed, ended = _choices(standin.responses[0])[:2]
    assert tokenizer.decode(closed) == "<plan>add them</plan>"  # the stop string cut the <think> after it
    assert closed == _choices(standin.responses[0])[2] and ended[-1] == tokenizer.eos_token_id
    # Stage 2: only the closed plans are continued (the other ended with EOS), n = z, capped at what is left.
    _check(answers, prompts=[q + closed for q in questions], n=2, max_tokens=12 - len(closed))
    ids = batch.completion_ids
    (continuation, *_) = _choices(standin.responses[1])
    assert ids[0, : len(closed) + len(continuation)].tolist() == closed + continuation
    assert ids[2][batch.completion_mask[2].bool()].tolist() == ended  # an ended plan is its rows' whole completion
    assert batch.rollout.parents == [-1, 0, -1, 2, -1, 4, -1, 6]
    # The rows carry the server's sampling log-probs: the plan's (stage 1), then the continuation's (stage 2).
    plan_logps, ended_logps = _choices(standin.responses[0], "logprobs")[:2]
    (answer_logps, *_) = _choices(standin.responses[1], "logprobs")
    assert _sampling_logps(batch, 0) == pytest.approx(plan_logps + answer_logps, abs=1e-5)
    assert _sampling_logps(batch, 2) == pytest.approx(ended_logps, abs=1e-5)
    assert trainer.state.log_history[0]["pta/plans_ended"] == 0.5
    # With several processes every row goes to the server (it slices its answer by process), ended plans included,
    # and their output is dropped.
    standin.reset()
    rows = [dict(row) for row in tiny_dataset(2) for _ in range(4)]
    plan = RolloutPlan(rows=rows, mode="train", num_generations=4)
    plan.add_prefix([closed, closed, ended, ended] * 2)
    monkeypatch.setattr(trainer, "accelerator", _Processes(trainer.accelerator, 2))
    rollout = trainer.generate_rollouts([r["prompt"] for r in rows], plan, num_generations=2,
                                        finished=[False, False, True, True] * 2)  # fmt: skip
    (body,) = standin.completions()
    prompts = trainer.tokenize_prompts([r["prompt"] for r in rows[::4]])
    _check(body, prompts=[p + prefix for p in prompts for prefix in (closed, ended)], n=2,
           max_tokens=12 - len(closed))  # fmt: skip
    assert rollout.completion_ids[2] == rollout.completion_ids[3] == ended
    assert rollout.completion_ids[0][: len(closed)] == closed and len(rollout.completion_ids[0]) > len(closed)


@contextlib.contextmanager
def _environment_kept():
    # TRL's colocate init sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for vLLM's external launcher;
    # left set, the next TrainingArguments would start a torch.distributed process group.
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_pta_colocate_sampling_params(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    engine = Engine(tiny_model_path)
    engine.script = _pta_script(tokenizer)
    patch_trl(monkeypatch, engine=engine)
    with _environment_kept():
        trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, use_vllm=True, vllm_mode="colocate")
    trainer.train()
    assert not torch.distributed.is_initialized()
    llm = trainer.vllm_generation.llm
    assert llm.init_kwargs["model"] == str(tiny_model_path)
    assert llm.init_kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.loaded == [n for n, _ in trainer.model.named_parameters()] and llm.prefix_cache_resets == 1
    (plans, plan_params), (answers, answer_params) = llm.calls
    # What TRL's `VLLMGeneration` asks for outside a stage: one completion per row (colocate never merges rows).
    batch = trainer.last_batch
    questions = trainer.tokenize_prompts([batch.prompts[r] for r in (0, 4)])
    trainer.vllm_generation.generate(prompts=questions, images=None, num_generations=4)
    trl_params = llm.calls[-1][1].kwargs
    assert trl_params["n"] == 1 and trl_params["max_tokens"] == 12 and "stop" not in trl_params
    common = {k: v for k, v in trl_params.items() if k != "max_tokens"}
    closed = _ids(tokenizer, "<plan>add them</plan>")
    assert plan_params.kwargs == {**common, "max_tokens": 6, "stop": ["</plan>"], "include_stop_str_in_output": True}
    assert answer_params.kwargs == {**common, "max_tokens": 12 - len(closed)}
    assert [p["prompt_token_ids"] for p in plans] == [q for q in questions for _ in range(2)]  # a row per plan
    assert [p["prompt_token_ids"] for p in answers] == [q + closed for q in questions for _ in range(2)]


# ---------------------------------------------------------------------------------------------- ARPO
def test_arpo_branches_after_tool_results(standin, tiny_model_path, tokenizer, tmp_path):
    tool_tokenizer = add_response_schema(copy.deepcopy(tokenizer))
    response = tokenizer.convert_tokens_to_ids("<tool_response>")
    call = _ids(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>')
    answers = [_ids(tokenizer, f"<answer>{n}</answer>") for n in (12, 13)]
    standin.engine.script = lambda prompt_ids, index: (
        (answers[index % 2] if response in prompt_ids else call) + [tokenizer.eos_token_id]
    )
    args = GRPOExtConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=96, max_steps=1, learning_rate=1e-2, seed=0, arpo=True,
                         arpo_initial_rollouts=2, arpo_beam_size=2, arpo_alpha=1.0, arpo_beta=0.0,
                         **cpu_test_config_kwargs(), **_vllm(standin))  # fmt: skip
    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=["contains_solution"], args=args,
                             train_dataset=tiny_dataset(8).map(lambda r: {"solution": "12"}),
                             processing_class=tool_tokenizer, tools=[calculator])  # fmt: skip
    trainer.train()
    batch = trainer.last_batch
    rollout = batch.rollout
    assert rollout.parents == [-1, -1, 0, 1, -1, -1, 4, 5]  # two initial rollouts per group, each branched once
    initial, after_tool, branches = standin.completions()
    questions = trainer.tokenize_prompts([batch.prompts[r] for r in (0, 4)], rows=[0, 4])
    _check(initial, prompts=questions, n=2, max_tokens=96)  # the initial rollouts: n = arpo_initial_rollouts
    # TRL's tool loop: each row's own history (prompt, call, tool result), n = 1.
    assert len(after_tool["prompt"]) == 4
    _check(after_tool, prompts=after_tool["prompt"], n=1, max_tokens=96)
    for prompt, row in zip(after_tool["prompt"], (0, 1, 4, 5), strict=True):
        assert prompt[: len(rollout.prompt_ids[row]) + len(call) + 1] == rollout.prompt_ids[row] + call + [
            tokenizer.eos_token_id
        ]
        assert response in prompt[len(rollout.prompt_ids[row]) :]
    # The branches: the parent's trajectory up to its resume point, then generation, n = 1, capped at what is left.
    parents = [(2, 0), (3, 1), (6, 4), (7, 5)]
    starts = [rollout.prompt_ids[p] + rollout.completion_ids[p][: rollout.shared[b]] for b, p in parents]
    _check(branches, prompts=starts, n=1, max_tokens=96 - min(rollout.shared[b] for b, _ in parents))
    for (branch, parent), made in zip(parents, _choices(standin.responses[2]), strict=True):
        point = rollout.shared[branch]
        assert rollout.completion_ids[branch] == rollout.completion_ids[parent][:point] + made
        # The shared prefix keeps the parent's sampling log-probs (0 on the tool result, as TRL's loop writes them).
        assert _sampling_logps(batch, branch)[:point] == pytest.approx(_sampling_logps(batch, parent)[:point])


# ---------------------------------------------------------------------------------------------- Tree-OPO
def test_tree_opo_teacher_prefixes(standin, tiny_model_path, tokenizer, tmp_path):
    args = make_config(tmp_path, TreeOPOConfig, prefix_trees=SAMPLE_TREES, per_device_train_batch_size=8,
                       max_steps=1, **_vllm(standin))  # fmt: skip
    trainer = TreeOPOTrainer(model=str(tiny_model_path), reward_funcs="last_integer", args=args,
                             processing_class=tokenizer)  # fmt: skip
    trainer.train()
    batch, treeopo = trainer.last_batch, trainer.extension("treeopo")
    (body,) = standin.completions()
    # Each row of a group starts from its own teacher prefix: the rows differ, so they are sent one by one (n = 1).
    questions = trainer.tokenize_prompts(batch.prompts)
    prefixes = [treeopo._prefix_ids[node] for node in batch.notes["treeopo_node"]]
    assert len({tuple(p) for p in prefixes[:4]}) == 4
    _check(body, prompts=[q + p for q, p in zip(questions, prefixes, strict=True)], n=1, max_tokens=8)


# ---------------------------------------------------------------------------------------------- drafts
def parity(completions, **kwargs):
    return [float(len(completion_text(c)) % 2) for c in completions]


parity.correctness = True


def test_self_drafts_then_refinement(standin, tiny_model_path, tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    standin.engine.script = lambda prompt_ids, index: _ids(tokenizer, f"it is {5 + index}") + [eos]
    args = make_config(tmp_path, DraftGRPOConfig, draft_source="self", draft_mode="refine", draft_num=2,
                       draft_max_new_tokens=6, per_device_train_batch_size=8, max_steps=1,
                       **_vllm(standin))  # fmt: skip
    trainer = DraftGRPOTrainer(model=str(tiny_model_path), reward_funcs=parity, args=args,
                               train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    batch = trainer.last_batch
    drafts, refine = standin.completions()
    # The drafts: each group's bare question once, n = draft_num, capped at draft_max_new_tokens.
    assert len(drafts["prompt"]) == 2 and all(p in _dataset_prompts(trainer, 8) for p in drafts["prompt"])
    _check(drafts, prompts=drafts["prompt"], n=2, max_tokens=6)
    # The policy's answers: each group's prompt shows one of its problem's drafts, n = num_generations.
    shown = [batch.columns["drafts"][r] for r in (0, 4)]
    assert all(len(s) == 1 and s[0] in ("it is 5", "it is 6") for s in shown)
    _check(refine, prompts=trainer.tokenize_prompts([batch.prompts[r] for r in (0, 4)]), n=4, max_tokens=8)
    for draft, question, prompt in zip(shown, drafts["prompt"], refine["prompt"], strict=True):
        user = (
            tokenizer.decode(question)
            .split("<|im_start|>user\n")[1]
            .removesuffix("<|im_end|>\n<|im_start|>assistant\n")
        )
        assert draft[0] in tokenizer.decode(prompt) and user in tokenizer.decode(prompt)  # its own problem's draft


# ---------------------------------------------------------------------------------------------- HiMA
def _hima_script(tokenizer):
    eos = tokenizer.eos_token_id
    outputs = {"You route": "<route>calc</route> add the numbers", "You solve": '<tool_call>{"name": "calculator", '
               '"arguments": {"expression": "3 + 4"}}</tool_call>', "You answer": "7"}  # fmt: skip

    def script(prompt_ids, index):
        text = tokenizer.decode(prompt_ids)
        return _ids(tokenizer, next(out for role, out in outputs.items() if role in text)) + [eos]

    return script


def test_hima_agent_calls_stop_at_route(standin, tiny_model_path, tokenizer, tmp_path):
    standin.engine.script = _hima_script(tokenizer)
    args = make_config(tmp_path, HiMAConfig, num_generations=4, per_device_train_batch_size=8, hima_alternatives=2,
                       max_completion_length=32, max_steps=1, **_vllm(standin))  # fmt: skip
    trainer = HiMATrainer(str(tiny_model_path), args=args, train_dataset=tiny_dataset(8), processing_class=tokenizer,
                          hierarchy="toy", reward_funcs=["last_integer", "hima_format",
                                                         "hima_efficiency"])  # fmt: skip
    trainer.train()
    batch = trainer.last_batch
    routes, calcs, alternatives, finishes = standin.completions()
    route = _ids(tokenizer, "<route>calc</route>")

    def agents(body):
        return [tokenizer.decode(p).split("<|im_start|>system\n")[1][:9] for p in body["prompt"]]

    # The reference trajectories: the router (stopped at </route>, the text after it cut), then the calculator agent.
    _check(routes, prompts=routes["prompt"], n=1, max_tokens=32, stop=["</route>"])
    assert agents(routes) == ["You route"] * 2 and _choices(standin.responses[0]) == [route] * 2
    _check(calcs, prompts=calcs["prompt"], n=1, max_tokens=32)  # a calculator call: no routes, no stop string
    assert agents(calcs) == ["You solve"] * 2
    assert "add the numbers" not in tokenizer.decode(calcs["prompt"][0])  # what followed </route> was never made
    # The node groups: G = 2 alternatives of each node of the reference, one block per node (n = G).
    _check(alternatives, prompts=alternatives["prompt"], n=2, max_tokens=32, stop=["</route>"])
    assert agents(alternatives) == ["You route", "You solve"] * 2
    assert alternatives["prompt"][0] == routes["prompt"][0] and alternatives["prompt"][1] == calcs["prompt"][0]
    # The router's alternatives then reach the calculator: those systems finish, one call each.
    _check(finishes, prompts=finishes["prompt"], n=1, max_tokens=32)
    assert agents(finishes) == ["You solve"] * 4
    # The trained rows are the node calls, with the server's sampling log-probs (vLLM's importance sampling).
    assert batch.completion_ids[0][batch.completion_mask[0].bool()].tolist() == route
    logps = _choices(standin.responses[2], "logprobs")
    for row in range(4):
        assert _sampling_logps(batch, row) == pytest.approx(logps[row], abs=1e-5)


def test_hima_agent_adapters_refuse_vllm_before_the_model_loads(tmp_path, tokenizer):
    args = make_config(tmp_path, HiMAConfig, num_generations=4, hima_alternatives=2, hima_hierarchy="toy",
                       hima_agent_adapters=True, use_vllm=True)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"per-agent LoRA adapters \['router', 'calc', 'qa'\].*set use_vllm=False"):
        HiMATrainer(str(tmp_path / "no-model"), args=args, train_dataset=tiny_dataset(8), processing_class=tokenizer,
                    peft_config=lora)  # fmt: skip
