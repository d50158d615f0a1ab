"""What starting a server takes below the command line (`specwise serve` is cli/serve.py): the policy a file or an
evaluation names, the client keys, the host names to answer, the resident-memory line. Torch-free: `specwise --help`
and a refused flag stay fast."""

from __future__ import annotations

import os

from specwise.errors import SpecwiseError
from specwise.harness.analyze import policy_from_run
from specwise.policy import Policy, PolicyFile
from specwise.server.middleware import LOOPBACK_HOSTS


def read_policy_from(path: str, drafter: str | None) -> tuple[Policy, str, str | None]:
    """(policy, why, drafter) from --policy-from: a policy file (.json, a per-load k table, which also names the
    drafter it was measured with: refused against another --drafter) or an evaluation run (run.db)."""
    if path.endswith(".json"):  # specwise export-config --format specwise
        file = PolicyFile.read(path)
        if drafter and drafter != file.drafter:
            raise SpecwiseError(
                f"--policy-from {path} was measured with drafter {file.drafter!r}, not --drafter {drafter!r}"
            )
        return file.policy(), f"{path}: per-load k of {file.drafter}", drafter or file.drafter
    mode, high, why = policy_from_run(path)
    return Policy(mode, high or 1), why, drafter


def api_keys(given: list[str] | None) -> tuple[str, ...]:
    """The client keys: every --api-key, else $SPECWISE_API_KEY's comma-separated keys; an empty one is refused."""
    if given is None:
        env = os.environ.get("SPECWISE_API_KEY")
        given = env.split(",") if env is not None else []
        where = "$SPECWISE_API_KEY"
    else:
        where = "--api-key"
    keys = [k.strip() for k in given]
    if any(not k for k in keys):
        raise SpecwiseError(f"{where} holds an empty key: give a key, or leave it out")
    bad = [k for k in keys if any(c.isspace() or not c.isprintable() for c in k)]
    if bad:
        raise SpecwiseError(f"{where}: a key may not hold spaces or control characters (it travels in a header)")
    return tuple(dict.fromkeys(keys))


def allowed_hosts(bind: str, given: str | None) -> tuple[str, ...] | None:
    """The Host header values to answer: --allowed-hosts ('*': any), else loopback's names when bound to
    loopback (a keyless local server is what DNS rebinding reaches), else any."""
    if given is not None:
        names = tuple(h.strip().lower() for h in given.split(",") if h.strip())
        if not names:
            raise SpecwiseError("--allowed-hosts is empty: give host names (e.g. localhost,myhost) or '*' for any")
        return None if "*" in names else names
    return LOOPBACK_HOSTS if bind in LOOPBACK_HOSTS else None


def memory_line(engine) -> str:
    """The resident budget's parts on one line (weights, KV cache of every slot, scratch), for the CPU kernels."""
    from specwise.engine.native import NativeDecoder

    model = engine.target.model
    if not isinstance(model, NativeDecoder):
        return ""
    b = model.memory_budget(max_len=engine.max_len)
    mb = 1e6
    kv = b["kv_bytes"] * engine.max_batch
    return (
        f"weights {b['weights_bytes'] / mb:,.0f} MB, KV cache {kv / mb:,.0f} MB ({engine.max_batch} × "
        f"{engine.max_len} positions), scratch {b['scratch_bytes'] / mb:,.0f} MB; drafters' extra "
        f"{sum(d.extra_memory_bytes() for d in engine.drafters.values()) / mb:,.0f} MB"
    )
