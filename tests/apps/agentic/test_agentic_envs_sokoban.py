"""Sokoban: generated rooms are solvable (independent BFS) and reproducible per seed; push / wall / two-box /
success / truncation rules on hand-built rooms; the grid_lookup / grid_vocab variant."""

from __future__ import annotations

import numpy as np
import pytest

from apps.agentic.envs import EnvConfigError, Room, SokobanEnv, make_env, solve
from apps.agentic.envs.draw import CELL_PX
from apps.agentic.envs.sokoban import COLORS, DEFAULT_GRID_LOOKUP

SYMBOL_CODES = {symbol: code for code, symbol in DEFAULT_GRID_LOOKUP.items()}


def room_from_text(text: str) -> Room:
    rows = text.strip().splitlines()
    return Room.from_state(np.array([[SYMBOL_CODES[symbol] for symbol in row] for row in rows], dtype=np.int8))


def sokoban(**env_config: object) -> SokobanEnv:
    env = make_env("sokoban", env_config)
    assert isinstance(env, SokobanEnv)
    return env


def answer(action: str) -> str:
    return f"<answer>{action}</answer>"


@pytest.mark.parametrize(
    ("dim_room", "num_boxes", "search_depth", "seeds"),
    [((6, 6), 1, 30, 200), ((8, 8), 2, 10, 30), ((10, 10), 2, 10, 30), ((5, 7), 1, 6, 30)],
)
def test_generated_rooms_are_solvable_and_the_solution_scores_as_specified(dim_room, num_boxes, search_depth, seeds):
    env = sokoban(dim_room=list(dim_room), num_boxes=num_boxes, search_depth=search_depth, max_steps=100)
    for seed in range(seeds):
        env.reset(seed)
        state = env.room_state
        assert state.shape == dim_room
        assert (np.isin(state, [3, 4])).sum() == num_boxes  # boxes (on target or not)
        assert (np.isin(state, [5, 6])).sum() == 1  # one player
        border = np.concatenate([state[0], state[-1], state[:, 0], state[:, -1]])
        assert (border == 0).all()
        plan = solve(state, max_depth=search_depth)
        assert plan is not None, f"seed {seed}: no solution within search_depth={search_depth}"
        assert len(plan) >= 1, f"seed {seed}: the room starts solved"
        on_target_before = int((state == 3).sum())
        results = [env.step(answer(action)) for action in plan]
        assert [r.terminated for r in results] == [False] * (len(plan) - 1) + [True]
        assert results[-1].info["success"] and not results[-1].truncated
        expected = -0.1 * len(plan) + (num_boxes - on_target_before) + 10.0
        assert sum(r.reward for r in results) == pytest.approx(expected, abs=1e-9)


def test_same_seed_same_room_and_different_seeds_differ():
    first, second = sokoban(), sokoban()
    assert first.reset(7) == second.reset(7)
    assert first.reset(7) == first.reset(7)
    rooms = {first.reset(seed) for seed in range(20)}
    assert len(rooms) >= 15


def test_push_onto_target_then_off_then_success():
    env = sokoban()
    env.reset_to(room_from_text("#######\n#PXO__#\n#___X_#\n#____O#\n#######"))
    onto = env.step(answer("Right"))
    assert onto.reward == pytest.approx(-0.1 + 1.0)
    assert onto.observation.splitlines()[1] == "#_P*__#"
    assert not onto.terminated and not onto.info["success"]
    off = env.step(answer("Right"))
    assert off.reward == pytest.approx(-0.1 - 1.0)
    assert off.observation.splitlines()[1] == "#__SX_#"  # the player stands on the target
    env.reset_to(room_from_text("#####\n#PXO#\n#####"))
    solved = env.step(answer("Right"))
    assert solved.reward == pytest.approx(-0.1 + 1.0 + 10.0)
    assert solved.terminated and solved.info["success"] and not solved.truncated
    with pytest.raises(RuntimeError, match="reset"):
        env.step(answer("Left"))


@pytest.mark.parametrize(
    ("room", "action"),
    [
        ("#####\n#P_O#\n#X__#\n#####", "Up"),  # wall
        ("#######\n#PXX_O#\n#____O#\n#######", "Right"),  # two boxes in a row
        ("######\n#_PX##\n#O___#\n######", "Right"),  # box against a wall
    ],
)
def test_blocked_moves_leave_the_room_unchanged(room, action):
    env = sokoban()
    before = env.reset_to(room_from_text(room))
    result = env.step(answer(action))
    assert result.observation == before
    assert result.reward == pytest.approx(-0.1)
    assert result.info["action_is_valid"] and not result.info["action_is_effective"]
    assert not result.terminated


def test_max_steps_truncates_and_invalid_actions_count():
    env = sokoban(dim_room=(6, 6), num_boxes=1, search_depth=30, max_steps=3, format_penalty=-0.15)
    start = env.reset(0)
    garbage = env.step("I would go up")
    # ROLL steps gym-sokoban with its no-op (-0.1 per step) and adds format_penalty
    assert garbage.reward == pytest.approx(-0.1 - 0.15)
    assert garbage.observation == start
    assert garbage.info == {"action_is_valid": False, "action_is_effective": False, "success": False, "action": None}
    assert not garbage.truncated
    env.step(answer("Sideways"))
    last = env.step("<answer>Up")
    assert last.truncated and not last.terminated


def test_keys_left_out_mean_what_they_mean_in_roll():
    """ROLL's SokobanEnv constructor defaults: a 10 x 10 room with 4 boxes (300 reverse moves), truncated after 20
    steps, no format penalty (a malformed answer earns the -0.1 step reward alone); its SokobanNativeEnv's: 6 x 6,
    one box, 10 steps, format penalty -0.1."""
    env = sokoban()
    assert (env.config.dim_room, env.config.num_boxes, env.config.search_depth) == ((10, 10), 4, 300)
    rows = env.reset(0).splitlines()
    assert len(rows) == 10 and all(len(row) == 10 for row in rows)
    assert sum(row.count("X") + row.count("*") for row in rows) == 4  # boxes, off or on a target
    results = [env.step("no answer") for _ in range(20)]
    assert [r.reward for r in results] == [pytest.approx(-0.1)] * 20
    assert results[-1].truncated and not results[-2].truncated
    native = make_env("sokoban_native_env").config
    assert (native.dim_room, native.num_boxes, native.max_steps, native.search_depth, native.format_penalty) == (
        (6, 6),
        1,
        10,
        300,
        -0.1,
    )


def test_same_seed_and_actions_give_the_same_trajectory():
    texts = [answer(a) for a in ("Up", "Left", "Down", "Right", "Right", "Up")] + ["junk", answer("down")] * 3

    def play(env: SokobanEnv) -> list[tuple[str, float, bool]]:
        env.reset(11)
        return [(r.observation, r.reward, r.terminated) for r in (env.step(t) for t in texts)]

    assert play(sokoban(max_steps=50)) == play(sokoban(max_steps=50))


def test_rgb_render_paints_cells():
    env = sokoban(dim_room=[6, 7])
    env.reset(3)
    image = env.render("rgb_array")
    assert isinstance(image, np.ndarray)
    assert image.shape == (6 * CELL_PX, 7 * CELL_PX, 3) and image.dtype == np.uint8
    state = env.room_state
    row, col = map(int, np.argwhere(np.isin(state, [5, 6]))[0])
    centre = image[row * CELL_PX + CELL_PX // 2, col * CELL_PX + CELL_PX // 2]
    assert tuple(centre) == COLORS[5][1]  # the player marker
    assert tuple(image[CELL_PX // 2, CELL_PX // 2]) == COLORS[0][0]  # corner wall
    with pytest.raises(ValueError, match="render mode"):
        env.render("human")


GRID_LOOKUP = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}
GRID_VOCAB = {"W": "wall", ".": "empty", "G": "target", "C": "box on target", "B": "box", "A": "player",
              "@": "player on target"}  # fmt: skip


def test_grid_lookup_and_vocab_change_symbols_not_rooms():
    plain = sokoban(search_depth=30)
    custom = sokoban(search_depth=30, grid_lookup=GRID_LOOKUP, grid_vocab=GRID_VOCAB)
    for seed in range(5):
        translated = "".join(GRID_LOOKUP.get(SYMBOL_CODES.get(ch, -1), ch) for ch in plain.reset(seed))
        assert custom.reset(seed) == translated
        assert set(translated) <= set(GRID_LOOKUP.values()) | {"\n"}
    assert "W: wall" in custom.instructions and "@: player on target" in custom.instructions
    assert "#: wall" in plain.instructions and "*: box on target" in plain.instructions


def test_json_style_grid_lookup_keys_are_accepted():
    env = sokoban(grid_lookup={str(code): symbol for code, symbol in GRID_LOOKUP.items()})
    assert env.config.grid_lookup == GRID_LOOKUP


@pytest.mark.parametrize(
    ("env_config", "named"),
    [
        ({"grid_lookup": {0: "W", 1: "."}}, "env_config.grid_lookup"),
        ({"grid_lookup": {**GRID_LOOKUP, 1: "W"}}, "env_config.grid_lookup"),
        ({"grid_vocab": {"Q": "queen"}}, "env_config.grid_vocab"),
        ({"dim_room": [3, 6]}, "env_config.dim_room"),
        ({"dim_room": [4, 4], "num_boxes": 3}, "env_config.num_boxes"),
        ({"search_depth": 0}, "env_config.search_depth"),
        ({"format_penalty": 0.5}, "env_config.format_penalty"),
        ({"max_steps": 0}, "env_config.max_steps"),
    ],
)
def test_bad_sokoban_settings_name_the_key(env_config, named):
    with pytest.raises(EnvConfigError, match=named.replace(".", r"\.")):
        make_env("sokoban", env_config)


def test_solver_finds_the_shortest_plan_or_none():
    room = room_from_text("######\n#P___#\n#_X_O#\n#____#\n######")
    plan = solve(room, max_depth=10)
    assert plan is not None and len(plan) == 3  # Down (to the box's left side), Right, Right
    assert solve(room, max_depth=2) is None
    assert solve(room_from_text("#####\n#XP_#\n#__O#\n#####"), max_depth=20) is None  # box stuck in a corner
