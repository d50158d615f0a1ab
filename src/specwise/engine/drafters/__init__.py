"""Drafters and the spec strings that name them.

- ``ngram`` / ``ngram:N``   prompt lookup over prompt + output, n-grams up to N tokens (default 3); no model
- ``suffix`` / ``suffix:T`` suffix drafting over the request and the last T tokens of earlier outputs; no model
- ``model:PATH``            an independent draft model (HF directory or GGUF) with the target's tokenizer; on a
                            vocabulary over 65,536 ids it scores the first 32,768, its specials and the prompt's
                            (``model:PATH@IDS`` another number, ``model:PATH@full`` every id: engine/draft_vocab.py);
                            its layers re-packed in 4 bits (group 32) where it stores them in 5 or 6 bits
                            (``model:PATH@int4`` every layer, ``model:PATH@stored`` none)
- ``eagle:PATH``            an EAGLE-3 head trained for this target (`specwise train-draft`), reading its hidden states
- ``int8``                  a copy of the target with every linear layer in 8 bits (group of 32)
- ``layerskip:SPEC``        the target run through a subset of its layers: ``12`` (the first 12), ``0-11,29``,
                            ``0-29/2`` (every other layer)
"""

from __future__ import annotations

from pathlib import Path

from specwise import models
from specwise.engine.cache import CausalLM, output_size
from specwise.engine.draft_vocab import DraftVocab, default_size
from specwise.engine.drafters.base import Draft, Drafter, SequenceView
from specwise.engine.drafters.draft_model import ModelDrafter
from specwise.engine.drafters.eagle import EagleDrafter
from specwise.engine.drafters.ngram import NgramDrafter
from specwise.engine.drafters.suffix import HISTORY_TOKENS, SuffixDrafter
from specwise.engine.native import NativeDecoder
from specwise.engine.weights import load_target, repacked
from specwise.errors import SpecwiseError
from specwise.specs import (
    DRAFT_PRECISIONS,
    DRAFTER_HELP,
    HEAD_PRECISIONS,
    check_drafter_spec,
    split_draft_model,
    split_head_precision,
)

__all__ = [
    "DRAFTER_HELP",
    "Draft",
    "Drafter",
    "EagleDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "SequenceView",
    "make_drafter",
    "parse_layers",
]


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'12' → first 12 layers; '0-11,29' and '0-29/2' → explicit sets. Sorted, unique, in range."""
    spec = spec.strip()
    try:
        if spec.isdigit():
            ids = list(range(int(spec)))
        else:
            ids = []
            for part in spec.split(","):
                rng, _, step = part.partition("/")
                lo, _, hi = rng.partition("-")
                ids += list(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    except ValueError:
        raise SpecwiseError(
            f"layerskip:{spec} does not parse; write e.g. layerskip:12, layerskip:0-11,29 or layerskip:0-29/2"
        ) from None
    ids = sorted(set(ids))
    if not ids or ids[0] < 0 or ids[-1] >= num_layers:
        raise SpecwiseError(
            f"layerskip:{spec} names no layers or layers outside 0..{num_layers - 1} "
            f"(the target has {num_layers} layers)"
        )
    return ids


def make_drafter(spec: str, target, num_slots: int, cache_len: int) -> Drafter:
    """Build the drafter named by `spec` for `target` (a LoadedModel)."""
    kind, _, arg = check_drafter_spec(spec).partition(":")
    if kind == "ngram":
        return NgramDrafter(max_ngram=int(arg) if arg else 3)
    if kind == "suffix":
        return SuffixDrafter(max_tokens=int(arg) if arg else HISTORY_TOKENS)
    if kind == "layerskip":
        if not hasattr(target.model, "layer_subset"):
            raise SpecwiseError("layerskip drafting needs a Llama-family target (our decoder)")
        ids = parse_layers(arg, target.model.num_layers)
        return ModelDrafter(target.model.layer_subset(ids), f"layerskip:{arg}", num_slots, cache_len, 0)
    if kind == "int8":
        if not hasattr(target.model, "requantized"):
            raise SpecwiseError("int8 self-drafting needs a Llama-family target (our decoder)")
        q = target.model.requantized("int8")  # every linear layer in 8 bits (group 32); embeddings shared
        return ModelDrafter(q, "int8", num_slots, cache_len, q.extra_bytes(target.model))
    if kind == "eagle":
        path, precision = split_head_precision(arg)
        _check_suffix(kind, arg, path, f"{HEAD_PRECISIONS[0]} (the default), " + ", ".join(HEAD_PRECISIONS[1:]))
        return EagleDrafter(path, target, num_slots, cache_len, precision)
    if kind == "model":
        path, repack, size = split_draft_model(arg)
        _check_suffix(kind, arg, path, f"{', '.join(DRAFT_PRECISIONS)}, a number of token ids (32 or more), or full")
        # in the name: requests choose drafters by name
        told = arg[len(path) :]  # the options as typed (@int4, @IDS, @full)
        draft = load_target(path, device=str(target.device), max_len=cache_len)
        check_same_vocabulary(target, draft, path)
        model: CausalLM = draft.model
        # The default re-packs the layers stored in 5 or 6 bits: their bit planes cost the kernels more than their
        # bytes (docs/drafters.md); @int4 re-packs every layer, @stored none.
        planes_only = repack is None
        wide = isinstance(model, NativeDecoder) and model.weights.bit_planes()
        precision = repack or (DRAFT_PRECISIONS[0] if wide else "stored")
        repacked_as = None  # the precision string of re-packed weights, for the provenance
        if precision != "stored":
            if not isinstance(model, NativeDecoder):
                raise SpecwiseError(f"model:{arg}: @{precision} re-packs a draft on the CPU kernels; this one is not")
            model = repacked(draft, precision, planes_only)
            repacked_as = model.weights.precision
        extra = model.weight_bytes()
        size = default_size(output_size(model)) if size is None and isinstance(model, NativeDecoder) else size
        if size:
            if not isinstance(model, NativeDecoder):
                raise SpecwiseError(f"model:{arg}: a reduced draft vocabulary needs the draft on the CPU kernels")
            model = DraftVocab(model, size, draft.tokenizer.special_ids())
        label = models.named(path, draft.identity.name)  # requests choose drafters by name: the one typed
        return ModelDrafter(
            model,
            f"model:{label}{told}",
            num_slots,
            cache_len,
            extra,
            draft.identity,
            repacked_as,
        )
    raise SpecwiseError(f"unknown drafter {spec!r} (allowed: {DRAFTER_HELP})")


def _check_suffix(kind: str, arg: str, path: str, allowed: str) -> None:
    """Refuse `kind:PATH@TAIL` whose TAIL was not taken as an option (so it stayed in the path) where PATH alone
    names something and PATH@TAIL does not: a mistyped option, not a missing file."""
    base, sep, tail = arg.rpartition("@")
    if path != arg or not sep or Path(arg).expanduser().exists():
        return
    if models.lookup(base) is not None or Path(base).expanduser().exists():
        raise SpecwiseError(f"{kind}:{arg}: {tail!r} after '@' is not allowed (allowed: {allowed})", param="drafter")


def check_same_vocabulary(target, draft, label: str) -> None:
    """Refuse a draft model whose tokenizer or output size differs from the target's."""
    tv, dv = target.tokenizer.vocab(), draft.tokenizer.vocab()
    if tv != dv:
        differing = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise SpecwiseError(
            f"draft model {label} has another vocabulary ({len(dv)} tokens vs the target's {len(tv)}; "
            f"e.g. {differing}): a draft model must use the target's tokenizer"
        )
    t_out, d_out = output_size(target.model), output_size(draft.model)
    if t_out != d_out:
        raise SpecwiseError(f"draft model {label} scores {d_out} tokens, the target {t_out}: output sizes must match")
