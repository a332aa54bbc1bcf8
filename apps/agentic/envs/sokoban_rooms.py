"""Sokoban rooms: the move rule, generation by reverse play (solvable by construction) and a BFS solver.

Generation follows gym-sokoban (Schrader 2018; the rooms of "Imagination-Augmented Agents", Weber et al. 2017):
carve a connected floor by a random walk inside the walls, put every box on its target and the player on another
floor cell, then play ``search_depth`` random moves *backwards*: the player steps, and a box right behind the
player is pulled along. Every pull is a push played in reverse, so the room is solvable in at most
``search_depth`` moves. Of ``REVERSE_PLAYS`` such plays the one leaving the boxes farthest from the targets is
kept. A room where every box ended back on a target is rejected and drawn again from a seed derived from the reset
seed (attempt ``k`` uses ``default_rng([seed, k])``), so one seed gives one room.

Cell codes (ROLL's ``room_state`` / ``grid_lookup`` keys): 0 wall, 1 floor, 2 target, 3 box on target, 4 box,
5 player, 6 player on target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
Cell = tuple[int, int]
MOVES: dict[str, Cell] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
"""Action name -> (row, column) step, in ROLL's action order (numbers 1..4)."""
TURN_PROBABILITY = 0.35
"""Chance that the carving walk changes direction at each step."""
BRUSHES: tuple[tuple[Cell, ...], ...] = (
    ((0, 0),),
    ((0, 0), (0, 1)),
    ((0, 0), (1, 0)),
    ((0, 0), (0, 1), (1, 0), (1, 1)),
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
)
"""Floor shapes the carving walk stamps (all connected to the walk's cell)."""
REVERSE_PLAYS = 16
"""Reverse plays per carved room; the one leaving the boxes farthest from the targets is kept (gym-sokoban
likewise keeps the best-scoring reverse play)."""
MAX_ATTEMPTS = 1000
"""Rooms drawn per seed before giving up (a room is redrawn when it is too small or ends solved)."""


@dataclass(frozen=True)
class Room:
    """One Sokoban state. Walls and targets are fixed; boxes and the player move. Cells are (row, column)."""

    shape: tuple[int, int]
    walls: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell

    @property
    def solved(self) -> bool:
        return self.boxes <= self.targets

    def boxes_on_targets(self) -> int:
        return len(self.boxes & self.targets)

    def is_wall(self, cell: Cell) -> bool:
        """A wall, or outside the room."""
        return cell in self.walls or not (0 <= cell[0] < self.shape[0] and 0 <= cell[1] < self.shape[1])

    def moved(self, delta: Cell) -> Room:
        """The room after the player moves by ``delta``: into floor, or pushing one box into floor. Blocked moves
        (a wall, or a box with a wall or another box behind it) return the room unchanged."""
        ahead = (self.player[0] + delta[0], self.player[1] + delta[1])
        if self.is_wall(ahead):
            return self
        if ahead in self.boxes:
            beyond = (ahead[0] + delta[0], ahead[1] + delta[1])
            if self.is_wall(beyond) or beyond in self.boxes:
                return self
            return replace(self, boxes=(self.boxes - {ahead}) | {beyond}, player=ahead)
        return replace(self, player=ahead)

    def state(self) -> npt.NDArray[np.int8]:
        """The cell codes ``[H, W]`` (``room_state``)."""
        codes = np.full(self.shape, FLOOR, dtype=np.int8)
        for cells, code in ((self.walls, WALL), (self.targets, TARGET), (self.boxes, BOX)):
            for cell in cells:
                codes[cell] = code
        for cell in self.boxes & self.targets:
            codes[cell] = BOX_ON_TARGET
        codes[self.player] = PLAYER_ON_TARGET if self.player in self.targets else PLAYER
        return codes

    @classmethod
    def from_state(cls, room_state: npt.NDArray[np.integer]) -> Room:
        """Inverse of :meth:`state`."""

        def cells(*codes: int) -> frozenset[Cell]:
            return frozenset((int(r), int(c)) for r, c in np.argwhere(np.isin(room_state, codes)))

        height, width = room_state.shape
        players = cells(PLAYER, PLAYER_ON_TARGET)
        if len(players) != 1:
            raise ValueError(f"room_state must hold exactly one player (code 5 or 6), found {len(players)}")
        return cls(
            shape=(height, width),
            walls=cells(WALL),
            targets=cells(TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET),
            boxes=cells(BOX, BOX_ON_TARGET),
            player=next(iter(players)),
        )


def generate_room(dim_room: tuple[int, int], num_boxes: int, search_depth: int, seed: int) -> Room:
    """A solvable, unsolved room of ``dim_room`` (rows, columns) with ``num_boxes`` boxes; same seed, same room."""
    if seed < 0:
        raise ValueError(f"reset seed must be >= 0, got {seed}")
    for attempt in range(MAX_ATTEMPTS):
        room = _attempt_room(np.random.default_rng([seed, attempt]), dim_room, num_boxes, search_depth)
        if room is not None:
            return room
    raise RuntimeError(
        f"no Sokoban room with {num_boxes} box(es) in dim_room={dim_room} after {MAX_ATTEMPTS} attempts "
        f"(seed {seed}); raise env_config.dim_room or env_config.search_depth, or lower env_config.num_boxes."
    )


def _attempt_room(
    rng: np.random.Generator, dim_room: tuple[int, int], num_boxes: int, search_depth: int
) -> Room | None:
    floor_map = _carve_floor(rng, dim_room)
    floor = [(int(r), int(c)) for r, c in np.argwhere(floor_map)]
    if len(floor) < num_boxes + 2:
        return None
    chosen = [floor[i] for i in rng.choice(len(floor), size=num_boxes + 1, replace=False)]
    walls = frozenset((int(r), int(c)) for r, c in np.argwhere(~floor_map))
    targets = frozenset(chosen[:num_boxes])
    solved = Room(dim_room, walls, targets, boxes=targets, player=chosen[num_boxes])
    candidates = [_reverse_play(rng, solved, search_depth) for _ in range(REVERSE_PLAYS)]
    room = max(candidates, key=_box_distance)
    return None if room.solved else room


def _box_distance(room: Room) -> int:
    """Sum over boxes of the Manhattan distance to the nearest target (how far the reverse play took them)."""
    return sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in room.targets) for b in room.boxes)


def _carve_floor(rng: np.random.Generator, dim_room: tuple[int, int]) -> npt.NDArray[np.bool_]:
    """``[H, W]`` True where floor: a random walk inside the outer wall ring stamping small brushes."""
    height, width = dim_room
    floor = np.zeros(dim_room, dtype=bool)
    deltas = list(MOVES.values())
    row, col = int(rng.integers(1, height - 1)), int(rng.integers(1, width - 1))
    delta = deltas[int(rng.integers(4))]
    for _ in range(int(1.5 * (height + width))):
        if rng.random() < TURN_PROBABILITY:
            delta = deltas[int(rng.integers(4))]
        row = min(max(row + delta[0], 1), height - 2)
        col = min(max(col + delta[1], 1), width - 2)
        for d_row, d_col in BRUSHES[int(rng.integers(len(BRUSHES)))]:
            floor[min(max(row + d_row, 1), height - 2), min(max(col + d_col, 1), width - 2)] = True
    return floor


def _reverse_play(rng: np.random.Generator, room: Room, search_depth: int) -> Room:
    """``search_depth`` random reverse moves: the player steps into free floor and pulls a box from behind."""
    deltas = list(MOVES.values())
    for _ in range(search_depth):
        delta = deltas[int(rng.integers(4))]
        ahead = (room.player[0] + delta[0], room.player[1] + delta[1])
        if room.is_wall(ahead) or ahead in room.boxes:
            continue
        behind = (room.player[0] - delta[0], room.player[1] - delta[1])
        boxes = (room.boxes - {behind}) | {room.player} if behind in room.boxes else room.boxes
        room = replace(room, boxes=boxes, player=ahead)
    return room


def solve(room_state: Room | npt.NDArray[np.integer], max_depth: int) -> list[str] | None:
    """A shortest action sequence that puts every box on a target, by breadth-first search over (player, boxes)
    up to ``max_depth`` moves; None when there is none that short. Exponential in general: for small rooms."""
    room = room_state if isinstance(room_state, Room) else Room.from_state(room_state)
    if room.solved:
        return []
    parents: dict[Room, tuple[Room, str] | None] = {room: None}
    frontier = [room]
    for _ in range(max_depth):
        following: list[Room] = []
        for current in frontier:
            for name, delta in MOVES.items():
                after = current.moved(delta)
                if after in parents:
                    continue
                parents[after] = (current, name)
                if after.solved:
                    return _path(parents, after)
                following.append(after)
        frontier = following
    return None


def _path(parents: dict[Room, tuple[Room, str] | None], end: Room) -> list[str]:
    actions: list[str] = []
    link = parents[end]
    while link is not None:
        actions.append(link[1])
        link = parents[link[0]]
    return actions[::-1]


def render_text(room_state: npt.NDArray[np.integer], grid_lookup: dict[int, str]) -> str:
    """Rows of symbols, one line per row."""
    return "\n".join("".join(grid_lookup[int(code)] for code in row) for row in room_state)
