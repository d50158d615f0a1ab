"""Workloads: tasks with a prompt or chat messages, group tags, an output limit and validators.

Loaded from YAML (`name`, `description`, `defaults`, `tasks`) or JSONL (one task per line) and checked field by
field, so a bad file fails with its path and the place before any measuring starts. `builtin_workload()` builds
the release-note assistant from `data/release_notes.yaml`: each note set gives a one-paragraph summary task and a
multi-section draft task, tagged familiar/unfamiliar, short-input/long-input and summary/draft.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specwise.errors import SpecwiseError
from specwise.harness.validate import check_validator

DATA = Path(__file__).parent / "data"
TASK_FIELDS = {"id", "prompt", "messages", "groups", "max_tokens", "validators"}


@dataclass(frozen=True)
class Task:
    """One request of a workload and how to judge its output."""

    id: str
    groups: tuple[str, ...]
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    validators: tuple[dict, ...] = ()

    @property
    def request(self) -> str | list[dict]:
        """What is sent: the prompt text, or the chat messages."""
        return self.prompt if self.prompt is not None else [dict(m) for m in self.messages or ()]


@dataclass
class Workload:
    name: str
    tasks: list[Task]
    description: str = ""
    source: str = ""
    groups: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.groups = sorted({g for t in self.tasks for g in t.groups})


def load_workload(path: str | Path) -> Workload:
    """Read and check a YAML or JSONL workload file."""
    path = Path(path)
    if not path.is_file():
        raise SpecwiseError(f"workload file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".jsonl":
        raw_tasks = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raw_tasks.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SpecwiseError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        doc = {"name": path.stem, "tasks": raw_tasks}
    elif path.suffix in (".yaml", ".yml"):
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecwiseError(f"{path}: not valid YAML ({exc})") from None
    else:
        raise SpecwiseError(f"{path}: a workload is a .yaml, .yml or .jsonl file")
    return parse_workload(doc, str(path))


def parse_workload(doc: object, source: str) -> Workload:
    """Check a workload document (already parsed) and build the tasks."""
    if not isinstance(doc, dict):
        raise SpecwiseError(
            f"{source}: the top level must be a mapping with 'tasks' (and optionally 'name', 'description', 'defaults')"
        )
    unknown = sorted(set(doc) - {"name", "description", "defaults", "tasks"})
    if unknown:
        raise SpecwiseError(
            f"{source}: unknown top-level field(s) {unknown} (allowed: name, description, defaults, tasks)"
        )
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict) or set(defaults) - (TASK_FIELDS - {"id", "prompt", "messages"}):
        raise SpecwiseError(f"{source}: 'defaults' may set only groups, max_tokens and validators")
    raw = doc.get("tasks")
    if not isinstance(raw, list) or not raw:
        raise SpecwiseError(f"{source}: 'tasks' must be a non-empty list of tasks")
    tasks = [_task({**defaults, **t} if isinstance(t, dict) else t, f"{source}: tasks[{i}]") for i, t in enumerate(raw)]
    ids = [t.id for t in tasks]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise SpecwiseError(f"{source}: task ids must be unique; repeated: {dupes}")
    name = doc.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        raise SpecwiseError(f"{source}: 'name' must be a non-empty string")
    return Workload(name, tasks, str(doc.get("description", "")), source)


def _task(t: object, where: str) -> Task:
    if not isinstance(t, dict):
        raise SpecwiseError(f"{where}: a task must be a mapping")
    unknown = sorted(set(t) - TASK_FIELDS)
    if unknown:
        raise SpecwiseError(f"{where}: unknown field(s) {unknown} (allowed: {sorted(TASK_FIELDS)})")
    tid = t.get("id")
    if not isinstance(tid, str) or not tid:
        raise SpecwiseError(f"{where}: field 'id' is missing or not a string")
    where = f"{where} ({tid!r})"
    prompt, messages = t.get("prompt"), t.get("messages")
    if (prompt is None) == (messages is None):
        raise SpecwiseError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a chat)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise SpecwiseError(f"{where}: field 'prompt' must be a non-empty string")
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise SpecwiseError(
            f"{where}: field 'messages' must be a non-empty list of {{role: system|user|assistant, content: string}}}}"
        )
    max_tokens = t.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise SpecwiseError(f"{where}: field 'max_tokens' must be a whole number ≥ 1, got {max_tokens!r}")
    groups = t.get("groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
        raise SpecwiseError(f"{where}: field 'groups' must be a list of non-empty strings")
    validators = t.get("validators", [])
    if not isinstance(validators, list):
        raise SpecwiseError(f"{where}: field 'validators' must be a list")
    checked = tuple(check_validator(v, f"{where} validators[{j}]") for j, v in enumerate(validators))
    return Task(
        tid, tuple(groups) or ("all",), max_tokens, prompt, tuple(messages) if messages is not None else None, checked
    )


# --- the built-in release-note workload ---------------------------------------------------------------------

SYSTEM = "You are a release-note assistant. You turn engineering notes into release notes for users."


BUILTIN = ("release-notes", "spec-bench-like", "agent-like", "code")
CODE_SYSTEM = "You are a careful Python programmer. You answer exactly what is asked."
CODE_EDIT = "Reply with the whole updated code in one ```python block and nothing else."


def code_workload() -> Workload:
    """Python edits whose answers copy most of their input, and questions about the same code (data/code.yaml):
    every edit's answer must parse and keep the input's identifiers."""
    doc = yaml.safe_load((DATA / "code.yaml").read_text())
    tasks = []
    for i, t in enumerate(doc["tasks"]):
        where = f"builtin:code tasks[{i}]"
        ask = t["ask"] if "question" in t["groups"] else f"{t['ask']} {CODE_EDIT}"
        user = f"{ask}\n\n```python\n{t['code']}```"
        tasks.append(
            Task(
                t["id"],
                tuple(t["groups"]),
                t["max_tokens"],
                messages=({"role": "system", "content": CODE_SYSTEM}, {"role": "user", "content": user}),
                validators=tuple(check_validator(v, f"{where} validators[{j}]") for j, v in enumerate(t["validators"])),
            )
        )
    return Workload(doc["name"], tasks, doc["description"], "builtin:code")


AGENT_SYSTEM = (
    "You are a tool-calling agent. Answer every request with exactly one JSON object and nothing else: "
    '{"tool": NAME, "arguments": {...}}. Tools: get_weather(city), search_flights(origin, destination, date), '
    "convert_currency(amount, source, target), create_ticket(title, priority)."
)
AGENT_EXAMPLES = [
    ("What's the weather in Oslo?", {"tool": "get_weather", "arguments": {"city": "Oslo"}}),
    (
        "Find me a flight from Lisbon to Rome on 2026-12-04.",
        {"tool": "search_flights", "arguments": {"origin": "Lisbon", "destination": "Rome", "date": "2026-12-04"}},
    ),
]
AGENT_REQUESTS: list[tuple[str, str, list]] = [
    ("get_weather", "What's the weather in {0}?", ["Paris", "Tokyo", "Lima", "Cairo"]),
    (
        "search_flights",
        "Find me a flight from {0} to {1} on 2026-12-1{2}.",
        [("Madrid", "Berlin", 1), ("Boston", "Denver", 2), ("Seoul", "Osaka", 3), ("Dublin", "Vienna", 4)],
    ),
    (
        "convert_currency",
        "Convert {0} {1} to {2}.",
        [(100, "EUR", "USD"), (250, "GBP", "JPY"), (40, "CHF", "EUR"), (75, "USD", "CAD")],
    ),
    (
        "create_ticket",
        "Open a {1} priority ticket: {0}.",
        [
            ("login page is slow", "high"),
            ("typo in footer", "low"),
            ("export fails on Safari", "medium"),
            ("dark mode flickers", "low"),
        ],
    ),
]
AGENT_ARGUMENTS = {
    "get_weather": ["city"],
    "search_flights": ["origin", "destination", "date"],
    "convert_currency": ["amount", "source", "target"],
    "create_ticket": ["title", "priority"],
}


def agent_workload() -> Workload:
    """Tool-calling turns whose answers are JSON objects of a few recurring shapes (what suffix drafting learns from
    across requests): four tools × four requests, each validated against its tool's call schema."""
    shots: list[dict] = [{"role": "system", "content": AGENT_SYSTEM}]
    for question, call in AGENT_EXAMPLES:
        shots += [{"role": "user", "content": question}, {"role": "assistant", "content": json.dumps(call)}]
    tasks = []
    for tool, template, values in AGENT_REQUESTS:
        schema = {
            "type": "object",
            "required": ["tool", "arguments"],
            "properties": {
                "tool": {"const": tool},
                "arguments": {"type": "object", "required": AGENT_ARGUMENTS[tool]},
            },
        }
        for i, v in enumerate(values):
            question = template.format(*(v if isinstance(v, tuple) else (v,)))
            tasks.append(
                Task(
                    f"{tool}-{i}",
                    ("agent", tool),
                    64,
                    messages=(*shots, {"role": "user", "content": question}),
                    validators=({"type": "json_schema", "schema": schema},),
                )
            )
    return Workload("agent-like", tasks, "tool-calling turns answered with JSON of recurring shapes", "built-in")


def builtin_workload(name: str = "release-notes") -> Workload:
    """A built-in workload: the release-note assistant (every note set as a summary task and a draft task), or
    `spec-bench-like` (data/spec_bench_like.yaml: Spec-Bench's six categories, small, with validators)."""
    if name not in BUILTIN:
        raise SpecwiseError(f"unknown built-in workload {name!r} (allowed: {', '.join(BUILTIN)})")
    if name == "spec-bench-like":
        return load_workload(DATA / "spec_bench_like.yaml")
    if name == "agent-like":
        return agent_workload()
    if name == "code":
        return code_workload()
    doc = yaml.safe_load((DATA / "release_notes.yaml").read_text())
    tasks = []
    for ns in doc["note_sets"]:
        items = ns["items"]
        notes = "\n".join(f"- {it['text']}" for it in items)
        version = ns["version"]
        size = "short-input" if len(items) <= 3 else "long-input"
        keys = [it["key"] for it in items]
        source = f"{version}\n{notes}"
        base = [{"type": "items_kept", "keys": keys}]
        summary = (
            f"Engineering notes for release {version}:\n{notes}\n\nWrite a one-paragraph summary of this "
            "release for users. Mention every change and add nothing that is not in the notes."
        )
        draft = (
            f"Engineering notes for release {version}:\n{notes}\n\nWrite the release notes in exactly this "
            f"format:\n## Release {version}\n### Summary\n(one sentence)\n### Changes\n(one bullet per note)\n"
            "Keep every note and add nothing that is not in the notes."
        )
        tasks.append(
            Task(
                f"{ns['id']}/summary",
                (ns["familiarity"], size, "summary"),
                96,
                messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": summary}),
                validators=(*base, {"type": "nothing_invented", "source": source}, {"type": "length", "max": 160}),
            )
        )
        tasks.append(
            Task(
                f"{ns['id']}/draft",
                (ns["familiarity"], size, "draft"),
                min(48 + 20 * len(items), 192),
                messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": draft}),
                validators=(
                    {"type": "headings", "required": [f"## Release {version}", "### Summary", "### Changes"]},
                    *base,
                    {"type": "nothing_invented", "source": source, "max_items": len(items)},
                ),
            )
        )
    return Workload(doc["name"], tasks, doc["description"], "builtin:release-notes")
