"""Our metrics reach TRL's usual reporters, under a prefix per method (here: TensorBoard event files)."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trl_grpo_ext import GRPOExtTrainer
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward


def test_method_metrics_are_written_to_tensorboard(tiny_model_path, tokenizer, tmp_path):
    args = make_config(tmp_path, report_to="tensorboard", max_steps=4, budget_start=16,
                       budget_end=4, budget_caps_generation=True, dynamic_sampling=True)  # fmt: skip
    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                             train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    events = EventAccumulator(str(next(p.parent for p in tmp_path.rglob("events.out.tfevents.*"))))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/curriculum/budget", "train/dynamic_sampling/kept_fraction", "train/reward"} <= tags
    assert [e.value for e in events.Scalars("train/curriculum/budget")] == [16, 10, 6, 4]
