"""Fuzzing the model-file loaders: hundreds of mutated GGUF files (header fields, metadata values, the tensor table,
random bytes, truncation), each loaded through specwise's model-file path and run for one forward pass on the
kernels, in a worker process (tests/fuzz_gguf_worker.py). Every case must load or be refused with a SpecwiseError:
no other exception, and no crash — a worker that dies is restarted after the case it died on, which is reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_kernels import write_gguf

WORKER = Path(__file__).with_name("fuzz_gguf_worker.py")
MIXED = {  # every kind the packer takes: 4- and 8-bit natively, the rest dequantised to bf16
    "token_embd.weight": "Q8_0",
    "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "F16",
    "blk.0.ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q4_K",
}


def fuzz(base: Path, work: Path, seed: int, cases: int, *extra: str, env: dict | None = None) -> dict[int, str]:
    """Case index → its result line; a case the worker died on is 'CRASH (signal)'."""
    results: dict[int, str] = {}
    first = 0
    while first < cases:
        done = subprocess.run(
            [sys.executable, str(WORKER), str(base), str(work), str(seed), str(first), str(cases - first), *extra],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        started = None
        for line in done.stdout.splitlines():
            kind, index, rest = [*line.split(" ", 2), "", ""][:3]
            if kind == "START":
                started = int(index)
            elif kind == "RESULT":
                results[int(index)] = rest
                started = None
        if done.returncode == 0:
            break
        assert started is not None, done.stderr[-2000:]  # died outside a case: the worker itself is broken
        results[started] = f"CRASH (exit {done.returncode}) on {done.stdout.splitlines()[-1]}"
        first = started + 1
    return results


def check(results: dict[int, str], cases: int) -> None:
    assert len(results) == cases
    wrong = {i: r for i, r in results.items() if not r.startswith(("ok", "refused"))}
    assert not wrong, "\n".join(f"case {i}: {r[:400]}" for i, r in sorted(wrong.items())[:10])


def test_hundreds_of_mutated_gguf_files_load_or_are_refused_never_crash(tmp_path):
    base = tmp_path / "mixed.gguf"
    write_gguf(base, MIXED)
    results = fuzz(base, tmp_path / "work.gguf", seed=19, cases=400)
    check(results, 400)
    loaded = sum(r.startswith("ok") for r in results.values())
    assert 10 <= loaded <= 390, loaded  # the mutations reach both outcomes: neither all refused nor all harmless


def test_mutated_files_through_kernels_built_with_asan_and_ubsan(tmp_path):
    """Issue 31 item 8: the same corpus (fewer cases) with the kernel library built with AddressSanitizer and UBSan
    (SPECWISE_KERNEL_CFLAGS) and the ASan runtime preloaded into the worker: a bad access or undefined behaviour
    in C ends the worker, which the harness reports as a crash."""
    libasan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    assert Path(libasan).is_file(), "gcc's libasan is needed (Debian: libasan8, with gcc)"
    env = {
        **os.environ,
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1",
        # The library's cache key includes these flags: built once into the cache, beside the plain builds.
        "SPECWISE_KERNEL_CFLAGS": "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer",
    }
    base = tmp_path / "mixed.gguf"
    write_gguf(base, MIXED)
    results = fuzz(base, tmp_path / "work.gguf", 23, 60, env=env)
    check(results, 60)
    assert sum(r.startswith("ok") for r in results.values()) >= 2  # some cases reach the kernels


@pytest.mark.embedded
def test_mutations_of_the_embedded_ggufs_header_and_tensor_table_are_refused_or_harmless(tmp_path):
    """The real file (98 MB, patched in place and restored): fewer cases, as each parse of its 49k-token vocabulary
    takes seconds."""
    from specwise.engine.weights import embedded_model_path

    results = fuzz(embedded_model_path(), tmp_path / "work.gguf", 5, 8, "--in-place")
    check(results, 8)
