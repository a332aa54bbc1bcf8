"""Grid pictures with numpy only: each cell a coloured square, optionally with a smaller centred square on top
(a box on a target, a player on a goal)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

RGB = tuple[int, int, int]
CELL_PX = 24
"""Pixels per cell side."""


def grid_image(
    codes: npt.NDArray[np.integer], colors: Mapping[int, tuple[RGB, RGB | None]], cell_px: int = CELL_PX
) -> npt.NDArray[np.uint8]:
    """Picture of ``codes`` ``[H, W]``: returns ``[H * cell_px, W * cell_px, 3]`` uint8.

    ``colors[code] = (fill, marker)``: the cell is filled with ``fill``; ``marker`` (when not None) is drawn as a
    centred square half the cell's side. A one-pixel dark border separates cells.
    """
    height, width = codes.shape
    image = np.zeros((height * cell_px, width * cell_px, 3), dtype=np.uint8)
    quarter = cell_px // 4
    for row in range(height):
        for col in range(width):
            fill, marker = colors[int(codes[row, col])]
            top, left = row * cell_px, col * cell_px
            image[top + 1 : top + cell_px - 1, left + 1 : left + cell_px - 1] = fill
            if marker is not None:
                image[top + quarter : top + cell_px - quarter, left + quarter : left + cell_px - quarter] = marker
    return image
