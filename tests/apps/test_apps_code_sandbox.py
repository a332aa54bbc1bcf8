"""The code sandbox (apps.common.sandbox) contains hostile programs, and ROLL's code reward (CodeSandboxRewardWorker)
grades real solutions of each case type in it."""

from __future__ import annotations

import json
import os
import signal

import pytest

from apps.common.sandbox import Limits, Sandbox, SandboxError
from apps.rlvr import code_reward
from apps.rlvr.code_reward import extract_code, same_output
from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS, Grade, RewardRouter

LIMITS = Limits(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 << 20, file_bytes=1 << 20, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(LIMITS, workers=4)
    yield box
    box.close()


def test_a_plain_program_reads_stdin_imports_the_stdlib_and_runs_threads(sandbox):
    source = "\n".join([
        "import collections, hashlib, json, threading",
        "t = threading.Thread(target=lambda: print('thread'))",
        "t.start(); t.join()",
        "print(json.dumps(collections.Counter(input()).most_common(1)), hashlib.sha1(b'').hexdigest()[:6])",
    ])  # fmt: skip
    result = sandbox.run(source, "abca\n")
    assert result.ok, result.stderr
    assert result.stdout.split("\n")[:2] == ["thread", '[["a", 2]] da39a3']


SYSCALL = (
    "import ctypes, platform\n"
    "NUMBERS = {'x86_64': {'rt_sigqueueinfo': 129, 'io_uring_setup': 425},\n"
    "           'aarch64': {'rt_sigqueueinfo': 138, 'io_uring_setup': 425}}[platform.machine()]\n"
    "def syscall(name, *args):\n"
    "    return ctypes.CDLL(None).syscall(NUMBERS[name], *args)\n"
)
"""A raw system call by name, for the calls Python does not wrap."""


def hostile(tmp_path, monkeypatch):
    """Each hostile program, and what shows it was contained."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    marker = tmp_path / "escaped"
    monkeypatch.setenv("RL_PARENT_SECRET", "parent-env-value")
    return {
        "infinite loop": ("while True: pass", lambda r: not r.ok and (r.exit_code == -signal.SIGXCPU or r.timed_out)),
        "sleeping forever": ("import time\ntime.sleep(60)", lambda r: r.timed_out and not r.ok),
        "memory hog": ("x = bytearray(1 << 31)", lambda r: not r.ok and "MemoryError" in r.stderr),
        "fork bomb": ("import os\nwhile True:\n    os.fork()", lambda r: not r.ok and "BlockingIOError" in r.stderr),
        "os.system": (f"import os\nprint(os.system('touch {marker}'))", lambda r: r.stdout.strip() != "0"),
        "subprocess": ("import subprocess\nsubprocess.run(['id'])", lambda r: not r.ok),
        "reading outside its dir": (f"print(open({str(secret)!r}).read())",
                                    lambda r: "PermissionError" in r.stderr and "secret" not in r.stdout),
        "reading the project": (f"print(open({__file__!r}).read())", lambda r: "PermissionError" in r.stderr),
        "writing outside its dir": (f"open({str(marker)!r}, 'w').write('x')", lambda r: "PermissionError" in r.stderr),
        "a socket": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
                     lambda r: "PermissionError" in r.stderr),
        "killing its parent": ("import os\nos.kill(os.getppid(), 9)", lambda r: "PermissionError" in r.stderr),
        "raising its limits": ("import resource\nhard = resource.getrlimit(resource.RLIMIT_CPU)[1]\n"
                               "resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))",  # allowed but for seccomp
                               lambda r: "PermissionError" in r.stderr),
        "queueing a signal to its parent": (SYSCALL + "import os\nprint(syscall('rt_sigqueueinfo', os.getppid(), 9, "
                                            "ctypes.create_string_buffer(128)))", lambda r: r.stdout.strip() == "-1"),
        "SIGIO to its parent": ("import fcntl, os\nr, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())",
                                lambda r: "PermissionError" in r.stderr),
        "a socket through io_uring": (SYSCALL + "print(syscall('io_uring_setup', 8, ctypes.create_string_buffer(120)))",
                                      lambda r: r.stdout.strip() == "-1"),
        "chmod outside its dir": (f"import os\nos.chmod({str(secret)!r}, 0o777)",
                                  lambda r: "PermissionError" in r.stderr and secret.stat().st_mode & 0o777 != 0o777),
        "truncating outside its dir": (f"import os\nos.truncate({str(secret)!r}, 0)",
                                       lambda r: not r.ok and secret.read_text() == "the secret"),
        "removing its stdout": ("import os\nos.remove('stdout.txt')\nprint('gone')", lambda r: r.stdout == "gone\n"),
        "a fifo for its stdout": ("import os\nos.remove('stdout.txt')\nos.mkfifo('stdout.txt')\nprint('fifo')",
                                  lambda r: r.stdout == "fifo\n"),
        "filling the disk": ("for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))",
                             lambda r: not r.ok and r.exit_code == -9),
        "fork through ctypes": ("import ctypes\nprint(ctypes.CDLL(None).fork())", lambda r: r.stdout.strip() == "-1"),
        "a huge file": ("open('big', 'wb').write(b'x' * (8 << 20))", lambda r: "File too large" in r.stderr),
        "an output flood": ("while True: print('x' * 1000)", lambda r: not r.ok and len(r.stdout) <= 4096),
        "the parent's environment": ("import os\nprint(dict(os.environ))",
                                     lambda r: r.ok and "parent-env-value" not in r.stdout),
    }  # fmt: skip


def test_hostile_programs_are_contained(sandbox, tmp_path, monkeypatch):
    cases = hostile(tmp_path, monkeypatch)
    results = sandbox.run_many([(source, "") for source, _ in cases.values()])
    contained = {name: check(result) for (name, (_, check)), result in zip(cases.items(), results)}
    assert contained == dict.fromkeys(cases, True), [(n, r) for n, r in zip(cases, results) if not contained[n]]
    assert not (tmp_path / "escaped").exists()
    assert os.getppid() > 1  # still here


def test_each_run_has_a_fresh_work_dir_that_is_removed(sandbox):
    first, second = sandbox.run_many([("import os\nopen('f', 'w').write('1')\nprint(os.getcwd())", "")] * 2)
    assert first.ok and second.ok and first.stdout != second.stdout
    assert not os.path.exists(first.stdout.strip()) and not os.path.exists(second.stdout.strip())


def test_run_many_keeps_the_order(sandbox):
    results = sandbox.run_many([(f"import time\ntime.sleep({0.3 - i * 0.05})\nprint({i})", "") for i in range(6)])
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(6)]


def test_preflight_refuses_code_rewards_on_a_machine_that_cannot_isolate(monkeypatch):
    from apps.common.sandbox import missing_isolation

    assert missing_isolation() == []  # this machine (and CI's) has Landlock and seccomp
    section = RewardConfig.from_dict({"worker_cls": "x.CodeSandboxRewardWorker"}, "rewards.code")
    code_reward.check_section("code", section)
    monkeypatch.setattr(code_reward, "missing_isolation", lambda: ["Landlock (Linux 5.13+ ...)"])
    with pytest.raises(ValueError, match=r"rewards\.code: the code sandbox runs responses only in isolated processes"):
        code_reward.check_section("code", section)


def test_a_sandbox_that_cannot_isolate_runs_nothing_and_says_why(tmp_path, monkeypatch):
    broken = tmp_path / "boot.py"
    broken.write_text("import sys\nsys.stderr.write('sandbox: Landlock failed: not on this kernel')\nsys.exit(1)\n")
    monkeypatch.setattr("apps.common.sandbox.BOOT", broken)
    with pytest.raises(SandboxError, match=r"could not isolate the process, so nothing ran: .*Landlock failed"):
        Sandbox(LIMITS, workers=1).run("print('never')")


# ---- the code reward ---------------------------------------------------------------------------------------------
@pytest.fixture
def graded_in(sandbox, monkeypatch):
    """The code reward on this module's sandbox (1 s of CPU, so the hostile cases end fast)."""
    monkeypatch.setattr(code_reward, "_SANDBOX", sandbox)
    return lambda response, record: REWARD_FUNCTIONS.get("CodeSandboxRewardWorker")(response, record, RewardSpec())


IO_CASES = json.dumps([{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "10 -4\n", "expected_stdout": "6"}])
SUM_RIGHT = "<think>read two ints</think>\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
SUM_WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"


@pytest.mark.parametrize(
    ("response", "record", "reward"),
    [
        (SUM_RIGHT, {"case_type": "input", "test_cases": IO_CASES}, 1.0),
        (SUM_WRONG, {"case_type": "input", "test_cases": IO_CASES}, 0.0),
        ("a, b = map(int, input().split())\nprint(a + b)", {"test_cases": IO_CASES}, 1.0),  # unfenced; input default
        ("```python\nprint(1/3)\n```", {"test_cases": [{"stdin": "", "expected_stdout": "0.3333333"}]}, 1.0),
        ("```python\nclass Solution:\n    def add(self, a, b):\n        return [a + b]\n```",
         {"case_type": "input", "test_case_function": "add",
          "test_cases": [{"stdin": "1\n2", "expected_stdout": "[3]"},
                         {"stdin": "5\n5", "expected_stdout": "[10]"}]}, 1.0),
        ("```python\ndef add(a, b):\n    return a * b\n```", {"test_case_function": "add",
         "test_cases": [{"stdin": "2\n2", "expected_stdout": "4"}, {"stdin": "1\n3", "expected_stdout": "4"}]}, 0.0),
        ("```python\ndef square(x):\n    return x * x\n```",
         {"case_type": "assert",
          "test_cases": [{"assert_code": "assert square(3) == 9"}, "assert square(-2) == 4"]}, 1.0),
        ("```python\ndef square(x):\n    return x + x\n```",
         {"case_type": "assert", "test_cases": [{"assert_code": "assert square(2) == 4"},
                                                {"assert_code": "assert square(3) == 9"}]}, 0.0),
        ("```python\ndef square(x):\n    return x + x\n```",  # a pytest-style case: its test_ functions are called
         {"case_type": "pytest", "test_cases": [{"assert_code": "def test_three():\n    assert square(3) == 9"}]}, 0.0),
        ("```python\ndef square(x):\n    return x ** 2\n```",
         {"case_type": "pytest", "test_cases": [{"assert_code": "def test_three():\n    assert square(3) == 9"}]}, 1.0),
        ("```python\ndef inc(x):\n    return x + 1\n```",
         {"case_type": "check_based",
          "test_cases": [{"assert_code": "def check(candidate):\n    assert candidate(1) == 2\n"
                                         "    assert candidate(-1) == 0",
                          "entry_point": "inc", "import_prefix": ""}]}, 1.0),
        ("The capital of France is Paris.",
         {"case_type": "text", "test_cases": [{"assert_code": "assert 'Paris' in {response}"}]}, 1.0),
        ("```python\nwhile True:\n    pass\n```", {"test_cases": IO_CASES}, 0.0),  # a time-out is a score
        ("```python\nprint(1\n```", {"test_cases": IO_CASES}, 0.0),  # so is a syntax error
        # exiting 0 before the asserts run passes nothing: a test program passes by printing its run's token last
        ("```python\nimport sys\nsys.exit(0)\n```", {"case_type": "assert", "test_cases": ["assert f() == 1"]}, 0.0),
        ("```python\nimport os\nos._exit(0)\n```",
         {"case_type": "pytest", "test_cases": [{"assert_code": "def test_f():\n    assert 0"}]}, 0.0),
        ("```python\nimport os\nos.kill(os.getppid(), 9)\n```", {"test_cases": IO_CASES}, 0.0),
    ],
)  # fmt: skip
def test_code_reward_grades_each_case_type(graded_in, response, record, reward):
    assert graded_in(response, record) == reward


def test_the_code_is_the_first_fenced_block_with_a_function_after_the_thinking():
    assert extract_code("<think>```python\nbad()\n```</think>```text\nnote\n```\n```py\ndef f(): pass\n```") == \
        "def f(): pass\n"  # fmt: skip
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("  print(2)  ") == "print(2)"
    assert same_output("1 2\n3  \n", "1 2\n3") and same_output("0.1000000001", "0.1") and not same_output("1", "2")


def test_a_record_without_test_cases_names_the_column(graded_in):
    with pytest.raises(KeyError, match="test_cases column; columns: \\['case_type'\\]"):
        graded_in("print(1)", {"case_type": "input"})


def test_the_router_grades_a_code_section_in_one_batch_and_refuses_the_remote_sandbox(graded_in):
    section = {"worker_cls": "roll.pipeline.rlvr.rewards.code_sandbox_reward_worker.CodeSandboxRewardWorker",
               "tag_included": ["KodCode"], "use_local": True}  # fmt: skip
    router = RewardRouter({"code_sandbox": RewardConfig.from_dict(section, "rewards.code_sandbox")})
    records = [{"tag": "KodCode", "test_cases": IO_CASES}] * 2
    assert router.grade_many([SUM_RIGHT, SUM_WRONG], records, [5, 5]) == [Grade(1.0, 1.0), Grade(0.0, 0.0)]
    remote = RewardConfig.from_dict({**section, "use_local": False}, "rewards.code_sandbox")
    refused = r"rewards\.code_sandbox: use_local is false.*Set rewards\.code_sandbox\.use_local: true"
    with pytest.raises(ValueError, match=refused):
        code_reward.check_section("code_sandbox", remote)
