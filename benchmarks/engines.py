"""Where to serve: vLLM (its CPU build), specwise and llama.cpp, each plain and with n-gram drafting, on the same
prompts, cores and model — one `specwise evaluate --endpoint --launch` per engine (its plain server first, then its
n-gram one), run one after another, then one table: decode tokens/s plain and n-gram, acceptance and MAL (from each
server's own counters), E2E speedup at each load and each engine's verdict.

The target is the embedded SmolLM2-135M-Instruct: specwise and llama.cpp run its GGUF (Q4_1), vLLM the bf16
`specwise export-hf` of it (vLLM's CPU build 0.32.0 did not load this GGUF: it reads it as a JSON config) — the
table says so, as the harness does: the engines' speeds are not a comparison on one set of numbers.

    python benchmarks/engines.py [--tasks 12] [--max-tokens 64] [--concurrency 1,4] [--only vllm,specwise,llamacpp]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specwise.harness.analyze import load_run
from specwise.harness.results import Run
from specwise.harness.server_reports import counts_from_counters
from specwise.speccounts import SpecCounts

ROOT = Path(__file__).resolve().parents[1]
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(script: str) -> str:
    out = subprocess.run([str(ROOT / "scripts" / script)], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def launches(engine: str, port: int, hf: Path, gguf: Path) -> tuple[str, str]:
    """(plain, n-gram) server commands of one engine on `port`, 2 threads."""
    if engine == "vllm":
        base = (
            f"VLLM_CPU_KVCACHE_SPACE=1 {tool('vllm.sh')} -m vllm.entrypoints.openai.api_server --model {hf} "
            f"--dtype bfloat16 --enforce-eager --max-model-len 2048 --port {port} --served-model-name smol"
        )
        return (
            base,
            f"{base} --speculative-config '{json.dumps(VLLM_NGRAM)}' --per-request-spec-decode-metrics detailed",
        )
    if engine == "specwise":
        base = f"{sys.executable} -m specwise.cli serve --port {port}"
        return f"{base} --drafter none", f"{base} --drafter ngram"
    base = f"{tool('llama-server.sh')} -m {gguf} --port {port} -t 2 -c 4096 --parallel 4 --metrics"
    return base, f"{base} --spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 8"


def decode_rate(run: Run, config: str) -> float | None:
    """Median decode tokens/s of one configuration's requests (tokens after the first over first-to-last chunk)."""
    rates = [
        (r.output_tokens - 1) / r.decode
        for r in run.records
        if r.config == config and r.error is None and r.decode and r.output_tokens > 1
    ]
    return statistics.median(rates) if rates else None


def speculation(run: Run, config: str) -> SpecCounts:
    """The server's own counters over every phase of `config`, else its per-request reports pooled."""
    deltas = [d for key, ds in run.server_counters.items() if key.partition("|")[0] == config for d in ds]
    if deltas:
        return counts_from_counters(deltas)
    return SpecCounts.pooled(r.spec for r in run.records if r.config == config and r.spec is not None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--only", default="vllm,specwise,llamacpp")
    args = ap.parse_args()
    from specwise.engine.weights import embedded_model_path

    gguf = embedded_model_path()
    work = Path(tempfile.mkdtemp(prefix="engines-"))
    hf = work / "smol-bf16"
    subprocess.run([sys.executable, "-m", "specwise.cli", "export-hf", str(hf)], check=True, capture_output=True)
    rows = []
    for engine in args.only.split(","):
        port = free_port()
        plain, ngram = launches(engine, port, hf, gguf)
        out = work / engine
        t0 = time.perf_counter()
        command = [sys.executable, "-m", "specwise.cli", "evaluate", "--endpoint", f"http://127.0.0.1:{port}"]
        command += ["--launch", f"plain={plain}", "--launch", f"ngram={ngram}", "--tasks", str(args.tasks)]
        command += ["--max-tokens", str(args.max_tokens), "--concurrency", args.concurrency, "--out", str(out)]
        proc = subprocess.run(
            [*command, "--no-progress"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            print(f"{engine}: evaluate failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        run = load_run(out / "run.db")
        spec = speculation(run, "ngram")
        verdict = run.analysed.verdicts["ngram"]["concurrent"]
        by_load = {}
        for load in run.analysed.loads:
            values = [c.e2e_speedup.value for c in run.analysed.comparisons if c.config == "ngram" and c.load == load]
            by_load[load] = statistics.median(values) if values else None
        target = run.provenance.served_target
        reasons = [c.text for c in verdict.clauses if not c.ok and not c.neutral]
        rows.append(
            (
                engine,
                target.describe(),
                decode_rate(run, "plain"),
                decode_rate(run, "ngram"),
                spec,
                by_load,
                verdict.headline().split(" — ")[0] + (f" ≤ {verdict.threshold:g}" if verdict.threshold else ""),
                time.perf_counter() - t0,
                f"{len(reasons)} clause(s) against, e.g. {reasons[0]}" if reasons else "",
            )
        )
    loads = sorted({ld for r in rows for ld in r[5]})
    print(f"\n{args.tasks} tasks of release-notes, {args.max_tokens} tokens, concurrency {args.concurrency}, 2 threads")
    head = f"{'engine':>9} {'plain tok/s':>11} {'ngram tok/s':>11} {'×':>5} {'accept':>6} {'MAL':>5}"
    head += "".join(f" {'E2E× ' + ld.split('@')[1]:>8}" for ld in loads) + f" {'verdict':>18} {'wall s':>6}"
    print(head)
    for engine, _, plain, ngram, spec, by_load, verdict, wall, _ in rows:
        ratio = ngram / plain if plain and ngram else None
        cells = "".join(f" {by_load.get(ld) or float('nan'):>8.2f}" for ld in loads)
        print(
            f"{engine:>9} {plain or float('nan'):>11.1f} {ngram or float('nan'):>11.1f} "
            f"{ratio or float('nan'):>5.2f} {spec.acceptance_rate or float('nan'):>6.2f} "
            f"{spec.mean_acceptance_length or float('nan'):>5.2f}{cells} {verdict:>18} {wall:>6.0f}"
        )
    print("\ntargets (not one set of numbers: the harness names each system's own):")
    for engine, target, *_, why in rows:
        print(f"  {engine}: {target}" + (f"\n    verdict: {why}" if why else ""))
    print(f"\nruns kept in {work}")


if __name__ == "__main__":
    main()
