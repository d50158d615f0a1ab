"""Task validators: does an output do the job, whatever produced it?

Each validator is a plain function of (output text, parameters) → (passed, reason). Parameters are checked when a
workload is loaded (`check_validator`), so a typo fails before any measuring starts. The release-note validators
encode the task's contract: the required headings are there, every item of the notes is kept, and nothing appears
that the notes do not contain (a version number, an identifier, an extra item).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema

from specwise.errors import SpecwiseError

VERSION_RE = re.compile(r"\bv?\d+(?:\.\d+)+(?:-[0-9A-Za-z.]+)?\b")
IDENT_RE = re.compile(r"`([^`\n]+)`|\b([A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]+|[a-z]+[A-Z][A-Za-z0-9]+)\b")
BULLET_RE = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+\S", re.MULTILINE)


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
    invented = sorted({m.group(0) for m in VERSION_RE.finditer(text) if m.group(0).lower().lstrip("v") not in source})
    for m in IDENT_RE.finditer(text):
        ident = m.group(1) or m.group(2)
        if ident.lower() not in source:
            invented.append(ident)
    bullets = len(BULLET_RE.findall(text))
    if "max_items" in p and bullets > p["max_items"]:
        invented.append(f"{bullets} list items for {p['max_items']} notes")
    return not invented, f"not in the notes: {invented}" if invented else ""


def _regex(text: str, p: dict) -> tuple[bool, str]:
    found = re.search(p["pattern"], text, re.MULTILINE) is not None
    want = p.get("must_match", True)
    return found == want, "" if found == want else f"pattern {p['pattern']!r} {'not ' if want else ''}found"


def _length(text: str, p: dict) -> tuple[bool, str]:
    unit = p.get("unit", "words")
    n = len(text.split()) if unit == "words" else len(text)
    lo, hi = p.get("min", 0), p.get("max", float("inf"))
    return lo <= n <= hi, "" if lo <= n <= hi else f"{n} {unit}, allowed {lo}..{hi}"


def _json_schema(text: str, p: dict) -> tuple[bool, str]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, f"not JSON ({exc.msg} at char {exc.pos})"
    except RecursionError:
        return False, "not JSON this validator can read: nested too deeply"
    try:
        jsonschema.validate(doc, p["schema"])
    except jsonschema.ValidationError as exc:
        return False, f"JSON does not match the schema: {exc.message}"
    except RecursionError:
        return False, "JSON nested too deeply to check against the schema"
    return True, ""


# name → (function, required parameters with their types, optional parameters with their types)
VALIDATORS: dict[str, tuple[Callable[[str, dict], tuple[bool, str]], dict, dict]] = {
    "headings": (_headings, {"required": list}, {}),
    "items_kept": (_items_kept, {"keys": list}, {}),
    "nothing_invented": (_nothing_invented, {"source": str}, {"max_items": int}),
    "regex": (_regex, {"pattern": str}, {"must_match": bool}),
    "length": (_length, {}, {"min": int, "max": int, "unit": str}),
    "json_schema": (_json_schema, {"schema": dict}, {}),
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
            re.compile(spec["pattern"])
        except re.error as exc:
            raise SpecwiseError(f"{where}: regex {spec['pattern']!r} does not compile ({exc})") from None
    if kind == "json_schema":
        try:
            jsonschema.validators.validator_for(spec["schema"]).check_schema(spec["schema"])
        except jsonschema.SchemaError as exc:
            raise SpecwiseError(f"{where}: validator 'json_schema' has an invalid schema: {exc.message}") from None
    if kind == "length" and spec.get("unit", "words") not in ("words", "chars"):
        raise SpecwiseError(f"{where}: validator 'length' unit must be 'words' or 'chars'")
    return spec


def run_validators(text: str, specs: list[dict]) -> list[Outcome]:
    """Judge one output with every validator of its task. A validator that fails on an output (whatever the output
    is) judges it failed, with the reason: a model's output never aborts a run."""
    out = []
    for s in specs:
        try:
            out.append(Outcome(s["type"], *VALIDATORS[s["type"]][0](text, s)))
        except Exception as exc:  # RecursionError, MemoryError of a pathological output, a validator's own bug
            out.append(Outcome(s["type"], False, f"the validator could not judge this output ({type(exc).__name__})"))
    return out
