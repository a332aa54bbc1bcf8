"""Enforce the package boundaries of STYLE.md by reading every import statement (no code is imported).

apps -> rl_engines -> rl_core; rl_replay and rl_ckpt import no sibling; nothing imports apps.
rl_core may import only torch, numpy and the standard library. Heavy engines are allowed in rl_engines only
inside its adapter modules: ``strategies/<engine>*.py`` or ``strategies/<engine>/`` (``ADAPTER_IMPORTS``).
Inside apps, the pipelines are siblings on apps.common: apps.common imports neither app, and apps.rlvr and
apps.agentic do not import each other (``APP_FORBIDDEN``). Exit 1 listing every violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)
SIBLINGS = {"rl_core", "rl_replay", "rl_ckpt", "rl_engines", "apps"}

# package import name -> (source dir, third-party top-level modules it may import)
RULES: dict[str, tuple[str, set[str]]] = {
    "rl_core": ("packages/rl-core/src/rl_core", {"torch", "numpy"}),
    "rl_replay": ("packages/rl-replay/src/rl_replay", {"numpy", "safetensors", "torch", "tensorboard"}),
    "rl_ckpt": ("packages/rl-ckpt/src/rl_ckpt", {"torch", "safetensors", "numpy", "transformers", "megatron"}),
    "rl_engines": ("packages/rl-engines/src/rl_engines", {"torch", "numpy", "ray", "transformers", "tokenizers"}),
}
# Which sibling packages each package may import (itself always allowed).
ALLOWED_SIBLINGS: dict[str, set[str]] = {
    "rl_core": set(),
    "rl_replay": set(),
    "rl_ckpt": set(),
    "rl_engines": {"rl_core"},
}

# rl_engines adapter modules: an engine (or rl_ckpt's Megatron <-> HF mapping) is importable only from
# rl_engines/strategies/<prefix>*.py or rl_engines/strategies/<prefix>/... (peft: the LoRA module)
ADAPTER_IMPORTS: dict[str, str | tuple[str, ...]] = {
    "deepspeed": "deepspeed",
    "megatron": "megatron",
    "rl_ckpt": "megatron",
    "vllm": "vllm",
    "sglang": "sglang",
    "peft": "lora",
    "safetensors": ("vllm", "lora"),  # PEFT adapter files (vLLM and peft depend on safetensors)
}


# apps package -> the apps packages it must not import (what both apps share lives in apps.common)
APP_FORBIDDEN: dict[str, tuple[str, ...]] = {
    "apps.common": ("apps.rlvr", "apps.agentic"),
    "apps.rlvr": ("apps.agentic",),
    "apps.agentic": ("apps.rlvr",),
}


def adapter_allows(package: str, path: Path, module: str) -> bool:
    """Whether ``path`` (inside ``package``) is the adapter module that may import the engine ``module``."""
    prefix = ADAPTER_IMPORTS.get(module)
    if package != "rl_engines" or prefix is None:
        return False
    relative = path.relative_to(ROOT / RULES[package][0]).parts
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    return len(relative) >= 2 and relative[0] == "strategies" and relative[1].startswith(prefixes)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) for every absolute import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def imported_names(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``, code of the package ``package``: relative imports resolved,
    and ``from a import b`` giving ``a.b`` as well as ``a`` (``b`` may be a module)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(name for name in (base, node.module or "") if name)
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def app_violations(package: str, source: str, where: str) -> list[str]:
    """The imports of ``source`` (code of ``package``, e.g. apps.agentic) that ``APP_FORBIDDEN`` rules out."""
    forbidden = next((banned for app, banned in APP_FORBIDDEN.items() if f"{package}.".startswith(f"{app}.")), ())
    hits: dict[int, str] = {}  # line -> the forbidden package it imports (once per statement)
    for line, name in imported_names(ast.parse(source, filename=where), package):
        hit = next((app for app in forbidden if name == app or name.startswith(f"{app}.")), None)
        if hit is not None:
            hits.setdefault(line, hit)
    return [
        f"{where}:{line}: {package} must not import {hit}; code the apps share belongs in apps.common"
        for line, hit in sorted(hits.items())
    ]


def apps_violations() -> list[str]:
    """``APP_FORBIDDEN`` over every module of apps/."""
    problems = []
    for path in sorted((ROOT / "apps").rglob("*.py")):
        relative = path.relative_to(ROOT)
        package = ".".join(relative.parent.parts)
        problems += app_violations(package, path.read_text(encoding="utf-8"), str(relative))
    return problems


def violations_of(package: str) -> list[str]:
    src, third_party = RULES[package]
    root = ROOT / src
    if not root.is_dir():
        return []
    allowed = STDLIB | third_party | {package} | ALLOWED_SIBLINGS[package]
    problems = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imported_modules(path):
            if module not in allowed and not adapter_allows(package, path, module):
                kind = "sibling package" if module in SIBLINGS else "third-party module"
                problems.append(f"{path.relative_to(ROOT)}:{line}: {package} must not import {kind} '{module}'")
    return problems


def main() -> int:
    problems = [p for package in RULES for p in violations_of(package)] + apps_violations()
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} import boundary violation(s); see STYLE.md 'Package boundaries'")
        return 1
    checked = [name for name, (src, _) in RULES.items() if (ROOT / src).is_dir()]
    print(f"import boundaries OK for {', '.join([*checked, *APP_FORBIDDEN])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
