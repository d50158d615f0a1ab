"""The plan's vocabulary: one configuration under comparison (`Config`), and `redact`, which keeps the secrets a
server command may carry out of everything stored or shown."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Secrets a server command may carry: a key flag's value, a secret-looking environment assignment, a bearer token.
_SECRET_FLAG = re.compile(r"(--?(?:\w+[-_])*(?:key|token|secret|password))(=|\s+)(\"[^\"]*\"|'[^']*'|\S+)", re.I)
_SECRET_ENV = re.compile(r"\b(\w*(?:KEY|TOKEN|SECRET|PASSWORD))=(\"[^\"]*\"|'[^']*'|\S+)", re.I)
_BEARER = re.compile(r"(Bearer\s+)[^\s'\"]+", re.I)


def redact(command: str | None) -> str | None:
    """A server command as it may be stored and shown: every API key, token or password in it replaced by ***."""
    if command is None:
        return None
    out = _SECRET_FLAG.sub(lambda m: f"{m[1]}{m[2]}***", command)
    out = _SECRET_ENV.sub(lambda m: f"{m[1]}=***", out)
    return _BEARER.sub(lambda m: f"{m[1]}***", out)


@dataclass(frozen=True)
class Config:
    """One configuration under comparison: a name, a drafter spec (None = baseline) and a draft length. Over HTTP,
    `options` are extra request-body fields and `launch` the command that starts this configuration's server."""

    name: str
    drafter: str | None = None
    k: int | str = "auto"
    options: dict | None = None
    launch: str | None = None
    verify: str | None = None  # in-process: this configuration's verification method (None: evaluate's --verify)

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "drafter": self.drafter, "k": self.k}
        if self.options is not None or self.launch is not None:
            d.update(options=self.options, launch=redact(self.launch))  # what is stored: never a key
        if self.verify is not None:  # absent otherwise, so earlier plans keep their fingerprint
            d["verify"] = self.verify
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        return cls(d["name"], d.get("drafter"), d.get("k", "auto"), d.get("options"), d.get("launch"), d.get("verify"))
