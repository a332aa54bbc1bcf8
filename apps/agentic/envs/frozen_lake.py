"""FrozenLake as a text environment (``env_type: frozen_lake``), wrapping gymnasium's ``FrozenLakeEnv``.

The map comes from the reset seed (``generate_random_map(size, p, seed)``; a valid path to the goal always
exists) unless ``map_name`` picks one of gymnasium's fixed maps; the start is the top-left cell. The slippery
dynamics draw from a generator seeded by the reset seed too, so one seed gives one map and, for the same actions,
one trajectory: the environments of a group (one seed) start identical. Reward 1 on reaching the goal (terminated,
success); falling into a hole terminates without success; every other step gives 0.

Text render, one line per row::

    P player   _ frozen   O hole   G goal   X player in a hole   * player on the goal
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from gymnasium.envs.toy_text.frozen_lake import MAPS, generate_random_map
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

from apps.agentic.envs.actions import ANSWER_PATTERN, ActionParser
from apps.agentic.envs.base import ENV_TYPES, Frame, StepResult, check_common_fields, invalid_action_result
from apps.agentic.envs.draw import RGB, grid_image
from apps.agentic.envs.env_config import EnvConfigError

ACTIONS = ("Left", "Down", "Right", "Up")
"""Action names in gymnasium's order (action ids 0..3; numbers 1..4 in answers)."""
FROZEN, HOLE, GOAL, PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL = range(6)
SYMBOLS = {FROZEN: "_", HOLE: "O", GOAL: "G", PLAYER: "P", PLAYER_IN_HOLE: "X", PLAYER_ON_GOAL: "*"}
WORDS = {FROZEN: "frozen", HOLE: "hole", GOAL: "goal", PLAYER: "player", PLAYER_IN_HOLE: "player in a hole",
         PLAYER_ON_GOAL: "player on the goal"}  # fmt: skip
COLORS: dict[int, tuple[RGB, RGB | None]] = {
    FROZEN: ((200, 230, 250), None),
    HOLE: ((20, 40, 90), None),
    GOAL: ((60, 180, 75), None),
    PLAYER: ((200, 230, 250), (220, 60, 60)),
    PLAYER_IN_HOLE: ((20, 40, 90), (220, 60, 60)),
    PLAYER_ON_GOAL: ((60, 180, 75), (220, 60, 60)),
}
"""Cell code -> (fill, centre marker) of the ``rgb_array`` render."""
MAP_LETTERS = {"S": FROZEN, "F": FROZEN, "H": HOLE, "G": GOAL}
"""gymnasium's map letters -> cell codes (the start is frozen ice)."""


@dataclass(frozen=True)
class FrozenLakeConfig:
    """``env_config`` of ``env_type: frozen_lake``: ROLL's FrozenLakeEnv keys, each defaulting as there (its
    constructor's defaults: a key a file leaves out means what it means in ROLL)."""

    size: int = 4
    """Side of the random map (ignored when map_name is set)."""
    p: float = 0.8
    """Probability that a cell of the random map is frozen rather than a hole."""
    is_slippery: bool = True
    """Slippery ice: the move goes in the chosen direction 1/3 of the time, else to one of the two perpendicular."""
    map_name: str | None = None
    """gymnasium's fixed map ("4x4" or "8x8") instead of a random one per seed."""
    max_steps: int = 20
    """Steps (valid or not) before the episode is truncated."""
    action_pattern: str = ANSWER_PATTERN
    """Regex finding the action in the response; its last group is the action."""
    format_penalty: float = 0.0
    """Reward of a step whose response holds no valid action (<= 0)."""
    env_instruction: str | None = None
    """Replaces the opening task description of the instructions (symbols, actions and format still follow)."""
    render_mode: str = "text"
    """What an observation is (ROLL's key): ``text`` (the symbol grid) or ``rgb_array`` (the picture of the grid,
    which the vision-language env manager, VLTrajEnvManager, puts into the conversation as an image)."""

    def __post_init__(self) -> None:
        check_common_fields(self.max_steps, self.format_penalty, self.render_mode)
        if self.size < 2:
            raise EnvConfigError(f"env_config.size must be >= 2, got {self.size}.")
        if not 0.0 < self.p <= 1.0:
            raise EnvConfigError(f"env_config.p (frozen-cell probability) must be in (0, 1], got {self.p}.")
        if self.map_name is not None and self.map_name not in MAPS:
            raise EnvConfigError(f"env_config.map_name={self.map_name!r} is not a gymnasium map; use {sorted(MAPS)}.")


@ENV_TYPES.register("frozen_lake")
class FrozenLakeEnv:
    """One FrozenLake episode at a time; ``reset(seed)`` draws the map (and slippery dynamics) of that seed."""

    config_cls: ClassVar[type[FrozenLakeConfig]] = FrozenLakeConfig

    def __init__(self, config: FrozenLakeConfig | None = None) -> None:
        self.config = config or FrozenLakeConfig()
        self.parser = ActionParser.build(self.config.action_pattern, ACTIONS)
        self._lake: GymFrozenLake | None = None
        self._steps = 0
        self._done = False

    @property
    def lake(self) -> GymFrozenLake:
        """The wrapped gymnasium environment (after ``reset``)."""
        if self._lake is None:
            raise RuntimeError("FrozenLakeEnv has no map yet; call reset(seed) first")
        return self._lake

    @property
    def position(self) -> tuple[int, int]:
        """The player's (row, column)."""
        row, col = divmod(int(self.lake.s), int(self.lake.ncol))
        return row, col

    def reset(self, seed: int) -> str:
        if seed < 0:
            raise ValueError(f"reset seed must be >= 0, got {seed}")
        cfg = self.config
        desc = MAPS[cfg.map_name] if cfg.map_name else generate_random_map(size=cfg.size, p=cfg.p, seed=seed)
        self._lake = GymFrozenLake(desc=desc, is_slippery=cfg.is_slippery)
        dynamics_seed = int(np.random.SeedSequence([seed, 1]).generate_state(1)[0])
        self._lake.reset(seed=dynamics_seed)
        self._steps, self._done = 0, False
        return self.render_text()

    def step(self, action_text: str) -> StepResult:
        if self._done:
            raise RuntimeError("the FrozenLake episode has ended (terminated or truncated); call reset(seed)")
        lake = self.lake
        self._steps += 1
        out_of_steps = self._steps >= self.config.max_steps
        action = self.parser.parse(action_text)
        if action is None:
            result = invalid_action_result(self.render_text(), self.config.format_penalty, out_of_steps)
        else:
            before = int(lake.s)
            _, reward, terminated, _, _ = lake.step(ACTIONS.index(action))  # type: ignore[no-untyped-call]
            success = bool(terminated) and float(reward) > 0
            info = {"action_is_valid": True, "action_is_effective": int(lake.s) != before, "success": success,
                    "action": action}  # fmt: skip
            done = bool(terminated)
            result = StepResult(self.render_text(), float(reward), done, out_of_steps and not done, info)
        self._done = result.terminated or result.truncated
        return result

    def cell_codes(self) -> npt.NDArray[np.int8]:
        """``[H, W]`` cell codes (FROZEN, HOLE, GOAL, PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL)."""
        letters: list[list[str]] = np.asarray(self.lake.desc).astype(str).tolist()
        codes = np.array([[MAP_LETTERS[letter] for letter in row] for row in letters], dtype=np.int8)
        player = {FROZEN: PLAYER, HOLE: PLAYER_IN_HOLE, GOAL: PLAYER_ON_GOAL}
        codes[self.position] = player[int(codes[self.position])]
        return codes

    def render_text(self) -> str:
        """The map as symbol rows (the observation)."""
        return "\n".join("".join(SYMBOLS[int(code)] for code in row) for row in self.cell_codes())

    def render(self, mode: str = "text") -> Frame:
        if mode == "text":
            return self.render_text()
        if mode == "rgb_array":
            return grid_image(self.cell_codes(), COLORS)
        raise ValueError(f"unknown render mode {mode!r}; FrozenLakeEnv renders 'text' or 'rgb_array'")

    @property
    def instructions(self) -> str:
        symbols = ", ".join(f"{SYMBOLS[code]}: {WORDS[code]}" for code in SYMBOLS)
        slippery = (
            "The ice is slippery: a move goes the chosen way only 1/3 of the time, otherwise to one side. "
            if self.config.is_slippery
            else ""
        )
        task = self.config.env_instruction or (
            "You are walking on a frozen lake. Reach the goal G without falling into a hole O. "
            f"{slippery}Moving into the edge of the map leaves you where you are."
        )
        return (
            f"{task}\n"
            f"The grid is shown row by row, top row first. Symbols: {symbols}.\n"
            f"Valid actions (name or number): {self.parser.describe_actions()}. One action per turn.\n"
            "Rewards: 1 for reaching the goal, 0 otherwise.\n"
            f"{self.parser.describe_format()}"
        )

    def close(self) -> None:
        if self._lake is not None:
            self._lake.close()  # type: ignore[no-untyped-call]
