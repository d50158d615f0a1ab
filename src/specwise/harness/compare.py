"""`specwise compare A.db B.db`: two runs side by side, with every difference of revision or setup flagged.

A comparison across revisions (another target or draft file, another specwise, other hardware or another plan) is
not a like-for-like result: it is printed, but flagged, and the command exits 1.
"""

from __future__ import annotations

from specwise.harness.results import Run


def _flags(a: Run, b: Run) -> list[str]:
    pa, pb = a.provenance, b.provenance
    flags = []
    ta, tb = pa.get("target", {}), pb.get("target", {})
    if ta.get("sha256") != tb.get("sha256"):
        flags.append(
            f"target revision differs: {ta.get('name')} {str(ta.get('sha256'))[:12]} vs "
            f"{tb.get('name')} {str(tb.get('sha256'))[:12]}"
        )
    for name in sorted(set(pa.get("configs", {})) & set(pb.get("configs", {}))):
        da, db = pa["configs"][name].get("draft_identity"), pb["configs"][name].get("draft_identity")
        if da != db:
            flags.append(f"draft of {name!r} differs: {da} vs {db}")
    if pa.get("specwise_version") != pb.get("specwise_version"):
        flags.append(f"specwise version differs: {pa.get('specwise_version')} vs {pb.get('specwise_version')}")
    ha, hb = pa.get("hardware", {}), pb.get("hardware", {})
    if any(ha.get(key) != hb.get(key) for key in ("cpu", "gpu")):
        flags.append("hardware differs")
    if ha.get("kernels") != hb.get("kernels"):
        flags.append(f"kernels differ: {ha.get('kernels')} vs {hb.get('kernels')}")
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
