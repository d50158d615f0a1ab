"""Reports from a run's SQLite file: a console summary, one self-contained HTML page with plots, JSON and CSV.

The HTML page inlines its SVG plots and styles (no scripts, no network): speedup per group with intervals, latency
against load for each configuration, the acceptance histogram and acceptance by position, and TTFT against E2E.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from html import escape

from specwise.harness import svgplot
from specwise.harness.facts import describe
from specwise.harness.load import parse_load
from specwise.harness.results import Analysis, Run
from specwise.harness.server_reports import counts_from_counters
from specwise.harness.verdict import Clause, load_name

__all__ = ["background_line", "console_summary", "html_report", "plots", "to_csv", "to_json"]


def _best_k_lines(a: Analysis) -> list[str]:
    """The k sweep's table: the best swept k per drafter, load and group, then one k per load for a server."""
    if not a.best_k:
        return []
    lines = ["", "best draft length of the sweep (by E2E speedup; `clear` when its CI lies above every other k's)"]
    lines.append(f"{'drafter':>14} {'load':>14} {'group':>12} {'best k':>6} {'E2E speedup [95% CI]':>24} {'vs off':>8}")
    for b in a.best_k:
        s = b.speedup
        verdict = "beats" if b.beats_off else ("loses" if s.hi < 1 else "unclear")
        lines.append(
            f"{b.drafter:>14} {b.load:>14} {b.group:>12} {b.k:>6} {s.value:>8.2f}x [{s.lo:.2f}–{s.hi:.2f}]    "
            f"{verdict:>8}{'  clear' if b.clearly_best else ''}"
        )
    lines += ["one k per load for a server setting (specwise export-config):"] + [f"  {c.text()}" for c in a.k_choices]
    return lines


def mark(clause: Clause) -> str:
    """A clause's mark on the console: ok, -- (neutral) or !!."""
    return "ok" if clause.ok else ("--" if clause.neutral else "!!")


def _css(clause: Clause) -> str:
    return "ok" if clause.ok else ("neutral" if clause.neutral else "bad")


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def background_line(run: Run) -> str:
    """One line on what else ran on the machine while the run measured (empty for a run that recorded nothing)."""
    phases = run.backgrounds
    if not phases:
        return ""
    local = [p for p in phases if p.background.observed == "local"]
    if not local:
        return (
            f"background: client side only ({len(phases)} phases; the endpoint's machine was not observed) — at most "
            f"{max(p.background.share for p in phases):.0%} of this client's cores"
        )
    busy = [p for p in local if p.background.busy(run.busy_share)]
    worst = max(local, key=lambda p: p.background.share)
    cpus = worst.background.cpus
    if not busy:
        return (
            f"background: quiet — at most {worst.background.share:.0%} of {cpus} cores over {len(local)} phases "
            f"(contended above {run.busy_share:.0%})"
        )
    return (
        f"background: BUSY — {len(busy)} of {len(local)} phases above {run.busy_share:.0%} of {cpus} cores, the worst "
        f"{worst.config} at {worst.load}: {worst.background.text()}; cells marked * (re-measure: evaluate --resume "
        "--remeasure-contended)"
    )


def phase_line(a: Analysis) -> str:
    """What the speedup intervals carry beside the tasks' spread: each load's phase noise (how far a chunk's phase
    pair shifts its speedups together), or why it was not measured (empty for a run without comparisons)."""
    if not a.comparisons or not a.phase_noise:
        return ""
    measured = {load: p for load, p in a.phase_noise.items() if p.df > 0}
    if not measured:
        return (
            "intervals: tasks resampled; how far a phase shifts all its requests together is not measured with one "
            "repeat (--repeats 2 measures it into the intervals; on a busy or noisy machine it can make them "
            "several times wider than shown)"
        )
    parts = ", ".join(f"{load} ±{p.sd:.0%} ({p.df} df)" for load, p in measured.items())
    return f"intervals: tasks resampled, plus the shift a chunk's phase pair gives all its speedups (sd): {parts}"


def _bg(share: float | None, busy: bool) -> str:
    return "-" if share is None else f"{share:.0%}{'*' if busy else ''}"


def predicted_rows(run: Run) -> list[tuple[str, str, str, str, str]]:
    """evaluate --predict-first: each predicted cell beside what was measured (config, load, group, predicted,
    measured), skipped configurations included ("not run")."""
    first = run.predict_first
    if first is None:
        return []
    measured = {(c.config, c.load, c.group): c.e2e_speedup for c in run.analysed.comparisons}
    rows = []
    for x in first.cells:
        m = measured.get((x.config, x.load, x.group))
        shown = f"{m.value:.2f}x [{m.lo:.2f}–{m.hi:.2f}]" if m else ("not run" if x.config in first.skipped else "—")
        rows.append((x.config, x.load, x.group, f"{x.value:.2f}x [{x.lo:.2f}–{x.hi:.2f}]", shown))
    return rows


def _predicted_lines(run: Run) -> list[str]:
    first = run.predict_first
    if first is None:
        return []
    lines = ["", f"predicted before the run (--predict-first, from the baseline in {first.baseline})"]
    lines.append(f"{'config':>22} {'load':>14} {'group':>12} {'predicted E2E ×  [95% CI]':>26} {'measured':>22}")
    lines += [f"{c:>22} {ld:>14} {g:>12} {p:>26} {m:>22}" for c, ld, g, p, m in predicted_rows(run)]
    lines += [f"  {name}: not run (predicted to lose in every cell)" for name in first.skipped]
    lines += [f"  {name}: run without a prediction ({why})" for name, why in first.unpredicted.items()]
    return lines


def console_summary(run: Run) -> str:
    a = run.analysed
    lines = []
    prov = run.provenance
    target, hw = prov.served_target, prov.hardware
    lines.append(f"run {run.path}  fingerprint {run.fingerprint}  specwise {prov.specwise_version}")
    sha = target.sha256
    precision = f"{target.precision}, " if target.precision else ""
    kernels = f", kernels {hw.kernels}" if hw.kernels else ""
    lines.append(
        f"target {describe(target.name)} ({precision}sha256 {sha[:12] + '…' if sha else 'unknown'}"
        + (f", derived from {target.source_sha256[:12]}…" if target.source_sha256 else "")
        + ")  "
        f"hardware {describe(hw.cpu)} ×{describe(hw.cpu_threads)}{kernels}"
    )
    servers = {describe(f.server) for f in prov.facts.values() if f.server}
    if servers:
        lines.append(f"server {'; '.join(sorted(servers))}")
    if bg := background_line(run):
        lines.append(bg)
    lines.append("")
    lines.append(
        f"{'config':>22} {'load':>14} {'group':>12} {'n':>3} {'E2E speedup [95% CI]':>24} "
        f"{'decode ×':>8} {'valid b→s':>11} {'mismatch':>8} {'bg':>5}"
    )
    for c in a.comparisons:
        e, d = c.e2e_speedup, c.decode_speedup
        lines.append(
            f"{c.config:>22} {c.load:>14} {c.group:>12} {c.n:>3} "
            f"{e.value:>8.2f}x [{e.lo:.2f}–{e.hi:.2f}]    {_fmt(d and d.value, '.2f'):>8} "
            f"{c.validation_base:>4.0%}→{c.validation_spec:<4.0%} {len(c.mismatches):>8} {_bg(c.background, c.busy):>5}"
        )
    evidence = sorted({c.evidence for c in a.comparisons if c.evidence})
    if evidence:
        lines.append(f"losslessness audit compared: {'; '.join(evidence)}")
    if phases := phase_line(a):
        lines.append(phases)
    lines += _predicted_lines(run)
    lines += _best_k_lines(a)
    findings = [d.text() for d in a.determinism if d.load != d.reference or d.repeat_pairs]
    if findings:
        lines.append("")
        lines.append("baseline determinism (outputs against the baseline's own; mismatch counts only outputs that")
        lines.append("differ from the baseline both at their load and at the reference load)")
        lines += [f"  {t}" for t in findings]
    lines.append("")
    lines.append(
        f"{'config':>22} {'load':>14} {'group':>12} {'E2E p50':>8} {'p90':>7} {'p99':>7} {'TTFT p50':>8} "
        f"{'TPOT p50':>8} {'accept':>6} {'MAL':>5} {'draft%':>6} {'goodput/s':>9}"
    )
    for row in a.table:
        lines.append(
            f"{row.config:>22} {row.load:>14} {row.group:>12} {_fmt(row.e2e.p50, '.2f'):>8} "
            f"{_fmt(row.e2e.p90, '.2f'):>7} {_fmt(row.e2e.p99, '.2f'):>7} "
            f"{_fmt(row.ttft.p50):>8} {_fmt(row.tpot.p50):>8} "
            f"{_fmt(row.acceptance_rate, '.2f'):>6} {_fmt(row.mean_acceptance_length, '.2f'):>5} "
            f"{_fmt(row.drafting_share and 100 * row.drafting_share, '.1f'):>6} "
            f"{_fmt(row.goodput, '.3f'):>9}"
        )
    if note := _unreported_note(run):
        lines.append(note)
    streamed = [row for row in a.table if row.stream is not None]
    if streamed:
        lines.append("")
        lines.append("streaming as a reader sees it (seconds; chars/s rendered between first and last chunk)")
        lines.append(
            f"{'config':>22} {'load':>14} {'group':>12} {'TTFT p50':>8} {'line p50':>8} {'chars/s':>8} "
            f"{'stall p50':>9} {'p99':>6} {'gap p99':>7}"
        )
        for row in streamed:
            st = row.stream
            assert st is not None
            lines.append(
                f"{row.config:>22} {row.load:>14} {row.group:>12} {_fmt(row.ttft.p50):>8} "
                f"{_fmt(st.first_line.p50):>8} {_fmt(st.chars_per_s.p50, '.0f'):>8} {_fmt(st.longest_stall.p50):>9} "
                f"{_fmt(st.longest_stall.p99):>6} {_fmt(st.gap_p99):>7}"
            )
    if run.server_counters:
        lines.append("")
        lines.append("server-side spec-decode counters (scraped from /metrics around each phase)")
        lines.append(f"{'config|load':>38} {'drafts':>8} {'draft tok':>9} {'accepted':>9} {'accept':>6} {'MAL':>5}")
        for key, deltas in run.server_counters.items():
            sc = counts_from_counters(deltas)
            lines.append(
                f"{key:>38} {sc.steps:>8} {sc.drafted:>9} {sc.accepted:>9} "
                f"{_fmt(sc.acceptance_rate, '.2f'):>6} {_fmt(sc.mean_acceptance_length, '.2f'):>5}"
                + (f"  ({deltas[-1].source})" if deltas and deltas[-1].source else "")
            )
    for config, by_kind in a.verdicts.items():
        for kind, v in by_kind.items():
            lines.append("")
            lines.append(
                f"VERDICT for {config} ({'concurrency' if kind == 'concurrent' else 'arrival rate'}): "
                f"{v.headline(load_name(kind))}"
            )
            lines += [f"  [{mark(cl)}] {cl.text}" for cl in v.clauses]
    return "\n".join(lines)


def counter_positions(run: Run) -> list[float]:
    """Acceptance at each draft position from the scraped counters of every speculative phase: accepted at the
    position over drafts (vLLM's own per-position rate; a draft shorter than k counts as not accepted there)."""
    deltas = [
        d for key, ds in run.server_counters.items() if not key.startswith(run.analysed.baseline + "|") for d in ds
    ]
    drafts = sum(d.num_drafts for d in deltas)
    if not drafts or not any(d.accepted_per_pos for d in deltas):
        return []
    width = max(len(d.accepted_per_pos) for d in deltas)
    return [sum(d.accepted_per_pos[i] for d in deltas if i < len(d.accepted_per_pos)) / drafts for i in range(width)]


def unreported(run: Run) -> list[str]:
    """Speculative configurations whose server counted drafts (its /metrics) but reported no speculation per request:
    their per-request acceptance columns are empty, and the report says why."""
    a = run.analysed
    counted = {key.partition("|")[0] for key, ds in run.server_counters.items() if any(d.num_drafts for d in ds)}
    per_request = {row.config for row in a.table if row.acceptance_rate is not None}
    return sorted(counted - per_request - {a.baseline})


def _unreported_note(run: Run) -> str:
    names = unreported(run)
    if not names:
        return ""
    return (
        f"{', '.join(names)}: the server counted drafts but reported no speculation per request, so accept and MAL "
        "per request are empty (vLLM reports them when started with --per-request-spec-decode-metrics detailed); "
        "its counters give each phase's figures"
    )


def plots(run: Run) -> dict[str, str]:
    """Every plot of the report, by name."""
    a = run.analysed
    out = {}
    several = len({c.config for c in a.comparisons}) > 1  # then each row says which configuration it is
    rows = [
        (f"{c.config} · {c.group} {c.load}" if several else f"{c.group} {c.load}", e.value, e.lo, e.hi)
        for c in a.comparisons
        for e in [c.e2e_speedup]
    ]
    out["speedup"] = svgplot.interval_chart("E2E speedup per group (95% CI)", rows, x_label="baseline E2E / spec E2E")
    by_group: dict[str, list[tuple[float, float, float, float]]] = {}
    for c in a.comparisons:  # speedup against load: one line per configuration × group, closed-loop loads
        load = parse_load(c.load)
        if load.kind == "concurrent":
            e = c.e2e_speedup
            by_group.setdefault(f"{c.config}: {c.group}", []).append((load.value, e.value, e.lo, e.hi))
    out["speedup_vs_load"] = svgplot.band_chart(
        "E2E speedup against concurrency (95% CI; dashed: break-even)", by_group, "concurrency", "speedup", 1.0
    )
    first = a.groups[0] if a.groups else None
    series: dict[str, list[tuple[float, float]]] = {}
    for row in a.table:
        load = parse_load(row.load)
        if row.e2e.p50 is not None and row.group == first:
            series.setdefault(f"{row.config} ({load.kind})", []).append((load.value, row.e2e.p50))
    out["latency_vs_load"] = svgplot.line_chart(
        f"E2E p50 against load (group {first or '-'})", series, "concurrency / rate", "seconds"
    )
    spec_rows = [r for r in a.table if r.config != a.baseline]
    configs = list(dict.fromkeys(r.config for r in spec_rows))
    accs = [x for r in spec_rows if r.group == first for x in r.per_request_acceptance]
    pooled = f", {len(configs)} configurations pooled" if len(configs) > 1 else ""
    out["acceptance_histogram"] = svgplot.histogram(
        f"Per-request acceptance rate (group {first or '-'}{pooled})", accs, x_label="acceptance rate"
    )
    by_pos: dict[str, dict[int, list[float]]] = {}  # configuration → draft position → its cells' acceptance
    for r in spec_rows:
        for i, v in enumerate(r.acceptance_by_position):
            by_pos.setdefault(r.config, {}).setdefault(i, []).append(v)
    title = "Acceptance by draft position"
    if len(by_pos) > 1:  # one line per configuration: drafters differ most in how far their drafts hold
        lines = {c: [(i + 1.0, sum(v) / len(v)) for i, v in sorted(p.items())] for c, p in by_pos.items()}
        out["acceptance_by_position"] = svgplot.line_chart(title, lines, "position", "acceptance")
    else:
        bars = [(str(i + 1), sum(v) / len(v)) for p in by_pos.values() for i, v in sorted(p.items())]
        if not bars and (counted := counter_positions(run)):  # no per-request positions: the server's counters
            bars = [(str(i + 1), v) for i, v in enumerate(counted)]
            title += " (server counters: accepted / drafts)"
        out["acceptance_by_position"] = svgplot.bar_chart(title, bars, "position", "acceptance", y_max=1.0)
    pts: dict[str, list[tuple[float, float]]] = {}
    for rec in run.records:
        if rec.error is None and rec.ttft is not None and rec.e2e is not None:
            pts.setdefault(rec.config, []).append((rec.ttft, rec.e2e))
    out["ttft_vs_e2e"] = svgplot.scatter("TTFT against E2E per request", pts, "TTFT (s)", "E2E (s)")
    return out


def html_report(run: Run) -> str:
    a = run.analysed
    prov = run.provenance
    figs = "".join(f'<figure data-plot="{name}">{svg}</figure>' for name, svg in plots(run).items())
    findings = [d.text() for d in a.determinism if d.load != d.reference or d.repeat_pairs]
    evidence = sorted({c.evidence for c in a.comparisons if c.evidence})
    determinism = (
        "<h2>Baseline determinism</h2><ul>" + "".join(f"<li>{escape(t)}</li>" for t in findings) + "</ul>"
        if findings
        else ""
    )
    if evidence:
        determinism = f"<p class=evidence>Losslessness audit compared: {escape('; '.join(evidence))}</p>" + determinism
    if phases := phase_line(a):
        determinism = f"<p class=intervals>{escape(phases)}</p>" + determinism
    best_k = ""
    if a.best_k:
        rows_k = "".join(
            "<tr>"
            + "".join(
                f"<td>{escape(str(x))}</td>"
                for x in (
                    b.drafter,
                    b.load,
                    b.group,
                    b.k,
                    f"{b.speedup.value:.2f}x",
                    f"{b.speedup.lo:.2f}–{b.speedup.hi:.2f}",
                    "beats" if b.beats_off else ("loses" if b.speedup.hi < 1 else "unclear"),
                    "yes" if b.clearly_best else "no",
                )
            )
            + "</tr>"
            for b in a.best_k
        )
        head_k = ["drafter", "load", "group", "best k", "E2E speedup", "95% CI", "vs off", "clearly best"]
        best_k = (
            f'<h2>Best draft length (k sweep)</h2><table data-table="best-k"><tr>'
            f"{''.join(f'<th>{h}</th>' for h in head_k)}</tr>{rows_k}</table><ul>"
            + "".join(f"<li>{escape(c.text())}</li>" for c in a.k_choices)
            + "</ul>"
        )
    verdicts = ""
    for config, by_kind in a.verdicts.items():
        for kind, v in by_kind.items():
            items = "".join(f'<li class="{_css(c)}">{escape(c.text)}</li>' for c in v.clauses)
            verdicts += (
                f'<section class="verdict {v.decision}"><h2>{escape(config)}: '
                f"{escape(v.headline(load_name(kind)))}</h2><ul>{items}</ul></section>"
            )
    head = [
        "config",
        "load",
        "group",
        "n",
        "E2E speedup",
        "95% CI",
        "decode speedup",
        "valid base",
        "valid spec",
        "mismatches",
        "background",
    ]
    rows = "".join(
        ('<tr class="busy">' if c.busy else "<tr>")
        + "".join(
            f"<td>{escape(str(x))}</td>"
            for x in (
                c.config,
                c.load,
                c.group,
                c.n,
                f"{c.e2e_speedup.value:.2f}x",
                f"{c.e2e_speedup.lo:.2f}–{c.e2e_speedup.hi:.2f}",
                _fmt(c.decode_speedup and c.decode_speedup.value, ".2f"),
                f"{c.validation_base:.0%}",
                f"{c.validation_spec:.0%}",
                len(c.mismatches),
                _bg(c.background, c.busy),
            )
        )
        + "</tr>"
        for c in a.comparisons
    )
    predicted = ""
    if run.predict_first is not None:
        first = run.predict_first
        cells = "".join("<tr>" + "".join(f"<td>{escape(x)}</td>" for x in row) + "</tr>" for row in predicted_rows(run))
        heads = "".join(f"<th>{h}</th>" for h in ("config", "load", "group", "predicted E2E speedup", "measured"))
        notes = [f"{n}: not run (predicted to lose in every cell)" for n in first.skipped]
        notes += [f"{n}: run without a prediction ({why})" for n, why in first.unpredicted.items()]
        predicted = (
            f"<h2>Predicted before the run</h2><p>From the baseline in <code>{escape(first.baseline)}</code> "
            f'(--predict-first).</p><table data-table="predicted"><tr>{heads}</tr>{cells}</table>'
            + ("<ul>" + "".join(f"<li>{escape(t)}</li>" for t in notes) + "</ul>" if notes else "")
        )
    bg_line = f'<p class="background">{escape(text)}</p>' if (text := background_line(run)) else ""
    table = f"<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{rows}</table>"
    note = f'<p class="unreported">{escape(text)}</p>' if (text := _unreported_note(run)) else ""
    provenance = escape(
        json.dumps(
            {k: prov.raw[k] for k in ("specwise_version", "target", "configs", "hardware") if k in prov.raw}, indent=2
        )
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>specwise report</title><style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}}
figure{{display:inline-block;vertical-align:top;margin:0.5em;border:1px solid #ddd;padding:0.5em}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}
.verdict{{border-left:6px solid #999;padding:0.2em 1em;margin:1em 0}}.adopt{{border-color:#59a14f}}
.conditional{{border-color:#edc948}}.reject{{border-color:#e15759}}.inconclusive{{border-color:#bab0ac}}
li.bad{{color:#b00}}li.neutral{{color:#666}}tr.busy td{{background:#fdf0d5}}
p.background{{font-size:14px}}
pre{{background:#f6f6f6;padding:1em;font-size:12px}}</style></head><body>
<h1>specwise evaluation</h1><p>Run <code>{escape(run.path)}</code>, fingerprint
<code>{escape(str(run.fingerprint))}</code>, workload <b>{escape(run.plan.workload)}</b>,
configurations {escape(", ".join(a.configs))}, loads {escape(", ".join(a.loads))}.</p>
{bg_line}{verdicts}{determinism}{best_k}<h2>Plots</h2>{note}{figs}<h2>Paired comparisons</h2>{table}{predicted}
<h2>Provenance</h2><pre>{provenance}</pre></body></html>"""


def to_json(run: Run) -> str:
    return json.dumps(
        {
            "plan": run.plan_meta,
            "provenance": run.provenance.raw,
            "fingerprint": run.fingerprint,
            "analysis": run.analysed.to_dict(),
            "background": {"busy_share": run.busy_share, "phases": [p.to_dict() for p in run.backgrounds]},
            "predict_first": run.predict_first.to_json() if run.predict_first else None,
            "records": [asdict(r) for r in run.records],
        },
        indent=2,
    )


_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet may read as the start of a formula


def _cell(value: object) -> object:
    """A CSV cell that a spreadsheet shows as text: a string that could start a formula gets a leading quote."""
    if isinstance(value, str) and value.startswith(_FORMULA):
        return "'" + value
    return value


def to_csv(run: Run) -> str:
    """One row per request; text cells escaped against formula injection (outputs and errors come from servers)."""
    buf = io.StringIO()
    fields = [
        "config",
        "load",
        "task_id",
        "repeat",
        "groups",
        "prompt_tokens",
        "output_tokens",
        "ttft",
        "e2e",
        "prefill",
        "decode",
        "drafted",
        "accepted",
        "passed",
        "error",
    ]
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for r in run.records:
        row = {
            "config": r.config,
            "load": r.load,
            "task_id": r.task_id,
            "repeat": r.repeat,
            "groups": "|".join(r.groups),
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "ttft": r.ttft,
            "e2e": r.e2e,
            "prefill": r.prefill,
            "decode": r.decode,
            "drafted": r.spec.drafted if r.spec else None,
            "accepted": r.spec.accepted if r.spec else None,
            "passed": r.passed,
            "error": r.error,
        }
        w.writerow({k: _cell(v) for k, v in row.items()})
    return buf.getvalue()
