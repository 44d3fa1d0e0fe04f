"""The reward-hacking monitor: scripted metric streams, the stored real-model runs, our trainers and plain TRL's."""

import json
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState

from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, RewardHackingMonitor
from trl_grpo_ext.methods.monitor import DETECTORS, History, Thresholds, detect, repeated_ngram_rate
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
STEPS = 30


def healthy(step: int) -> dict:
    """One log of a run that learns: correctness rises, the format reward with it, the rest steady."""
    t = step / STEPS
    return {"reward": 0.3 + 0.6 * t, "rewards/accuracy/mean": 0.2 + 0.7 * t, "rewards/accuracy/std": 0.45,
            "rewards/fmt/mean": 0.5 + 0.3 * t, "rewards/fmt/std": 0.2, "completions/mean_length": 40.0 - 5 * t,
            "completions/clipped_ratio": 0.1, "completions/repetition": 0.05, "entropy": 1.0 - 0.5 * t,
            "kl": 0.02 + 0.01 * t, "clip_ratio/region_mean": 0.01, "clip_ratio/low_mean": 0.005,
            "clip_ratio/high_mean": 0.005, "frac_reward_zero_std": 0.2, "grad_norm": 1.0}  # fmt: skip


def hacking(step):
    """The format reward climbs to 1 while correctness stays at 0.3."""
    t = step / STEPS
    return {"rewards/accuracy/mean": 0.3, "rewards/fmt/mean": 0.1 + 0.9 * t, "reward": 0.4 + 0.9 * t}


def after(start: int, changes):
    """A run that does not learn (correctness 0.3 throughout), healthy otherwise; from step `start` on,
    `changes(step)` applies."""

    def log(step):
        values = {**healthy(step), "rewards/accuracy/mean": 0.3, "reward": 0.5, "rewards/fmt/mean": 0.5}
        if step >= start:
            values.update(changes(step))
        return values

    return log


# detector -> (a stream that shows it, monitor kwargs)
STREAMS = {
    "component_hacking": (lambda s: {**healthy(s), **hacking(s)}, {}),
    "correctness_regression": (
        lambda s: {**healthy(s), "rewards/accuracy/mean": 0.9 if s < 15 else 0.2, "rewards/fmt/mean": 0.5},
        {},
    ),
    "reward_composition": (after(12, lambda s: {"rewards/accuracy/std": 0.02, "rewards/fmt/std": 0.4}), {}),
    "heldout_divergence": (
        lambda s: {**healthy(s), **({"heldout/accuracy": 0.6 - 0.01 * s} if s % 6 == 0 else {})},
        {},
    ),
    "length_collapse": (after(10, lambda s: {"completions/mean_length": 6.0}), {}),
    "length_explosion": (after(10, lambda s: {"completions/mean_length": 120.0}), {}),
    "repetition": (lambda s: {**healthy(s), "completions/repetition": 0.05 if s < 12 else 0.6}, {}),
    "entropy_collapse": (after(10, lambda s: {"entropy": 0.02}), {}),
    "kl_spike": (lambda s: {**healthy(s), "kl": 0.02 if s < 15 else 0.3}, {}),
    "kl_drift": (lambda s: {**healthy(s), "kl": 0.02 + 0.05 * s}, {"thresholds": {"kl_spike": 1e9}}),
    "kl_strangled": (after(1, lambda s: {"kl": 1e-4}), {}),
    "clip_saturation": (lambda s: {**healthy(s), "clip_ratio/region_mean": 0.01 if s < 12 else 0.4}, {}),
    "advantage_collapse": (after(10, lambda s: {"frac_reward_zero_std": 1.0}), {}),
    "grad_explosion": (lambda s: {**healthy(s), "grad_norm": 1.0 if s < 15 else 50.0}, {}),
    "plateau": (lambda s: {**healthy(s), "reward": min(s, 12) / 12}, {"thresholds": {"plateau_logs": 10}}),
    "pta_plans_unclosed": (lambda s: {**healthy(s), "pta/plans_closed": 0.9 if s < 12 else 0.1}, {}),
    "arpo_no_branching": (lambda s: {**healthy(s), "arpo/branches": 2.0 if s < 12 else 0.0}, {}),
    "curriculum_overrun": (lambda s: {**healthy(s), "curriculum/budget": 64.0 if s < 12 else 30.0}, {}),
}


def replay(stream, steps=STEPS, **kwargs):
    monitor = RewardHackingMonitor(correctness="accuracy", **kwargs)
    monitor.replay([{**stream(s), "step": s} for s in range(1, steps + 1)])
    return monitor


def test_every_detector_has_a_scripted_stream():
    assert set(STREAMS) == set(DETECTORS)


def test_a_healthy_stream_triggers_nothing():
    monitor = replay(healthy)
    assert monitor.findings == []
    assert "Nothing fired." in monitor.summary()


@pytest.mark.parametrize("detector", sorted(STREAMS))
def test_each_scripted_stream_triggers_its_warning_exactly_once(detector):
    stream, kwargs = STREAMS[detector]
    monitor = replay(stream, **kwargs)
    assert [f.detector for f in monitor.findings] == [detector], [(f.detector, f.evidence) for f in monitor.findings]
    finding = monitor.findings[0]
    assert finding.evidence and finding.advice == DETECTORS[detector][1]
    assert any(ch.isdigit() for ch in finding.evidence)  # the evidence says the numbers


def test_hacking_evidence_names_the_component_and_the_numbers():
    monitor = replay(STREAMS["component_hacking"][0])
    (finding,) = monitor.findings
    assert finding.subject == "fmt"
    assert "rewards/fmt/mean rose" in finding.evidence and "rewards/accuracy/mean 0.3 -> 0.3" in finding.evidence
    # the start is the median of steps 1-3 (0.16), the value the median of the last 5 logs, fmt(step - 2): it is
    # 0.2 above the start from step 11 on, and fires on the second log in a row where it holds
    assert finding.step == 12


def test_a_format_term_rising_below_flat_correctness_is_hacking():
    # Issue 32: correctness flat at 0.7, a format term (weight 1) rising 0.1 -> 0.6 over 24 logs. The term never pays
    # as much as correctness (0.6 < 0.7); the rule is the rise while correctness is flat, so it fires, once.
    def stream(s):
        fmt = 0.1 + 0.5 * (s - 1) / 23
        return {"rewards/accuracy/mean": 0.7, "rewards/fmt/mean": fmt, "reward": 0.7 + fmt}

    monitor = replay(stream, steps=24)
    assert [(f.detector, f.subject) for f in monitor.findings] == [("component_hacking", "fmt")]
    # start: the median of logs 1-3, fmt(2); now: the median of the last 5, fmt(s - 2); the rise fmt(s - 2) - fmt(2) =
    # 0.5 (s - 4) / 23 first reaches 0.2 at s = 14 (0.2174); it holds twice in a row at s = 15
    assert monitor.findings[0].step == 15
    assert "rewards/accuracy/mean 0.7 -> 0.7" in monitor.findings[0].evidence


def test_an_episode_that_ends_and_returns_warns_again():
    def stream(s):  # the length collapses, recovers for 10 logs, collapses again
        return after(8, lambda t: {"completions/mean_length": 6.0 if t < 18 or t >= 28 else 40.0})(s)

    monitor = replay(stream, steps=40)
    assert [f.detector for f in monitor.findings] == ["length_collapse", "length_collapse"]


def test_stop_on_stops_training_and_logs_reach_the_reporters():
    monitor = RewardHackingMonitor(correctness="accuracy", stop_on=["component_hacking"])
    state, control = TrainerState(), TrainerControl()
    state.log_history = []
    for step in range(1, STEPS + 1):
        state.global_step = step
        logs = {**healthy(step), **hacking(step)}
        state.log_history.append({**logs, "step": step})
        monitor.on_log(_Args(), state, control, logs=logs)
        if control.should_training_stop:
            break
    assert state.global_step == 12
    assert logs["monitor/component_hacking"] == 1.0 and logs["monitor/warnings"] == 1.0
    assert state.log_history[-1]["monitor/warnings"] == 1.0


class _Args:
    reward_weights = None
    output_dir = "."


def test_without_correctness_the_hacking_detectors_are_reported_as_not_watched():
    monitor = RewardHackingMonitor()
    monitor.replay([{**healthy(s), **hacking(s), "step": s} for s in range(1, STEPS + 1)])
    assert monitor.correctness is None and monitor.findings == []
    assert monitor.watched()["component_hacking"].startswith("not watched")
    assert "no correctness reward" in monitor.summary()


def test_thresholds_parse_and_reject_bad_input():
    parsed = Thresholds.parse(["hacking_rise=0.3", "window=4", "heldout_points=3", "plateau_logs=None"])
    assert parsed == Thresholds(hacking_rise=0.3, window=4, heldout_points=3)
    assert isinstance(parsed.heldout_points, int) and isinstance(parsed.flat, float)
    with pytest.raises(ValueError, match="'hacking_rize' is not a threshold"):
        Thresholds.parse(["hacking_rize=0.3"])
    with pytest.raises(ValueError, match="window='x' must be a whole number"):
        Thresholds.parse(["window=x"])
    with pytest.raises(ValueError, match="must read 'name=value'"):
        Thresholds.parse(["window"])
    with pytest.raises(ValueError, match="names no detector"):
        RewardHackingMonitor(stop_on=["hacking"])


def test_repeated_ngram_rate_by_hand():
    assert repeated_ngram_rate([5, 6, 7, 8, 5, 6, 7, 8], n=4) == 1 / 5  # 5 four-grams, the last repeats the first
    assert repeated_ngram_rate([1] * 6, n=2) == 4 / 5
    assert repeated_ngram_rate([1, 2], n=4) == 0.0


def test_detect_is_pure_and_waits_for_a_start_and_a_window():
    history = History()
    for step in range(1, 8):  # 7 logs, fewer than baseline_logs (3) + window (5): the jump at step 4 waits
        history.add(step, {**healthy(step), "rewards/accuracy/mean": 0.3, "rewards/fmt/mean": 0.1 if step < 4 else 1})
    assert detect(history, Thresholds(), "accuracy", ["fmt"], None, {}) == []
    history.add(8, {**healthy(8), "rewards/accuracy/mean": 0.3, "rewards/fmt/mean": 1.0})
    (finding,) = detect(history, Thresholds(), "accuracy", ["fmt"], None, {})
    assert finding.detector == "component_hacking" and "0.1 -> 1" in finding.evidence


# ---- the stored real-model runs of benchmarks/learning.py (docs/results/*.json: every logged step) on the addition
# task; NoRD's (nord.json) are on the driving task, whose correctness is not `last_integer` and where no arm learned.
# Cost benchmarks (overhead.json: step times, no held-out curve) share the folder and are not learning runs.
def stored_runs():
    for path in sorted(p for p in RESULTS.glob("*.json") if p.stem != "nord"):
        runs = json.loads(path.read_text())["runs"]
        if not all("heldout" in run and "steps" in run for run in runs.values()):
            continue
        for arm, run in runs.items():
            yield path.stem, arm, run, runs["grpo"]


def replay_stored(run):
    names = [
        k[len("rewards/") : -len("/mean")] for k in run["steps"][0] if k.startswith("rewards/") and k.endswith("/mean")
    ]
    weights = [1.0, 0.5] if names == ["last_integer_reward", "brevity"] else None  # the task's weights
    monitor = RewardHackingMonitor(correctness="last_integer")
    monitor.replay(run["steps"], reward_weights=weights)
    return [f for f in monitor.findings if f.kind == "warning"]


NOISE = 1.5 / 60  # one held-out problem


def learned(run, grpo) -> bool:
    """Held-out accuracy did not fall, and ended within one problem of GRPO's or above (PTA's baseline started at
    0.933 after its cold start and stayed there)."""
    first, last = run["heldout"][0][1], run["heldout"][-1][1]
    return last >= first and last >= grpo["heldout"][-1][1] - NOISE


LEARNED = [(name, arm, run) for name, arm, run, grpo in stored_runs() if learned(run, grpo)]


def test_the_stored_runs_include_every_grpo_baseline_and_the_methods_that_matched_it():
    arms = {(name, arm) for name, arm, _ in LEARNED}
    assert len(arms) >= 18 and {(name, "grpo") for name, *_ in stored_runs()} <= arms
    assert {("pta", "pta"), ("bicc", "bicc"), ("segments", "segments"), ("prorl", "prorl")} <= arms


@pytest.mark.parametrize("name, arm, run", LEARNED, ids=[f"{n}-{a}" for n, a, _ in LEARNED])
def test_stored_runs_that_learn_as_well_as_grpo_raise_no_warning(name, arm, run):
    assert replay_stored(run) == []


def test_stored_runs_that_collapsed_are_flagged():
    runs = {(name, arm): run for name, arm, run, _ in stored_runs()}
    drafts = {
        f.detector for f in replay_stored(runs["drafts", "drafts"])
    }  # brevity paid, correctness 0 (0.683 -> 0.133)
    assert {"component_hacking", "heldout_divergence", "length_collapse"} <= drafts
    cap = {f.detector for f in replay_stored(runs["curriculum_cap", "curriculum_cap"])}  # 0.683 -> 0.217
    assert {"correctness_regression", "component_hacking"} <= cap
    # Tree-OPO (0.817 against GRPO's 0.950): brevity 0.41 -> 0.67 under a correctness flat at 0.375 by step 9, when
    # brevity paid less than correctness (0.33 weighted): the rise is the rule
    tree = [(f.detector, f.step) for f in replay_stored(runs["tree_opo", "tree_opo"])]
    assert ("component_hacking", 9) in tree
    prorl = RewardHackingMonitor(correctness="last_integer")
    prorl.replay(runs["prorl", "prorl"]["steps"])
    assert [(f.detector, f.step) for f in prorl.findings] == [("prorl_reset", 11), ("prorl_reset", 21)]


# ---- in trainers
def test_monitor_in_our_trainer_from_the_config(tiny_model_path, tokenizer, tmp_path):
    # Thresholds that make grad_explosion hold from the second log: the stop and the report, end to end.
    args = make_config(tmp_path, max_steps=4, logging_steps=1, monitor=True, monitor_stop=["grad_explosion"],
                       monitor_thresholds=["window=1", "baseline_logs=1", "patience=1", "grad_explosion=0"])  # fmt: skip
    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                             train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    monitor = trainer.extension("monitor")
    assert trainer.callback_handler.callbacks[0] is monitor  # before the reporters
    trainer.train()
    assert trainer.state.global_step == 2  # stopped when it fired
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert all("completions/repetition" in log for log in logs)
    assert logs[-1]["monitor/grad_explosion"] == 1.0 and logs[-1]["monitor/warnings"] == 1.0
    report = Path(args.output_dir) / "reward_hacking.md"
    assert "| 2 | grad_explosion |" in report.read_text()
    assert json.loads(report.with_suffix(".json").read_text())["warnings"] == 1
    state = monitor.state_dict()
    restored = RewardHackingMonitor()
    restored.load_state_dict(state)
    assert restored.history.series == monitor.history.series and restored.findings == monitor.findings


def test_monitor_on_plain_trl_grpo_trainer(tiny_model_path, tokenizer, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext.testing import cpu_test_config_kwargs

    monitor = RewardHackingMonitor(stop_on="any", thresholds=["window=1", "baseline_logs=1", "patience=1",
                                                              "grad_explosion=0"])  # fmt: skip
    args = GRPOConfig(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=4, learning_rate=1e-2,
                      **cpu_test_config_kwargs())  # fmt: skip
    trainer = GRPOTrainer(model=str(tiny_model_path), reward_funcs=[varied_reward, monitor.probe], args=args,
                          train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    monitor.attach(trainer)
    assert trainer.callback_handler.callbacks[0] is monitor
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert all(0.0 <= log["completions/repetition"] <= 1.0 for log in logs)
    assert logs[0]["rewards/varied_reward/mean"] == pytest.approx(logs[0]["reward"])  # the probe scores nothing
    assert monitor.watched()["repetition"] == "watched"
    assert (tmp_path / "plain" / "reward_hacking.md").exists()


def test_bad_monitor_settings_fail_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="monitor_correctness is set, but monitor=False"):
        make_config(tmp_path, monitor_correctness="accuracy")
    with pytest.raises(ValueError, match="'hacking_rize' is not a threshold"):
        make_config(tmp_path, monitor=True, monitor_thresholds=["hacking_rize=1"])
    args = make_config(tmp_path, monitor=True, monitor_correctness="accuracy")
    with pytest.raises(ValueError, match="monitor_correctness='accuracy' is not one of this trainer's rewards"):
        GRPOExtTrainer(model="no/such-model", reward_funcs=varied_reward, args=args, train_dataset=tiny_dataset(8))
    with pytest.raises(ValueError, match="two extensions are named 'monitor'"):
        GRPOExtTrainer(model="no/such-model", reward_funcs=varied_reward, args=make_config(tmp_path, monitor=True),
                       train_dataset=tiny_dataset(8), callbacks=[RewardHackingMonitor()])  # fmt: skip
    assert isinstance(GRPOExtConfig, type)


def test_warnings_reach_report_to(tiny_model_path, tokenizer, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = make_config(tmp_path, max_steps=3, logging_steps=1, report_to="tensorboard", monitor=True,
                       monitor_thresholds=["window=1", "baseline_logs=1", "patience=1", "grad_explosion=0"])  # fmt: skip
    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                             train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    events = EventAccumulator(str(next(p.parent for p in tmp_path.rglob("events.out.tfevents.*"))))
    events.Reload()
    assert [e.value for e in events.Scalars("train/monitor/warnings")] == [0.0, 1.0, 1.0]
    assert [e.step for e in events.Scalars("train/monitor/grad_explosion")] == [2]
