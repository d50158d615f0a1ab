"""An evaluation's parts below the command line: the workload (`workload_from`, `stratified`), the configurations
(`configs_from`, `launch_configs`), the in-process engine's batch, and `evaluate`: measure, judge, report.
`specwise evaluate` (cli/evaluate.py) checks its flags and builds these before anything loads."""

from __future__ import annotations

import contextlib
import re
import signal
import sys
from pathlib import Path

import yaml

from specwise.errors import SpecwiseError
from specwise.harness import commands
from specwise.harness.analyze import load_run, store_verdicts
from specwise.harness.backends import Backend
from specwise.harness.config import Config
from specwise.harness.load import Load
from specwise.harness.report import console_summary, html_report
from specwise.harness.runner import Plan, RunOptions, run
from specwise.harness.store import Store
from specwise.harness.workload import BUILTIN, Task, Workload, builtin_workload, load_workload
from specwise.specs import (
    check_drafter_spec,
    check_verify,
    parse_k,
)

CONFIG_KEYS = {"name", "drafter", "k", "launch", "request", "verify"}


def stratified(workload: Workload, n: int) -> Workload:
    """n tasks spread over the workload: each pick takes the task whose combination of group tags, then whose tags
    one by one, have been picked least so far (ties in file order) — so tags stay balanced and do not go together."""
    if n <= 0 or n >= len(workload.tasks):
        return workload
    left = list(workload.tasks)
    picked: list[Task] = []
    counts: dict[str, int] = {}
    combos: dict[tuple[str, ...], int] = {}
    while len(picked) < n:
        best = min(
            left,
            key=lambda t: (
                combos.get(tuple(sorted(t.groups)), 0),
                sum(counts.get(g, 0) for g in t.groups),
                max(counts.get(g, 0) for g in t.groups),
            ),
        )
        left.remove(best)
        picked.append(best)
        combos[tuple(sorted(best.groups))] = combos.get(tuple(sorted(best.groups)), 0) + 1
        for g in best.groups:
            counts[g] = counts.get(g, 0) + 1
    return Workload(workload.name, picked, workload.description, workload.source)


def configs_from(
    config_file: str | None,
    drafters: list[str] | None = None,
    ks: list[int | str] | None = None,
    launches: list[str] | None = None,
    endpoint: bool = False,
) -> list[Config]:
    """The configurations to measure, the baseline first: from a config file, or one per --launch command (a `{k}`
    command swept over `ks`), or the baseline and one per drafter × k (default: n-gram, k auto). Against an
    endpoint each asks specwise's server for its speculation in the request."""
    ks = ks or ["auto"]
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise SpecwiseError(f"config file {str(path)!r} does not exist")
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise SpecwiseError(f"{path}: not valid YAML ({exc})") from None
        raw = doc.get("configs") if isinstance(doc, dict) else None
        if not isinstance(raw, list) or len(raw) < 2:
            raise SpecwiseError(f"{path}: 'configs' must list a baseline and at least one speculative configuration")
        out = []
        for i, c in enumerate(raw):
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or set(c) - CONFIG_KEYS:
                raise SpecwiseError(
                    f"{path}: configs[{i}] must be a mapping with 'name' and optionally "
                    "'drafter', 'k', 'verify' (coupled or rejection), 'launch' (a server command), 'request' (extra "
                    "request fields) — nothing else"
                )
            if c.get("launch") is not None and not (isinstance(c["launch"], str) and c["launch"].strip()):
                raise SpecwiseError(f"{path}: configs[{i}].launch must be a command line (a non-empty string)")
            if c.get("request") is not None and not isinstance(c["request"], dict):
                raise SpecwiseError(f"{path}: configs[{i}].request must be a mapping of extra request fields")
            where = f"{path}: configs[{i}]"
            k = _where(where, parse_k, c.get("k", "auto"))
            if c.get("launch"):  # the server's own command says what it drafts (unless the file says it)
                drafter, k_said = _where(where, commands.speculation, c["launch"])
                drafter, k = c.get("drafter") or drafter, k if "k" in c else k_said
            else:
                drafter = _check_drafter(c.get("drafter"), where)
            verify = _where(where, check_verify, c["verify"]) if c.get("verify") is not None else None
            if verify and endpoint:
                raise SpecwiseError(
                    f"{where}: 'verify' sets an in-process engine's method; against a server give it in the request "
                    "(specwise: request: {speculative: {verify: ...}}) or in its launch command (serve --verify)"
                )
            out.append(Config(c["name"], drafter, k, c.get("request"), c.get("launch"), verify))
        return out
    if launches:
        if len(launches) < 2:
            raise SpecwiseError("--launch: give one command per configuration, the baseline's first (at least two)")
        return launch_configs(launches, ks)
    configs = [Config("baseline")] + [
        Config(f"{_check_drafter(d, '--drafter')} k={k}", d, k) for d in drafters or ["ngram"] for k in ks
    ]
    if endpoint:  # specwise serve chooses per request; other servers need --launch
        configs = [
            Config(
                c.name,
                c.drafter,
                c.k,
                {
                    "speculative": {
                        "enabled": c.drafter is not None,
                        **({"drafter": c.drafter, "k": c.k} if c.drafter else {}),
                    }
                },
            )
            for c in configs
        ]
    return configs


LAUNCH_NAME = re.compile(
    r"^([a-z][a-z0-9_.-]*)=(.*)$", re.DOTALL
)  # lowercase: `FOO=1 cmd` stays an environment assignment


def launch_configs(launches: list[str], ks: list[int | str] | None = None) -> list[Config]:
    """`--launch [NAME=]CMD`, the baseline's first: named as given, else baseline, speculative(-i). A command with
    `{k}` becomes one configuration per `--k` draft length (a sweep over launched servers, `NAME k=K`); each
    configuration's drafter and k are read from its command (commands.speculation), so a sweep can be exported."""
    ks = ks or ["auto"]
    defaults = ["baseline"] + (
        ["speculative"] if len(launches) == 2 else [f"speculative-{i}" for i in range(1, len(launches))]
    )
    configs = []
    for default, text in zip(defaults, launches, strict=True):
        m = LAUNCH_NAME.match(text.strip())
        name, cmd = (m.group(1), m.group(2).strip()) if m else (default, text.strip())
        if not cmd:
            raise SpecwiseError(f"--launch {text!r}: give a command after {name}= (e.g. {name}=llama-server -m M.gguf)")
        swept = commands.with_k(cmd, ks)
        for k, one in swept:
            drafter, k_said = commands.speculation(one)
            configs.append(Config(f"{name} k={k}" if len(swept) > 1 else name, drafter, k_said, None, one))
    if ks != ["auto"] and not any(commands.K_PLACEHOLDER in t for t in launches):
        raise SpecwiseError(
            f"--k {','.join(map(str, ks))} with --launch sweeps only commands that hold {commands.K_PLACEHOLDER} (e.g. "
            "'\"num_speculative_tokens\": {k}' in vLLM's --speculative-config): put it where the draft length goes"
        )
    if commands.K_PLACEHOLDER in launches[0]:
        raise SpecwiseError(f"--launch: the baseline's command (the first) cannot hold {commands.K_PLACEHOLDER}")
    names = [c.name for c in configs]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise SpecwiseError(
            f"--launch: configuration names must be unique, and {', '.join(clashes)} is given twice (names: "
            f"{', '.join(names)}); name each with NAME=CMD"
        )
    return configs


def engine_batch(loads: list[Load]) -> int:
    """The in-process engine's batch for these loads: the highest concurrency, at least 4 (room for open loops)."""
    return max([int(ld.value) for ld in loads if ld.kind == "concurrent"] + [4])


def workload_from(value: str | None) -> Workload:
    """--workload: a file, or the name of a built-in workload (default: release-notes), also as a run records it
    (`builtin:NAME`)."""
    if value is None:
        return builtin_workload()
    if value.startswith("builtin:") and value[len("builtin:") :] in BUILTIN:
        return builtin_workload(value[len("builtin:") :])
    if value in BUILTIN and not Path(value).exists():
        return builtin_workload(value)
    if not Path(value).exists():
        raise SpecwiseError(
            f"--workload {value!r} is neither a file nor a built-in workload (built-in: {', '.join(BUILTIN)})"
        )
    return load_workload(value)


def _check_drafter(spec, where: str):
    return None if spec is None else _where(where, check_drafter_spec, spec)


def _where(where: str, check, value):
    """`check(value)`, its error prefixed with where the value came from."""
    try:
        return check(value)
    except SpecwiseError as exc:
        raise SpecwiseError(f"{where}: {exc}", param=exc.param) from None


def check_output_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specwise-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise SpecwiseError(f"output directory {str(out)!r} is not writable ({exc.strerror or exc})") from None


def evaluate(plan: Plan, store: Store, backend: Backend, out: Path, options: RunOptions) -> int:
    """Measure the plan into `store` (closed, and the backend's servers stopped, on every exit path), then judge the
    run and write its report into `out`: 0, or 130 when interrupted (every finished request kept)."""

    # SIGTERM and SIGHUP end the run as Ctrl-C does: records are saved, launched servers stopped (every exit path;
    # a kill -9 is covered by each launched server's reaper, http_backend._reaper).
    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread (tests): leave the handlers as they are
            signal.signal(sig, _interrupt)
    try:
        run(plan, store, backend, options)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: every finished request is saved in {out / 'run.db'}; continue with --resume",
            file=sys.stderr,
        )
        return 130
    finally:
        store.close()
        backend.close()
    result = load_run(out / "run.db")
    store_verdicts(out / "run.db", result.analysed)
    print(console_summary(result))
    (out / "report.html").write_text(html_report(result))
    print(f"\nreport: {out / 'report.html'}")
    return 0
