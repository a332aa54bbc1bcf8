"""ROLL-style YAML loading: Hydra defaults, ${} interpolation, key=value overrides, and their errors."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest

from apps.common.yaml_config import ConfigFileError, load_config
from tests.shared_dir import ROLL_EXAMPLES, require_shared


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


def test_hydras_now_resolver_gives_one_time_to_the_whole_load(tmp_path):
    from datetime import datetime

    text = "stamp: ${now:%Y%m%d-%H%M%S}\nexp_name: run-${stamp}\nout: ./out/${now:%Y%m%d-%H%M%S}/x\n"
    before = datetime.now().replace(microsecond=0)
    config = load_config(write(tmp_path, "c.yaml", text))
    after = datetime.now()
    stamp = config["stamp"]
    assert before <= datetime.strptime(stamp, "%Y%m%d-%H%M%S") <= after
    assert config["exp_name"] == f"run-{stamp}" and config["out"] == f"./out/{stamp}/x"


def test_omegaconfs_env_resolver_reads_the_environment_or_the_default(tmp_path, monkeypatch):
    """ROLL's wandb files read their key as ${oc.env:WANDB_API_KEY}."""
    monkeypatch.setenv("RL_TEST_SET", "42")
    monkeypatch.delenv("RL_TEST_UNSET", raising=False)
    text = ("set: ${oc.env:RL_TEST_SET}\nset_default: ${oc.env:RL_TEST_SET,7}\nplain: ${oc.env:RL_TEST_UNSET,7}\n"
            "quoted: ${oc.env:RL_TEST_UNSET,'a, b'}\nnone: ${oc.env:RL_TEST_UNSET, NULL}\n"
            "text: run-${oc.env:RL_TEST_SET}-x\nflag: ${oc.env:RL_TEST_UNSET,true}\n"
            "float: ${oc.env:RL_TEST_UNSET,1e3}\nword: ${oc.env:RL_TEST_UNSET,007}\nname: tiny\n"
            "nested: ${oc.env:RL_TEST_UNSET,${name}}\n")  # fmt: skip
    config = load_config(write(tmp_path, "c.yaml", text))
    assert config == {"set": "42", "set_default": "42", "plain": "7", "quoted": "a, b", "none": None,
                      "text": "run-42-x", "flag": "True", "float": "1000.0", "word": "007", "name": "tiny",
                      "nested": "tiny"}  # OmegaConf's strings of these defaults  # fmt: skip
    with pytest.raises(ConfigFileError, match=r"a: \$\{oc\.env:RL_TEST_UNSET,1,2\}: oc\.env takes a variable name"):
        load_config(write(tmp_path, "bad.yaml", "a: ${oc.env:RL_TEST_UNSET,1,2}\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: ${b}\nb: ${a}\n", r"interpolation cycle"),
        ("a: ${missing.key}\n", r"a: \$\{missing\.key\} refers to a key the config does not have \('missing'\)"),
        ("a: ${oc.decode:'1'}\n", r"resolver interpolation \$\{oc\.decode:'1'\} is not supported \(only Hydra's"),
        (
            "tracker_kwargs: {api_key: '${oc.env:RL_TEST_UNSET_VARIABLE}'}\n",
            r"tracker_kwargs\.api_key: \$\{oc\.env:RL_TEST_UNSET_VARIABLE\} reads the environment variable "
            r"'RL_TEST_UNSET_VARIABLE', which is not set; set it, or give a default",
        ),
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
    files = sorted(require_shared(ROLL_EXAMPLES).glob("*/*.yaml"))
    assert files, f"no */*.yaml in {ROLL_EXAMPLES}"
    for path in files:
        config = load_config(path)
        assert "hydra" not in config
        assert "${" not in repr(config), path


def nested_levels(first, line, levels=9):
    """`a: <first>` then `b: <line(a, b)>`, `c: <line(b, c)>` ...: each level repeats the previous one 9 times."""
    names = "abcdefghijklmnopqrstuvwxyz"[:levels]
    return f"a: {first}\n" + "".join(line(prev, name) + "\n" for prev, name in itertools.pairwise(names))


def nine(item):
    return "[" + ", ".join([item] * 9) + "]"


def alias_levels(levels=9):
    """`a: &a [x, ... x]`, `b: &b [*a, ... *a]` ...: 9**levels values once the aliases are expanded."""
    return nested_levels("&a " + nine("x"), lambda prev, name: f"{name}: &{name} {nine('*' + prev)}", levels)


def test_yaml_alias_bomb_is_refused_naming_the_file_and_the_limit(tmp_path):
    path = write(tmp_path, "bomb.yaml", alias_levels(9))
    with pytest.raises(ValueError, match=r"expand the value at line 7, column 4 to more than 1,000,000 values") as info:
        load_config(path)
    assert isinstance(info.value, ConfigFileError)
    assert str(info.value).startswith(f"{path}: its YAML aliases")
    assert "write the repeated values out or use fewer levels of aliases of aliases" in str(info.value)


def test_yaml_alias_referring_to_its_own_parent_is_refused(tmp_path):
    path = write(tmp_path, "loop.yaml", "ok: 1\nloop: &a [1, *a]\n")  # before: RecursionError while resolving
    with pytest.raises(ConfigFileError, match=r"loop\.yaml: an alias inside the value at line 2, column 7 refers back"):
        load_config(path)


def test_yaml_aliases_and_merge_keys_within_the_limit_still_load(tmp_path):
    path = write(tmp_path, "ok.yaml", """\
        base: &base {lr: 1.0e-6, betas: [0.9, 0.99]}
        actor: {<<: *base, lr: 2.0e-6}
        critic: *base
    """)  # fmt: skip
    config = load_config(path)
    assert config["actor"] == {"lr": 2.0e-6, "betas": [0.9, 0.99]}
    assert config["critic"] == {"lr": 1.0e-6, "betas": [0.9, 0.99]}
    assert len(load_config(write(tmp_path, "five.yaml", alias_levels(5)))["e"]) == 9  # 9**5 values: under the limit


def ref(name):
    return "${" + name + "}"


@pytest.mark.parametrize(
    ("first", "line", "limit"),
    [  # 9 levels of 9 references: 9**9 values, or 10 * 9**8 characters of text
        (nine("x"), lambda prev, name: f"{name}: {nine(repr(ref(prev)))}", "100,000 values"),
        ("xxxxxxxxxx", lambda prev, name: f"{name}: {ref(prev) * 9!r}", "4,000,000 characters of text"),
    ],
    ids=["lists", "text"],
)
def test_interpolation_bomb_is_refused_naming_the_file_and_the_limit(tmp_path, first, line, limit):
    path = write(tmp_path, "bomb.yaml", nested_levels(first, line))
    with pytest.raises(ValueError, match=rf"references copy more than {limit} into the config") as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ${{...}} references copy more than")
    assert "(reached expanding ${" in str(info.value) and "refer to the value you need directly" in str(info.value)


def test_a_file_included_many_times_is_composed_once(tmp_path, monkeypatch):
    import apps.common.yaml_config as yaml_config

    for level in range(3):  # inc0 lists inc1 three times, inc1 lists inc2 three times, ...
        write(tmp_path, f"inc{level}.yaml", f"defaults: [{', '.join([f'inc{level + 1}@_here_'] * 3)}]\nk{level}: 1\n")
    write(tmp_path, "inc3.yaml", "k3: 1\n")
    reads = []
    real_read = yaml_config._read
    monkeypatch.setattr(yaml_config, "_read", lambda path: reads.append(path.name) or real_read(path))
    assert load_config(tmp_path / "inc0.yaml") == {"k0": 1, "k1": 1, "k2": 1, "k3": 1}
    assert sorted(reads) == ["inc0.yaml", "inc1.yaml", "inc2.yaml", "inc3.yaml"]  # before: 1 + 3 + 9 + 27 reads
