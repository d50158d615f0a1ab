"""The harness must run from a light install: importing it must not import torch."""

import subprocess
import sys

HARNESS = ["specwise.harness." + m for m in (
    "workload", "validate", "stats", "verdict", "store", "load", "backends", "runner", "analyze", "report",
    "svgplot", "compare", "evaluate", "http_backend", "requestlog", "monitor")] + ["specwise.errors", "specwise.cli"]


def test_harness_modules_do_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in HARNESS) +
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
