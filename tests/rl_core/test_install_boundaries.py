"""rl_core must import with nothing but torch and numpy: no ray, transformers or sibling package."""

import subprocess
import sys

FORBIDDEN = ["ray", "transformers", "vllm", "sglang", "deepspeed", "megatron", "rl_engines", "rl_replay", "rl_ckpt"]


def test_importing_every_module_pulls_no_heavy_package():
    code = (
        "import pkgutil, sys, importlib, rl_core\n"
        "for m in pkgutil.walk_packages(rl_core.__path__, 'rl_core.'):\n"
        "    importlib.import_module(m.name)\n"
        f"bad = [n for n in {FORBIDDEN!r} if n in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
