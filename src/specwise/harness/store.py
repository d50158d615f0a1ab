"""Results in SQLite, written as each request completes, so an interrupted run loses at most what was in flight.

One file per run: `meta` holds the schema version, the run's plan (workload, configurations, loads, settings) and
its provenance; `requests` holds one row per measured request, unique per (config, load, task, repeat) so a
resumed run skips exactly what is already there.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.paths import owner_only, sqlite_readonly_uri
from specwise.speccounts import SpecCounts

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    config TEXT NOT NULL, load TEXT NOT NULL, task_id TEXT NOT NULL, repeat INTEGER NOT NULL,
    groups TEXT NOT NULL, seed INTEGER, started REAL, finished REAL,
    output TEXT, prompt_tokens INTEGER, output_tokens INTEGER, finish_reason TEXT,
    ttft REAL, itl TEXT, e2e REAL, prefill REAL, decode REAL, spec TEXT,
    error TEXT, validation TEXT, passed INTEGER, chunks TEXT, tokens TEXT,
    PRIMARY KEY (config, load, task_id, repeat)
);
"""


@dataclass
class Record:
    """One measured request, as the client saw it, with the engine's statistics where it reports them."""

    config: str
    load: str
    task_id: str
    repeat: int
    groups: list[str]
    seed: int | None = None
    started: float = 0.0
    finished: float = 0.0
    output: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive streamed chunks
    e2e: float | None = None
    prefill: float | None = None
    decode: float | None = None
    spec: SpecCounts | None = None  # what the system reported of its speculation (None: it reported none)
    verify: str | None = None  # how sampled drafts were verified, where the system says (specwise: coupled, …)
    error: str | None = None
    validation: list[dict] = field(default_factory=list)
    passed: bool | None = None
    chunks: list[list[float]] = field(default_factory=list)  # [seconds since submission, characters] per chunk
    tokens: list[int] | None = None  # the output's token ids, where the system gave them (specwise's engine)

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.config, self.load, self.task_id, self.repeat)


_JSON = ("groups", "itl", "spec", "validation", "chunks", "tokens")


class Store:
    """A run's SQLite file."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise SpecwiseError(f"results file {str(self.path)!r} does not exist")
        try:
            if create:
                owner_only(self.path)  # a run holds prompts, outputs and the servers' answers
                self.db = sqlite3.connect(str(self.path))
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.executescript(SCHEMA)
                columns = {r[1] for r in self.db.execute("PRAGMA table_info(requests)")}
                for column in ("chunks", "tokens"):  # a file from before these were recorded: add the column
                    if column not in columns:
                        self.db.execute(f"ALTER TABLE requests ADD COLUMN {column} TEXT")
            else:  # reading: touch nothing, and say so if this is not a results file
                self.db = sqlite3.connect(sqlite_readonly_uri(self.path), uri=True)
                tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                version = self.get_meta("schema_version") if "meta" in tables else None
                if version is not None and version != SCHEMA_VERSION:
                    self.db.close()
                    raise SpecwiseError(
                        f"{self.path}: results schema version {version}; this specwise reads "
                        f"version {SCHEMA_VERSION} (re-run the evaluation, or use the specwise "
                        "that wrote it)"
                    )
                if not {"meta", "requests"} <= tables:
                    self.db.close()
                    raise SpecwiseError(f"{self.path} is not a specwise results file (run.db of `specwise evaluate`)")
        except (sqlite3.Error, OSError) as exc:
            raise SpecwiseError(f"cannot open results file {str(self.path)!r}: {exc}") from None
        version = self.get_meta("schema_version")
        if version is None and create:
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif version != SCHEMA_VERSION:
            raise SpecwiseError(
                f"{self.path}: results schema version {version}; this specwise reads version "
                f"{SCHEMA_VERSION} (re-run the evaluation, or use the specwise that wrote it)"
            )

    def get_meta(self, key: str):
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def set_meta(self, key: str, value) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def add(self, r: Record) -> None:
        """Write one record and commit at once."""
        row = asdict(r)
        row.pop("verify")  # kept beside the counts in the spec column (the file's format is unchanged)
        row["spec"] = {**(row["spec"] or {}), **({"verify": r.verify} if r.verify is not None else {})}
        for k in _JSON:
            row[k] = json.dumps(row[k])
        row["passed"] = None if r.passed is None else int(r.passed)
        cols = ", ".join(row)
        with self.db:
            self.db.execute(
                f"INSERT OR REPLACE INTO requests ({cols}) VALUES ({', '.join('?' * len(row))})", tuple(row.values())
            )

    def delete(self, keys: set[tuple[str, str, str, int]]) -> None:
        """Drop these (config, load, task, repeat) records, so a resumed run measures them again."""
        with self.db:
            self.db.executemany(
                "DELETE FROM requests WHERE config = ? AND load = ? AND task_id = ? AND repeat = ?", sorted(keys)
            )

    def done_keys(self, retry_errors: bool = False) -> set[tuple[str, str, str, int]]:
        """(config, load, task, repeat) of the stored records; with `retry_errors`, of the ones that did not fail."""
        where = " WHERE error IS NULL" if retry_errors else ""
        return set(self.db.execute(f"SELECT config, load, task_id, repeat FROM requests{where}").fetchall())

    def records(self) -> list[Record]:
        cur = self.db.execute("SELECT * FROM requests ORDER BY started")
        names = [d[0] for d in cur.description]
        out = []
        for row in cur.fetchall():
            d = dict(zip(names, row, strict=False))
            for k in _JSON:
                d[k] = json.loads(d[k]) if d.get(k) is not None else {"spec": {}, "tokens": None}.get(k, [])
            spec = dict(d["spec"] or {})
            d["verify"] = spec.pop("verify", None)
            d["spec"] = SpecCounts.from_dict(spec) if spec else None
            d["passed"] = None if d["passed"] is None else bool(d["passed"])
            out.append(Record(**d))
        return out

    def close(self) -> None:
        self.db.close()
