"""`specwise compare A.db B.db`: two runs side by side, with every difference of revision or setup flagged.

A comparison across revisions (another target or draft file, another specwise, other hardware or another plan) is
not a like-for-like result: it is printed, but flagged, and the command exits 1.
"""

from __future__ import annotations

from specwise.harness.facts import describe
from specwise.harness.results import Run


def _flags(a: Run, b: Run) -> list[str]:
    pa, pb = a.provenance, b.provenance
    flags = []
    ta, tb = pa.served_target, pb.served_target
    if why := ta.difference(tb):
        flags.append(f"target {why}")
    elif ta.sha256 != tb.sha256:  # one of them unnamed
        flags.append(f"target revision differs: {ta.name} {str(ta.sha256)[:12]} vs {tb.name} {str(tb.sha256)[:12]}")
    servers_a = {describe(f.server) for f in pa.facts.values() if f.server} or {"the in-process engine"}
    servers_b = {describe(f.server) for f in pb.facts.values() if f.server} or {"the in-process engine"}
    if servers_a != servers_b:
        flags.append(f"server differs: {'; '.join(sorted(servers_a))} vs {'; '.join(sorted(servers_b))}")
    for name in sorted(set(pa.configs) & set(pb.configs)):
        da, db = pa.configs[name].draft_identity, pb.configs[name].draft_identity
        if da != db:
            flags.append(f"draft of {name!r} differs: {da} vs {db}")
    if pa.specwise_version != pb.specwise_version:
        flags.append(f"specwise version differs: {pa.specwise_version} vs {pb.specwise_version}")
    ha, hb = pa.hardware, pb.hardware
    if (ha.cpu, ha.gpu) != (hb.cpu, hb.gpu):
        flags.append("hardware differs")
    if ha.kernels != hb.kernels:
        flags.append(f"kernels differ: {ha.kernels} vs {hb.kernels}")
    if a.fingerprint != b.fingerprint:
        flags.append(f"plan differs (fingerprint {a.fingerprint} vs {b.fingerprint})")
    return flags


def compare_runs(a: Run, b: Run) -> tuple[str, bool]:
    """Text of the side-by-side table and whether anything was flagged."""
    rows_a = {(c.config, c.load, c.group): c for c in a.analysed.comparisons}
    rows_b = {(c.config, c.load, c.group): c for c in b.analysed.comparisons}
    lines = [
        f"A: {a.path}",
        f"B: {b.path}",
        "",
        f"{'config':>22} {'load':>14} {'group':>12} {'A speedup [CI]':>22} {'B speedup [CI]':>22}",
    ]
    for key in sorted(rows_a.keys() | rows_b.keys()):
        cells = []
        for rows in (rows_a, rows_b):
            c = rows.get(key)
            e = c.e2e_speedup if c else None
            cells.append(f"{e.value:.2f}x [{e.lo:.2f}–{e.hi:.2f}]" if e else "-")
        lines.append(f"{key[0]:>22} {key[1]:>14} {key[2]:>12} {cells[0]:>22} {cells[1]:>22}")
    flags = _flags(a, b)
    lines.append("")
    lines += [f"FLAG: {f}" for f in flags] or ["same target, drafts, specwise version, hardware and plan"]
    return "\n".join(lines), bool(flags)
