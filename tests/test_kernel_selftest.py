"""Every kernel variant — the x86 ones this CPU runs and NEON under qemu-aarch64 — against each other, through the C
self-test (tests/csrc/selftest.c): each checks kernels.h's invariance on random GEMMs in every format and on a tiny
decoder, and prints a hash per case; every variant must print the same hashes.

NEON is cross-compiled with Debian's gcc-aarch64-linux-gnu and run under qemu-user (scripts/test-deps.sh installs
both), with the dot-product extension and without: correctness here, speed for whoever has the hardware.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from specwise.engine import kernels as K

ROOT = Path(__file__).resolve().parents[1]
SELFTEST = ROOT / "tests" / "csrc" / "selftest.c"
NEON_BUILDS = {"neon+dotprod": ("-march=armv8.2-a+dotprod", "max"), "neon": ("-march=armv8-a", "cortex-a57")}


def build(cc: str, flags: list[str], variant: str, out: Path) -> Path:
    common = [f for f in K.COMMON_FLAGS if f not in ("-shared", "-fPIC")]
    sources = [str(p) for p in K.sources(variant)]
    cmd = [cc, *common, *flags, f"-I{K.CSRC}", *sources, str(SELFTEST), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def run(cmd: list[str]) -> list[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "ok", done.stdout
    return lines[1:-1]  # the case hashes (the first line names the variant)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("selftest") / "generic"
    return run([str(build("cc", K.flags("generic"), "generic", out))])


@pytest.mark.parametrize("variant", [v for v in K.runnable() if v != "generic"])
def test_x86_variants_compute_the_generic_bits(reference, variant, tmp_path):
    assert run([str(build("cc", K.flags(variant), variant, tmp_path / variant))]) == reference


def test_generic_on_the_baseline_isa_computes_the_same_bits(reference, tmp_path):
    """The portable path built for the oldest CPUs of the architecture (on x86-64: no hardware fused multiply-add, so
    libm's fmaf in software): the same bits, slower."""
    baseline = ["-DSW_PORTABLE", "-march=x86-64" if K._arch() == "x86_64" else "-march=armv8-a"]
    assert run([str(build("cc", baseline, "generic", tmp_path / "baseline"))]) == reference


def test_the_generic_variant_is_portable_c_on_aarch64_too(reference, tmp_path):
    """The generic variant cross-built for aarch64 (its portable spelling of the vector primitives, no NEON
    intrinsics), under qemu: the same bits."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    assert cross and qemu, "the aarch64 checks need gcc-aarch64-linux-gnu and qemu-user: run scripts/test-deps.sh"
    binary = build(cross, ["-static", "-DSW_PORTABLE", "-march=armv8-a"], "generic", tmp_path / "generic-arm")
    assert run([qemu, "-cpu", "cortex-a57", str(binary)]) == reference


@pytest.mark.parametrize("build_name", list(NEON_BUILDS))
def test_neon_under_qemu_computes_the_generic_bits(reference, build_name, tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    assert cross and qemu, "the NEON check needs gcc-aarch64-linux-gnu and qemu-user: run scripts/test-deps.sh"
    march, cpu = NEON_BUILDS[build_name]
    binary = build(cross, ["-static", march], "neon", tmp_path / build_name)
    lines = subprocess.run([qemu, "-cpu", cpu, str(binary)], capture_output=True, text=True).stdout.splitlines()
    assert lines and lines[0] == f"variant neon (aarch64, {'dotprod' if 'dotprod' in build_name else 'no dotprod'})"
    assert run([qemu, "-cpu", cpu, str(binary)]) == reference


SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}


@pytest.mark.parametrize("variant", K.runnable())
def test_every_entry_point_under_asan_and_ubsan_refuses_what_it_must_and_touches_only_its_memory(variant, tmp_path):
    """Issue 31 item 8: the self-test and a fuzz driver (random shapes, counts, positions, slots, rows, layer ids and
    self-contradicting declarations at sw_gemm, sw_quantize_rows and sw_forward, each call's buffers
    exactly what a valid call may touch) built with AddressSanitizer and UBSan: every call refused exactly when its
    input is invalid, and no report. At b8ad943 this ended on the first negative row count (UBSan: an offset
    applied to a null pointer)."""
    import os

    binary = build("cc", [*K.flags(variant), *SANITIZERS], variant, tmp_path / f"{variant}-asan")
    env = {**os.environ, **SANITIZER_ENV}
    for args in ([], ["fuzz", "4000"]):
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=600, env=env)
        report = done.stdout[-3000:] + done.stderr[-3000:]
        assert done.returncode == 0 and done.stdout.splitlines()[-1] == "ok", report
        assert "runtime error" not in done.stderr and "AddressSanitizer" not in done.stderr, report
