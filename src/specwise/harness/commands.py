"""What a `--launch` command says: the environment it sets and the program it runs (`split`, as a shell reads
`VAR=1 prog …` or `env VAR=1 prog …`), the speculation it turns on (`speculation`: vLLM's `--speculative-config`,
`specwise serve --drafter/--k`, llama-server's `--spec-type`/`--draft-max`), and one command per draft length of a
sweep (`with_k`: a `{k}` in the command)."""

from __future__ import annotations

import json
import re
import shlex

from specwise.errors import SpecwiseError

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
K_PLACEHOLDER = "{k}"


def split(cmd: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of a command line: leading `NAME=value` words, after an optional `env`, are
    the environment (a shell's reading; `exec` would take `NAME=value` for the program's name)."""
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise SpecwiseError(f"the command {cmd!r:.200} cannot be read as a command line ({exc})") from None
    env: dict[str, str] = {}
    i = 1 if words[:1] == ["env"] else 0
    while i < len(words) and _ASSIGNMENT.match(words[i]):
        name, _, value = words[i].partition("=")
        env[name] = value
        i += 1
    if i >= len(words):
        raise SpecwiseError(f"the command {cmd!r:.200} sets environment variables but names no program to run")
    return env, words[i:]


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of the last of `names` in argv (`--flag value` or `--flag=value`)."""
    found = None
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif word.startswith(name + "="):
                found = word[len(name) + 1 :]
    return found


def speculation(cmd: str) -> tuple[str | None, int | str]:
    """(drafter, k) the command's server speculates with, in specwise's vocabulary; (None, "auto") when it turns
    none on or this reader does not know its flags. A k sweep over launched servers is read from these."""
    _, argv = split(cmd)
    spec = _vllm_spec(argv)
    if spec is not None:  # vLLM
        k = spec.get("num_speculative_tokens")
        k = k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else "auto"
        method = str(spec.get("method") or spec.get("model") or "draft")
        if method == "ngram":
            n = spec.get("prompt_lookup_max")
            return (f"ngram:{n}" if isinstance(n, int) and not isinstance(n, bool) else "ngram"), k
        return f"vllm:{method}", k
    spec_type = _flag(argv, "--spec-type")
    if spec_type is not None:  # llama-server
        n_max = _flag(argv, "--spec-draft-n-max", "--draft-max", "--draft-n")
        return f"llamacpp:{spec_type}", int(n_max) if n_max and n_max.isdigit() else "auto"
    if "serve" in argv and any(w.endswith("specwise") or w == "specwise.cli" for w in argv[: argv.index("serve")]):
        drafter = _flag(argv, "--drafter")
        k = _flag(argv, "--k")
        if drafter is not None and drafter != "none":
            return drafter, int(k) if k and k.isdigit() else "auto"
    return None, "auto"


def vllm_speculative_config(cmd: str) -> dict | None:
    """The JSON object of a vLLM command's `--speculative-config`; None when it has none."""
    return _vllm_spec(split(cmd)[1])


def _vllm_spec(argv: list[str]) -> dict | None:
    raw = _flag(argv, "--speculative-config", "--speculative_config", "-sc")
    if raw is None:
        return None
    try:
        spec = json.loads(raw)
    except ValueError:
        raise SpecwiseError(f"--speculative-config {raw!r:.200} is not JSON (vLLM takes a JSON object)") from None
    if not isinstance(spec, dict):
        raise SpecwiseError(f"--speculative-config {raw!r:.200} is not a JSON object")
    return spec


def with_k(cmd: str, ks: list[int | str]) -> list[tuple[int | str, str]]:
    """One (k, command) per draft length where the command holds `{k}` (a sweep over launched servers); the command
    alone otherwise."""
    if K_PLACEHOLDER not in cmd:
        return [("auto", cmd)]
    bad = [k for k in ks if not isinstance(k, int)]
    if bad:
        raise SpecwiseError(
            f"--launch with {K_PLACEHOLDER} takes numeric draft lengths from --k (e.g. --k 1,2,4), not {bad[0]!r}"
        )
    return [(k, cmd.replace(K_PLACEHOLDER, str(k))) for k in ks]
