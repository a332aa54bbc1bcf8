"""Parse ROLL's ``device_mapping`` values into device-id lists without ``eval``.

ROLL configs write device mappings as Python expressions inside YAML strings (``list(range(0,8))``) and ROLL
evaluates them with ``eval``. Here the string is parsed with ``ast.parse(mode="eval")`` and only a tiny grammar is
interpreted; nothing in the string is ever executed:

    expr  := seq ("+" seq)*
    seq   := "[" ints "]" | "(" ints ")" | ints            # list / tuple / bare "0,1,2"
           | "range(" int ["," int ["," int]] ")"
           | "list(" expr ")"
    int   := integer literal, optionally with a leading "-" (only so that negatives get a clear error)

Device ids are abstract slots: GPUs on a GPU machine, CPU worker slots on a CPU-only one.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Sequence

ACCEPTED_FORMS = "list(range(0,8)), list(range(0,16,2)), range(8,16), [0,1,2], '0,1,2', list(range(0,4)) + [8,9]"
# Guards against a config that asks for an absurd allocation (``range(10**12)``) or an AST bomb.
MAX_DEVICES = 1 << 16
MAX_EXPRESSION_CHARS = 10_000
MAX_ID_LITERAL = 1 << 31
MAX_SUM_TERMS = 256
MAX_NESTING = 32
"""Checked on the text before ``ast.parse``: how deep Python's parser may go depends on the process's recursion limit
(which libraries raise), so a long ``+`` chain or deep nesting would parse in one process and not in another."""


class DeviceMappingError(ValueError):
    """A ``device_mapping`` value that is malformed, empty, negative or has duplicates; the message names the key."""


def parse_device_mapping(value: object, *, role: str) -> list[int]:
    """Return the device ids of ``<role>.device_mapping`` as a list of ints, in the order written.

    ``value`` is a ROLL expression string (``"list(range(0,8))"``, ``"[0,1,2]"``, ``"0,1,2"``,
    ``"list(range(0,4)) + list(range(8,12))"``), or a list / tuple / range of ints as YAML or Python gives it.
    Raises ``DeviceMappingError`` (a ``ValueError``) naming the key and the bad value or ids, with the accepted forms.
    """
    key = f"{role}.device_mapping"
    if isinstance(value, str):
        ids = _parse_expression(value, key)
    elif isinstance(value, (list, tuple, range)):
        ids = _ints_from_sequence(value, key, value)
    else:
        raise _form_error(key, value, f"expected a string or a list of ints, got {type(value).__name__}")
    _check_ids(ids, key)
    return ids


def _form_error(key: str, value: object, why: str) -> DeviceMappingError:
    shown = repr(value)
    if len(shown) > 120:  # keep errors readable when a whole file ends up in one value
        shown = shown[:100] + f"... ({len(shown)} chars)"
    return DeviceMappingError(f"{key}={shown} is not a device mapping: {why}. Accepted forms: {ACCEPTED_FORMS}.")


def _ints_from_sequence(items: Sequence[object], key: str, value: object) -> list[int]:
    ids: list[int] = []
    for item in items:
        # bool is an int subclass; True as a device id is always a mistake.
        if isinstance(item, bool) or not isinstance(item, int):
            raise _form_error(key, value, f"element {item!r} is not an integer device id")
        ids.append(item)
    if len(ids) > MAX_DEVICES:
        raise _form_error(key, value, f"{len(ids)} devices is more than the supported {MAX_DEVICES}")
    return ids


def _parse_expression(text: str, key: str) -> list[int]:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _form_error(key, text, f"longer than {MAX_EXPRESSION_CHARS} characters")
    if not text.strip():
        raise DeviceMappingError(f"{key} is empty; give at least one device id, e.g. list(range(0,8)).")
    _check_size(text, key)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise _form_error(key, text, f"not a valid expression ({exc})") from None
    return _Interpreter(key, text).sequence(tree.body)


def _check_size(text: str, key: str) -> None:
    """Refuse more than MAX_SUM_TERMS terms joined by ``+`` or brackets nested deeper than MAX_NESTING."""
    terms = text.count("+") + 1
    if terms > MAX_SUM_TERMS:
        raise _form_error(key, text, f"{terms} terms joined by '+', more than the supported {MAX_SUM_TERMS}")
    depth = deepest = 0
    for char in text:
        depth += (char in "([{") - (char in ")]}")
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise _form_error(key, text, f"brackets nested {deepest} deep, more than the supported {MAX_NESTING}")


class _Interpreter:
    """Walks the allowed AST nodes only; any other node type is rejected before anything is evaluated."""

    def __init__(self, key: str, text: str) -> None:
        self.key = key
        self.text = text

    def fail(self, why: str) -> DeviceMappingError:
        return _form_error(self.key, self.text, why)

    def sequence(self, node: ast.expr) -> list[int]:
        if isinstance(node, (ast.List, ast.Tuple)):
            return self.bounded([self.integer(element) for element in node.elts])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            ids: list[int] = []
            for term in _flatten_sum(node):
                ids = self.bounded(ids + self.sequence(term))
            return ids
        if isinstance(node, ast.Call):
            return self.call(node)
        raise self.fail(f"{_describe(node)} is not allowed (only lists, tuples, list(...), range(...) and +)")

    def call(self, node: ast.Call) -> list[int]:
        if not isinstance(node.func, ast.Name) or node.func.id not in ("list", "range"):
            raise self.fail(f"call to {_describe(node.func)} is not allowed (only list(...) and range(...))")
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise self.fail(f"{node.func.id}(...) takes positional arguments only")
        if node.func.id == "list":
            if len(node.args) != 1:
                raise self.fail(f"list(...) takes exactly one argument, got {len(node.args)}")
            return self.sequence(node.args[0])
        if not 1 <= len(node.args) <= 3:
            raise self.fail(f"range(...) takes 1 to 3 integer arguments, got {len(node.args)}")
        args = [self.integer(arg) for arg in node.args]
        if len(args) == 3 and args[2] == 0:
            raise self.fail("range(...) step must not be zero")
        bounds = range(*args)
        if len(bounds) > MAX_DEVICES:
            raise self.fail(f"{_describe(node)} spans {len(bounds)} devices, more than the supported {MAX_DEVICES}")
        return list(bounds)

    def integer(self, node: ast.expr) -> int:
        negate = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
        inner = node.operand if isinstance(node, ast.UnaryOp) and negate else node
        if isinstance(inner, ast.Constant) and type(inner.value) is int:
            if inner.value > MAX_ID_LITERAL:
                raise self.fail(f"integer {inner.value} is larger than any device id ({MAX_ID_LITERAL})")
            return -inner.value if negate else inner.value
        raise self.fail(f"{_describe(node)} is not an integer literal")

    def bounded(self, ids: list[int]) -> list[int]:
        if len(ids) > MAX_DEVICES:
            raise self.fail(f"{len(ids)} devices is more than the supported {MAX_DEVICES}")
        return ids


def _flatten_sum(node: ast.BinOp) -> list[ast.expr]:
    """Terms of a left-deep ``a + b + c`` chain, iteratively (a long chain must not hit the recursion limit)."""
    terms: list[ast.expr] = []
    current: ast.expr = node
    while isinstance(current, ast.BinOp) and isinstance(current.op, ast.Add):
        terms.append(current.right)
        current = current.left
    terms.append(current)
    return terms[::-1]


def _describe(node: ast.AST) -> str:
    try:
        return repr(ast.unparse(node))
    except Exception:  # unparse never runs code; this only guards exotic nodes
        return type(node).__name__


def _check_ids(ids: list[int], key: str) -> None:
    if not ids:
        raise DeviceMappingError(f"{key} is empty; give at least one device id, e.g. list(range(0,8)).")
    negative = sorted({i for i in ids if i < 0})
    if negative:
        raise DeviceMappingError(f"{key} has negative device ids {negative}; device ids start at 0.")
    duplicates = sorted(i for i, count in Counter(ids).items() if count > 1)
    if duplicates:
        raise DeviceMappingError(
            f"{key} lists device ids {duplicates} more than once; each device may appear once per role "
            "(to share devices between roles, repeat the mapping in the other role instead)."
        )
