"""GuideLLM, the field's standard serving benchmark, against `specwise serve` on the embedded model: every request
it sends is accepted (it always asks for vLLM's continuous usage stats, once refused), and what it measures agrees
with what `specwise evaluate --endpoint` measures on the same server in the same run.

GuideLLM comes from scripts/guidellm.sh (a venv of its own in the cache; scripts/test-deps.sh installs it). Without
it this test fails rather than skips: it is part of what CI proves.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_evaluate import cli
from test_server import serve_process

from specwise.harness.analyze import load_run

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "river",
    "stone",
    "market",
    "lantern",
    "quiet",
    "engine",
    "garden",
    "paper",
    "window",
    "orbit",
    "velvet",
    "harbor",
    "signal",
    "copper",
    "meadow",
    "canvas",
    "thunder",
    "marble",
    "pocket",
    "ribbon",
]


def guidellm() -> str:
    proc = subprocess.run([str(ROOT / "scripts/guidellm.sh"), "--find-only"], capture_output=True, text=True)
    assert proc.returncode == 0, f"GuideLLM is not installed: run scripts/test-deps.sh ({proc.stderr.strip()})"
    return proc.stdout.strip()


def workload(path: Path, tokenizer, prompt_tokens: int = 64, n: int = 8) -> Path:
    """n chat tasks whose user message is `prompt_tokens` tokens of words, as GuideLLM's synthetic text is."""
    lines = ["tasks:"]
    for i in range(n):
        words: list[str] = []
        j = i
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < prompt_tokens:
            words.append(WORDS[j % len(WORDS)])
            j += 3 + i
        lines.append(f"  - {{id: g{i}, messages: [{{role: user, content: '{' '.join(words)}'}}], max_tokens: 32}}")
    path.write_text("\n".join(lines) + "\n")
    return path


ROUND_TRIP_MS = 10.0  # what a client's TTFT may add to the server's own beyond 15% (its HTTP round trip)


def test_guidellm_synchronous_profile_against_specwise_serve(tmp_path):
    from specwise.engine import load_target

    exe = guidellm()
    target = load_target(None)
    # Plain decoding on the server: with a drafter, time per token depends on what gets drafted, i.e. on the text, and
    # GuideLLM's synthetic text is not ours (seen: n-gram drafting made our repetitive prompts' ITL 25% lower).
    # (The drafter is there so evaluate's default configurations are accepted; --policy never keeps every step plain.)
    log = tmp_path / "requests.db"
    with serve_process("--drafter", "ngram", "--policy", "never", "--log", log, timeout=180) as url:
        out = tmp_path / "guidellm.json"
        proc = subprocess.run(
            [
                exe,
                "run",
                "--backend",
                f"kind=openai_http,target={url}",
                "--profile",
                "kind=synchronous",
                "--constraint",
                "kind=max_requests,count=8",
                "--data",
                "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
                "--tokenizer",
                f"kind=hf_auto,model={target.directory}",  # the GGUF's tokenizer.json and chat template
                "--output",
                f"kind=json,path={out}",
                "--disable-console-interactive",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        bench = json.loads(out.read_text())["benchmarks"][0]["metrics"]
        totals = bench["request_totals"]
        # Nothing refused, nothing cut off. GuideLLM's own totals sometimes stop one short of the 8 its constraint asks
        # for (seen once in a full-suite run: 7 of 7 successful; its scheduler's stop races the last result); the
        # server's log below shows every request it sent was answered.
        assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
        assert totals["successful"] == totals["total"] >= 7, totals
        assert bench["output_token_count"]["successful"]["median"] == 32  # ignore_eos and max_completion_tokens held

        cli(
            "evaluate",
            "--repeats",
            "1",
            "--endpoint",
            url,
            "--workload",
            workload(tmp_path / "w.yaml", target.tokenizer),
            "--concurrency",
            "1",
            "--out",
            tmp_path / "eval",
            "--no-progress",
        )
    recs = sorted(
        (r for r in load_run(tmp_path / "eval" / "run.db").records if r.error is None), key=lambda r: r.started
    )
    assert len(recs) == 16  # both configurations decode plainly under --policy never
    # The server's own record of each request (its request log). Each client's figures are set against the server's
    # for the same requests: the first few of a client's requests run up to 4x slower than the rest (the client's own
    # processes still starting on the same two cores), so medians over different sets of requests disagree by more
    # than any client's error. GuideLLM's requests are found by when they ended (its clock and the log's are both the
    # wall clock; its totals may stop one short of what it sent); evaluate's 16 are the last in the log (its probes
    # of the server come before them).
    rows = (
        sqlite3.connect(log).execute("SELECT time, ttft, decode_time, output_tokens FROM log ORDER BY time").fetchall()
    )
    sent = json.loads(out.read_text())["benchmarks"][0]["requests"]["successful"]  # GuideLLM's own figures per request
    server_theirs = [min(rows[:-16], key=lambda row: abs(row[0] - q["request_end_time"])) for q in sent]
    assert len(set(server_theirs)) == len(sent), "two GuideLLM requests matched one logged request"
    assert all(abs(row[0] - q["request_end_time"]) < 0.05 for row, q in zip(server_theirs, sent, strict=True)), (
        server_theirs
    )
    server = lambda part: [Timing(ttft * 1000, decode * 1000 / (n - 1)) for _, ttft, decode, n in part]  # noqa: E731
    pairs = {
        "GuideLLM": (
            [Timing(q["time_to_first_token_ms"], q["inter_token_latency_ms"]) for q in sent],
            server(server_theirs),
        ),
        # evaluate's figures as GuideLLM computes its own: per token after the first, (latency − TTFT) / (tokens − 1)
        "specwise evaluate": (
            [Timing(r.ttft * 1000, (r.e2e - r.ttft) * 1000 / (r.output_tokens - 1)) for r in recs],
            server(rows[-16:]),
        ),
    }
    medians = {name: (Timing.median(client), Timing.median(own)) for name, (client, own) in pairs.items()}
    print("\n" + "; ".join(f"{name} {client} (server: {own})" for name, (client, own) in medians.items()))
    # Each client measures what the server did for it, within 15%: the two clients agree on what they measure. A
    # client's TTFT also holds its own round trip over HTTP, a few ms whatever the prompt — over 15% of a server TTFT
    # of ~50 ms, which a prompt whose start is read from the cache gets (seen: 58.0 against 50.3 ms).
    for client, own in medians.values():
        assert client.ttft == pytest.approx(own.ttft, rel=0.15, abs=ROUND_TRIP_MS), (client, own)
        assert client.itl == pytest.approx(own.itl, rel=0.15), (client, own)
    (theirs, server_theirs_t), (ours, server_ours_t) = medians["GuideLLM"], medians["specwise evaluate"]
    # Across clients the figures may differ by more, and the server's log says why: on two cores the server itself
    # decodes more slowly while GuideLLM (a multi-process asyncio client) is the one sending (seen: 5.4 against 4.6
    # ms per token, server-side; not the per-chunk usage it asks for, which measured the same with and without). The
    # ratio of the clients' figures follows the ratio of the server's.
    assert theirs.itl / ours.itl == pytest.approx(server_theirs_t.itl / server_ours_t.itl, rel=0.15)


@dataclass
class Timing:
    """Time to first token and per-token latency after it, in milliseconds (one request's, or a median)."""

    ttft: float
    itl: float

    @classmethod
    def median(cls, timings: list[Timing]) -> Timing:
        return cls(statistics.median(t.ttft for t in timings), statistics.median(t.itl for t in timings))

    def __str__(self) -> str:
        return f"TTFT p50 {self.ttft:.1f} ms, ITL p50 {self.itl:.2f} ms"
