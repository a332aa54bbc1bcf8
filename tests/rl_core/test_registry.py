import pytest

from rl_core.registry import Registry


def test_register_lookup_alias_and_errors():
    reg: Registry[int] = Registry("widget", "widget_kind")
    reg.register("a", "alpha")(1)
    assert reg.get("a") == 1 and reg.get("alpha") == 1
    assert reg.canonical_name("alpha") == "a"
    assert reg.names() == ["a"] and "alpha" in reg and list(reg) == ["a"]
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("alpha")(2)
    with pytest.raises(ValueError, match=r"unknown widget 'b' \(config key 'widget_kind'\); valid names: a, alpha"):
        reg.get("b")
    with pytest.raises(ValueError, match="unknown widget"):
        reg.get(None)  # type: ignore[arg-type]
