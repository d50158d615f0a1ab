"""What else ran on this machine while a phase was measured (issue 36): CPU time of every process other than
specwise and the servers it launched, steal time, the load average and the CPU clock, from /proc and /sys.

Interleaving cancels drift between configurations; it cannot cancel that speculation's extra compute costs more
when the cores are contended. So each phase records its background, and a cell measured while the background took
more than `BUSY_SHARE` of the cores is flagged wherever its figures are shown.

The background is the busy time of this process's CPUs (/proc/stat, the CPUs it may run on) less the CPU time of
the observed tree: this process, every descendant (a launched server and its workers; reaped children count
through their parent's cutime), and a server found listening on a loopback endpoint. Short-lived processes are
caught too: their time is in /proc/stat whether or not they are still alive when the phase ends.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.specs import BUSY_SHARE, QUIET_WAIT_S

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")
TOP = 3  # the busiest other processes named per phase


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    busy: int  # ticks the observed CPUs were busy (user, nice, system, irq, softirq; guest is inside user)
    steal: int  # ticks the hypervisor gave those CPUs to someone else
    total: int  # every tick of those CPUs
    ours: int  # ticks of the observed tree (utime + stime + cutime + cstime)
    others: dict[int, tuple[str, int]]  # pid → (command, utime + stime) of every other process


@dataclass(frozen=True)
class Background:
    """The background over one span of time (a phase, or a quiet-machine check before one)."""

    seconds: float
    cores: float  # CPU the other processes used, in cores on average
    cpus: int  # the CPUs this process may run on
    steal: float  # share of those CPUs' time the hypervisor took
    load_avg: float | None  # 1-minute load average at the end (it counts specwise's own threads too)
    mhz: float | None  # mean current clock of those CPUs at the end, where the kernel exposes it
    top: list[tuple[str, float]] = field(default_factory=list)  # (command, cores) of the busiest others
    observed: str = "local"  # "local": the measured system runs here; "client": only this client was observed
    measured: float | None = None  # CPU the measured system used (specwise, its launched servers, a local server)

    @property
    def share(self) -> float:
        """The background's share of this process's CPUs (steal counted: a stolen core is as busy as a used one)."""
        return self.cores / self.cpus + self.steal if self.cpus else 0.0

    def busy(self, threshold: float = BUSY_SHARE) -> bool:
        """Whether the measured system shared its cores: only where it runs on this machine."""
        return self.observed == "local" and self.share > threshold

    def text(self) -> str:
        others = ", ".join(f"{name} {cores:.2f}" for name, cores in self.top if cores >= 0.01)
        parts = [f"background {self.cores:.2f} of {self.cpus} cores ({self.share:.0%})"]
        if others:
            parts.append(f"busiest: {others}")
        if self.steal >= 0.005:
            parts.append(f"steal {self.steal:.0%}")
        if self.load_avg is not None:
            parts.append(f"load {self.load_avg:.2f}")
        if self.mhz is not None:
            parts.append(f"{self.mhz:.0f} MHz")
        if self.measured is not None:
            parts.append(f"the measured system {self.measured:.2f} cores")
        if self.observed != "local":
            parts.append("client side only: the server's machine was not observed")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {**asdict(self), "share": self.share}

    @classmethod
    def read(cls, d: dict) -> Background:
        return cls(
            float(d["seconds"]),
            float(d["cores"]),
            int(d["cpus"]),
            float(d.get("steal") or 0.0),
            d.get("load_avg"),
            d.get("mhz"),
            [(str(n), float(c)) for n, c in d.get("top") or []],
            str(d.get("observed") or "local"),
            d.get("measured"),
        )


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _stat(path: Path) -> tuple[str, int, int, int] | None:
    """(command, ppid, own ticks, reaped children's ticks) of one /proc/PID/stat; None if it is gone."""
    try:
        raw = path.read_bytes().decode(errors="replace")
    except OSError:
        return None
    left, right = raw.find("("), raw.rfind(")")
    if left < 0 or right < left:
        return None
    fields = raw[right + 2 :].split()  # from the state (field 3) on
    try:
        ppid, utime, stime, cutime, cstime = (int(fields[i]) for i in (1, 11, 12, 13, 14))
    except (IndexError, ValueError):
        return None
    return raw[left + 1 : right], ppid, utime + stime, cutime + cstime


class Sampler:
    """Snapshots of the machine's CPU time, split into the observed tree (`roots` and their descendants) and the
    rest. `remote` (an endpoint on another machine): figures are recorded as the client side only."""

    def __init__(self, roots: list[int] | None = None, remote: bool = False, proc: Path = PROC):
        self.roots = {os.getpid(), *(roots or [])}
        self.remote, self.proc, self.cpus = remote, proc, _cpus()

    def snapshot(self) -> Snapshot:
        busy = steal = total = 0
        wanted = {f"cpu{i}" for i in self.cpus}
        with contextlib.suppress(OSError):
            for line in (self.proc / "stat").read_text().splitlines():
                name, *vals = line.split()
                if name in wanted:
                    v = [int(x) for x in vals[:8]] + [0] * (8 - len(vals[:8]))
                    user, nice, system, _idle, _iowait, irq, softirq, st = v
                    busy += user + nice + system + irq + softirq
                    steal += st
                    total += sum(v)
        stats: dict[int, tuple[str, int, int, int]] = {}
        for entry in self.proc.iterdir() if self.proc.is_dir() else []:
            if entry.name.isdigit() and (s := _stat(entry / "stat")) is not None:
                stats[int(entry.name)] = s
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        tree, stack = set(), [p for p in self.roots if p in stats]
        while stack:
            pid = stack.pop()
            if pid not in tree:
                tree.add(pid)
                stack.extend(children.get(pid, []))
        ours = sum(own + reaped for pid, (_, _, own, reaped) in stats.items() if pid in tree)
        others = {pid: (cmd, own) for pid, (cmd, _, own, _) in stats.items() if pid not in tree}
        return Snapshot(time.monotonic(), busy, steal, total, ours, others)

    def between(self, a: Snapshot, b: Snapshot) -> Background:
        seconds = max(b.at - a.at, 1e-9)
        total = max(b.total - a.total, 1)
        background = max(0, (b.busy - a.busy) - (b.ours - a.ours))
        per = [
            (cmd, (ticks - a.others[pid][1]) / TICK / seconds)
            for pid, (cmd, ticks) in b.others.items()
            if a.others.get(pid, ("", 0))[0] == cmd and ticks > a.others[pid][1]  # alive throughout (a pid reused: not)
        ]
        return Background(
            seconds,
            background / TICK / seconds,
            len(self.cpus),
            max(0, b.steal - a.steal) / total,
            _load_avg(self.proc),
            _mhz(self.cpus),
            sorted(per, key=lambda x: -x[1])[:TOP],
            "client" if self.remote else "local",
            max(0, b.ours - a.ours) / TICK / seconds,
        )

    def measure(self, seconds: float) -> Background:
        """The background over the next `seconds` (this process idle meanwhile)."""
        a = self.snapshot()
        time.sleep(seconds)
        return self.between(a, self.snapshot())


def _load_avg(proc: Path) -> float | None:
    try:
        return float((proc / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mhz(cpus: list[int]) -> float | None:
    found = []
    for i in cpus:
        with contextlib.suppress(OSError, ValueError):
            found.append(int(Path(f"/sys/devices/system/cpu/cpu{i}/cpufreq/scaling_cur_freq").read_text()) / 1000)
    return sum(found) / len(found) if found else None


def listening_pid(port: int, proc: Path = PROC) -> int | None:
    """The process listening on TCP `port` on this machine, where this user can see it (/proc/net, /proc/PID/fd)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in (proc / table).read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(parts[9])
    if not inodes:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(entry.name)
    return None


QUIET_CHECK_S = 1.0  # how long one quiet-machine check watches the background


class QuietMachine:
    """`--quiet-machine`: before each phase, `wait` (up to `wait_s`) for the background to drop to the threshold,
    `fail` refuses to measure on a busy machine, `ignore` only records."""

    def __init__(self, mode: str, sampler: Sampler, threshold: float = BUSY_SHARE, wait_s: float = QUIET_WAIT_S):
        self.mode, self.sampler, self.threshold, self.wait_s = mode, sampler, threshold, wait_s
        self.waited = 0.0  # seconds spent waiting, over the run

    def before_phase(self, what: str) -> Background | None:
        """Check (and wait for) a quiet machine before `what` is measured; None when only recording."""
        if self.mode == "ignore" or self.sampler.remote:
            return None
        bg = self.sampler.measure(QUIET_CHECK_S)
        if self.mode == "fail" and bg.busy(self.threshold):
            raise SpecwiseError(
                f"the machine is busy before {what}: {bg.text()} — more than {self.threshold:.0%} of the cores "
                "(--busy-share); --quiet-machine fail refuses to measure on it (stop the other work, or use "
                "--quiet-machine wait to wait for it, or ignore to record it and flag the cells); what was measured is "
                "kept: --resume continues"
            )
        deadline = time.monotonic() + self.wait_s
        while bg.busy(self.threshold) and time.monotonic() < deadline:
            start = time.monotonic()
            bg = self.sampler.measure(QUIET_CHECK_S)
            self.waited += time.monotonic() - start
        return bg


@dataclass(frozen=True)
class PhaseBackground:
    """One measured phase's background, as a run file keeps it (meta `background`, a list in measuring order)."""

    config: str
    load: str
    repeat: int
    tasks: list[str]
    phase_seconds: float  # the phase's own wall time (what phase_seconds summed for it)
    background: Background

    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "load": self.load,
            "repeat": self.repeat,
            "tasks": self.tasks,
            "phase_seconds": self.phase_seconds,
            **self.background.to_dict(),
        }

    @classmethod
    def read(cls, d: dict) -> PhaseBackground:
        return cls(
            str(d["config"]),
            str(d["load"]),
            int(d["repeat"]),
            [str(t) for t in d["tasks"]],
            float(d.get("phase_seconds") or 0.0),
            Background.read(d),
        )

    def record_keys(self) -> list[tuple[str, str, str, int]]:
        """The (config, load, task, repeat) of the records this phase measured."""
        return [(self.config, self.load, t, self.repeat) for t in self.tasks]


def per_record(phases: list[PhaseBackground]) -> dict[tuple[str, str, str, int], Background]:
    """Each record's background: that of the last phase that measured it (a retried request: its new phase)."""
    return {key: p.background for p in phases for key in p.record_keys()}
