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
    recs = [r for r in load_run(tmp_path / "eval" / "run.db").records if r.error is None]
    assert len(recs) == 16  # both configurations decode plainly under --policy never
    ours = Timing(
        statistics.median(r.ttft * 1000 for r in recs),
        # GuideLLM's inter-token latency is per token after the first: (latency − TTFT) / (tokens − 1).
        statistics.median((r.e2e - r.ttft) * 1000 / (r.output_tokens - 1) for r in recs if r.output_tokens > 1),
    )
    theirs = Timing(
        bench["time_to_first_token_ms"]["successful"]["median"], bench["inter_token_latency_ms"]["successful"]["median"]
    )
    # The server's own record of each client's requests (its request log, in arrival order: GuideLLM's came first).
    rows = sqlite3.connect(log).execute("SELECT ttft, decode_time, output_tokens FROM log ORDER BY time").fetchall()
    assert len(rows) - 16 >= totals["successful"]  # GuideLLM's requests (its warm-up ones too), every one answered

    def server(part: list) -> Timing:
        return Timing(
            statistics.median(t * 1000 for t, _, _ in part),
            statistics.median(d * 1000 / (n - 1) for _, d, n in part if n > 1),
        )

    server_theirs, server_ours = server(rows[:-16]), server(rows[-16:])
    print(f"\nGuideLLM {theirs} (server: {server_theirs}); specwise evaluate {ours} (server: {server_ours})")
    # Each client measures what the server did for it, within 15%: the two clients agree on what they measure.
    for client, own in ((theirs, server_theirs), (ours, server_ours)):
        assert client.ttft == pytest.approx(own.ttft, rel=0.15), (client, own)
        assert client.itl == pytest.approx(own.itl, rel=0.15), (client, own)
    # Across clients the figures may differ by more, and the server's log says why: on two cores the server itself
    # decodes more slowly while GuideLLM (a multi-process asyncio client) is the one sending (seen: 5.4 against 4.6
    # ms per token, server-side; not the per-chunk usage it asks for, which measured the same with and without). The
    # ratio of the clients' figures follows the ratio of the server's.
    assert theirs.itl / ours.itl == pytest.approx(server_theirs.itl / server_ours.itl, rel=0.15)


@dataclass
class Timing:
    """Median time to first token and per-token latency after it, in milliseconds."""

    ttft: float
    itl: float

    def __str__(self) -> str:
        return f"TTFT p50 {self.ttft:.1f} ms, ITL p50 {self.itl:.2f} ms"
