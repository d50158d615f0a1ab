"""The server's request log: one SQLite row per finished request, what `specwise monitor` compares with an evaluation.

Each row holds when the request finished, its prompt and output token counts, TTFT and E2E, the load it met (running
+ waiting requests when it was submitted), whether it speculated, drafted and accepted tokens (in total and by
position), the time split between drafting and verification, and the target and draft identity in force. Prompt and
output text only when asked for (`--log-text`). Rows are committed one by one (WAL), so a monitor can read while the
server writes. No torch here.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.paths import owner_only, sqlite_readonly_uri
from specwise.speccounts import SpecCounts

LOG_SCHEMA_VERSION = 1
KIND = "specwise-request-log"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log (
    time REAL NOT NULL, prompt_tokens INTEGER, output_tokens INTEGER, ttft REAL, e2e REAL, load INTEGER,
    speculative INTEGER, drafter TEXT, steps INTEGER, drafted INTEGER, accepted INTEGER,
    drafted_per_position TEXT, accepted_per_position TEXT, drafting_time REAL, verification_time REAL,
    decode_time REAL, finish_reason TEXT, target TEXT, draft TEXT, prompt TEXT, output TEXT, chat INTEGER, tokens TEXT
);
CREATE INDEX IF NOT EXISTS log_time ON log (time);
CREATE TABLE IF NOT EXISTS policy_changes (time REAL NOT NULL, old TEXT, new TEXT, by TEXT, reason TEXT);
CREATE TABLE IF NOT EXISTS background (time REAL NOT NULL, figures TEXT NOT NULL);
"""


@dataclass
class LogEntry:
    time: float
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    e2e: float
    load: int
    speculative: bool
    drafter: str | None
    spec: SpecCounts = field(default_factory=SpecCounts)
    decode_time: float = 0.0
    finish_reason: str | None = None
    target: dict = field(default_factory=dict)  # identity: name, sha256, …
    draft: dict | None = None  # identity of the draft in force (None when the request did not speculate)
    prompt: str | None = None
    output: str | None = None
    chat: bool | None = None  # the prompt is chat messages (JSON); None in logs from before this was recorded
    tokens: list[int] | None = None  # the output's token ids, with the text (--log-text): what predict replays


_JSON = ("drafted_per_position", "accepted_per_position", "target", "draft", "tokens")
_COUNTS = (
    "steps",
    "drafted",
    "accepted",
    "drafted_per_position",
    "accepted_per_position",
    "drafting_time",
    "verification_time",
)  # the SpecCounts fields the log keeps (not rejections)


MAX_POLICY_CHANGES = 10_000  # run-time policy changes a log keeps (the oldest dropped first)
MAX_BACKGROUND = 100_000  # background samples a log keeps (11 days at one per 10 s; the oldest dropped first)


class RequestLog:
    """Append to (or read) a request log file; `mode='r'` refuses a file that is missing or not a request log.
    `max_bytes` bounds the records' size in the file: past it the oldest are dropped (to 90% of it), and counted."""

    def __init__(self, path: str | Path, mode: str = "a", max_bytes: int | None = None):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._adds = 0
        if mode == "r" and not self.path.is_file():
            raise SpecwiseError(f"request log {str(self.path)!r} does not exist")
        self._lock = threading.Lock()
        try:
            if mode == "a":
                owner_only(self.path)  # from its first byte (it may hold prompts and outputs); an older file too
            self.db = sqlite3.connect(
                str(self.path) if mode == "a" else sqlite_readonly_uri(self.path),
                uri=mode != "a",
                check_same_thread=False,
            )
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if mode == "a":
                self.db.execute("PRAGMA journal_mode=WAL")
                if tables and "log" not in tables:
                    raise SpecwiseError(
                        f"{self.path} is an SQLite file but not a specwise request log: choose another path for --log"
                    )
                self.db.executescript(SCHEMA)
                columns = {r[1] for r in self.db.execute("PRAGMA table_info(log)")}
                for column, kind in (("chat", "INTEGER"), ("tokens", "TEXT")):  # an older log: add the column
                    if column not in columns:
                        self.db.execute(f"ALTER TABLE log ADD COLUMN {column} {kind}")
            elif "log" not in tables or "meta" not in tables:
                raise SpecwiseError(f"{self.path} is not a specwise request log (written by `specwise serve --log`)")
        except sqlite3.Error as exc:
            raise SpecwiseError(f"cannot open request log {str(self.path)!r}: {exc}") from None
        except OSError as exc:
            raise SpecwiseError(f"cannot open request log {str(self.path)!r}: {exc.strerror or exc}") from None
        version = self._meta("schema_version")
        if version is None and mode == "a":
            with self.db:
                self.db.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?), ('kind', ?)",
                    (json.dumps(LOG_SCHEMA_VERSION), json.dumps(KIND)),
                )
        elif version != LOG_SCHEMA_VERSION:
            raise SpecwiseError(
                f"{self.path}: request log schema version {version}; this specwise reads version {LOG_SCHEMA_VERSION}"
            )

    def _meta(self, key: str):
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def add(self, entry: LogEntry) -> None:
        row = asdict(entry)
        counts = row.pop("spec")
        row.update({k: counts[k] for k in _COUNTS})
        for k in _JSON:
            row[k] = json.dumps(row[k])
        row["speculative"] = int(entry.speculative)
        row["chat"] = None if entry.chat is None else int(entry.chat)
        with self._lock, self.db:
            self.db.execute(
                f"INSERT INTO log ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values())
            )
            self._adds += 1
            if self.max_bytes is not None and self._adds % 16 == 1 and self.records_bytes() > self.max_bytes:
                self._trim(int(self.max_bytes * 0.9))

    def records_bytes(self) -> int:
        """Bytes the file's live pages hold (free pages left by dropped records are reused, not counted)."""

        def pragma(name: str) -> int:
            return int(self.db.execute(f"PRAGMA {name}").fetchone()[0])

        return (pragma("page_count") - pragma("freelist_count")) * pragma("page_size")

    def dropped(self) -> int:
        """Records dropped to keep the log within its size (0 when it never had to)."""
        return int(self._meta("dropped") or 0)

    def _trim(self, goal: int) -> None:
        """Drop the oldest records, a tenth at a time, until the live pages fit in `goal` bytes."""
        while self.records_bytes() > goal:
            n = self.count()
            drop = max(1, n // 10)
            if n == 0:
                return
            self.db.execute("DELETE FROM log WHERE rowid IN (SELECT rowid FROM log ORDER BY time LIMIT ?)", (drop,))
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('dropped', ?)", (json.dumps(self.dropped() + drop),))

    def add_policy_change(self, change: dict) -> None:
        """A run-time replacement of the load policy: time, old, new, by (admin / drift), reason."""
        with self._lock, self.db:
            self.db.execute(
                "INSERT INTO policy_changes VALUES (?, ?, ?, ?, ?)",
                (change["time"], change["old"], change["new"], change["by"], change.get("reason", "")),
            )
            self.db.execute(
                "DELETE FROM policy_changes WHERE rowid NOT IN "
                "(SELECT rowid FROM policy_changes ORDER BY time DESC LIMIT ?)",
                (MAX_POLICY_CHANGES,),
            )

    def add_background(self, at: float, figures: dict) -> None:
        """The machine's background over the last sampling interval (harness.background.Background.to_dict)."""
        with self._lock, self.db:
            self.db.execute("INSERT INTO background VALUES (?, ?)", (at, json.dumps(figures)))
            self._background_adds = getattr(self, "_background_adds", 0) + 1
            if self._background_adds % 1000 == 0:
                self.db.execute(
                    "DELETE FROM background WHERE rowid NOT IN "
                    "(SELECT rowid FROM background ORDER BY time DESC LIMIT ?)",
                    (MAX_BACKGROUND,),
                )

    def backgrounds(self, since: float | None = None, until: float | None = None) -> list[tuple[float, dict]]:
        """(time, figures) of the background samples in a window; none in a log from before they were recorded."""
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "background" not in tables:
            return []
        rows = self.db.execute(
            "SELECT time, figures FROM background WHERE time >= ? AND time <= ? ORDER BY time",
            (since or 0.0, until or 1e18),
        ).fetchall()
        return [(t, json.loads(f)) for t, f in rows]

    def policy_changes(self) -> list[dict]:
        rows = self.db.execute("SELECT time, old, new, by, reason FROM policy_changes ORDER BY time").fetchall()
        return [dict(zip(("time", "old", "new", "by", "reason"), r, strict=True)) for r in rows]

    def entries(self, since: float | None = None, until: float | None = None) -> list[LogEntry]:
        q, args = "SELECT * FROM log WHERE time >= ? AND time <= ? ORDER BY time", (since or 0.0, until or 1e18)
        try:
            cur = self.db.execute(q, args)
        except sqlite3.Error as exc:
            raise SpecwiseError(f"cannot read request log {self.path}: {exc}") from None
        names = [d[0] for d in cur.description]
        out = []
        for row in cur.fetchall():
            d = dict(zip(names, row, strict=True))
            for k in _JSON:
                d[k] = json.loads(d[k]) if d.get(k) is not None else None
            d["spec"] = SpecCounts.from_dict({k: d.pop(k) for k in _COUNTS})
            d["target"] = d["target"] or {}
            d["speculative"] = bool(d["speculative"])
            d["chat"] = None if d.get("chat") is None else bool(d["chat"])
            out.append(LogEntry(**d))
        return out

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM log").fetchone()[0]

    def close(self) -> None:
        self.db.close()
