"""Validators on crafted passing and failing outputs."""

import pytest

from specwise.errors import SpecwiseError
from specwise.harness.validate import check_validator, run_validators
from specwise.harness.workload import builtin_workload

NOTES = (
    "2.4.1\n- Fixed a crash on the login page when the password field is empty.\n- Fixed a typo in the welcome email."
)
GOOD_DRAFT = """## Release 2.4.1
### Summary
This release fixes two bugs.
### Changes
- Fixed a crash on the login page when the password is empty.
- Fixed a typo in the welcome email.
"""
DRAFT_VALIDATORS = [
    {"type": "headings", "required": ["## Release 2.4.1", "### Summary", "### Changes"]},
    {"type": "items_kept", "keys": ["login", "welcome email"]},
    {"type": "nothing_invented", "source": NOTES, "max_items": 2},
]


def verdicts(text):
    return {o.name: o.passed for o in run_validators(text, DRAFT_VALIDATORS)}


def test_faithful_draft_passes_every_validator():
    assert verdicts(GOOD_DRAFT) == {"headings": True, "items_kept": True, "nothing_invented": True}


def test_invented_version_number_fails():
    out = run_validators(GOOD_DRAFT.replace("This release", "Like 2.5.0, this release"), DRAFT_VALIDATORS)
    bad = [o for o in out if not o.passed]
    assert [o.name for o in bad] == ["nothing_invented"] and "2.5.0" in bad[0].reason


def test_invented_identifier_fails():
    assert not verdicts(GOOD_DRAFT + "- Tuned `max_retry_budget`.\n")["nothing_invented"]


def test_extra_item_fails():
    assert not verdicts(GOOD_DRAFT + "- Improved performance.\n")["nothing_invented"]


def test_dropped_item_fails():
    out = run_validators(GOOD_DRAFT.replace("- Fixed a typo in the welcome email.\n", ""), DRAFT_VALIDATORS)
    kept = next(o for o in out if o.name == "items_kept")
    assert not kept.passed and "welcome email" in kept.reason


def test_missing_heading_fails():
    assert not verdicts(GOOD_DRAFT.replace("### Summary", "Summary:"))["headings"]


@pytest.mark.parametrize(
    "spec, text, passed",
    [
        ({"type": "regex", "pattern": r"^## Release"}, "## Release 1", True),
        ({"type": "regex", "pattern": r"TODO", "must_match": False}, "all done", True),
        ({"type": "regex", "pattern": r"TODO", "must_match": False}, "TODO: fix", False),
        ({"type": "length", "max": 3}, "one two three four", False),
        ({"type": "length", "min": 2, "unit": "chars"}, "ok", True),
        ({"type": "json_schema", "schema": {"type": "object", "required": ["a"]}}, '{"a": 1}', True),
        ({"type": "json_schema", "schema": {"type": "object", "required": ["a"]}}, '{"b": 1}', False),
        ({"type": "json_schema", "schema": {"type": "object"}}, "not json", False),
    ],
)
def test_generic_validators(spec, text, passed):
    check_validator(spec, "test")
    assert run_validators(text, [spec])[0].passed is passed


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"type": "spellcheck"}, "unknown validator 'spellcheck'"),
        ({"type": "regex"}, "needs parameter(s) ['pattern']"),
        ({"type": "regex", "pattern": "("}, "does not compile"),
        ({"type": "length", "max": "ten"}, "must be a int"),
        ({"type": "length", "unit": "pages"}, "unit must be"),
        ({"type": "headings", "required": ["x"], "strict": True}, "unknown parameter(s) ['strict']"),
        ("regex", "mapping with a 'type'"),
    ],
)
def test_bad_validator_specs_are_refused(spec, needle):
    with pytest.raises(SpecwiseError) as err:
        check_validator(spec, "w.yaml: tasks[0]")
    assert needle in str(err.value) and "w.yaml: tasks[0]" in str(err.value)


def test_builtin_workload_shape():
    w = builtin_workload()
    assert len(w.tasks) >= 40
    for g in ("familiar", "unfamiliar", "short-input", "long-input", "summary", "draft"):
        assert sum(g in t.groups for t in w.tasks) >= 8, g
    for t in w.tasks:  # every built-in task's validators accept a faithful answer shape and are well-formed
        for v in t.validators:
            check_validator(v, t.id)


# --- the built-in code workload (issue 33): correct answers pass every validator, the input echoed back fails ---

FIXED = {
    "receipt/rename": lambda code: code.replace("calc(", "compute_total("),
    "receipt/types": lambda code: (
        code.replace("def calc(items):", "def calc(items: list[dict]) -> float:")
        .replace("def apply_discount(total, percent):", "def apply_discount(total: float, percent: float) -> float:")
        .replace("(items, percent=0):", "(items: list[dict], percent: float = 0) -> str:")
    ),
    "average/fix": lambda code: code.replace("range(len(values) - window)", "range(len(values) - window + 1)"),
    "limiter/docstrings": lambda code: code.replace(
        "class RateLimiter:\n", 'class RateLimiter:\n    """A token bucket."""\n\n'
    ),
    "config/refactor": lambda code: (
        "def convert_value(value):\n    return value\n\n\n"
        + code.replace("config[key] = value", "config[key] = convert_value(value)")
    ),
    "intervals/types": lambda code: code.replace(
        "def merge_intervals(intervals):", "def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:"
    ),
    "counts/feature": lambda code: code.replace("stopwords=None):", "stopwords=None, limit=None):").replace(
        "counts.most_common()", "counts.most_common(limit)"
    ),
}
ANSWERS = {
    "receipt/question": ("It raises a ValueError because percent must be between 0 and 100.", "It prints 150."),
    "average/question": ("It raises ValueError: window must be positive.", "It returns an empty list."),
    "limiter/question": ("It returns False and keeps the tokens.", "It waits until enough tokens arrive."),
    "config/question": ("It returns {'retries': 3}, with 3 as an int.", "It returns the string 'retries = 3'."),
    "intervals/question": ("[[1, 6], [8, 10]]", "[[1, 3], [2, 6], [8, 10]]"),
}


def _input_code(task) -> str:
    text = task.messages[-1]["content"]
    return text.split("```python\n", 1)[1].rsplit("```", 1)[0]


def test_the_code_workload_has_edits_and_questions_on_the_same_code():
    w = builtin_workload("code")
    assert w.name == "code" and len(w.tasks) == 12 and set(w.groups) == {"edit", "question"}
    assert sum("edit" in t.groups for t in w.tasks) == len(FIXED) == 7
    assert {t.id for t in w.tasks} == set(FIXED) | set(ANSWERS)


@pytest.mark.parametrize("task_id", sorted(FIXED))
def test_a_correct_edit_passes_and_the_input_echoed_back_fails(task_id):
    task = next(t for t in builtin_workload("code").tasks if t.id == task_id)
    code = _input_code(task)
    fixed = FIXED[task_id](code)
    assert fixed != code
    ok = run_validators(f"Here is the updated code:\n```python\n{fixed}```\n", list(task.validators))
    assert all(o.passed for o in ok), [(o.name, o.reason) for o in ok if not o.passed]
    echoed = run_validators(f"```python\n{code}```", list(task.validators))
    assert not all(o.passed for o in echoed)
    broken = run_validators(f"```python\n{fixed.replace('def ', 'def (', 1)}```", list(task.validators))
    assert not next(o for o in broken if o.name == "code_parses").passed


@pytest.mark.parametrize("task_id", sorted(ANSWERS))
def test_a_question_is_answered_right_or_wrong(task_id):
    task = next(t for t in builtin_workload("code").tasks if t.id == task_id)
    right, wrong = ANSWERS[task_id]
    assert all(o.passed for o in run_validators(right, list(task.validators)))
    assert not all(o.passed for o in run_validators(wrong, list(task.validators)))


@pytest.mark.parametrize(
    ("text", "passed", "reason"),
    [
        ("```python\ndef f(:\n```", False, "does not parse as Python: "),
        ("no fence, plain code:\nx = 1", False, "does not parse"),
        ("x = 1\ny = x + 1\n", True, ""),
        ("```python\n```", False, "no code in the answer"),
        ("```python\n" + "(" * 300 + "1" + ")" * 300 + "\n```", False, "does not parse as Python"),
        ("```py\nprint(1)\n", True, ""),  # an unclosed fence: to the end
    ],
)
def test_code_parses_judges_without_running(text, passed, reason):
    [o] = run_validators(text, [{"type": "code_parses"}])
    assert o.passed is passed and reason in o.reason


def test_identifiers_kept_needs_whole_names_in_the_code_block():
    spec = [{"type": "identifiers_kept", "names": ["total", "calc"]}]
    assert run_validators("```python\ntotal = calc(x)\n```", spec)[0].passed
    [o] = run_validators("```python\nsubtotal = recalc(x)\n```\ntotal calc", spec)  # prose outside the block
    assert not o.passed and o.reason == "identifier(s) lost: ['total', 'calc']"
    with pytest.raises(SpecwiseError, match="names must be identifiers"):
        check_validator({"type": "identifiers_kept", "names": ["a b"]}, "w")
    with pytest.raises(SpecwiseError, match="language must be one of"):
        check_validator({"type": "code_parses", "language": "cobol"}, "w")
