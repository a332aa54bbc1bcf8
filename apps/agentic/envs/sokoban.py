"""Sokoban as a text environment (``env_type: sokoban``): push every box onto a target.

Rooms come from :mod:`apps.agentic.envs.sokoban_rooms` (reverse play: solvable by construction, one room per
seed). Rewards follow gym-sokoban / ROLL: -0.1 per step, +1 for a box pushed onto a target, -1 for a box pushed
off one, +10 when every box is on a target (the episode terminates with success). A response without a valid
action leaves the room unchanged and earns the -0.1 step reward plus ``format_penalty`` (ROLL steps gym-sokoban
with its no-op, then adds the penalty).

Text render, one line per row (ROLL's symbols, with ``*`` instead of ``√`` to stay ASCII)::

    # wall   _ empty floor   O target   * box on target   X box   P player   S player on target

``grid_lookup`` (cell code 0..6 -> symbol) and ``grid_vocab`` (symbol -> word used in the instructions) replace
them, as in ROLL's ``SokobanDifferentGridVocab``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from apps.agentic.envs.actions import ANSWER_PATTERN, ActionParser
from apps.agentic.envs.base import ENV_TYPES, Frame, StepResult, check_common_fields, invalid_action_result
from apps.agentic.envs.draw import RGB, grid_image
from apps.agentic.envs.env_config import EnvConfigError
from apps.agentic.envs.sokoban_rooms import MOVES, Room, generate_room, render_text

DEFAULT_GRID_LOOKUP = {0: "#", 1: "_", 2: "O", 3: "*", 4: "X", 5: "P", 6: "S"}
"""Cell code -> text symbol (codes: see sokoban_rooms)."""
CELL_WORDS = {0: "wall", 1: "empty", 2: "target", 3: "box on target", 4: "box", 5: "player", 6: "player on target"}
"""Cell code -> the word the instructions use, unless ``grid_vocab`` names another."""
STEP_REWARD = -0.1
BOX_ON_TARGET_REWARD = 1.0
SOLVED_REWARD = 10.0
COLORS: dict[int, tuple[RGB, RGB | None]] = {
    0: ((70, 70, 80), None),
    1: ((230, 225, 210), None),
    2: ((240, 170, 170), None),
    3: ((60, 180, 75), (200, 140, 60)),
    4: ((200, 140, 60), None),
    5: ((230, 225, 210), (40, 90, 220)),
    6: ((240, 170, 170), (40, 90, 220)),
}
"""Cell code -> (fill, centre marker) of the ``rgb_array`` render."""


@dataclass(frozen=True)
class SokobanConfig:
    """``env_config`` of ``env_type: sokoban``: ROLL's SokobanEnv keys, each defaulting as there (its constructor's
    defaults: a key a file leaves out means what it means in ROLL)."""

    dim_room: tuple[int, int] = (10, 10)
    """Room size (rows, columns), outer walls included."""
    num_boxes: int = 4
    """Boxes (and targets) in the room."""
    max_steps: int = 20
    """Steps (valid or not) before the episode is truncated."""
    search_depth: int = 300
    """Random reverse moves played from the solved room; a room is solvable in at most this many moves."""
    action_pattern: str = ANSWER_PATTERN
    """Regex finding the action in the response; its last group is the action."""
    format_penalty: float = 0.0
    """Added to the -0.1 step reward of a step whose response holds no valid action (<= 0)."""
    grid_lookup: dict[int, str] | None = None
    """Cell code (0 wall, 1 empty, 2 target, 3 box on target, 4 box, 5 player, 6 player on target) -> symbol."""
    grid_vocab: dict[str, str] | None = None
    """Symbol -> the word the instructions explain it with."""
    env_instruction: str | None = None
    """Replaces the opening task description of the instructions (symbols, actions and format still follow)."""
    render_mode: str = "text"
    """What an observation is (ROLL's key): ``text`` (the symbol grid) or ``rgb_array`` (the picture of the grid,
    which the vision-language env manager, VLTrajEnvManager, puts into the conversation as an image)."""

    def __post_init__(self) -> None:
        check_common_fields(self.max_steps, self.format_penalty, self.render_mode)
        rows, cols = self.dim_room
        if rows < 4 or cols < 4:
            raise EnvConfigError(f"env_config.dim_room must be at least [4, 4] (walls included), got {self.dim_room}.")
        if self.num_boxes < 1 or (rows - 2) * (cols - 2) < self.num_boxes + 2:
            raise EnvConfigError(
                f"env_config.num_boxes={self.num_boxes} does not fit dim_room={self.dim_room}: it must be >= 1 and "
                "leave the player and one more cell free inside the walls."
            )
        if self.search_depth < 1:
            raise EnvConfigError(f"env_config.search_depth must be >= 1, got {self.search_depth}.")
        _check_symbols(self.grid_lookup, self.grid_vocab)


def _check_symbols(grid_lookup: dict[int, str] | None, grid_vocab: dict[str, str] | None) -> None:
    if grid_lookup is not None:
        if sorted(grid_lookup) != list(CELL_WORDS):
            raise EnvConfigError(
                f"env_config.grid_lookup must map every cell code 0..6 to a symbol, got keys {sorted(grid_lookup)}."
            )
        symbols = list(grid_lookup.values())
        if any(not symbol for symbol in symbols) or len(set(symbols)) != len(symbols):
            raise EnvConfigError(f"env_config.grid_lookup symbols must be distinct and non-empty, got {symbols}.")
    known = set((grid_lookup or DEFAULT_GRID_LOOKUP).values())
    unknown = sorted(set(grid_vocab or {}) - known)
    if unknown:
        raise EnvConfigError(
            f"env_config.grid_vocab names symbols {unknown} that grid_lookup does not use; symbols: {sorted(known)}."
        )


@ENV_TYPES.register("sokoban")
class SokobanEnv:
    """One Sokoban episode at a time; ``reset(seed)`` draws the room of that seed."""

    config_cls: ClassVar[type[SokobanConfig]] = SokobanConfig

    def __init__(self, config: SokobanConfig | None = None) -> None:
        self.config = config or SokobanConfig()
        self.parser = ActionParser.build(self.config.action_pattern, list(MOVES))
        self.grid_lookup = self.config.grid_lookup or DEFAULT_GRID_LOOKUP
        self._room: Room | None = None
        self._steps = 0
        self._done = False

    @property
    def room(self) -> Room:
        """The current room (after ``reset``)."""
        if self._room is None:
            raise RuntimeError("SokobanEnv has no room yet; call reset(seed) first")
        return self._room

    @property
    def room_state(self) -> npt.NDArray[np.int8]:
        """Cell codes ``[H, W]`` of the current room (see sokoban_rooms)."""
        return self.room.state()

    def reset(self, seed: int) -> str:
        cfg = self.config
        self._room = generate_room(cfg.dim_room, cfg.num_boxes, cfg.search_depth, seed)
        self._steps, self._done = 0, False
        return self.render_text()

    def reset_to(self, room_state: Room | npt.NDArray[np.integer]) -> str:
        """Start an episode from a given room (a fixed level, a test position) instead of a generated one."""
        self._room = room_state if isinstance(room_state, Room) else Room.from_state(room_state)
        self._steps, self._done = 0, False
        return self.render_text()

    def step(self, action_text: str) -> StepResult:
        if self._done:
            raise RuntimeError("the Sokoban episode has ended (terminated or truncated); call reset(seed)")
        before = self.room
        self._steps += 1
        out_of_steps = self._steps >= self.config.max_steps
        action = self.parser.parse(action_text)
        if action is None:  # ROLL steps gym-sokoban with its no-op: the step reward, then the format penalty
            result = invalid_action_result(self.render_text(), STEP_REWARD + self.config.format_penalty, out_of_steps)
        else:
            after = before.moved(MOVES[action])
            self._room = after
            reward = STEP_REWARD + BOX_ON_TARGET_REWARD * (after.boxes_on_targets() - before.boxes_on_targets())
            reward += SOLVED_REWARD if after.solved else 0.0
            info = {"action_is_valid": True, "action_is_effective": after != before, "success": after.solved,
                    "action": action}  # fmt: skip
            result = StepResult(self.render_text(), reward, after.solved, out_of_steps and not after.solved, info)
        self._done = result.terminated or result.truncated
        return result

    def render_text(self) -> str:
        """The room as symbol rows (the observation)."""
        return render_text(self.room_state, self.grid_lookup)

    def render(self, mode: str = "text") -> Frame:
        if mode == "text":
            return self.render_text()
        if mode == "rgb_array":
            return grid_image(self.room_state, COLORS)
        raise ValueError(f"unknown render mode {mode!r}; SokobanEnv renders 'text' or 'rgb_array'")

    @property
    def instructions(self) -> str:
        vocab = self.config.grid_vocab or {}
        symbols = ", ".join(
            f"{symbol}: {vocab.get(symbol, CELL_WORDS[code])}" for code, symbol in sorted(self.grid_lookup.items())
        )
        task = self.config.env_instruction or (
            "You are solving the Sokoban puzzle. You are the player and must push every box onto a target. "
            "Walking into a box pushes it one cell if the cell behind it is free; you cannot pull boxes, push two "
            "boxes at once or walk through walls."
        )
        return (
            f"{task}\n"
            f"The grid is shown row by row, top row first. Symbols: {symbols}.\n"
            f"Valid actions (name or number): {self.parser.describe_actions()}. One action per turn.\n"
            f"Rewards: {STEP_REWARD} per step, +{BOX_ON_TARGET_REWARD:g} for a box pushed onto a target, "
            f"-{BOX_ON_TARGET_REWARD:g} for one pushed off, +{SOLVED_REWARD:g} when all boxes are on targets.\n"
            f"{self.parser.describe_format()}"
        )

    def close(self) -> None:
        """Nothing to release."""
