"""FrozenLake: maps and slippery dynamics reproducible from the reset seed; goal, hole, edge and format-penalty
steps on gymnasium's fixed 4x4 map (SFFF / FHFH / FFFH / HFFG)."""

from __future__ import annotations

import numpy as np
import pytest

from apps.agentic.envs import EnvConfigError, FrozenLakeEnv, make_env
from apps.agentic.envs.draw import CELL_PX
from apps.agentic.envs.frozen_lake import COLORS, HOLE, PLAYER


def lake(**env_config: object) -> FrozenLakeEnv:
    env = make_env("frozen_lake", env_config)
    assert isinstance(env, FrozenLakeEnv)
    return env


def answer(action: str) -> str:
    return f"<answer>{action}</answer>"


def test_random_map_comes_from_the_seed():
    first, second = lake(size=5), lake(size=5)
    assert first.reset(4) == second.reset(4)
    rows = first.reset(4).splitlines()
    assert len(rows) == 5 and all(len(row) == 5 for row in rows)
    assert rows[0][0] == "P" and rows[-1][-1] == "G"
    assert len({first.reset(seed) for seed in range(20)}) >= 10


def test_fixed_map_reaches_the_goal():
    env = lake(map_name="4x4", max_steps=10, is_slippery=False)
    assert env.reset(0) == "P___\n_O_O\n___O\nO__G"
    results = [env.step(answer(a)) for a in ("Right", "Right", "Down", "Down", "Down", "Right")]
    assert [r.reward for r in results] == [0.0] * 5 + [1.0]
    assert [r.terminated for r in results] == [False] * 5 + [True]
    assert results[-1].info["success"] and not results[-1].truncated
    assert results[-1].observation == "____\n_O_O\n___O\nO__*"


def test_hole_terminates_without_success():
    env = lake(map_name="4x4", is_slippery=False)
    env.reset(0)
    env.step(answer("Right"))
    fall = env.step(answer("Down"))
    assert fall.terminated and not fall.info["success"] and fall.reward == 0.0
    assert fall.observation.splitlines()[1] == "_X_O"
    with pytest.raises(RuntimeError, match="reset"):
        env.step(answer("Up"))


def test_edge_moves_and_unparsable_answers_keep_the_state():
    env = lake(map_name="4x4", max_steps=2, is_slippery=False, format_penalty=-0.01)
    start = env.reset(0)
    edge = env.step("<answer> left </answer>")
    assert edge.observation == start and edge.info["action_is_valid"] and not edge.info["action_is_effective"]
    garbage = env.step("left")
    assert garbage.observation == start and garbage.reward == pytest.approx(-0.01)
    assert not garbage.info["action_is_valid"] and garbage.truncated and not garbage.terminated


def test_number_answers_use_gymnasium_order():
    env = lake(map_name="4x4", is_slippery=False)
    env.reset(0)
    assert env.step(answer("2")).info["action"] == "Down"  # 1 Left, 2 Down, 3 Right, 4 Up
    assert env.position == (1, 0)


def test_slippery_dynamics_are_seeded_by_reset():
    actions = [answer(a) for a in ("Down", "Right", "Down", "Right", "Down", "Right")] * 3

    def play(seed: int) -> list[str]:
        env = lake(map_name="8x8", is_slippery=True, max_steps=100)
        frames = [env.reset(seed)]
        for text in actions:
            result = env.step(text)
            frames.append(result.observation)
            if result.terminated:
                break
        return frames

    assert play(3) == play(3)
    assert len({tuple(play(seed)) for seed in range(8)}) > 1
    first_moves = set()
    for seed in range(30):
        env = lake(map_name="4x4", is_slippery=True)
        env.reset(seed)
        env.step(answer("Down"))
        first_moves.add(env.position)
    assert first_moves - {(1, 0)}, "slippery ice never slipped in 30 seeds"


def test_not_slippery_is_deterministic_across_seeds():
    for seed in range(10):
        env = lake(size=4, is_slippery=False)
        env.reset(seed)
        env.step(answer("Down"))
        assert env.position == (1, 0)


def test_rgb_render_marks_the_player_and_holes():
    env = lake(map_name="4x4")
    env.reset(0)
    image = env.render("rgb_array")
    assert isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.shape == (4 * CELL_PX, 4 * CELL_PX, 3)
    half = CELL_PX // 2
    assert tuple(image[half, half]) == COLORS[PLAYER][1]  # player marker at (0, 0)
    assert tuple(image[CELL_PX + half, CELL_PX + half]) == COLORS[HOLE][0]  # hole at (1, 1)


def test_instructions_name_symbols_actions_and_format():
    text = lake(is_slippery=True).instructions
    for needed in ("P: player", "O: hole", "G: goal", "_: frozen", "Left (1)", "Up (4)", "<answer>", "slippery"):
        assert needed in text
    assert "slippery" not in lake(is_slippery=False).instructions


def test_keys_left_out_mean_what_they_mean_in_roll():
    """ROLL's FrozenLakeEnv constructor defaults: a 4 x 4 random map (p 0.8) of slippery ice, truncated after 20
    steps, no penalty for a malformed answer (the files ROLL ships set their own)."""
    env = lake()
    config = env.config
    assert (config.size, config.p, config.is_slippery, config.max_steps) == (4, 0.8, True, 20)
    assert "slippery" in env.instructions
    env.reset(0)
    results = [env.step("no answer") for _ in range(20)]
    assert [r.reward for r in results] == [0.0] * 20 and results[-1].truncated and not results[-2].truncated


@pytest.mark.parametrize(
    ("env_config", "named"),
    [
        ({"map_name": "5x5"}, "env_config.map_name"),
        ({"p": 0.0}, "env_config.p"),
        ({"size": 1}, "env_config.size"),
        ({"is_slippery": "yes"}, "env_config.is_slippery"),
    ],
)
def test_bad_frozen_lake_settings_name_the_key(env_config, named):
    with pytest.raises(EnvConfigError, match=named.replace(".", r"\.")):
        make_env("frozen_lake", env_config)
