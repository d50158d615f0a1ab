"""A nested state (dicts, lists, tuples, tensors, plain values) in one safetensors file: the tensors as tensors, the
rest as JSON in the file's metadata. What `train-draft` keeps between runs (collected answers, a checkpoint) lives
in this form because reading it runs no code, unlike a pickle, whoever wrote the file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from specwise.errors import SpecwiseError

FORMAT = "specwise-state-v1"  # the metadata key holding the JSON skeleton
_TENSOR, _TUPLE, _ITEMS, _FLOAT = "__tensor__", "__tuple__", "__items__", "__float__"
_MARKERS = (_TENSOR, _TUPLE, _ITEMS, _FLOAT)


class StateFileError(SpecwiseError):
    """A file that is not a state file of this form (refused, never interpreted)."""


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        t = value.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.contiguous().clone()  # a view into a larger storage: safetensors stores tensors that own theirs
        tensors[name] = t
        return {_TENSOR: name}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: repr(value)}  # JSON has no inf or nan
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise TypeError(f"a state's dict keys must be str or int, not {sorted({type(k).__name__ for k in value})}")
        return {_ITEMS: [[k, _encode(v, tensors)] for k, v in value.items()]}
    raise TypeError(f"a state holds dicts, lists, tuples, tensors and plain values, not {type(value).__name__}")


def save(path: Path, state: Any) -> None:
    """Write `state` to `path` atomically (a temporary file renamed over it), readable by its owner only."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_encode(state, tensors), separators=(",", ":"))
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={FORMAT: skeleton})
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        name = value[_TENSOR]
        if len(value) != 1 or not isinstance(name, str) or name not in tensors:
            raise StateFileError(f"{where}: a tensor reference {value!r} names no tensor in the file")
        return tensors[name]
    if _TUPLE in value:
        if len(value) != 1 or not isinstance(value[_TUPLE], list):
            raise StateFileError(f"{where}: a malformed tuple entry")
        return tuple(_decode(v, tensors, where) for v in value[_TUPLE])
    if _FLOAT in value:
        if len(value) != 1 or value[_FLOAT] not in ("inf", "-inf", "nan"):
            raise StateFileError(f"{where}: a malformed float entry {value!r}")
        return float(value[_FLOAT])
    if _ITEMS in value:
        items = value[_ITEMS]
        pairs = isinstance(items, list) and all(isinstance(p, list) and len(p) == 2 for p in items)
        if len(value) != 1 or not pairs:
            raise StateFileError(f"{where}: a malformed item list")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k, _ in items):
            raise StateFileError(f"{where}: a dict key that is neither text nor an integer")
        return {k: _decode(v, tensors, where) for k, v in items}
    return {k: _decode(v, tensors, where) for k, v in value.items()}


def load(path: Path) -> Any:
    """The state saved at `path`; a file that is not one (a pickle, another safetensors file, a truncated or
    malformed one) is refused with the reason and never interpreted."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if FORMAT not in meta:
                raise StateFileError(f"{path} is a safetensors file without specwise's state ({FORMAT!r} metadata)")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except StateFileError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise StateFileError(f"{path} is not a specwise state file (safetensors with JSON metadata): {e}") from None
    try:
        skeleton = json.loads(meta[FORMAT])
    except (json.JSONDecodeError, RecursionError) as e:
        raise StateFileError(f"{path}: its state metadata is not JSON ({e})") from None
    try:
        return _decode(skeleton, tensors, path)
    except RecursionError:
        raise StateFileError(f"{path}: its state is nested too deeply") from None
