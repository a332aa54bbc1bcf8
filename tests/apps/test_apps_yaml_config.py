"""ROLL-style YAML loading: Hydra defaults, ${} interpolation, key=value overrides, and their errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from apps.common.yaml_config import ConfigFileError, load_config

SHARED = Path(__file__).resolve().parents[3] / "shared" / "roll-examples"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_merge_in_order_with_self_last_unless_placed(tmp_path):
    write(tmp_path, "config/base.yaml", "a: 1\nnested: {x: 1, y: 1}\nonly_base: true\n")
    main = write(tmp_path, "exp/main.yaml", """\
        defaults:
          - ../config/base@_here_
        a: 2
        nested: {y: 2}
        hydra: {run: {dir: .}}
    """)  # fmt: skip
    config = load_config(main)
    assert config == {"a": 2, "nested": {"x": 1, "y": 2}, "only_base": True}  # hydra section dropped
    first = write(tmp_path, "exp/self_first.yaml", "defaults: [_self_, ../config/base@_here_]\na: 2\n")
    assert load_config(first)["a"] == 1  # _self_ first: the include wins


def test_interpolation_keeps_types_substitutes_text_and_nests(tmp_path):
    path = write(tmp_path, "c.yaml", """\
        response_length: 512
        exp_name: demo
        env: {size: 4, name: lake}
        envs: {train: "${env}"}
        actor_infer: {generating_args: {max_new_tokens: "${response_length}"}}
        output: "./out/${exp_name}/len${response_length}"
        chain: "${alias}"
        alias: "${env.size}"
    """)  # fmt: skip
    config = load_config(path)
    assert config["actor_infer"]["generating_args"]["max_new_tokens"] == 512  # whole value: the int itself
    assert config["envs"]["train"] == {"size": 4, "name": "lake"}
    assert config["output"] == "./out/demo/len512"
    assert config["chain"] == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: ${b}\nb: ${a}\n", r"interpolation cycle"),
        ("a: ${missing.key}\n", r"a: \$\{missing\.key\} refers to a key the config does not have \('missing'\)"),
        ("a: ${oc.env:HOME}\n", r"resolver interpolation"),
        ("defaults: [../x/nope@_here_]\n", r"nope\.yaml does not exist"),
        ("defaults: [{db: mysql}]\n", r"defaults entry \{'db': 'mysql'\} is not supported"),
        ("defaults: [other@pkg]\n", r"only @_here_"),
        ("- a\n- b\n", r"must hold a mapping at the top level"),
        ("a: [1, 2\n", r"is not valid YAML"),
    ],
)
def test_bad_files_fail_naming_the_file_or_key(tmp_path, text, message):
    with pytest.raises(ConfigFileError, match=message):
        load_config(write(tmp_path, "c.yaml", text))


def test_overrides_set_existing_keys_and_add_with_plus(tmp_path):
    path = write(
        tmp_path, "c.yaml", "max_steps: 5\nactor_train: {training_args: {learning_rate: 1.0e-6}}\nn: ${max_steps}\n"
    )
    config = load_config(path, ["max_steps=7", "actor_train.training_args.learning_rate=0.001", "+extra.deep=[1, 2]"])
    assert config["max_steps"] == 7 and config["n"] == 7  # interpolation sees the override
    assert config["actor_train"]["training_args"]["learning_rate"] == 0.001
    assert config["extra"] == {"deep": [1, 2]}
    assert load_config(path, ["max_step=3"])["max_step"] == 3  # added; the typed config rejects it by name
    with pytest.raises(ConfigFileError, match=r"max_steps is not a mapping in the config"):
        load_config(path, ["max_steps.x=1"])
    with pytest.raises(ConfigFileError, match=r"must look like key=value"):
        load_config(path, ["max_steps"])


def test_every_roll_example_composes_and_interpolates():
    files = sorted(SHARED.glob("*/*.yaml"))
    if not files:
        pytest.skip(f"{SHARED} is not beside the checkout")
    for path in files:
        config = load_config(path)
        assert "hydra" not in config
        assert "${" not in repr(config), path
