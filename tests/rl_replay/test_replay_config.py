import pathlib

import pytest

from rl_replay import ConfigError, RolloutMockConfig, RolloutReplay


def test_from_dict_reads_the_guide_shape():
    cfg = RolloutMockConfig.from_dict({"enable": True, "mode": "mock", "dump_dir": "./output/rollout_dumps/v1"})
    assert (cfg.enable, cfg.mode, cfg.dump_dir, cfg.overwrite) == (True, "mock", "./output/rollout_dumps/v1", False)


def test_absent_section_is_disabled():
    assert RolloutMockConfig.from_dict(None).enable is False
    assert RolloutReplay.from_config(None) is None
    assert RolloutReplay.from_config({"enable": False, "mode": "dump", "dump_dir": "x"}) is None


def test_bad_mode_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout_mock\.mode must be one of \['dump', 'mock'\].*'replay'"):
        RolloutMockConfig.from_dict({"enable": True, "mode": "replay", "dump_dir": "d"})


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"enable": "yes"}, "rollout_mock.enable"),
        ({"enable": True, "dump_dir": ""}, "rollout_mock.dump_dir"),
        ({"enable": True, "dump_dir": 3}, "rollout_mock.dump_dir"),
        ({"overwrite": 1}, "rollout_mock.overwrite"),
        ({"enable": True, "dumpdir": "x"}, "rollout_mock.dumpdir"),
    ],
)
def test_invalid_values_name_their_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RolloutMockConfig.from_dict(section)


def test_section_must_be_a_mapping():
    with pytest.raises(ConfigError, match="rollout_mock must be a mapping"):
        RolloutMockConfig.from_dict(["enable"])  # type: ignore[arg-type]


def test_path_like_dump_dir_and_from_config(tmp_path: pathlib.Path):
    cfg = RolloutMockConfig.from_dict({"enable": True, "mode": "dump", "dump_dir": tmp_path / "d"})
    assert cfg.dump_dir == str(tmp_path / "d")
    replay = RolloutReplay.from_config(cfg)
    assert replay is not None and replay.mode == "dump" and (tmp_path / "d").is_dir()


def test_replay_constructor_validates_mode(tmp_path: pathlib.Path):
    with pytest.raises(ConfigError, match=r"rollout_mock\.mode"):
        RolloutReplay(tmp_path, "record")
