"""Models by name (issue 32 item 1): a registry entry's chunk packages are found installed, concatenated once into the
cache and hash-checked (a mismatch is refused and nothing is kept); a name that is not installed says what to
install; `specwise models` lists what is installed and what can be. Then the real pair, Qwen2.5-Coder 1.5B and 0.5B
(scripts/test-deps.sh assembles them into the cache once): loaded by name, each of their quant types on every
variant against the numpy emulation of the kernel contract on real tensors, greedy output of the 1.5B alone equal to
its output in a batch of 4 on every variant, and the 0.5B drafting for it without changing a token."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from specwise import models
from specwise.cli import main
from specwise.errors import SpecwiseError


@pytest.fixture
def fake_entry(tmp_path, monkeypatch):
    """A registry entry of three chunk packages installed on sys.path (modules with data/partNN.bin)."""
    site = tmp_path / "site"
    blob = bytes(range(256)) * 300
    cuts = [0, 20_000, 50_000, len(blob)]
    for i in range(3):
        pkg = site / f"fakechunk_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i + 1:02d}.bin").write_bytes(blob[cuts[i] : cuts[i + 1]])
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECWISE_CACHE", str(tmp_path / "cache"))
    entry = models.Entry(
        "fake-1b",
        "A fake model",
        "fake.gguf",
        len(blob),
        hashlib.sha256(blob).hexdigest(),
        "Q4_K",
        models._parts("fakechunk_part", 3),
        "pip install 'specwise[fake]'",
    )
    monkeypatch.setitem(models.REGISTRY, entry.name, entry)
    return entry, blob, site


def test_a_name_resolves_to_its_chunks_assembled_once_and_checked(fake_entry, capsys):
    entry, blob, site = fake_entry
    path = models.resolve("FAKE-1B")  # names are case-insensitive
    assert path == entry.cached and path.read_bytes() == blob
    assert "assembling fake-1b once from 3 packages" in capsys.readouterr().out
    for p in site.glob("*/data/*.bin"):
        p.unlink()  # the packages may go: the cache holds the checked file
    assert models.resolve("fake-1b") == path and "assembling" not in capsys.readouterr().out
    assert models.resolve("some/dir") == models.Path("some/dir")  # anything else is a path


def test_chunks_that_do_not_hash_to_the_model_are_refused_and_nothing_is_kept(fake_entry, monkeypatch):
    entry, _, site = fake_entry
    (site / "fakechunk_part2" / "data" / "part02.bin").write_bytes(b"\0" * 30_000)  # same size, other bytes
    with pytest.raises(SpecwiseError, match=r"sha256 [0-9a-f]{64}, not the \d+ bytes with sha256"):
        models.resolve("fake-1b")
    assert not entry.cached.exists() and not list(entry.cached.parent.glob(".fake.gguf.*"))
    entry.cached.write_bytes(b"tampered")  # a cached file that is not the model: assembled again (and refused)
    with pytest.raises(SpecwiseError, match="reinstall them"):
        models.resolve("fake-1b")


def test_a_model_that_is_not_installed_says_what_to_install(fake_entry, capsys):
    _, _, site = fake_entry
    (site / "fakechunk_part3" / "data" / "part03.bin").unlink()
    with pytest.raises(SpecwiseError, match=r"1 of its 3 chunk packages are missing, e\.g\. fakechunk-part3\): run "):
        models.resolve("fake-1b")
    assert main(["generate", "--model", "fake-1b", "hi"]) == 2
    assert "pip install 'specwise[fake]'" in capsys.readouterr().err
    assert main(["models", "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["fake-1b"]["state"] == "partly installed (2 of 3 packages)"
    assert listed["qwen2.5-coder-1.5b"]["sha256"] == models.REGISTRY["qwen2.5-coder-1.5b"].sha256
    assert main(["models", "--assemble", "nope"]) == 2


def test_the_extra_installs_exactly_the_registrys_packages():
    """pyproject's qwen2.5-coder extra and the registry name the same 28 chunk packages (one list, checked)."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["qwen2_5-coder"]
    names = {r.split("==")[0].replace("-", "_") for r in extra}
    wanted = {m for e in models.REGISTRY.values() for m, _ in e.chunks}
    assert names == wanted and len(wanted) == 28


# --- the real pair ------------------------------------------------------------------------------------------------

PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def pair():
    """Both models by name; they must be there (scripts/test-deps.sh puts them in the cache): a missing one fails."""
    from specwise.engine import load_target

    for name in PAIR:
        st = models.status(models.REGISTRY[name])
        if st.path is None and st.installed < st.needed:
            pytest.fail(f"{name} is neither in the cache nor installed: run scripts/test-deps.sh")
    return {name: load_target(name, max_len=256) for name in PAIR}


@pytest.mark.real
def test_both_models_load_by_name_in_their_own_types(pair):
    big, small = pair[PAIR[0]], pair[PAIR[1]]
    assert big.identity.source_sha256 == models.REGISTRY[PAIR[0]].sha256
    assert small.identity.source_sha256 == models.REGISTRY[PAIR[1]].sha256
    assert big.identity.precision.startswith("native (Q4_K, Q6_K)")
    assert small.identity.precision.startswith("native (Q4_K, Q5_0, Q6_K, Q8_0)")
    assert big.tokenizer.vocab_size == small.tokenizer.vocab_size  # one tokenizer: a draft for the other
    from specwise.engine import kernels as K

    w = big.model.weights
    assert {p.fmt for L in w.layers for q in (L.qkv, L.o, L.gate_up, L.down) for p in q.parts} == {K.Q4, K.Q6}
    assert big.model.weight_bytes() < 1.05 * models.REGISTRY[PAIR[0]].size  # its own bytes, not a bf16 copy


def real_layers(pair):
    """One real layer of each quant type the pair holds (a slice of its outputs, every input)."""
    out = {}
    for name in PAIR:
        w = pair[name].model.weights
        for L in w.layers:
            for lin in (L.qkv, L.o, L.gate_up, L.down):
                for p in lin.parts:
                    key = (p.fmt, p.scales)
                    if key not in out:
                        out[key] = p
        out.setdefault(("head", w.head.fmt), w.head)
    return out


@pytest.mark.real
def test_every_quant_type_of_the_pair_computes_the_contract_on_every_variant(pair):
    from test_kernels import VARIANTS, contract_gemm

    from specwise.engine import kernels as K

    layers = real_layers(pair)
    assert {(K.Q4, K.SCALES_K), (K.Q6, K.SCALES_K6), (K.Q5, K.SCALES_F16), (K.Q8, K.SCALES_F16)} <= set(layers)
    for key, full in layers.items():
        lin = full.prefix(64)  # 64 outputs: the numpy emulation stays quick
        xs = torch.randn(3, lin.k, generator=torch.Generator().manual_seed(1))
        for activations in ("int8", "float32"):
            want = contract_gemm(lin, xs.numpy(), activations)
            for variant in VARIANTS:
                got = K.gemm(lin, xs, activations=activations, variant=variant).numpy()
                assert np.array_equal(got, want), (key, activations, variant)


@pytest.mark.real
def test_the_big_models_greedy_output_is_the_same_alone_and_in_a_batch_on_every_variant(pair):
    from test_kernels import VARIANTS

    from specwise.engine import Engine, SamplingParams

    target = pair[PAIR[0]]
    prompts = ["def add(a, b):", "Rename x to count: x = 0\nx += 1", "What is a mutex?", "print('hi')"]
    new = {"generic": 3}  # the portable C is slow on a 1.5B model; its bits are the others' (test_kernels)
    for variant in VARIANTS:
        t = replace(target, model=target.model.on_kernels(variant))
        params = SamplingParams(max_new_tokens=new.get(variant, 8))
        batch = Engine(t, max_batch=4).generate(prompts, params)
        alone = Engine(t, max_batch=1).generate(prompts[:1], params)[0]
        assert alone.token_ids == batch[0].token_ids, variant
        assert len(batch[0].token_ids) == params.max_new_tokens


@pytest.mark.real
def test_the_small_model_drafts_for_the_big_one_without_changing_a_token(pair):
    """Greedy and seeded coupled, k 1, 4 and auto, alone and in a batch of 3, the draft over its default reduced
    vocabulary (32,768 ids, the specials and the prompt's) and with its default precision (its Q5_0 and Q6_K
    layers re-packed in 4 bits, the rest as stored): every output is plain decoding's."""
    from specwise.engine import Engine, SamplingParams
    from specwise.engine import kernels as K

    target = pair[PAIR[0]]
    drafter = next(iter(Engine(target, drafter=f"model:{PAIR[1]}", max_batch=1).drafters.values()))
    stored = pair[PAIR[1]].model.weights
    weights = drafter.model.full.weights
    assert (
        drafter.provenance("")["layers_repacked"]
        == weights.precision
        == f"{stored.precision}, 5- and 6-bit layers in int4"
    )
    assert stored.bit_planes() and not weights.bit_planes()
    names = ("qkv", "o", "gate_up", "down")
    pairs = [(getattr(a, n), getattr(b, n)) for a, b in zip(stored.layers, weights.layers, strict=True) for n in names]
    fmts = [([p.fmt for p in a.parts], [p.fmt for p in b.parts]) for a, b in pairs]
    kept = [was == now for was, now in fmts if not {K.Q5, K.Q6} & set(was)]
    assert kept and all(kept)  # the 4- and 8-bit layers as stored
    prompts = [
        "Add type hints:\ndef area(w, h):\n    return w * h\n",
        "Rename total to acc_sum:\ntotal = 0\nfor v in vals:\n    total += v\n",
        "What does a mutex protect?",
    ]
    for params in (SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=16, temperature=0.7, seed=5)):
        plain = [r.token_ids for r in Engine(target, max_batch=3).generate(prompts, params)]
        for k in (1, 4, "auto"):
            engine = Engine(target, drafter=f"model:{PAIR[1]}", k=k, max_batch=3)
            assert [d.vocab.size for d in engine.drafters.values()] == [32768]
            assert list(engine.drafters) == [f"model:{PAIR[1]}"]  # named as typed: what a request asks for by name
            batch = engine.generate(prompts, params)
            assert [r.token_ids for r in batch] == plain, (k, params.temperature)
            if k != "auto":  # adaptive k may keep drafting off in a batch of 3 (measured costs): exact either way
                assert sum(r.stats.accepted for r in batch) > 0
        alone = Engine(target, drafter=f"model:{PAIR[1]}", k=4, max_batch=1).generate(prompts[1:2], params)[0]
        assert alone.token_ids == plain[1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
