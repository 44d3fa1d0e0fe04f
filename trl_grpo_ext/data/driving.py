"""A synthetic driving set for NoRD-style training: top-down scenes, past trajectory and speed, future waypoints.

Every scene is a straight two-lane road in the ego frame (x forward, y to the left, metres; the ego car at the
origin, driving along +x in lane 0, whose centre is y = 0; lane 1 is centred at y = `LANE_WIDTH`). The ego has
driven at constant speed: its past positions, one every `dt` seconds, lie on y = 0. Two kinds of scene:

- `"cruise"` (easy): the ego lane is free within the horizon; the future keeps speed and lane:
  (v·dt·k, 0) for k = 1..K. Cars may stand in the other lane.
- `"lane_change"` (harder): a car blocks the ego lane just beyond the horizon; the future keeps speed and moves
  into lane 1 along a smooth step, y_k = LANE_WIDTH·(3t² − 2t³) with t = k/K. Driving straight on hits the car.

A row carries `prompt` (a conversational prompt: past positions and speed; in the text-only set also the cars'
positions, which the image shows otherwise), `image` (a rendered top-down view, unless `images=False`), `future`
(the K ground-truth waypoints as [x, y] pairs), `scene` (what the driving score needs: the road's lateral bounds,
the cars as [x, y, radius], the ego radius, `dt`, the speed and the kind) and `kind`. The reward that scores a
completion against `future` and `scene` is `trajectory` (`trl_grpo_ext.methods.nord`).

>>> rows = driving_dataset(2, images=False, seed=0)
>>> rows[0]["kind"], len(rows[0]["future"])
('cruise', 4)
>>> format_waypoints([[1.0, 0.0], [2.0, 0.25]])
'(1.0, 0.0) (2.0, 0.2)'
"""

from __future__ import annotations

import random

from datasets import Dataset

__all__ = [
    "LANE_WIDTH",
    "EGO_RADIUS",
    "CAR_RADIUS",
    "SYSTEM",
    "make_scene",
    "render_scene",
    "format_waypoints",
    "scene_prompt",
    "driving_dataset",
    "driving_sft_dataset",
]

LANE_WIDTH = 3.5
EGO_RADIUS = 1.0
CAR_RADIUS = 1.2
SPEEDS = (1.0, 2.0, 3.0, 4.0)  # m/s: with dt = 0.5 s, 0.5 to 2 m a step (exact with one decimal)
SYSTEM = (
    "You drive the ego car. Coordinates are metres in the ego frame: x forward, y to the left; the ego lane is "
    f"centred at y = 0, the left lane at y = {LANE_WIDTH}. Answer with the next waypoints only, as (x, y) pairs "
    "separated by spaces, one decimal each."
)


def make_scene(rng: random.Random, *, num_past: int = 4, num_future: int = 4, dt: float = 0.5,
               lane_change_fraction: float = 0.5) -> dict:  # fmt: skip
    """One random scene: {past, future, speed, kind, scene}. See the module docstring for the geometry."""
    speed = rng.choice(SPEEDS)
    step = speed * dt
    past = [[round(-step * k, 2) + 0.0, 0.0] for k in range(num_past - 1, -1, -1)]
    horizon = step * num_future
    kind = "lane_change" if rng.random() < lane_change_fraction else "cruise"
    cars = []
    if kind == "lane_change":
        # just beyond the last waypoint: straight on, the last waypoint is 1.5 m from its centre (radii sum 2.2 m)
        cars.append([round(horizon + 1.5, 2), 0.0, CAR_RADIUS])
        future = [[round(step * k, 2), round(LANE_WIDTH * _smoothstep(k / num_future), 1)]
                  for k in range(1, num_future + 1)]  # fmt: skip
    else:
        if rng.random() < 0.5:  # a car ahead, far beyond the horizon, in the ego lane
            cars.append([round(horizon + rng.uniform(6.0, 10.0), 1), 0.0, CAR_RADIUS])
        future = [[round(step * k, 2), 0.0] for k in range(1, num_future + 1)]
    if rng.random() < 0.5:  # a car in the other lane: anywhere when the ego keeps its lane, else well ahead
        low = -4.0 if kind == "cruise" else horizon + 5.0
        cars.append([round(rng.uniform(low, horizon + 8.0), 1), LANE_WIDTH, CAR_RADIUS])
    scene = {"road": [-LANE_WIDTH / 2, 1.5 * LANE_WIDTH], "cars": cars, "ego_radius": EGO_RADIUS, "dt": dt,
             "speed": speed, "kind": kind}  # fmt: skip
    return {"past": past, "future": future, "speed": speed, "kind": kind, "scene": scene}


def _smoothstep(t: float) -> float:
    return 3 * t * t - 2 * t * t * t


def format_waypoints(points) -> str:
    """Waypoints as the documented text format, `(x1, y1) (x2, y2) ...`, one decimal each."""
    return " ".join(f"({x:.1f}, {y:.1f})" for x, y in points)


def scene_prompt(sample: dict, *, with_cars: bool) -> str:
    """The user message for a scene: past positions and speed (and, text-only, where the cars stand)."""
    num_future = len(sample["future"])
    dt = sample["scene"]["dt"]
    text = (f"Past positions, one every {dt} s, the last is now: {format_waypoints(sample['past'])}. "
            f"Speed {sample['speed']:.1f} m/s.")  # fmt: skip
    if with_cars:
        cars = sample["scene"]["cars"]
        where = ", ".join(f"({x:.1f}, {y:.1f})" for x, y, _ in cars) if cars else "none"
        text += f" Cars (radius {CAR_RADIUS} m) at: {where}."
    else:
        text += " The image shows the road from above, ego car in blue, other cars in red."
    return text + f" Give the next {num_future} positions, one every {dt} s."


def render_scene(sample: dict, size: int = 112):
    """A top-down view of the scene as a PIL image (`size` × `size`): road, lane lines, cars, ego and its past.

    The view spans x from −4 m (bottom) to 12 m (top) and y from −5 m (right) to 8 m (left)."""
    from PIL import Image, ImageDraw

    x_range, y_range = (-4.0, 12.0), (-5.0, 8.0)
    sx, sy = size / (x_range[1] - x_range[0]), size / (y_range[1] - y_range[0])

    def pixel(x: float, y: float) -> tuple[float, float]:
        return (y_range[1] - y) * sy, (x_range[1] - x) * sx

    image = Image.new("RGB", (size, size), (60, 130, 60))  # grass
    draw = ImageDraw.Draw(image)
    low, high = sample["scene"]["road"]
    draw.rectangle([pixel(x_range[1], high), pixel(x_range[0], low)], fill=(90, 90, 90))
    for edge in (low, high):
        draw.line([pixel(x_range[0], edge), pixel(x_range[1], edge)], fill=(240, 240, 240), width=1)
    divider = (low + high) / 2
    x = x_range[0]
    while x < x_range[1]:  # dashed centre line
        draw.line([pixel(x, divider), pixel(x + 1.0, divider)], fill=(240, 220, 60), width=1)
        x += 2.0
    for cx, cy, radius in sample["scene"]["cars"]:
        draw.rectangle([pixel(cx + radius, cy + radius * 0.8), pixel(cx - radius, cy - radius * 0.8)],
                       fill=(210, 40, 40))  # fmt: skip
    ego = sample["scene"]["ego_radius"]
    draw.rectangle([pixel(ego, ego * 0.8), pixel(-ego, -ego * 0.8)], fill=(40, 80, 220))
    for px, py in sample["past"][:-1]:
        u, v = pixel(px, py)
        draw.ellipse([u - 1.5, v - 1.5, u + 1.5, v + 1.5], fill=(120, 200, 255))
    return image


def driving_dataset(n: int = 64, *, seed: int = 0, images: bool = True, image_size: int = 112, num_past: int = 4,
                    num_future: int = 4, dt: float = 0.5, lane_change_fraction: float = 0.5,
                    system: str | None = SYSTEM) -> Dataset:  # fmt: skip
    """`n` seeded scenes as a TRL dataset: `prompt`, `future`, `scene`, `kind`, and `image` unless `images=False`.

    With images the prompt gives past positions and speed and the image shows the cars (the VLM setting of NoRD);
    text-only (`images=False`), the prompt also lists where the cars stand, so a text model can drive.
    """
    if n < 1 or num_past < 1 or num_future < 1 or dt <= 0 or not 0 <= lane_change_fraction <= 1:
        raise ValueError(
            f"driving_dataset: n={n}, num_past={num_past}, num_future={num_future} must be >= 1, dt={dt} > 0 and "
            f"lane_change_fraction={lane_change_fraction} in [0, 1]."
        )
    rng = random.Random(seed)
    columns: dict[str, list] = {"prompt": [], "future": [], "scene": [], "kind": []}
    if images:
        columns["image"] = []
    for _ in range(n):
        sample = make_scene(rng, num_past=num_past, num_future=num_future, dt=dt,
                            lane_change_fraction=lane_change_fraction)  # fmt: skip
        head = [{"role": "system", "content": system}] if system else []
        columns["prompt"].append([*head, {"role": "user", "content": scene_prompt(sample, with_cars=not images)}])
        columns["future"].append(sample["future"])
        columns["scene"].append(sample["scene"])
        columns["kind"].append(sample["kind"])
        if images:
            columns["image"].append(render_scene(sample, image_size))
    return Dataset.from_dict(columns)


def driving_sft_dataset(n: int = 64, *, seed: int = 500, **kwargs) -> Dataset:
    """A cold start on the answer format: `n` scenes (seed 500 by default, not the driving task's training or held-out
    seeds) as TRL's prompt-completion rows, the completion the ground-truth waypoints (`format_waypoints`).
    `kwargs` go to `driving_dataset` (`images=False` unless given)."""
    rows = driving_dataset(n, seed=seed, **{"images": False, **kwargs})
    answers = [[{"role": "assistant", "content": format_waypoints(f)}] for f in rows["future"]]
    columns = {"prompt": rows["prompt"], "completion": answers}
    if "image" in rows.column_names:
        columns["image"] = rows["image"]
    return Dataset.from_dict(columns)
