"""docs/rlvr-config-reference.md is generated from the config dataclasses and must match them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from apps.agentic.config import AgenticConfig, RewardNormalization
from apps.agentic.config_reference import agentic_reference
from apps.agentic.env_sections import EnvManagerConfig, EnvSpec
from apps.common.config_reference import field_docs
from apps.rlvr.config import RLVRConfig
from apps.rlvr.config_reference import reference
from rl_engines.config import GeneratingArgs, TrainingArgs, WorkerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "rlvr-config-reference.md"
AGENTIC_DOC = DOC.with_name("agentic-config-reference.md")


def test_the_reference_in_docs_is_up_to_date():
    assert DOC.read_text() == reference(), (
        "docs/rlvr-config-reference.md is stale: run `python -m apps.rlvr.config_reference > "
        "docs/rlvr-config-reference.md`"
    )


def test_the_agentic_reference_in_docs_is_up_to_date():
    assert AGENTIC_DOC.read_text() == agentic_reference(), (
        "docs/agentic-config-reference.md is stale: run `python -m apps.agentic.config_reference > "
        "docs/agentic-config-reference.md`"
    )
    assert "| `group_size` | int | `1` | Environments per group. |" in agentic_reference()


def test_every_key_has_its_documentation_line():
    for cls in (
        RLVRConfig,
        WorkerConfig,
        TrainingArgs,
        GeneratingArgs,
        AgenticConfig,
        EnvManagerConfig,
        EnvSpec,
        RewardNormalization,
    ):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: fields without a doc line: {missing}"


def test_a_row_shows_type_default_and_meaning():
    assert "| `async_generation_ratio` | float | `0.0` | Batches generation may run ahead" in reference()
