"""The fair losslessness audit, against a stand-in server whose *baseline* changes greedy outputs with the batch (as
llama.cpp's does): speculation is blamed only for what the baseline does not do to itself. Also: acceptance read
from a llama.cpp-style server's responses and counters."""

import sys
import time
from pathlib import Path

import pytest
from test_evaluate import cli
from test_server import free_port

from specwise.harness.analyze import load_run

FAKE = Path(__file__).with_name("fake_openai_server.py")


def workload(tmp_path: Path, n: int = 8) -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(
        "tasks:\n"
        + "".join(f"  - {{id: t{i}, prompt: 'task number {i} says hello', max_tokens: 16}}\n" for i in range(n))
    )
    return path


def evaluate(tmp_path: Path, spec_flags: str, name: str):
    port = free_port()
    server = f"{sys.executable} {FAKE} --port {port} --batch-variant"
    out = tmp_path / name
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--workload",
        workload(tmp_path),
        "--launch",
        server,
        "--launch",
        f"{server} --speculative {spec_flags}",
        "--concurrency",
        "1,4",
        "--out",
        out,
        "--no-progress",
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return load_run(out / "run.db"), proc.stdout


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    return evaluate(tmp_path_factory.mktemp("audit"), "", "lossless")


def test_a_batch_variant_baseline_is_reported_and_not_blamed_on_speculation(lossless):
    run, stdout = lossless
    a = run.analysis
    finding = {d.load: d for d in a.determinism}["concurrent@4"]
    assert finding.reference == "concurrent@1" and len(finding.changed) >= 4  # the baseline changed its own outputs
    assert "the baseline is not batch-invariant" in stdout and f"{len(finding.changed)} of 8 outputs" in stdout
    at4 = [c for c in a.comparisons if c.load == "concurrent@4"]
    assert at4 and all(c.mismatches == [] for c in at4)  # never an output the baseline did not produce itself
    assert sum(len(c.mismatches_vs_reference) for c in at4) > 0  # yet outputs did differ from the c=1 baseline
    verdict = a.verdicts["speculative"]["concurrent"]
    assert not any("differ from the baseline" in cl.text and not cl.ok for cl in verdict.clauses)


def test_a_speculation_that_changes_outputs_is_still_rejected(tmp_path):
    run, _ = evaluate(tmp_path, "--lossy", "lossy")
    verdict = run.analysis.verdicts["speculative"]["concurrent"]
    assert verdict.decision == "reject"
    bad = [cl.text for cl in verdict.clauses if not cl.ok and "differ from the baseline" in cl.text]
    assert any("@ concurrency 1: 8 greedy output(s)" in t for t in bad), bad
    # At concurrency 4 the baseline itself changed every output, so the count there proves nothing either way; the
    # clause says so, and concurrency 1 (no batching) carries the evidence.
    assert any("@ concurrency 4" in cl.text and "could explain them" in cl.text for cl in verdict.clauses)


def test_acceptance_is_read_from_llamacpp_style_responses_and_counters(lossless):
    run, stdout = lossless
    spec = [r for r in run.records if r.config == "speculative"]
    assert spec and all(r.spec.drafted == 6 and r.spec.accepted == 4 for r in spec)
    row = next(r for r in run.analysis.table if r.config == "speculative" and r.load == "concurrent@1")
    assert row.acceptance_rate == pytest.approx(4 / 6)
    counters = run.server_counters["speculative|concurrent@1"]
    assert counters[0].num_draft_tokens == 6 * 8 and counters[0].source == "llamacpp"
    assert "(llamacpp)" in stdout
    header = stdout.split("\n\n")[0]
    assert "sha256 unknown" in header and "server kind llama.cpp, version fake-1" in header and "None" not in header
    facts = run.provenance.facts
    assert facts["baseline"].target.path == "/models/fake" == facts["speculative"].target.path


def test_named_launches_and_a_second_server_on_another_target_is_refused(tmp_path):
    port = free_port()
    fake = f"{sys.executable} {FAKE} --port {port}"
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--workload",
        workload(tmp_path, 2),
        "--launch",
        f"llama-base={fake} --model a.gguf",
        "--launch",
        f"llama-ngram={fake} --model b.gguf",
        "--concurrency",
        "1",
        "--out",
        tmp_path / "out",
        "--no-progress",
        check=False,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "configuration 'llama-ngram': the configurations differ in target" in proc.stderr
    assert "llama-base: name a.gguf" in proc.stderr and "llama-ngram: name b.gguf" in proc.stderr
    assert (tmp_path / "out" / "server-llama-ngram.log").exists()


@pytest.mark.parametrize(
    "launches, needle",
    [
        (["a=x", "a=y"], "a is given twice"),
        (["base=", "spec=y"], "give a command after base="),
        (["x", "baseline=y"], "baseline is given twice"),
    ],
)
def test_bad_launch_names_are_refused(tmp_path, launches, needle):
    args = [a for launch in launches for a in ("--launch", launch)]
    proc = cli("evaluate", "--endpoint", "http://127.0.0.1:9", *args, "--out", tmp_path, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_an_environment_assignment_is_not_a_name():
    from specwise.harness.evaluate import launch_configs

    configs = launch_configs(["CUDA_VISIBLE_DEVICES=0 vllm serve m", "spec=vllm serve m --speculative-config {}"])
    assert [c.name for c in configs] == ["baseline", "spec"]
    assert configs[0].launch == "CUDA_VISIBLE_DEVICES=0 vllm serve m"


def test_a_launched_server_that_never_becomes_healthy_is_stopped_with_its_log_tail(tmp_path):
    port = free_port()
    hang = f"{sys.executable} -c \"print('loading weights', flush=True); import time; time.sleep(120)\""
    start = time.monotonic()
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--workload",
        workload(tmp_path, 2),
        "--launch",
        hang,
        "--launch",
        hang,
        "--launch-timeout",
        "3",
        "--concurrency",
        "1",
        "--out",
        tmp_path / "out",
        "--no-progress",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and time.monotonic() - start < 60
    assert "did not answer 200 within 3 s" in proc.stderr and "loading weights" in proc.stderr


def test_streaming_as_a_reader_sees_it_from_a_known_schedule(tmp_path):
    """Chunks every 50 ms, the first line complete at the third chunk; the speculative server stalls 0.6 s before
    its fifth chunk. The figures come out as scheduled, and the verdict tells of the burstier stream."""
    port = free_port()
    text = "'alpha beta gamma\ndelta epsilon zeta eta theta iota kappa'"  # a real newline, quoted for shlex
    server = f"{sys.executable} {FAKE} --port {port} --gap 0.05 --text {text}"
    out = tmp_path / "stream"
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--workload",
        workload(tmp_path, 6),
        "--launch",
        f"base={server}",
        "--launch",
        f"spec={server} --stall 4:0.6",
        "--concurrency",
        "1",
        "--out",
        out,
        "--no-progress",
        timeout=300,
    )
    run = load_run(out / "run.db")
    rows = {r.config: r.stream for r in run.analysis.table}
    base, spec = rows["base"], rows["spec"]
    assert 0.04 <= base.longest_stall.p50 <= 0.25 and 0.55 <= spec.longest_stall.p50 <= 1.0
    assert spec.gap_p99 >= 0.5 > base.gap_p99
    # first line: the first chunk (after the server's 0.15 s) and two 50 ms gaps; the stall comes later
    assert 0.2 <= base.first_line.p50 <= 0.6 and abs(spec.first_line.p50 - base.first_line.p50) < 0.2
    assert spec.chars_per_s.p50 < base.chars_per_s.p50  # the same text, delivered over a longer span
    verdict = run.analysis.verdicts["spec"]["concurrent"]
    assert any("streams are burstier" in cl.text and cl.neutral for cl in verdict.clauses)
    assert "streaming as a reader sees it" in proc.stdout and "[--]" in proc.stdout
