"""What a run measured and where, read back typed: the target, the hardware, each configuration's draft and
launch command, what each configuration's system said of itself, and the specwise that ran it. The one reader of
the stored provenance; `raw` keeps the stored form for the JSON report (a file from an older specwise lacks some
fields: they read as None)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def _of(d: object, key: str) -> object:
    return d[key] if isinstance(d, dict) and key in d else None


def _text(d: object, key: str) -> str | None:
    v = _of(d, key)
    return None if v is None else str(v)


def _mapping(d: object, key: str) -> dict:
    v = _of(d, key)
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class Target:
    """The model a system ran, as it named it (sha256: of its weights; endpoint: where it was served)."""

    name: str | None = None
    sha256: str | None = None
    precision: str | None = None
    path: str | None = None
    endpoint: str | None = None
    source_sha256: str | None = None  # of the file its weights derive from (a GGUF, for an export-hf directory)
    derived_from: str | None = None  # that file's path, for an export

    @classmethod
    def read(cls, d: object) -> Target:
        keys = ("name", "sha256", "precision", "path", "endpoint", "source_sha256", "derived_from")
        return cls(*(_text(d, k) for k in keys))

    def origin(self) -> str | None:
        """The hash of the weights at the root of this target: the source of an export, else its own."""
        return self.source_sha256 or self.sha256

    def difference(self, other: Target) -> str | None:
        """How this target and `other` are not the same weights (None when they are, or when either is unnamed):
        `form differs: …` for two forms of one source (an export, other activations), `revision differs: …` else."""
        if not self.sha256 or not other.sha256 or self.sha256 == other.sha256:
            return None
        if self.origin() == other.origin() and self.precision != other.precision:
            return (
                f"form differs: both derive from the same source ({str(self.origin())[:12]}…) in other forms — "
                f"{self.describe()} vs {other.describe()}: not the same numbers, so outputs and speed differ by more "
                "than the engines"
            )
        return f"revision differs: {self.describe()} vs {other.describe()}"

    def describe(self) -> str:
        form = f"{self.precision} " if self.precision else ""
        kind = "derived from its source" if self.source_sha256 and self.source_sha256 != self.sha256 else "as stored"
        return f"{self.name or '?'} ({form}{kind}, sha256 {str(self.sha256)[:12]}…)"


@dataclass(frozen=True)
class Hardware:
    """The machine: CPU model and threads, the kernel variant (specwise's engine) and the accelerator, if any."""

    cpu: str | None = None
    cpu_threads: int | None = None
    kernels: str | None = None
    gpu: str | None = None

    @classmethod
    def read(cls, d: object) -> Hardware:
        threads = _of(d, "cpu_threads")
        return cls(_text(d, "cpu"), threads if isinstance(threads, int) else None, _text(d, "kernels"), _text(d, "gpu"))


@dataclass(frozen=True)
class ConfigProvenance:
    """One configuration's draft (its identity: a draft model's hash, or what it derives from) and launch command."""

    draft_identity: dict | None = None
    launch: str | None = None

    @classmethod
    def read(cls, d: object) -> ConfigProvenance:
        draft = _of(d, "draft_identity")
        return cls(draft if isinstance(draft, dict) else None, _text(d, "launch"))


@dataclass(frozen=True)
class SystemFacts:
    """What one configuration's own system reported of itself: its server (kind, version, kernels), target and
    hardware."""

    server: dict | None = None
    target: Target = field(default_factory=Target)
    hardware: Hardware = field(default_factory=Hardware)

    @classmethod
    def read(cls, d: object) -> SystemFacts:
        server = _of(d, "server")
        return cls(
            server if isinstance(server, dict) else None,
            Target.read(_of(d, "target")),
            Hardware.read(_of(d, "hardware")),
        )

    def named(self, part: str) -> dict | None:
        """One of COMPARED as a plain mapping (only what was said), for comparing and showing."""
        value = getattr(self, part)
        if isinstance(value, Target | Hardware):
            said = {k: v for k, v in asdict(value).items() if v is not None}
            return said or None
        return value


@dataclass(frozen=True)
class Provenance:
    specwise_version: str | None
    target: Target
    hardware: Hardware
    configs: dict[str, ConfigProvenance]
    facts: dict[str, SystemFacts]
    raw: dict  # as stored

    @property
    def served_target(self) -> Target:
        """The target as measured: the run's own when it names the weights, else (a server the harness launched)
        the first configuration's server's."""
        if self.target.sha256:
            return self.target
        named = [f.target for f in self.facts.values() if f.target.sha256]
        return named[0] if named else self.target

    @classmethod
    def read(cls, d: object) -> Provenance:
        raw = d if isinstance(d, dict) else {}
        return cls(
            _text(raw, "specwise_version"),
            Target.read(_of(raw, "target")),
            Hardware.read(_of(raw, "hardware")),
            {name: ConfigProvenance.read(c) for name, c in _mapping(raw, "configs").items()},
            {name: SystemFacts.read(f) for name, f in _mapping(raw, "facts").items()},
            raw,
        )
