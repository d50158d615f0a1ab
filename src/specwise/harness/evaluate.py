"""`specwise evaluate`: settings from flags or a config file, checked before anything is measured, then run, report.

With no arguments it runs the built-in release-note workload (a stratified subset of 12 tasks) on the embedded
model, baseline against n-gram drafting with adaptive k, at concurrency 1 and 4 — about five minutes on two CPU
cores — and prints the verdict. `--quick` is a one-minute subset.
"""

from __future__ import annotations

import argparse
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
from specwise.harness.engine_backend import EngineBackend
from specwise.harness.http_backend import EndpointOptions, HTTPBackend
from specwise.harness.load import Load, loads_from_flags
from specwise.harness.report import console_summary, html_report
from specwise.harness.runner import Plan, RunOptions, check_store, run
from specwise.harness.store import Store
from specwise.harness.workload import BUILTIN, Task, Workload, builtin_workload, load_workload
from specwise.specs import (
    BUSY_SHARE,
    QUIET_MACHINE_MODES,
    VERIFY_METHODS,
    TargetOptions,
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


def configs_from(args: argparse.Namespace) -> list[Config]:
    if args.config:
        path = Path(args.config)
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
            if verify and getattr(args, "endpoint", None):
                raise SpecwiseError(
                    f"{where}: 'verify' sets an in-process engine's method; against a server give it in the request "
                    "(specwise: request: {speculative: {verify: ...}}) or in its launch command (serve --verify)"
                )
            out.append(Config(c["name"], drafter, k, c.get("request"), c.get("launch"), verify))
        return out
    if getattr(args, "launch", None):
        if len(args.launch) < 2:
            raise SpecwiseError("--launch: give one command per configuration, the baseline's first (at least two)")
        return launch_configs(args.launch, _ks(getattr(args, "k", ["auto"])))
    drafters = args.drafter or ["ngram"]
    configs = [Config("baseline")] + [
        Config(f"{_check_drafter(d, '--drafter')} k={k}", d, k) for d in drafters for k in _ks(args.k)
    ]
    if getattr(args, "endpoint", None):  # specwise serve chooses per request; other servers need --launch
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


def _ks(value) -> list:
    return value if isinstance(value, list) else [value]


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


def evaluate_from_args(args: argparse.Namespace) -> int:

    # Everything is checked before the model loads or anything is measured.
    if args.launch and not args.endpoint:
        raise SpecwiseError("--launch needs --endpoint: the URL where the launched server will listen")
    if getattr(args, "retry_errors", False) and not args.resume:
        raise SpecwiseError("--retry-errors needs --resume: it re-runs the failed requests of the run in --out")
    if getattr(args, "remeasure_contended", False) and not args.resume:
        raise SpecwiseError("--remeasure-contended needs --resume: it re-runs the busy phases of the run in --out")
    options = RunOptions(
        resume=args.resume,
        show_progress=not args.no_progress,
        retry_errors=getattr(args, "retry_errors", False),
        quiet=getattr(args, "quiet_machine", QUIET_MACHINE_MODES[0]),
        busy_share=getattr(args, "busy_share", BUSY_SHARE),
        remeasure_contended=getattr(args, "remeasure_contended", False),
    )
    other_precision = args.dtype != "auto" or args.quantize or args.activations != "auto"
    if args.endpoint and other_precision:
        raise SpecwiseError(
            "--dtype, --quantize and --activations set the in-process engine's precision; with --endpoint the server "
            "decides it (put them in the command you --launch)"
        )
    workload = workload_from(args.workload)
    n_tasks = args.tasks if args.tasks is not None else (4 if args.quick else 12)
    if n_tasks < 0:
        raise SpecwiseError(f"--tasks {n_tasks} is not allowed: give 0 (all) or a positive number")
    workload = stratified(workload, n_tasks)
    loads = loads_from_flags(args.concurrency or ("1,2" if args.quick else ("" if args.rate else "1,4")), args.rate)
    configs = configs_from(args)
    cap = args.max_tokens or (48 if args.quick else None)
    if cap is not None and cap < 1:
        raise SpecwiseError(f"--max-tokens {cap} is not allowed: it must be ≥ 1")
    if args.temperature < 0:
        raise SpecwiseError(f"--temperature {args.temperature} is not allowed: it must be ≥ 0")
    if args.endpoint and args.verify:
        raise SpecwiseError(
            "--verify chooses how in-process engines verify sampled drafts; a server under --endpoint verifies as it "
            "was started (specwise: `serve --verify`, in the --launch command), and the audit reads what it reports"
        )
    verify = args.verify or VERIFY_METHODS[0]
    engine_target = TargetOptions(args.model, args.device, args.dtype, args.quantize, args.activations)
    target = args.model
    if not args.endpoint and other_precision:  # another precision is another target
        target = " ".join(filter(None, [args.model, engine_target.precision_flags()]))
    plan = Plan(
        workload,
        configs,
        loads,
        args.repeats,
        args.seed,
        args.temperature,
        target if not args.endpoint else f"{args.endpoint} {args.model or ''}".strip(),
        cap,
        verify,
    )
    out = Path(args.out)
    check_output_dir(out)
    store = Store(out / "run.db")
    check_store(plan, store, args.resume)  # before the model loads
    max_batch = engine_batch(loads)
    print(
        f"specwise evaluate: {len(workload.tasks)} tasks × {len(configs)} configurations × "
        f"{', '.join(ld.name for ld in loads)} × {plan.repeats} repeat(s) → {out / 'run.db'}",
        file=sys.stderr,
    )
    backend: Backend
    if args.endpoint:
        endpoint_options = EndpointOptions(
            api_key=args.api_key,
            temperature=args.temperature,
            launch_timeout=args.launch_timeout,
            request_timeout=args.request_timeout,
            log_dir=out,
        )
        backend = HTTPBackend(args.endpoint, args.model, configs, endpoint_options)
    else:
        backend = EngineBackend(
            engine_target, configs, max_batch=max_batch, temperature=args.temperature, verify=verify
        )

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
