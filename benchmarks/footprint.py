"""What the embedded model costs to load and to serve: load times (first, in an empty cache, and later) and the
resident memory of `specwise serve` idle and after traffic.

1. In a fresh process with an empty cache directory: `load_target()` — reads the GGUF, packs its tensors, builds the
   CPU kernels — then, in a second fresh process with the cache now filled, the same call.
2. `specwise serve --drafter ngram` (defaults otherwise): VmRSS idle, then after chat requests sent 8 at a time
   (the copy-heavy and free-form prompts, each prompt's text tripled, twice over, 200 new tokens), and the peak
   (VmHWM).

    python benchmarks/footprint.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from prompts import COPY_HEAVY, FREE_FORM
from serve_load import free_port

LOAD = (
    "import time, torch; t = time.perf_counter(); from specwise.engine import load_target; load_target(); "
    "print(time.perf_counter() - t)"
)


def timed_load(cache: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", LOAD], capture_output=True, text=True, env={**os.environ, "SPECWISE_CACHE": cache}
    )
    if out.returncode:
        sys.exit(out.stderr)
    return float(out.stdout.strip().splitlines()[-1])


def rss(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    return float(fields["VmRSS"].split()[0]) / 1024, float(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        first = timed_load(cache)
        later = timed_load(cache)
    print(
        f"load of the embedded model (torch import excluded): first {first:.1f} s (empty cache: GGUF read and "
        f"packed, kernels built), later {later:.2f} s"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specwise.cli",
            "serve",
            "--port",
            str(port),
            "--drafter",
            "ngram",
            "--served-model-name",
            "m",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        idle = rss(proc.pid)[0]

        def ask(prompt: str) -> None:
            r = httpx.post(
                url + "/v1/chat/completions",
                timeout=600,
                json={"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 200},
            )
            r.raise_for_status()

        prompts = [p * 3 for p in COPY_HEAVY + FREE_FORM] * 2
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, prompts))
        now, peak = rss(proc.pid)
        print(
            f"specwise serve RSS: idle {idle:.0f} MB, after {len(prompts)} requests at concurrency 8 {now:.0f} MB, "
            f"peak {peak:.0f} MB (target ≤ 600 MB)"
        )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
