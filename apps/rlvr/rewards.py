"""Verifiable rewards: one registry of reward functions, chosen per ``rewards.<name>`` section, routed by tag.

A reward function maps ``(response_text, record, spec)`` to a float, or to a ``Grade`` when what the response
scores (right or wrong) differs from what the policy is rewarded (ROLL's ``scores`` and ``response_level_rewards``:
CrossThinkQA's soft reward, the repetition penalty). The section's ``worker_cls`` picks it by its
last component (ROLL's ``...MathRuleRewardWorker``), else the section's name (``math_rule``); users add their own
with ``@REWARD_FUNCTIONS.register("my_reward")``. Each sample goes to the reward whose ``tag_included`` lists the
record's ``tag`` (a section without tags takes every sample no other section claims).

A section whose ``world_size`` is set is scored by that many CPU Ray actors (``apps.rlvr.reward_workers``) once
``RewardRouter.start_workers`` has run; the other sections (and every section before that) are scored in the driver.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from apps.rlvr.config import RewardConfig, RewardSpec
from rl_core.registry import Registry
from rl_engines.config import WorkerConfig

if TYPE_CHECKING:
    from apps.rlvr.reward_workers import RewardWorkers


@dataclass(frozen=True)
class Grade:
    """One response's grade: ``score`` says how right it is (ROLL's ``scores``: the score metrics, dynamic
    sampling's query filters, the difficulty mask); ``reward`` is what the policy is trained on (ROLL's
    ``response_level_rewards``: reward normalisation and advantages). ``parts``: what the reward is made of (a
    ROLL reward worker's ``meta_info["metrics"]``, e.g. Video-R1's ``acc_reward`` and ``fmt_reward``), logged per
    step as ``<section>/<part>``, the mean over the section's responses."""

    score: float
    reward: float
    parts: Mapping[str, float] = field(default_factory=dict)


RewardFn = Callable[[str, dict[str, Any], RewardSpec], "float | Grade"]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", "rewards.<name>.worker_cls")

T = TypeVar("T")

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
ROLL_DEFAULT_DOMAIN = "math_rule"
"""The domain ROLL gives a record whose domain column is empty and whose tag no reward claims."""


def extract_answer(response: str) -> str:
    """The text to grade: the last ``<answer>...</answer>`` when present, else the whole response."""
    tagged = ANSWER_TAG.findall(response)
    return tagged[-1].strip() if tagged else response


def ground_truth(record: dict[str, Any]) -> str:
    for key in ("ground_truth", "answer", "label"):
        if key in record and record[key] is not None:
            return str(record[key])
    raise KeyError(
        f"the record has no ground_truth / answer / label column to grade against; columns: {sorted(record)}"
    )


@REWARD_FUNCTIONS.register("math_rule", "MathRuleRewardWorker")
def math_rule_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the answer is mathematically equal to the ground truth (``math-verify``), else 0.0.

    Handles ``\\boxed{}``, LaTeX and plain expressions (1/2 == 0.5 == \\frac{1}{2}).
    """
    from math_verify import parse, verify

    gold = parse(ground_truth(record))
    if not gold:
        gold = parse(f"${ground_truth(record)}$")
    answer = parse(extract_answer(response))
    return 1.0 if gold and answer and verify(gold, answer) else 0.0


@REWARD_FUNCTIONS.register("exact_match", "ExactMatchRewardWorker")
def exact_match_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the extracted answer equals the ground truth after stripping whitespace, else 0.0."""
    return 1.0 if extract_answer(response).strip() == ground_truth(record).strip() else 0.0


@REWARD_FUNCTIONS.register("format", "FormatRewardWorker")
def format_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the response contains exactly one ``<answer>...</answer>`` block, else 0.0 (a rule reward)."""
    return 1.0 if len(ANSWER_TAG.findall(response)) == 1 else 0.0


def reward_function(name: str, section: RewardConfig) -> RewardFn:
    """The function a section asks for: by worker_cls's last component, else by the section name."""
    wanted = section.spec.worker_cls.rsplit(".", 1)[-1] if section.spec.worker_cls else name
    if wanted not in REWARD_FUNCTIONS:
        raise ValueError(
            f"rewards.{name}: no reward function {wanted!r} (from worker_cls={section.spec.worker_cls!r}); "
            f"registered: {REWARD_FUNCTIONS.names()}. Register one with @REWARD_FUNCTIONS.register({wanted!r})."
        )
    return REWARD_FUNCTIONS.get(wanted)


def graded(function: RewardFn, response: str, record: dict[str, Any], spec: RewardSpec, response_tokens: int) -> Grade:
    """``function``'s grade of one response, its reward less ``spec.response_length_penalty_coef`` per response
    token (the score is left as it is)."""
    return _penalized(function(response, record, spec), spec, response_tokens)


def graded_rows(
    function: RewardFn, texts: list[str], records: list[dict[str, Any]], spec: RewardSpec, lengths: list[int]
) -> list[Grade]:
    """``graded`` for every row; a function with a ``many(responses, records, spec)`` attribute (the code sandbox:
    one pool for the batch) grades them in one call."""
    many = getattr(function, "many", None)
    values = many(texts, records, spec) if many is not None else [function(t, r, spec) for t, r in zip(texts, records)]
    return [_penalized(value, spec, tokens) for value, tokens in zip(values, lengths)]


def _penalized(value: float | Grade, spec: RewardSpec, response_tokens: int) -> Grade:
    grade = value if isinstance(value, Grade) else Grade(float(value), float(value))
    return Grade(grade.score, grade.reward - spec.response_length_penalty_coef * response_tokens, grade.parts)


def check_reward_sections(sections: dict[str, RewardConfig]) -> None:
    """Pre-flight: every section resolves to a registered reward function, tags go to one section each (a
    ``RewardRouter`` can be built), and each function's own ``check_section`` passes. Raises ``ValueError`` naming
    ``rewards.<name>``; starts nothing."""
    router = RewardRouter(sections)
    for name, function in router.functions.items():
        check = getattr(function, "check_section", None)
        if check is not None:
            check(name, sections[name])


def worker_counts(sections: dict[str, RewardConfig]) -> dict[str, int]:
    """``worker.world_size`` of every section that sets it (those are scored by Ray actors).

    Raises ``ValueError`` naming ``rewards.<name>.world_size`` when one is not an int >= 1.
    """
    counts: dict[str, int] = {}
    for name, section in sections.items():
        size = section.worker.world_size
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"rewards.{name}.world_size must be an int >= 1 (reward actors on Ray), got {size!r}; "
                "leave it unset to score this reward in the driver."
            )
        counts[name] = size
    return counts


class RewardRouter:
    """Scores samples with the reward section their tag belongs to, adding the response-length penalty.

    Sections with ``world_size`` are scored by Ray actors after ``start_workers``; until then (and for the other
    sections) ``grade_many`` grades in the driver. Sections whose function ``needs_role`` (the LLM judge) run a
    model as the role ``rewards.<name>``: the pipeline starts ``role_sections()`` with its roles, then
    ``attach_judges``. Call ``shutdown`` to stop the actors.
    """

    def __init__(self, sections: dict[str, RewardConfig]) -> None:
        if not sections:
            raise ValueError("no reward sections configured")
        self.sections = sections
        self.functions = {name: reward_function(name, section) for name, section in sections.items()}
        self.role_based = {name for name, function in self.functions.items() if getattr(function, "needs_role", False)}
        self.cpu_sections = {name: s for name, s in sections.items() if name not in self.role_based}
        self.worker_counts = worker_counts(self.cpu_sections)
        self.workers: RewardWorkers | None = None
        self.judges: dict[str, Any] = {}
        self.spans: dict[str, tuple[float, float]] = {}
        self.graded: dict[str, list[Grade]] = {}
        """The last ``grade_many``'s grades by section (their parts: :func:`part_metrics`)."""
        """Each section's (start, end) ``time.perf_counter()`` in the last ``grade_many`` call."""
        self.by_tag: dict[str, str] = {}
        for name, section in sections.items():
            for tag in section.spec.tag_included:
                if tag in self.by_tag:
                    raise ValueError(f"tag {tag!r} is in tag_included of both rewards.{self.by_tag[tag]} and "
                                     f"rewards.{name}; each tag may go to one reward.")  # fmt: skip
                self.by_tag[tag] = name
        untagged = [name for name, section in sections.items() if not section.spec.tag_included]
        self.default = untagged[0] if untagged else None

    def start_workers(self, rpc_timeout: float, system_envs: dict[str, str]) -> None:
        """Start the Ray actors of every section with ``world_size`` (Ray must be running); no-op when none has."""
        if self.workers is not None:
            raise RuntimeError("the reward workers are already started; call shutdown() before starting them again.")
        if not self.worker_counts:
            return
        from apps.rlvr.reward_workers import RewardWorkers  # here, not at the top: that module imports this one

        functions = {name: self.functions[name] for name in self.cpu_sections}
        self.workers = RewardWorkers(self.cpu_sections, functions, rpc_timeout=rpc_timeout, system_envs=system_envs)

    def start(self, roles: Any, rpc_timeout: float, system_envs: dict[str, str], prompt_key: str | None,
              messages_key: str | None) -> None:  # fmt: skip
        """:meth:`start_workers`, then :meth:`attach_judges` to ``roles`` (started with :meth:`role_sections`)."""
        self.start_workers(rpc_timeout, system_envs)
        self.attach_judges(roles, prompt_key, messages_key)

    def role_sections(self) -> dict[str, WorkerConfig]:
        """The roles the model-based rewards run as (``rewards.<name>``), to start with the pipeline's roles."""
        return {f"rewards.{name}": self.sections[name].worker for name in sorted(self.role_based)}

    def attach_judges(self, roles: Any, prompt_key: str | None, messages_key: str | None) -> None:
        """Grade the model-based sections with their started roles (``roles`` holds ``role_sections()``)."""
        from apps.rlvr.judge import Judge

        self.judges = {name: Judge(name, self.sections[name], roles, prompt_key, messages_key)
                       for name in sorted(self.role_based)}  # fmt: skip

    def shutdown(self) -> None:
        """Kill the reward actors and drop the judges (idempotent); later calls score in the driver."""
        workers, self.workers = self.workers, None
        self.judges = {}
        if workers is not None:
            workers.shutdown()

    def section_for(self, record: dict[str, Any]) -> str:
        """The reward section of a record, as ROLL picks its reward by the record's domain: its ``domain`` column
        when set (it must name a section), else the section whose ``tag_included`` has its ``tag``, else ROLL's
        default domain ``math_rule`` when there is such a section, else a section without ``tag_included``."""
        domain = record.get("domain")
        if domain is not None and domain != "" and not (isinstance(domain, float) and math.isnan(domain)):
            if str(domain) not in self.sections:
                raise ValueError(
                    f"a record's domain column is {domain!r}, which names no reward section (ROLL grades a record by "
                    f"the reward its domain names); sections: {sorted(self.sections)}. Fix the data or add the section."
                )
            return str(domain)
        tag = record.get("tag")
        if tag in self.by_tag:
            return self.by_tag[str(tag)]
        if ROLL_DEFAULT_DOMAIN in self.sections:
            return ROLL_DEFAULT_DOMAIN
        if self.default is not None:
            return self.default
        raise ValueError(
            f"no reward takes tag {tag!r}: add it to some rewards.<name>.tag_included, name a section "
            f"{ROLL_DEFAULT_DOMAIN} (ROLL's default domain), or add a reward section without tag_included to take "
            "every other sample."
        )

    def check_records(self, records: list[dict[str, Any]], what: str) -> None:
        """Every record resolves to a reward section (raises at load, naming the first that does not)."""
        for number, record in enumerate(records):
            try:
                self.section_for(record)
            except ValueError as error:
                raise ValueError(f"{what} record {number}: {error}") from None

    def grade(self, response: str, record: dict[str, Any], response_tokens: int) -> Grade:
        """The grade of one response, in the driver."""
        name = self.section_for(record)
        return graded(self.functions[name], response, record, self.sections[name].spec, response_tokens)

    def grade_many(self, texts: list[str], records: list[dict[str, Any]], lengths: list[int]) -> list[Grade]:
        """The grade of every response, in order; ``lengths`` are response tokens.

        Every worker-backed section's share is sent to its actors first (all sections run in parallel), the
        driver scores the other sections meanwhile, then the actors' grades are gathered. Raises the worker
        errors of ``rl_engines.worker_group`` naming ``rewards.<name>``.
        """
        if not len(texts) == len(records) == len(lengths):
            raise ValueError(
                f"grade_many needs one record and one length per text, got {len(texts)} texts, "
                f"{len(records)} records and {len(lengths)} lengths."
            )
        rows_of: dict[str, list[int]] = {}
        for row, record in enumerate(records):
            rows_of.setdefault(self.section_for(record), []).append(row)
        start = time.perf_counter()
        self.spans = {}
        workers = self.workers
        futures = {
            name: workers.score_async(name, _take(rows, texts), _take(rows, records), _take(rows, lengths))
            for name, rows in rows_of.items()
            if workers is not None and name in workers
        }
        grades = [Grade(0.0, 0.0)] * len(texts)
        for name, rows in rows_of.items():
            if name not in futures:
                begun = time.perf_counter()
                here = self._grade_here(name, _take(rows, texts), _take(rows, records), _take(rows, lengths))
                for i, grade in zip(rows, here):
                    grades[i] = grade
                self.spans[name] = (begun, time.perf_counter())
        for name, future in futures.items():
            for i, grade in zip(rows_of[name], future.get()):
                grades[i] = grade
            self.spans[name] = (start, time.perf_counter())
        self.graded = {name: _take(rows, grades) for name, rows in rows_of.items()}
        return grades

    def _grade_here(
        self, name: str, texts: list[str], records: list[dict[str, Any]], lengths: list[int]
    ) -> list[Grade]:
        """One section's rows graded in the driver, or by its judge role."""
        spec = self.sections[name].spec
        if name not in self.role_based:
            return graded_rows(self.functions[name], texts, records, spec, lengths)
        if name not in self.judges:
            raise RuntimeError(
                f"rewards.{name} is graded by a model running as the role rewards.{name}, which is not attached: "
                "start role_sections() with the pipeline's roles and call attach_judges first."
            )
        values = self.judges[name].grade(texts, records)
        return [_penalized(value, spec, tokens) for value, tokens in zip(values, lengths)]


def part_metrics(grades_of: dict[str, list[Grade]]) -> dict[str, float]:
    """``<section>/<part>``: the mean of each part of the section's grades (ROLL's ``reduce_metrics`` of a reward
    worker's metrics under its domain)."""
    out: dict[str, float] = {}
    for name, grades in grades_of.items():
        for part in dict.fromkeys(key for grade in grades for key in grade.parts):
            values = [grade.parts[part] for grade in grades if part in grade.parts]
            out[f"{name}/{part}"] = sum(values) / len(values)
    return out


def _take(rows: list[int], values: list[T]) -> list[T]:
    return [values[row] for row in rows]


# The rule rewards of the other domains register themselves on import (they use this module's registry).
from apps.rlvr import code_reward, detection_reward, judge, rule_rewards, video_r1_reward  # noqa: E402, F401
