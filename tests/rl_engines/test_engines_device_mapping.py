"""parse_device_mapping: every accepted ROLL form, every rejection, and the real ROLL example configs."""

import re
import sys

import pytest

from rl_engines import DeviceMappingError, parse_device_mapping
from tests.shared_dir import ROLL_EXAMPLES, require_shared


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("list(range(0,8))", list(range(8))),
        ("list(range(0, 16, 2))", [0, 2, 4, 6, 8, 10, 12, 14]),
        ("range(8,16)", [8, 9, 10, 11, 12, 13, 14, 15]),
        ("range(3)", [0, 1, 2]),
        ("[0,1,2]", [0, 1, 2]),
        ("(3, 1, 2)", [3, 1, 2]),
        ("0,1,2", [0, 1, 2]),
        ("[5]", [5]),
        ("list([0,1,2,3,8,9,10,11])", [0, 1, 2, 3, 8, 9, 10, 11]),
        ("list(range(0,4)) + list(range(8,12))", [0, 1, 2, 3, 8, 9, 10, 11]),
        ("list(range(0,2)) + [4, 5] + range(6, 8)", [0, 1, 4, 5, 6, 7]),
        ("list(range(7, -1, -1))", [7, 6, 5, 4, 3, 2, 1, 0]),
        ("  list(range(0,4))  ", [0, 1, 2, 3]),
    ],
)
def test_accepted_strings(text, expected):
    assert parse_device_mapping(text, role="actor_infer") == expected


@pytest.mark.parametrize(
    ("value", "expected"), [([0, 1, 2], [0, 1, 2]), ((4, 5), [4, 5]), (range(2, 4), [2, 3]), ([7, 3], [7, 3])]
)
def test_accepted_python_values(value, expected):
    assert parse_device_mapping(value, role="reference") == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("__import__('os').system('x')", "call to"),
        ("list(range(0,8)).__class__", "is not allowed"),
        ("eval('[0]')", "call to 'eval'"),
        ("sorted([1, 0])", "call to 'sorted'"),
        ("list(range(0, n))", "'n' is not an integer literal"),
        ("range(0, 10**3)", "'10 ** 3' is not an integer literal"),
        ("range(0, 8, 0)", "step must not be zero"),
        ("range()", "1 to 3 integer arguments"),
        ("range(0, 1, 2, 3)", "1 to 3 integer arguments"),
        ("list()", "exactly one argument"),
        ("list(range(0, 4), [1])", "exactly one argument"),
        ("range(stop=4)", "positional arguments only"),
        ("list(*[[0]])", "positional arguments only"),
        ("[0, 1.5]", "not an integer literal"),
        ("[True, 1]", "not an integer literal"),
        ("['0', '1']", "not an integer literal"),
        ("[0] * 8", "is not allowed"),
        ("[i for i in range(8)]", "is not allowed"),
        ("{0, 1}", "is not allowed"),
        ("[0, 1] - [1]", "is not allowed"),
        ("7", "is not allowed"),
        ("list(range(0,8)", "not a valid expression"),
        ("range(0, 99999999999)", "larger than any device id"),
        ("range(0, 100000)", "more than the supported"),
        ("[]+" * 3000 + "[1]", "3001 terms joined by '+', more than the supported 256"),
        ("list(" * 40 + "[1]" + ")" * 40, "brackets nested 41 deep, more than the supported 32"),
        ("[0]" + " " * 10_001, "longer than"),
    ],
)
def test_rejected_strings_name_key_value_and_forms(text, reason):
    with pytest.raises(DeviceMappingError) as info:
        parse_device_mapping(text, role="actor_infer")
    message = str(info.value)
    assert "actor_infer.device_mapping=" in message
    assert reason in message
    assert "Accepted forms: list(range(0,8))" in message
    assert repr(text)[:60] in message  # the bad value itself, possibly shortened


@pytest.mark.parametrize("limit", [1000, 100_000])
def test_long_and_deep_values_get_one_answer_whatever_the_recursion_limit(limit):
    """Libraries raise the process's recursion limit (torch's compiler does), which decides how deep Python's parser
    goes: the size limits are checked on the text first, so the answer does not depend on what ran before."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        assert parse_device_mapping("[]+" * 255 + "[1]", role="actor_train") == [1]  # 256 terms: the most
        assert parse_device_mapping("list(" * 31 + "[1]" + ")" * 31, role="actor_train") == [1]  # 32 deep
        with pytest.raises(DeviceMappingError, match="3001 terms joined by"):
            parse_device_mapping("[]+" * 3000 + "[1]", role="actor_train")
        with pytest.raises(DeviceMappingError, match="nested 33 deep"):
            parse_device_mapping("list(" * 32 + "[1]" + ")" * 32, role="actor_train")
    finally:
        sys.setrecursionlimit(old)


def test_code_in_a_mapping_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [
        f"__import__('pathlib').Path({str(marker)!r}).touch()",
        f"list(range(0, __import__('pathlib').Path({str(marker)!r}).touch() or 2))",
        f"[0] + [__import__('pathlib').Path({str(marker)!r}).touch()]",
    ]
    for payload in payloads:
        with pytest.raises(DeviceMappingError):
            parse_device_mapping(payload, role="actor_train")
    assert not marker.exists()


@pytest.mark.parametrize("value", [None, 3, 2.0, {"a": 1}, b"[0]"])
def test_rejected_types(value):
    with pytest.raises(DeviceMappingError, match=r"critic\.device_mapping=.*expected a string or a list of ints"):
        parse_device_mapping(value, role="critic")


@pytest.mark.parametrize("value", [[0, "1"], [0, 1.0], [True], [[0, 1]]])
def test_rejected_list_elements(value):
    with pytest.raises(DeviceMappingError, match=r"reward\.device_mapping=.*is not an integer device id"):
        parse_device_mapping(value, role="reward")


@pytest.mark.parametrize("value", ["", "   ", "[]", "list(range(4, 4))", [], ()])
def test_empty_mapping(value):
    with pytest.raises(DeviceMappingError, match=r"^actor_train\.device_mapping is empty; give at least one"):
        parse_device_mapping(value, role="actor_train")


@pytest.mark.parametrize("value", ["[0, -1, -3]", [0, -1, -3], "list(range(-3, 1))"])
def test_negative_ids(value):
    with pytest.raises(DeviceMappingError) as info:
        parse_device_mapping(value, role="reference")
    message = str(info.value)
    assert message.startswith("reference.device_mapping has negative device ids [")
    assert "-1" in message
    assert "start at 0" in message


def test_negative_ids_listed_exactly():
    with pytest.raises(DeviceMappingError, match=r"negative device ids \[-3, -1\]"):
        parse_device_mapping([0, -1, -3, -1], role="reference")


@pytest.mark.parametrize("value", ["list(range(0,4)) + [2, 3]", [2, 3, 0, 1, 2, 3]])
def test_duplicate_ids(value):
    with pytest.raises(DeviceMappingError, match=r"^actor_infer\.device_mapping lists device ids \[2, 3\] more than"):
        parse_device_mapping(value, role="actor_infer")


def test_error_is_a_value_error():
    with pytest.raises(ValueError, match="actor_infer"):
        parse_device_mapping("oops(", role="actor_infer")


def _example_mappings() -> list[tuple[str, str]]:
    found = []
    for path in sorted(ROLL_EXAMPLES.rglob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            match = re.match(r"^\s*device_mapping:\s*(.+?)\s*(#.*)?$", line)
            if match:
                found.append((str(path.relative_to(ROLL_EXAMPLES)), match.group(1).strip("'\"")))
    return found


def test_every_roll_example_mapping_parses():
    require_shared(ROLL_EXAMPLES)  # ../shared beside the checkout; missing: skip here, fail under CI
    mappings = _example_mappings()
    assert len(mappings) >= 30  # the examples hold 35 device_mapping lines; a regex gone wrong finds none
    for source, text in mappings:
        ids = parse_device_mapping(text, role=f"{source}:role")
        assert ids, source
        assert ids == sorted(ids), (source, text)  # all ROLL examples list ascending ids
