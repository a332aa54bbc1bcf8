"""Session-scoped tiny HF models shared by the rl_ckpt tests (each is built once, in a few hundred ms)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ckpt_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """``tiny_hf(family, tied)`` -> folder of a saved tiny random model (cached per session)."""
    cache: dict[tuple[str, bool], Path] = {}

    def get(family: str = "qwen2", tied: bool = False) -> Path:
        if (family, tied) not in cache:
            path = tmp_path_factory.mktemp(f"hf_{family}_{'tied' if tied else 'untied'}")
            cache[family, tied] = save_tiny_model(path, family, tied)
        return cache[family, tied]

    return get
