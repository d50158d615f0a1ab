"""Task validators: does an output do the job, whatever produced it?

Each validator is a plain function of (output text, parameters) → (passed, reason). Parameters are checked when a
workload is loaded (`check_validator`), so a typo fails before any measuring starts. The release-note validators
encode the task's contract: the required headings are there, every item of the notes is kept, and nothing appears
that the notes do not contain (a version number, an identifier, an extra item).

Every validator of one output shares one time limit (`LIMIT_S`): patterns run under the `regex` package's timeout
(a workload's own `regex`, a schema's `pattern` and `patternProperties`), so a pathological output or pattern fails
that output with a reason instead of stalling the run. A schema's `$ref`s resolve inside the schema only: nothing is
fetched, and a reference that points outside is refused when the workload loads.
"""

from __future__ import annotations

import ast
import contextvars
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache

import jsonschema
import referencing
import referencing.exceptions
import regex

from specwise.errors import SpecwiseError

LIMIT_S = 2.0  # all validators of one output together, seconds
VERSION_RE = regex.compile(r"\bv?\d+(?:\.\d+)+(?:-[0-9A-Za-z.]+)?\b")
IDENT_RE = regex.compile(r"`([^`\n]+)`|\b([A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]+|[a-z]+[A-Z][A-Za-z0-9]+)\b")
# A list item: the indent is spaces and tabs only (`^\s*` would span blank lines, quadratic on an output that loops)
BULLET_RE = regex.compile(r"^[ \t]*(?:[-*•]|\d+[.)])[ \t]+\S", regex.MULTILINE)
_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("validate_deadline", default=float("inf"))


class OutOfTime(Exception):
    """The output's validators used up `LIMIT_S`."""


def _left() -> float:
    left = _deadline.get() - time.monotonic()
    if left <= 0:
        raise OutOfTime
    return left


@lru_cache(maxsize=256)
def _compiled(pattern: str, flags: int = 0) -> regex.Pattern:
    return regex.compile(pattern, flags)


def _search(pattern: str | regex.Pattern, text: str, flags: int = 0) -> bool:
    pat = _compiled(pattern, flags) if isinstance(pattern, str) else pattern
    try:
        return pat.search(text, timeout=_left()) is not None
    except TimeoutError:
        raise OutOfTime from None


def _finditer(pat: regex.Pattern, text: str) -> Iterator[regex.Match]:
    try:
        yield from pat.finditer(text, timeout=_left())
    except TimeoutError:
        raise OutOfTime from None


@dataclass(frozen=True)
class Outcome:
    """One validator's judgement of one output."""

    name: str
    passed: bool
    reason: str = ""


def _headings(text: str, p: dict) -> tuple[bool, str]:
    lines = [line.strip().lower() for line in text.splitlines()]
    missing = [h for h in p["required"] if h.strip().lower() not in lines]
    return not missing, f"missing heading(s): {missing}" if missing else ""


def _items_kept(text: str, p: dict) -> tuple[bool, str]:
    low = text.lower()
    dropped = [k for k in p["keys"] if k.lower() not in low]
    return not dropped, f"dropped item(s): {dropped}" if dropped else ""


def _nothing_invented(text: str, p: dict) -> tuple[bool, str]:
    source = p["source"].lower()
    invented = sorted({m.group(0) for m in _finditer(VERSION_RE, text) if m.group(0).lower().lstrip("v") not in source})
    for m in _finditer(IDENT_RE, text):
        ident = m.group(1) or m.group(2)
        if ident.lower() not in source:
            invented.append(ident)
    bullets = sum(1 for _ in _finditer(BULLET_RE, text))
    if "max_items" in p and bullets > p["max_items"]:
        invented.append(f"{bullets} list items for {p['max_items']} notes")
    return not invented, f"not in the notes: {invented}" if invented else ""


def _regex(text: str, p: dict) -> tuple[bool, str]:
    found = _search(p["pattern"], text, regex.MULTILINE)
    want = p.get("must_match", True)
    return found == want, "" if found == want else f"pattern {p['pattern']!r} {'not ' if want else ''}found"


def _length(text: str, p: dict) -> tuple[bool, str]:
    unit = p.get("unit", "words")
    n = len(text.split()) if unit == "words" else len(text)
    lo, hi = p.get("min", 0), p.get("max", float("inf"))
    return lo <= n <= hi, "" if lo <= n <= hi else f"{n} {unit}, allowed {lo}..{hi}"


FENCE_RE = regex.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", regex.DOTALL)
LANGUAGES = ("python",)  # what code_parses can parse


def _code(text: str) -> str:
    """The code an answer gives: its first fenced block (```python …```; an unclosed one to the end), else all of it."""
    m = next(_finditer(FENCE_RE, text), None)
    return m.group(2) if m else text


def _code_parses(text: str, p: dict) -> tuple[bool, str]:
    """The answer's code parses (Python: `ast.parse`, which never runs it)."""
    code = _code(text)
    if not code.strip():
        return False, "no code in the answer"
    try:
        ast.parse(code)
    except SyntaxError as exc:
        return False, f"the code does not parse as Python: {exc.msg} (line {exc.lineno})"
    except (RecursionError, MemoryError, ValueError) as exc:
        return False, f"the code does not parse as Python ({type(exc).__name__})"
    return True, ""


def _identifiers_kept(text: str, p: dict) -> tuple[bool, str]:
    """Every name the input's code defines or uses that the edit must keep is still in the answer's code."""
    code = _code(text)
    lost = [n for n in p["names"] if not _search(r"(?<![A-Za-z0-9_])" + regex.escape(n) + r"(?![A-Za-z0-9_])", code)]
    return not lost, f"identifier(s) lost: {lost}" if lost else ""


def _json_schema(text: str, p: dict) -> tuple[bool, str]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, f"not JSON ({exc.msg} at char {exc.pos})"
    except RecursionError:
        return False, "not JSON this validator can read: nested too deeply"
    try:
        error = jsonschema.exceptions.best_match(_schema_validator(p["schema"]).iter_errors(doc))
    except RecursionError:
        return False, "JSON nested too deeply to check against the schema"
    except referencing.exceptions.Unresolvable as exc:
        return False, f"the schema's reference {getattr(exc, 'ref', '')!r} does not resolve inside the schema"
    if error is not None:
        return False, f"JSON does not match the schema: {error.message}"
    return True, ""


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if validator.is_type(instance, "object"):
        for pattern, sub in patterns.items():
            for key, value in instance.items():
                if _search(pattern, key):
                    yield from validator.descend(value, sub, path=key, schema_path=pattern)


def _additional_properties(validator, extra, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    known, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [k for k in instance if k not in known and not any(_search(p, k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif extra is False and extras:
        yield jsonschema.ValidationError(f"additional properties are not allowed ({sorted(extras)} unexpected)")


_TIMED = {"pattern": _pattern, "patternProperties": _pattern_properties, "additionalProperties": _additional_properties}
_NO_RETRIEVAL: referencing.Registry = referencing.Registry()  # no `retrieve`: an outside reference is Unresolvable


def _schema_validator(schema: dict) -> jsonschema.protocols.Validator:
    """The schema's validator with its patterns under the time limit and a registry that never fetches."""
    return _timed_class(jsonschema.validators.validator_for(schema))(schema, registry=_NO_RETRIEVAL)


@cache
def _timed_class(base: type) -> type:
    """`base` (one per draft of JSON Schema) with the timed keywords: built once, not per output checked."""
    return jsonschema.validators.extend(base, _TIMED)


def _outside_refs(node: object) -> list[str]:
    """Every `$ref`/`$dynamicRef` of a schema that does not point inside the schema itself (a `#` fragment)."""
    found: list[str] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            for key, value in cur.items():
                inside = isinstance(value, str) and value.startswith("#")
                if key in ("$ref", "$dynamicRef", "$recursiveRef") and not inside:
                    found.append(str(value))
                stack.append(value)
        elif isinstance(cur, list):
            stack.extend(cur)
    return found


# name → (function, required parameters with their types, optional parameters with their types)
VALIDATORS: dict[str, tuple[Callable[[str, dict], tuple[bool, str]], dict, dict]] = {
    "headings": (_headings, {"required": list}, {}),
    "items_kept": (_items_kept, {"keys": list}, {}),
    "nothing_invented": (_nothing_invented, {"source": str}, {"max_items": int}),
    "regex": (_regex, {"pattern": str}, {"must_match": bool}),
    "length": (_length, {}, {"min": int, "max": int, "unit": str}),
    "json_schema": (_json_schema, {"schema": dict}, {}),
    "code_parses": (_code_parses, {}, {"language": str}),
    "identifiers_kept": (_identifiers_kept, {"names": list}, {}),
}


def check_validator(spec: object, where: str) -> dict:
    """Raise SpecwiseError (naming `where`) unless `spec` is a known validator with well-typed parameters."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise SpecwiseError(f"{where}: a validator is a mapping with a 'type' (allowed: {sorted(VALIDATORS)})")
    kind = spec["type"]
    if kind not in VALIDATORS:
        raise SpecwiseError(f"{where}: unknown validator {kind!r} (allowed: {sorted(VALIDATORS)})")
    _, required, optional = VALIDATORS[kind]
    for name, typ in {**required, **optional}.items():
        if name in spec and not isinstance(spec[name], typ):
            raise SpecwiseError(f"{where}: validator {kind!r} parameter {name!r} must be a {typ.__name__}")
    missing = [n for n in required if n not in spec]
    if missing:
        raise SpecwiseError(f"{where}: validator {kind!r} needs parameter(s) {missing}")
    extra = sorted(set(spec) - {"type", *required, *optional})
    if extra:
        raise SpecwiseError(
            f"{where}: validator {kind!r} has unknown parameter(s) {extra} (allowed: {sorted({*required, *optional})})"
        )
    if kind == "regex":
        try:
            regex.compile(spec["pattern"])
        except regex.error as exc:
            raise SpecwiseError(f"{where}: regex {spec['pattern']!r} does not compile ({exc})") from None
    if kind == "json_schema":
        try:
            jsonschema.validators.validator_for(spec["schema"]).check_schema(spec["schema"])
        except jsonschema.SchemaError as exc:
            raise SpecwiseError(f"{where}: validator 'json_schema' has an invalid schema: {exc.message}") from None
        except RecursionError:
            raise SpecwiseError(f"{where}: validator 'json_schema' has a schema nested too deeply") from None
        outside = _outside_refs(spec["schema"])
        if outside:
            raise SpecwiseError(
                f"{where}: validator 'json_schema' refers outside its schema ({outside[:3]}); nothing is fetched: "
                "a reference must be a fragment of the schema itself ('#/$defs/NAME')"
            )
    if kind == "code_parses" and spec.get("language", LANGUAGES[0]) not in LANGUAGES:
        raise SpecwiseError(f"{where}: validator 'code_parses' language must be one of {list(LANGUAGES)}")
    if kind == "identifiers_kept" and not all(
        isinstance(n, str) and regex.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in spec["names"]
    ):
        raise SpecwiseError(f"{where}: validator 'identifiers_kept' names must be identifiers (letters, digits, _)")
    if kind == "length" and spec.get("unit", "words") not in ("words", "chars"):
        raise SpecwiseError(f"{where}: validator 'length' unit must be 'words' or 'chars'")
    return spec


def run_validators(text: str, specs: list[dict], limit_s: float = LIMIT_S) -> list[Outcome]:
    """Judge one output with every validator of its task, all of them within `limit_s`. A validator that fails on an
    output (whatever the output is) or runs out of time judges it failed, with the reason: a model's output never
    aborts or stalls a run."""
    out = []
    token = _deadline.set(time.monotonic() + limit_s)
    try:
        for s in specs:
            try:
                _left()
                out.append(Outcome(s["type"], *VALIDATORS[s["type"]][0](text, s)))
            except OutOfTime:
                out.append(Outcome(s["type"], False, f"not judged within the output's {limit_s:g} s validation limit"))
            except Exception as exc:  # RecursionError, MemoryError of a pathological output, a validator's own bug
                reason = f"the validator could not judge this output ({type(exc).__name__})"
                out.append(Outcome(s["type"], False, reason))
    finally:
        _deadline.reset(token)
    return out
