"""specwise's engine against llama.cpp's `llama-server`, on the same GGUF and the same threads, in one run.

Part 1, one request at a time: the copy-heavy and free-form prompts of `prompts.py`, the same token ids (specwise's
chat template) to every system, up to 96 new tokens (stopping at EOS, as a user would), temperature 0, interleaved
prompt by prompt with the order rotating. Systems: llama.cpp plain and with its n-gram speculation settings (one
server each, `-t THREADS`), specwise plain and with n-gram drafting (k=auto and k=4), in-process on the CPU kernels
with torch limited to the same threads. Times are each system's own: llama.cpp's `timings` (prompt_ms,
predicted_ms), specwise's request statistics (prefill, decode). Prints decode and prefill tokens/s, TTFT,
acceptance, and the ratios the engine issue sets targets for. specwise's speculative outputs are checked against its
plain ones (greedy: they must be equal).

Part 2, under load: the built-in workload's chat tasks at concurrency 4 (closed loop, streamed), `specwise serve`
against `llama-server --parallel 4`, both plain; TTFT and E2E as the client sees them.

Part 3, what adaptive speculation costs where it cannot help: general chat prompts (prompts.py CHAT), in-process,
closed loop at concurrency 1 and 4, specwise plain against n-gram k=auto on one loaded model, phases interleaved over
several rounds; generated tokens per second (prefill included) and their ratio.

With --kernels (a list, or `all`: every variant this CPU runs), part 1 runs specwise on each kernel variant against
llama.cpp built for the same instruction-set level (scripts/llama-server.sh with LLAMA_LEVEL=avx2|avx512; the native
build for generic and neon, and for avx2 on a CPU without AVX-512, where native is llama.cpp's best), all in the
same interleaved run, and part 4 adds per variant: a 9-token verification
pass against a one-token step (benchmarks/kernel_passes.py's measurement), a served step (`specwise serve`, its own
decode time) beside a process busy-looping on one core against the idle one, the wall time of the default `specwise
evaluate` (the README's main job after setup), and each engine's decode as a fraction of the floor the machine's
read bandwidth sets for the weights. The targets of the kernels issue are printed as ratios.

`llama-server` comes from $LLAMA_SERVER, PATH, or scripts/llama-server.sh (which builds it once into the cache).

    python benchmarks/engine_vs_llamacpp.py [--kernels all] [--max-new-tokens 96] [--repeats 2] [--threads 2]
        [--load-tasks 16] [--chat-rounds 4] [--llama-settings best|all]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from prompts import CHAT, COPY_HEAVY, FREE_FORM, chat

from specwise.speccounts import SpecCounts

ROOT = Path(__file__).resolve().parent.parent
LLAMA_NGRAM = {  # llama.cpp's n-gram speculation settings tried; the best one measured is the one compared against
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple n4 m8": [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "4",
        "--spec-ngram-simple-size-m",
        "8",
    ],
    "ngram-simple n3 m16": [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "16",
    ],
    "ngram-map-k n3": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LEVELS = {"avx2": "avx2", "avx512": "avx512"}  # specwise variant → llama.cpp build level (others: native)
if "avx512f" not in Path("/proc/cpuinfo").read_text():  # an AVX2-only CPU: its native build is llama.cpp's best here
    LEVELS["avx2"] = "native"


def find_llama_server(path: str | None, level: str = "native") -> str:
    """llama-server built for `level` (native, avx2, avx512), built once into the cache if needed."""
    if path and level == "native":
        return path
    env = {**os.environ, "LLAMA_LEVEL": level}
    done = subprocess.run([str(ROOT / "scripts" / "llama-server.sh")], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"no llama-server ({level}): {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}: {proc.args}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"server not healthy after {timeout} s: {proc.args}")


class Llama:
    """One llama-server process and its /completion endpoint (token ids in, llama.cpp's own timings out)."""

    def __init__(self, binary: str, gguf: Path, threads: int, extra: list[str], parallel: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the server
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(gguf),
                "--port",
                str(self.port),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "-c",
                str(4096 * parallel),
                "--parallel",
                str(parallel),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_healthy(self.url, self.proc)

    def run(self, ids: list[int], n: int) -> dict:
        r = httpx.post(
            self.url + "/completion",
            timeout=600,
            json={"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": False},
        )
        r.raise_for_status()
        body = r.json()
        t = body["timings"]
        return {
            "prompt": t["prompt_n"],
            "prefill": t["prompt_ms"] / 1e3,
            "decoded": t["predicted_n"],
            "decode": t["predicted_ms"] / 1e3,
            "ttft": t["prompt_ms"] / 1e3,
            "tokens": body.get("tokens"),
            "spec": SpecCounts(drafted=t.get("draft_n", 0), accepted=t.get("draft_n_accepted", 0)),
            "text": body.get("content", ""),
        }

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def run_specwise(engine, ids_prompt: list[dict], n: int) -> dict:
    from specwise.engine import SamplingParams

    r = engine.generate([ids_prompt], SamplingParams(max_new_tokens=n))[0]
    s = r.stats
    return {
        "prompt": s.prompt_tokens - s.cached_tokens,  # the tokens prefilled, as llama-server's prompt_n counts them
        "prefill": s.prefill_time,
        "decoded": s.generated_tokens - 1,
        "decode": s.decode_time,
        "ttft": s.ttft,
        "spec": s.counts(),
        "tokens": r.token_ids,
        "text": r.text,
    }


def aggregate(runs: list[dict]) -> dict:
    spec = SpecCounts.pooled(r["spec"] for r in runs)  # llama.cpp reports no step count: its MAL stays None
    return {
        "decode": sum(r["decoded"] for r in runs) / sum(r["decode"] for r in runs),
        "prefill": sum(r["prompt"] for r in runs) / sum(r["prefill"] for r in runs),
        "ttft": statistics.median(r["ttft"] for r in runs),
        "accept": spec.acceptance_rate,
        "mal": spec.mean_acceptance_length,
    }


def part_one(args, variants: list[str], gguf: Path) -> dict:
    import torch

    from specwise.engine import Engine, load_target

    torch.set_num_threads(args.threads)
    target = load_target(gguf)
    engines: dict[str, Engine] = {}
    for v in variants:
        on_v = dataclasses.replace(target, model=target.model.on_kernels(v))
        engines[f"specwise {v} plain"] = Engine(on_v, max_batch=1)
        engines[f"specwise {v} ngram k=auto"] = Engine(on_v, drafter="ngram", k="auto", max_batch=1)
        engines[f"specwise {v} ngram k=4"] = Engine(on_v, drafter="ngram", k=4, max_batch=1)
    settings = (
        LLAMA_NGRAM if args.llama_settings == "all" else {"ngram-simple n4 m8": LLAMA_NGRAM["ngram-simple n4 m8"]}
    )
    levels = sorted({LEVELS.get(v, "native") for v in variants})
    llamas: dict[str, Llama] = {}
    for level in levels:
        binary = find_llama_server(args.llama_server, level)
        llamas[f"llama.cpp {level} plain"] = Llama(binary, gguf, args.threads, [])
        for name, extra in settings.items():
            llamas[f"llama.cpp {level} {name}"] = Llama(binary, gguf, args.threads, extra)
    systems = [*llamas, *engines]
    tok = target.tokenizer
    kernels = ", ".join(e.target.model.kernels for e in list(engines.values())[::3])
    print(
        f"target {target.identity.name} ({target.identity.precision}), {args.threads} threads, "
        f"{args.max_new_tokens} new tokens, {args.repeats} repeat(s); specwise kernels: {kernels}; "
        f"llama.cpp builds: {', '.join(levels)}",
        flush=True,
    )
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for e in engines.values():  # warm-up
            e.generate([chat("hi")], None)
        for ll in llamas.values():
            ll.run(tok.encode("hello"), 4)
        turn = 0
        for set_name, prompts in (("copy-heavy", COPY_HEAVY), ("free-form", FREE_FORM)):
            for _ in range(args.repeats):
                for prompt in prompts:
                    messages = chat(prompt)
                    ids = tok.encode(
                        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
                    )
                    order = systems[turn % len(systems) :] + systems[: turn % len(systems)]
                    turn += 1
                    for name in order:
                        if name in engines:
                            res = run_specwise(engines[name], messages, args.max_new_tokens)
                        else:
                            res = llamas[name].run(ids, args.max_new_tokens)
                        results.setdefault((set_name, name), []).append(res)
            report(set_name, systems, variants, results)
        verdict(results, variants, settings)
    finally:
        for ll in llamas.values():
            ll.close()
    return results


def level_of(variant: str) -> str:
    return LEVELS.get(variant, "native")


def report(set_name: str, systems: list[str], variants: list[str], results: dict) -> None:
    n = len(results[(set_name, systems[0])])
    print(f"\n== {set_name}: {n} requests per system ==")
    print(
        f"{'system':34} {'decode tok/s':>12} {'× llama plain':>13} {'prefill tok/s':>13} {'TTFT ms':>8} "
        f"{'accept':>7} {'MAL':>5}"
    )
    for name in systems:
        a = aggregate(results[(set_name, name)])
        level = name.split()[1] if name.startswith("llama.cpp") else level_of(name.split()[1])
        base = aggregate(results[(set_name, f"llama.cpp {level} plain")])["decode"]
        print(
            f"{name:34} {a['decode']:12.1f} {a['decode'] / base:12.2f}x {a['prefill']:13.0f} "
            f"{a['ttft'] * 1e3:8.1f} {_fmt(a['accept']):>7} {_fmt(a['mal']):>5}"
        )
    reference = [r["tokens"] for r in results[(set_name, f"specwise {variants[0]} plain")]]
    for v in variants:
        for kind in ("plain", "ngram k=auto", "ngram k=4"):
            name = f"specwise {v} {kind}"
            got = [r["tokens"] for r in results[(set_name, name)]]
            same = sum(a == b for a, b in zip(reference, got, strict=True))
            print(f"{name}: {same}/{len(reference)} outputs equal to specwise {variants[0]} plain (greedy)")
    for level in sorted({level_of(v) for v in variants}):
        got = [r["tokens"] for r in results[(set_name, f"llama.cpp {level} plain")]]
        same = sum(a == b for a, b in zip(reference, got, strict=True))
        print(f"llama.cpp {level} plain: {same}/{len(reference)} outputs token for token equal to specwise plain")


def verdict(results: dict, variants: list[str], settings: dict) -> None:
    def dec(set_name: str, name: str) -> float:
        return aggregate(results[(set_name, name)])["decode"]

    def pre(set_name: str, name: str) -> float:
        return aggregate(results[(set_name, name)])["prefill"]

    print("\n== ratios (target) ==")
    for v in variants:
        lv = level_of(v)
        sp, ll = f"specwise {v}", f"llama.cpp {lv}"
        best = max(settings, key=lambda k: dec("copy-heavy", f"{ll} {k}"))
        lines = [
            (
                f"{sp} plain / {ll} plain, decode (copy-heavy)",
                dec("copy-heavy", f"{sp} plain") / dec("copy-heavy", f"{ll} plain"),
                1.0,
            ),
            (
                f"{sp} plain / {ll} plain, decode (free-form)",
                dec("free-form", f"{sp} plain") / dec("free-form", f"{ll} plain"),
                1.0,
            ),
            (
                f"{sp} ngram k=auto / {ll} plain (copy-heavy)",
                dec("copy-heavy", f"{sp} ngram k=auto") / dec("copy-heavy", f"{ll} plain"),
                2.5,
            ),
            (
                f"{sp} ngram k=auto / {ll} {best} (copy-heavy)",
                dec("copy-heavy", f"{sp} ngram k=auto") / dec("copy-heavy", f"{ll} {best}"),
                2.0,
            ),
            (
                f"{sp} ngram k=auto / {sp} plain (free-form)",
                dec("free-form", f"{sp} ngram k=auto") / dec("free-form", f"{sp} plain"),
                0.97,
            ),
            (
                f"{sp} / {ll} prefill tokens/s (copy-heavy)",
                pre("copy-heavy", f"{sp} plain") / pre("copy-heavy", f"{ll} plain"),
                1.0,
            ),
            (
                f"{sp} / {ll} prefill tokens/s (free-form)",
                pre("free-form", f"{sp} plain") / pre("free-form", f"{ll} plain"),
                1.0,
            ),
        ]
        for label, value, target in lines:
            print(f"{label:78} {value:6.2f}x  {_target(v, f'≥ {target}', value >= target)}")


def part_two(args, binary: str, gguf: Path) -> None:
    from specwise.harness.workload import builtin_workload

    tasks = builtin_workload().tasks[: args.load_tasks]
    port = free_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specwise.cli",
            "serve",
            "--model",
            str(gguf),
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--max-batch",
            "4",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
    )
    llama = Llama(binary, gguf, args.threads, [], parallel=4)
    specwise_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(specwise_url, serve)
        print(f"\n== under load: {len(tasks)} built-in chat tasks, concurrency 4, closed loop, plain decoding ==")
        rows = {}
        for rnd in range(2):  # alternate which server goes first
            for name, url in (("specwise serve", specwise_url), ("llama-server", llama.url))[:: 1 if rnd == 0 else -1]:
                rows.setdefault(name, []).extend(closed_loop(url, tasks, args.max_new_tokens))
        print(f"{'server':16} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'E2E p50 s':>10}")
        for name, runs in rows.items():
            ttft = sorted(r["ttft"] for r in runs)
            e2e = sorted(r["e2e"] for r in runs)
            print(
                f"{name:16} {statistics.median(ttft) * 1e3:12.0f} {ttft[int(0.9 * (len(ttft) - 1))] * 1e3:12.0f} "
                f"{statistics.median(e2e):10.2f}"
            )
        ratio = statistics.median(r["ttft"] for r in rows["specwise serve"]) / statistics.median(
            r["ttft"] for r in rows["llama-server"]
        )
        print(
            f"TTFT p50 specwise / llama.cpp at concurrency 4: {ratio:.2f}x (target ≤ 1.5: "
            f"{'met' if ratio <= 1.5 else 'MISSED'})"
        )
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        llama.close()


def part_three(args, gguf: Path) -> None:
    import torch

    from specwise.engine import Engine, SamplingParams, load_target

    torch.set_num_threads(args.threads)
    target = load_target(gguf)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    print(f"\n== general chat, in-process, closed loop: plain against n-gram k=auto, {args.chat_rounds} rounds ==")
    for conc in (1, 4):
        engines = {
            "plain": Engine(target, max_batch=conc),
            "ngram k=auto": Engine(target, drafter="ngram", k="auto", max_batch=conc),
        }
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for rnd in range(args.chat_rounds + 1):  # round 0 warms both up (and adaptive k's acceptance history)
            for name in list(engines) if rnd % 2 else list(engines)[::-1]:
                tokens, seconds = closed_loop_engine(engines[name], [chat(p) for p in CHAT], conc, params)
                if rnd:
                    rates[name].append(tokens / seconds)
        plain, spec = (statistics.median(rates[n]) for n in engines)
        print(
            f"concurrency {conc}: plain {plain:.1f} tok/s, ngram k=auto {spec:.1f} tok/s, ratio {spec / plain:.3f} "
            f"(target ≥ 0.97: {'met' if spec / plain >= 0.97 else 'MISSED'})"
        )


def closed_loop_engine(engine, prompts: list, conc: int, params) -> tuple[int, float]:
    """Run prompts through the engine keeping `conc` in flight; (generated tokens, seconds)."""
    queue = list(prompts)
    live, tokens = 0, 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and live < conc:
            engine.submit(queue.pop(0), params)
            live += 1
        for event in engine.step():
            if event.result is not None:
                live -= 1
                tokens += len(event.result.token_ids)
    return tokens, time.perf_counter() - t0


def closed_loop(url: str, tasks, max_tokens: int) -> list[dict]:
    def one(task) -> dict:
        t0 = time.perf_counter()
        first = None
        body = {
            "model": "m",
            "messages": [dict(m) for m in task.messages or ()] or [{"role": "user", "content": task.prompt}],
            "max_tokens": min(task.max_tokens, max_tokens),
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter()
        end = time.perf_counter()
        return {"ttft": (first or end) - t0, "e2e": end - t0}

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, tasks))


def served_step(url: str, prompt: str, tokens: int) -> float:
    """Seconds per decode step of one request as the server measured it (usage.speculative.decode_time)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["speculative"]["decode_time"] / (usage["completion_tokens"] - 1)


def part_four(args, variants: list[str], gguf: Path, results: dict) -> None:
    """Per variant: a 9-token pass against a step, a served step beside a busy neighbour, the default evaluation's
    wall time, decode against the bandwidth floor."""
    import torch
    from kernel_passes import bandwidth, busy_neighbour, pass_costs

    from specwise.engine import load_target

    torch.set_num_threads(args.threads)
    target = load_target(gguf)
    costs = pass_costs({v: target.model.on_kernels(v) for v in variants}, rounds=3)
    served: dict[str, dict[str, list[float]]] = {}
    prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle."
    for v in variants:
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "SPECWISE_KERNELS": v}
        cmd = [sys.executable, "-m", "specwise.cli", "serve", "--model", str(gguf), "--port", str(port)]
        serve = subprocess.Popen(
            [*cmd, "--served-model-name", "m"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, serve)
            served_step(url, prompt, 16)  # warm-up
            times: dict[str, list[float]] = {"idle": [], "busy": []}
            for _ in range(3):  # idle and busy alternating
                times["idle"] += [served_step(url, prompt, 64) for _ in range(3)]
                with busy_neighbour():
                    times["busy"] += [served_step(url, prompt, 64) for _ in range(3)]
            served[v] = times
        finally:
            serve.terminate()
            serve.wait(timeout=30)
    evaluate: dict[str, float] = {}
    for v in variants:  # the README's first command, after setup: the default evaluation, wall time
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "SPECWISE_KERNELS": v}
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "specwise.cli", "evaluate", "--out", out, "--no-progress"],
                check=True,
                capture_output=True,
                env=env,
            )
            evaluate[v] = time.perf_counter() - t0
    bw = bandwidth(args.threads)
    floor = target.model.weight_bytes() / bw
    print(
        f"\n== per kernel variant: passes, a busy neighbour, the bandwidth floor ==\n"
        f"read bandwidth {bw / 1e9:.1f} GB/s on {args.threads} threads: the {target.model.weight_bytes() / 1e6:.0f} MB "
        f"of weights allow at most {1 / floor:.0f} decode steps a second"
    )
    head = f"{'variant':8} {'step ms':>8} {'pass9 ms':>9} {'served idle ms':>15} {'served busy ms':>15}"
    print(f"{head} {'decode of floor':>16}")
    for v in variants:
        c, t = costs[v], served[v]
        idle, busy = statistics.median(t["idle"]), statistics.median(t["busy"])
        plain = aggregate(results[("free-form", f"specwise {v} plain")])["decode"]
        print(
            f"{v:8} {c['step'] * 1e3:8.2f} {c['pass9'] * 1e3:9.2f} {idle * 1e3:15.2f} {busy * 1e3:15.2f} "
            f"{plain * floor:16.2f}"
        )
    for level in sorted({level_of(v) for v in variants}):
        llama = aggregate(results[("free-form", f"llama.cpp {level} plain")])["decode"]
        print(f"llama.cpp {level} plain decode: {llama * floor:.2f} of the floor")
    print("\n== ratios (target) ==")
    for v in variants:
        c, t = costs[v], served[v]
        ratio = c["pass9"] / c["step"]
        print(f"specwise {v}: a 9-token pass / a one-token step {ratio:27.2f}x  {_target(v, '≤ 2.0', ratio <= 2.0)}")
        busy = statistics.median(t["busy"]) / statistics.median(t["idle"])
        verdict_busy = _target(v, "≤ 2.5", busy <= 2.5)
        print(f"specwise {v}: a served step beside a busy core / idle {busy:22.2f}x  {verdict_busy}")
        seconds = evaluate[v]
        verdict_eval = _target(v, "≤ 90 s", seconds <= 90)
        print(f"specwise {v}: the default specwise evaluate, wall {seconds:21.1f} s  {verdict_eval}")


def _target(variant: str, target: str, ok: bool) -> str:
    """The kernels issue sets its targets on the SIMD variants; the portable one is measured, not held to them."""
    if variant == "generic":
        return "(portable fallback: no target)"
    return f"(target {target}: {'met' if ok else 'MISSED'})"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-tasks", type=int, default=16, help="tasks for part 2 (0 skips it)")
    ap.add_argument("--chat-rounds", type=int, default=4, help="rounds of part 3 (0 skips it)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--kernels",
        help="specwise kernel variants to measure, each against llama.cpp built for its level: a comma list or "
        "'all' (every variant this CPU runs); default: the one specwise picks; adds part 4",
    )
    ap.add_argument(
        "--llama-settings",
        choices=("all", "best"),
        help="llama.cpp n-gram settings in part 1: all six, or the best one measured so far (default: all without "
        "--kernels, best with it)",
    )
    args = ap.parse_args()
    from specwise.engine import kernels as K
    from specwise.engine.weights import embedded_model_path

    gguf = Path(args.model) if args.model else embedded_model_path()
    if args.kernels == "all":
        variants = K.runnable()[::-1]
    else:
        variants = [K.choose(v) for v in (args.kernels or "auto").split(",")]
    args.llama_settings = args.llama_settings or ("best" if args.kernels else "all")
    results = part_one(args, variants, gguf)
    binary = find_llama_server(args.llama_server)
    if args.load_tasks:
        part_two(args, binary, gguf)
    if args.chat_rounds:
        part_three(args, gguf)
    if args.kernels:
        part_four(args, variants, gguf, results)


if __name__ == "__main__":
    main()
