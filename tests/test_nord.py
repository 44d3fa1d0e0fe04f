"""NoRD: the trajectory reward and the difficulty diagnostic by hand, then real training (text and vision)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from trl_grpo_ext import DifficultyBiasDiagnostic, GRPOExtConfig, NoRDConfig, NoRDTrainer, RolloutBatch, get_reward
from trl_grpo_ext.data.driving import driving_dataset
from trl_grpo_ext.methods.nord import difficulty_stats, group_advantages, parse_waypoints, score_trajectory

from .conftest import make_config, varied_reward

GT = [(1.0, 0.0), (2.0, 0.0)]
SCENE = {"cars": [[4.5, 0.0, 1.2]], "ego_radius": 1.0, "road": [-1.75, 5.25]}


def test_trajectory_cases_by_hand():
    assert score_trajectory(GT, GT, SCENE).score == pytest.approx(1.0)
    offset = score_trajectory([(1.0, 0.5), (2.0, 0.5)], GT, SCENE)  # ADE = FDE = 0.5
    assert offset.score == pytest.approx(2 / 3 * math.exp(-0.5) + 1 / 3)
    assert score_trajectory([(1.0, 0.0), (2.5, 0.0)], GT, SCENE).collision  # 2.0 m from the car, radii 2.2
    assert score_trajectory([(1.0, 0.0), (2.0, 9.0)], GT, SCENE).offroad
    reward = get_reward("trajectory")
    got = reward(completions=["(1.0, 0.0) (2.0, 0.0)", "turn left", "(1.0, 0.0)", "(1, 0) (2, 0) (3, 0)"],
                 future=[GT] * 4, scene=[SCENE] * 4)  # fmt: skip
    assert got == [pytest.approx(1.0), 0.0, 0.0, 0.0]  # perfect, malformed, too few, too many
    assert parse_waypoints("nothing") is None


def test_difficulty_bias_by_hand():
    rewards = torch.tensor([0.9, 1.0, 0.0, 0.6])  # an easy group (std 0.0707) and a hard one (std 0.4243)
    adv = {k: group_advantages(rewards, 2, k) for k in ("group", "none")}
    stats = difficulty_stats(rewards, 2, ["easy", "hard"], ["hard", "easy"], adv)
    assert stats["mass"]["none"]["hard"] == pytest.approx(0.6 / 0.7)
    assert stats["mass"]["group"]["hard"] == pytest.approx(0.5, abs=1e-3)  # std normalisation evens them out


def test_driving_ground_truth_scores_one():
    for row in driving_dataset(40, images=False, seed=3):
        assert score_trajectory([tuple(p) for p in row["future"]], [tuple(p) for p in row["future"]],
                                row["scene"]).score == pytest.approx(1.0)  # fmt: skip


def _scripted_batch(rewards, advantages):
    n = rewards.numel()
    return RolloutBatch(rewards=rewards, rewards_per_func=rewards[:, None], reward_func_names=["r"],
                        reward_weights=torch.ones(1), num_generations=2, process_slice=slice(0, n),
                        advantages=advantages, completion_ids=torch.zeros(n, 3, dtype=torch.long),
                        completion_mask=torch.ones(n, 3, dtype=torch.long))  # fmt: skip


def test_diagnostic_on_a_scripted_batch():
    """Two groups: easy (0.9, 1.0; std 0.0707) and hard (0.0, 0.6; std 0.4243), mean |A| by hand."""
    rewards = torch.tensor([0.9, 1.0, 0.0, 0.6])
    logged = {}
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), log_metric=lambda k, v, mode: logged.update({k: v})
    )
    diagnostic = DifficultyBiasDiagnostic(edges=[0.5])  # hard below a group mean of 0.5, easy above
    diagnostic.trainer = trainer
    diagnostic.after_scoring(_scripted_batch(rewards, group_advantages(rewards, 2, "none")))  # a Dr. GRPO run
    # "none": |A| = 0.05 per easy row, 0.3 per hard row -> hard share 0.3 / 0.35
    assert logged["difficulty/mass_hard_unscaled"] == pytest.approx(0.3 / 0.35)
    assert logged["difficulty/mass_hard"] == pytest.approx(0.3 / 0.35)  # the run's own advantages: unscaled
    # "group": |A| = 0.05 / (0.0707 + 1e-4) and 0.3 / (0.4243 + 1e-4), both about 0.707: the easy group's noise is
    # inflated to the hard group's signal
    easy, hard = 0.05 / (math.sqrt(0.005) + 1e-4), 0.3 / (math.sqrt(0.18) + 1e-4)
    assert logged["difficulty/mass_hard_scaled"] == pytest.approx(hard / (easy + hard))
    assert logged["difficulty/mass_easy_scaled"] == pytest.approx(easy / (easy + hard))
    assert logged["difficulty/groups_hard"] == 0.5
    assert [g["bucket"] for g in diagnostic.groups] == ["easy", "hard"]
    assert diagnostic.groups[1]["std"] == pytest.approx(math.sqrt(0.18))


def test_bad_diagnostic_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="difficulty_by is set, but difficulty_diagnostic=False"):
        make_config(tmp_path, difficulty_by="kind")
    with pytest.raises(ValueError, match="difficulty_edges"):
        DifficultyBiasDiagnostic(edges=[0.6, 0.2])
    with pytest.raises(ValueError, match="pattern"):
        get_reward("trajectory", pattern=r"\((\d+)\)")


@pytest.mark.parametrize("scale_rewards", ["none", "group"])
def test_nord_trains_and_the_diagnostic_reads_the_run(tiny_model_path, tokenizer, tmp_path, scale_rewards):
    """NoRDTrainer's defaults train; the diagnostic's `loss` advantages are those of the run's scaling."""
    data = driving_dataset(8, images=False, seed=0)
    args = make_config(tmp_path, NoRDConfig, max_steps=2, max_completion_length=12, per_device_train_batch_size=8,
                       scale_rewards=scale_rewards,
                       loss_type="dr_grpo" if scale_rewards == "none" else "grpo", difficulty_by="kind")  # fmt: skip
    trainer = NoRDTrainer(str(tiny_model_path), [get_reward("trajectory"), varied_reward], args=args,
                          train_dataset=data, processing_class=tokenizer)  # fmt: skip
    trainer.train()
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"trajectory/malformed", "difficulty/mass_cruise", "difficulty/mass_lane_change_unscaled"} <= logs
    record = json.loads((tmp_path / "out" / "difficulty_bias.json").read_text())
    assert (tmp_path / "out" / "difficulty_bias.png").stat().st_size > 1000
    groups = record["groups"]
    assert len(groups) == 4  # 2 steps of 2 groups
    key = "mean_abs_unscaled" if scale_rewards == "none" else "mean_abs_scaled"
    assert [g["mean_abs_loss"] for g in groups] == pytest.approx([g[key] for g in groups], abs=1e-4)
    assert {g["bucket"] for g in groups} <= {"cruise", "lane_change"}


def test_nord_defaults():
    args = NoRDConfig(output_dir="/tmp/nord-defaults", use_cpu=True, bf16=False)
    assert (args.loss_type, args.scale_rewards, args.difficulty_diagnostic) == ("dr_grpo", "none", True)
    assert not GRPOExtConfig(output_dir="/tmp/nord-defaults", use_cpu=True, bf16=False).difficulty_diagnostic


def test_tiny_vlm_trains_on_rendered_scenes(tmp_path):
    """Images in the prompt through TRL's VLM path: 2 steps, every parameter moves, the vision tower's too."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_grpo_ext.testing import load_tiny_vlm, tiny_vlm_processor_class

    path, processor = load_tiny_vlm(tmp_path / "vlm")
    assert type(AutoProcessor.from_pretrained(path)) is tiny_vlm_processor_class()  # not the bare tokenizer
    model = AutoModelForImageTextToText.from_pretrained(path)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = driving_dataset(4, images=True, image_size=56, seed=0)
    args = make_config(tmp_path, NoRDConfig, per_device_train_batch_size=2, num_generations=2, max_steps=2)
    trainer = NoRDTrainer(model, [get_reward("trajectory"), varied_reward], args=args, train_dataset=data,
                          processing_class=processor)  # fmt: skip
    trainer.train()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    visual = {name for name in before if "visual" in name}
    assert visual and visual <= changed
    assert len(changed) == len(before)
    assert any("difficulty/mass_hard_unscaled" in entry for entry in trainer.state.log_history)


def test_difficulty_record_is_strict_json():
    """A group with one scored row has no std (NaN, as TRL's nanstd): the record writes it as null."""
    import json

    from trl_grpo_ext.methods.nord import _json_safe

    groups = [{"std": float("nan"), "mean": 0.5, "rows": [1.0, float("inf")]}]
    assert json.loads(json.dumps(_json_safe(groups), allow_nan=False)) == [
        {"std": None, "mean": 0.5, "rows": [1.0, None]}
    ]
