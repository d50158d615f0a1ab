"""The report where a server counted drafts but reported nothing per request (vLLM without
--per-request-spec-decode-metrics): acceptance by position from its counters, and a line saying why the per-request
columns are empty; chart legends below the plotted area (issue 22, gaps of the report)."""

from __future__ import annotations

import re

from specwise.harness import svgplot
from specwise.harness.analyze import load_run
from specwise.harness.config import Config
from specwise.harness.report import console_summary, html_report, plots, unreported
from specwise.harness.server_reports import CounterDelta
from specwise.harness.store import Record, Store
from specwise.speccounts import SpecCounts


def counted_only_run(path) -> str:
    store = Store(path)
    configs = [Config("base", None, "auto", None, "srv"), Config("spec", "ngram:4", 4, None, "srv --spec")]
    _plan(store, configs)
    delta = CounterDelta(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=18, accepted_per_pos=[8, 5, 3, 2])
    store.set_meta("server_counters", {"spec|concurrent@1": [delta.to_dict()]})
    for i in range(4):
        for c, e2e in (("base", 1.0), ("spec", 0.7)):
            store.add(_record(c, i, e2e))
    store.close()
    return str(path)


def _plan(store: Store, configs: list[Config]) -> None:
    store.set_meta(
        "plan",
        {
            "workload": {"name": "w", "source": "synthetic", "tasks": [[f"t{i}", 16] for i in range(4)]},
            "configs": [c.to_dict() for c in configs],
            "loads": ["concurrent@1"],
            "repeats": 1,
            "seed": 0,
            "temperature": 0.0,
            "model": None,
        },
    )
    store.set_meta("provenance", {"target": {"name": "m"}, "hardware": {}})


def _record(config: str, i: int, e2e: float, spec: SpecCounts | None = None) -> Record:
    return Record(
        config,
        "concurrent@1",
        f"t{i}",
        0,
        ["g"],
        0,
        0.0,
        e2e,
        output="o",
        e2e=e2e,
        ttft=0.1,
        output_tokens=16,
        passed=True,
        spec=spec,
    )


def test_counted_drafts_without_per_request_figures_are_explained_and_plotted(tmp_path):
    run = load_run(counted_only_run(tmp_path / "run.db"))
    assert unreported(run) == ["spec"]
    note = "spec: the server counted drafts but reported no speculation per request"
    assert note in console_summary(run) and note in html_report(run)
    bars = plots(run)["acceptance_by_position"]
    assert "server counters: accepted / drafts" in bars
    heights = [float(h) for h in re.findall(r'<rect [^>]*height="([0-9.]+)"', bars)]
    assert len(heights) == 4 and heights == sorted(heights, reverse=True)  # 0.8, 0.5, 0.3, 0.2 of the drafts


def test_legends_lie_below_the_plotted_area():
    series = {f"configuration-{i}: group": [(1.0, 1.0 + i / 10, 0.9, 1.3), (4.0, 1.2, 1.0, 1.4)] for i in range(5)}
    svg = svgplot.band_chart("t", series, "concurrency", "speedup", 1.0)
    ys = [float(y) for y in re.findall(r'<g data-legend="[^"]*"><rect x="[0-9.]+" y="([0-9.]+)"', svg)]
    assert len(ys) == 5 and min(ys) > svgplot.H  # under the x axis and its label, not over the curves
    height = float(re.search(r'height="([0-9.]+)" role', svg).group(1))
    assert max(ys) + 8 <= height  # and inside the picture, however many rows the names take


def test_with_several_drafters_each_plotted_row_and_line_names_its_configuration(tmp_path):
    long_names = ("model:qwen2.5-coder-0.5b k=auto", "suffix k=auto")
    store = Store(tmp_path / "run.db")
    _plan(store, [Config("base", None, "auto", None, "srv"), *(Config(n, "ngram", 4, None, "srv") for n in long_names)])
    for i in range(4):
        store.add(_record("base", i, 1.0))
        for n, (e2e, accepted) in zip(long_names, ((0.6, 3), (0.9, 1)), strict=True):
            counts = SpecCounts()
            counts.observe_step(4, accepted)
            store.add(_record(n, i, e2e, counts))
    store.close()
    figures = plots(load_run(str(tmp_path / "run.db")))
    row = r'<text x="([0-9.]+)" y="[0-9.]+" text-anchor="end" font-size="10">([^<]*)</text>'
    rows = re.findall(row, figures["speedup"])
    labels = [label for _, label in rows]
    assert labels == [f"{n} · g concurrent@1" for n in long_names]  # not two rows both called "g concurrent@1"
    width = float(re.search(r'width="([0-9.]+)" height', figures["speedup"]).group(1))
    shift = float(re.search(r"translate\(([0-9.]+),0\)", figures["speedup"]).group(1))
    assert shift + float(rows[0][0]) - svgplot.LABEL_W * len(labels[0]) > 0 and width == svgplot.W + shift
    lines = figures["acceptance_by_position"]
    assert lines.count("<polyline") == 2 and all(f'data-legend="{n}"' in lines for n in long_names)
