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
