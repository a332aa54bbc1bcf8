"""GEM's own environments (``env_type: <family>:<name>``, e.g. ``game:GuessTheNumber-v0``, ``rg:leg_counting``) through
the gem-llm package, made as ROLL makes them: ``gem.make(env_type, **env_config)``.

GEM's environments speak gymnasium's tuple API with text: ``reset(seed) -> (observation, info)``, ``step(response)
-> (observation, reward, terminated, truncated, info)``; ``info["suffix"]`` is the environment's prompt for the
next move ("Enter your next guess."), which ROLL's templates show as ``{suffix}``. :class:`GemEnv` wraps one as a
:class:`~apps.agentic.envs.base.TextEnv`:

- ``env_config`` keys are checked against the environment class's own arguments (GEM's classes take ``**_`` and
  would drop a misspelt key silently); the registered defaults fill the rest.
- GEM reports no action validity or success flag. A step that earns GEM's format-error reward
  (``LanguageGameReward.format_error_reward``: the response held no parsable action) is an invalid action; an
  episode succeeds when it ends on GEM's success reward (``LanguageGameReward.success_reward``, 1.0). GEM parses its
  action out of the response, so a valid step's ``action`` is the response itself.
- GEM's environments draw from Python's and numpy's global generators (``reset`` seeds them). Each ``GemEnv`` keeps
  generators of its own: every call into GEM runs under one lock with the environment's states swapped in and the
  process's restored after, so episodes do not depend on which thread stepped which environment first (ROLL only
  serialises them, ``use_thread_lock``).

Refused, naming what is missing: environments that load a HuggingFace Hub dataset (the ``math:``, ``code:``,
``qa:``, ``eval:`` and ``logic:`` families; ``roll_math`` serves ROLL's GEM math files from a local file) and
Wordle / Hangman, which download NLTK's word list at every start. This machine reaches no Hub and no internet.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, ClassVar

import numpy as np

from apps.agentic.envs.base import Frame, StepResult
from apps.agentic.envs.env_config import EnvConfigError
from apps.common.plots import quiet_matplotlib

GEM_PACKAGE = "gem-llm==0.0.4"
"""The GEM release ROLL pins (its ``game:*-v0`` ids are that release's)."""
NEEDS_DOWNLOAD = {
    "gem.envs.game_env.wordle": "NLTK's words corpus, which it downloads at every start (nltk.download('words'))",
    "gem.envs.game_env.hangman": "NLTK's words corpus, which it downloads at every start (nltk.download('words'))",
}
"""Entry-point modules whose environments fetch data from the internet when made -> what they fetch."""
_GLOBAL_RNG_LOCK = threading.Lock()


def gem_registry() -> dict[str, Any] | None:
    """GEM's environment registry (id -> EnvSpec), or None when gem-llm is not installed."""
    quiet_matplotlib()  # gem imports reasoning-gym, which imports matplotlib: its caches go to the temp dir
    try:
        from gem.envs.registration import ENV_REGISTRY
    except ImportError:
        return None
    import gem.envs  # noqa: F401  # registers GEM's environments

    return dict(ENV_REGISTRY)


def is_gem_id(env_type: str) -> bool:
    """``family:name``: how GEM names its environments."""
    return ":" in env_type


def check_gem_env(env_type: str) -> None:
    """Raise ``EnvConfigError`` naming the package, the id or the data when GEM's ``env_type`` cannot run here."""
    registry = gem_registry()
    if registry is None:
        raise EnvConfigError(
            f"env_type {env_type!r} is one of GEM's own environments (family:name), which run through the gem-llm "
            f"package; it is not installed. Install it with `pip install {GEM_PACKAGE}` (ROLL's version)."
        )
    if env_type not in registry:
        families = sorted({key.split(":", 1)[0] for key in registry})
        raise EnvConfigError(
            f"env_type {env_type!r} is not an environment of {GEM_PACKAGE} (families {families}; e.g. "
            "game:GuessTheNumber-v0, rg:leg_counting). Check the id against gem.envs.registration.ENV_REGISTRY."
        )
    spec = registry[env_type]
    dataset = spec.kwargs.get("dataset_name")
    if dataset is not None:
        raise EnvConfigError(
            f"env_type {env_type!r} loads the HuggingFace Hub dataset {dataset!r}, which this machine cannot reach. "
            "For math questions use env_type roll_math with env_config.dataset_name a local .jsonl file."
        )
    module = str(spec.entry_point).split(":", 1)[0]
    if module in NEEDS_DOWNLOAD:
        raise EnvConfigError(
            f"env_type {env_type!r} needs {NEEDS_DOWNLOAD[module]}; this machine has no internet. Choose another "
            "GEM game (e.g. game:GuessTheNumber-v0, game:Mastermind-v0, game:Sudoku-v0)."
        )


@cache
def gem_env_class(env_type: str) -> type[GemEnv]:
    """A :class:`GemEnv` subclass for ``env_type`` whose ``config_cls`` has the environment class's arguments."""
    check_gem_env(env_type)
    registry = gem_registry()
    assert registry is not None  # checked above
    spec = registry[env_type]
    module, name = str(spec.entry_point).split(":", 1)
    signature = inspect.signature(getattr(importlib.import_module(module), name).__init__)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in list(signature.parameters.values())[1:] if p.kind in keyword]
    fields = [(key, Any, dataclasses.field(default=spec.kwargs.get(key, signature.parameters[key].default)))
              for key in names]  # fmt: skip
    config_cls = dataclasses.make_dataclass(f"GemConfig_{name}", fields, frozen=True)
    return type(f"Gem_{name}", (GemEnv,), {"config_cls": config_cls, "env_id": env_type})


# GEM draws from numpy's legacy global generator, so its state is what is swapped (NPY002: the legacy API on purpose)
def _global_states() -> tuple[Any, Any]:
    return random.getstate(), np.random.get_state()  # noqa: NPY002


def _set_global_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])  # noqa: NPY002


class GemEnv:
    """One GEM environment as a text environment (the module docstring); one subclass per id (``gem_env_class``)."""

    config_cls: ClassVar[type[Any]]
    env_id: ClassVar[str]

    def __init__(self, config: Any) -> None:
        import gem
        from gem.utils.constants import LanguageGameReward

        self.rewards = LanguageGameReward
        self._states = (random.Random(0).getstate(), np.random.RandomState(0).get_state())
        kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        with self._own_generators():
            self.env = gem.make(self.env_id, **kwargs)
        self.observation, self.suffix = "", ""

    @contextmanager
    def _own_generators(self) -> Iterator[None]:
        """Python's and numpy's global generators hold this environment's states for the block."""
        with _GLOBAL_RNG_LOCK:
            process = _global_states()
            _set_global_states(self._states)
            try:
                yield
            finally:
                self._states = _global_states()
                _set_global_states(process)

    def reset(self, seed: int) -> str:
        with self._own_generators():
            observation, info = self.env.reset(seed=seed)
        self.observation, self.suffix = str(observation), str((info or {}).get("suffix", ""))
        return self.observation

    def step(self, action_text: str) -> StepResult:
        with self._own_generators():
            observation, reward, terminated, truncated, info = self.env.step(action_text)
        info = dict(info or {})
        self.observation = str(observation)
        self.suffix = str(info.pop("suffix", self.suffix))
        valid = float(reward) != self.rewards.format_error_reward
        success = bool(terminated) and float(reward) >= self.rewards.success_reward
        action = action_text if valid else None  # GEM parses its action out of the response: a history shows it
        info.update(action_is_valid=valid, action_is_effective=valid, success=success, action=action)
        return StepResult(self.observation, float(reward), bool(terminated), bool(truncated), info)

    def render(self, mode: str = "text") -> Frame:
        """The last observation (GEM's environments are text: ``rgb_array`` gives the text too)."""
        return self.observation

    @property
    def instructions(self) -> str:
        """None: GEM's first observation holds the rules (ROLL: no env_instruction)."""
        return ""

    def close(self) -> None:
        """Nothing to release."""
