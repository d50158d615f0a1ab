"""What a system under test is — its target, server build and hardware — and the rule that configurations compared
side by side must be the same system in all three (`check_comparable`)."""

from __future__ import annotations

import json
import os
import platform

from specwise.errors import SpecwiseError
from specwise.harness.provenance import SystemFacts

COMPARED = ("target", "server", "hardware")  # what must be the same for a paired comparison to mean anything


def check_comparable(facts: dict[str, dict]) -> None:
    """Refuse configurations whose systems differ in target, server build or hardware, saying what differs."""
    systems = {n: SystemFacts.read(f) for n, f in facts.items()}
    for field_ in COMPARED:
        said = {n: s.named(field_) for n, s in systems.items()}
        if len({json.dumps(v, sort_keys=True) for v in said.values()}) > 1:
            detail = "; ".join(f"{n}: {describe(v)}" for n, v in said.items())
            raise SpecwiseError(
                f"the configurations differ in {field_} ({detail}): a paired comparison needs the same target, "
                "server build and hardware"
            )


def describe(value) -> str:
    """A fact for people: `unknown` where a system did not say."""
    if value is None or value == "":
        return "unknown"
    if isinstance(value, dict):
        return ", ".join(f"{k} {describe(v)}" for k, v in value.items())
    return str(value)


def hardware() -> dict:
    """CPU model and thread count of this machine (the engine backend adds the accelerator)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_threads": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
