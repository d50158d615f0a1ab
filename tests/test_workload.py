"""Workload files: what loads, and what is refused (with the file, the place and what is allowed)."""

import json

import pytest

from specwise.errors import SpecwiseError
from specwise.harness.workload import load_workload

GOOD = """
name: demo
defaults: {max_tokens: 32, groups: [misc]}
tasks:
  - id: a
    prompt: "Say hi"
  - id: b
    messages: [{role: user, content: "Say bye"}]
    max_tokens: 8
    groups: [chat]
    validators: [{type: length, max: 20}]
"""


def write(tmp_path, text, name="w.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_workload_loads_with_defaults(tmp_path):
    w = load_workload(write(tmp_path, GOOD))
    assert w.name == "demo" and [t.id for t in w.tasks] == ["a", "b"]
    assert w.tasks[0].max_tokens == 32 and w.tasks[0].groups == ("misc",)
    assert w.tasks[1].request == [{"role": "user", "content": "Say bye"}] and w.groups == ["chat", "misc"]


def test_jsonl_workload_loads(tmp_path):
    lines = [json.dumps({"id": f"t{i}", "prompt": f"p{i}", "max_tokens": 4}) for i in range(3)]
    w = load_workload(write(tmp_path, "\n".join(lines), "tasks.jsonl"))
    assert w.name == "tasks" and len(w.tasks) == 3


@pytest.mark.parametrize(
    "text, needle",
    [
        ("tasks: []", "'tasks' must be a non-empty list"),
        ("tasks:\n  - {prompt: hi, max_tokens: 3}", "tasks[0]: field 'id' is missing"),
        ("tasks:\n  - {id: a, max_tokens: 3}", "tasks[0] ('a'): give exactly one of 'prompt'"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: ten}", "'max_tokens' must be a whole number ≥ 1, got 'ten'"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: 0}", "got 0"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: 3, groups: x}", "'groups' must be a list"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: 3, validators: [{type: magic}]}", "unknown validator 'magic'"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: 3, colour: red}", "unknown field(s) ['colour']"),
        ("tasks:\n  - {id: a, messages: [{role: robot, content: x}], max_tokens: 3}", "role: system|user|assistant"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: 3}\n  - {id: a, prompt: yo, max_tokens: 3}", "repeated: ['a']"),
        ("tasks: [", "not valid YAML"),
        ("- 1\n- 2", "top level must be a mapping"),
        ("tasks:\n  - {id: a, prompt: hi, max_tokens: 3}\nextra: 1", "unknown top-level field(s) ['extra']"),
    ],
)
def test_bad_workloads_are_refused_with_the_place(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(SpecwiseError) as err:
        load_workload(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_missing_file_and_wrong_suffix(tmp_path):
    with pytest.raises(SpecwiseError, match="does not exist"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(SpecwiseError, match=r"\.yaml, \.yml or \.jsonl"):
        load_workload(write(tmp_path, "x", "w.txt"))


def test_bad_jsonl_line_names_the_line(tmp_path):
    with pytest.raises(SpecwiseError, match=r"tasks.jsonl:2: not valid JSON"):
        load_workload(write(tmp_path, '{"id": "a", "prompt": "p", "max_tokens": 1}\n{oops', "tasks.jsonl"))


def test_stratified_subset_balances_every_group():
    from specwise.harness.evaluate import stratified
    from specwise.harness.workload import builtin_workload

    sub = stratified(builtin_workload(), 12)
    counts = {g: sum(g in t.groups for t in sub.tasks) for g in sub.groups}
    assert len(sub.tasks) == 12 and set(counts) == set(builtin_workload().groups)
    assert counts == {g: 6 for g in counts}  # three binary tags, 12 tasks: six of each side
    combos = {tuple(sorted(t.groups)) for t in sub.tasks}
    assert len(combos) == 8  # every combination of familiarity × input size × output kind
    familiar = {t.id for t in sub.tasks if "familiar" in t.groups}
    short = {t.id for t in sub.tasks if "short-input" in t.groups}
    assert familiar != short  # tags do not coincide, so their groups measure different things


def test_the_spec_bench_like_workload_has_six_categories_and_validators():
    from specwise.harness.workload import builtin_workload

    w = builtin_workload("spec-bench-like")
    groups = {g for t in w.tasks for g in t.groups}
    assert groups == {"multi-turn", "translation", "summarisation", "question-answering", "math", "retrieval"}
    assert all(t.validators for t in w.tasks) and all(t.messages for t in w.tasks)
    assert any(len(t.messages) > 1 for t in w.tasks if "multi-turn" in t.groups)
    with pytest.raises(SpecwiseError, match="allowed: release-notes, spec-bench-like"):
        builtin_workload("mt-bench")


@pytest.mark.embedded
def test_the_embedded_model_passes_some_spec_bench_like_validators(tmp_path):
    """Goodput is not zero by construction: the real model passes validators in most categories."""
    from test_evaluate import cli

    from specwise.harness.analyze import load_run

    cli(
        "evaluate",
        "--repeats",
        "1",
        "--workload",
        "spec-bench-like",
        "--tasks",
        "0",
        "--concurrency",
        "1",
        "--drafter",
        "ngram",
        "--out",
        tmp_path,
        "--no-progress",
        timeout=600,
    )
    run = load_run(tmp_path / "run.db")
    base = [r for r in run.analysis.table if r.config == "baseline"]
    assert len(base) == 6 and sum(r.validation_rate > 0 for r in base) >= 4, [
        (r.group, r.validation_rate) for r in base
    ]


def test_an_unknown_workload_name_is_refused(tmp_path):
    from test_evaluate import cli

    proc = cli("evaluate", "--repeats", "1", "--workload", "spec-bench", "--out", tmp_path, check=False)
    assert proc.returncode == 2 and "neither a file nor a built-in workload" in proc.stderr
    assert "spec-bench-like" in proc.stderr


def test_the_agent_like_workload_asks_for_tool_calls_of_recurring_shapes():
    from specwise.harness.validate import run_validators
    from specwise.harness.workload import builtin_workload

    w = builtin_workload("agent-like")
    assert len(w.tasks) == 16 and {g for t in w.tasks for g in t.groups} >= {"agent", "get_weather", "create_ticket"}
    task = next(t for t in w.tasks if t.id == "get_weather-0")
    good = '{"tool": "get_weather", "arguments": {"city": "Paris"}}'
    assert all(o.passed for o in run_validators(good, list(task.validators)))
    for bad in (
        '{"tool": "search_flights", "arguments": {"city": "Paris"}}',
        "Paris is sunny",
        '{"tool": "get_weather"}',
    ):
        assert not all(o.passed for o in run_validators(bad, list(task.validators))), bad
