"""`specwise train-draft` (issue 23, item 3): the prompts come from a JSONL file, a workload file or a request log
with text; bad input is refused with the reason and nothing is written; a run writes a head that drafts, with its
provenance; an interrupted training resumes from its checkpoint and ends where an uninterrupted one does."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
from conftest import write_tiny_model

from specwise.cli import main
from specwise.engine import Engine, SamplingParams, load_target
from specwise.engine import draft_data as D
from specwise.engine import draft_train as T
from specwise.engine import eagle as E
from specwise.errors import SpecwiseError
from specwise.monitor.requestlog import LogEntry, RequestLog

PROMPTS = ["hello world", "the cat sat on", "abcabc", "speculative", "a b c d e", "zzz top"]


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny4") / "m", layers=4, seed=3, max_pos=2048)


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def train_cli(source, out, model, *extra) -> int:
    return main(["train-draft", "--from", str(source), "--out", str(out), "--model", str(model), "--no-progress",
                 "--max-tokens", "24", "--draft-vocab", "40", "--epochs", "2", *extra])  # fmt: skip


def test_a_jsonl_of_prompts_and_messages_trains_a_head_that_drafts(tiny4_dir, tmp_path, capsys):
    rows = [{"prompt": p} for p in PROMPTS[:4]] + [{"messages": [{"role": "user", "content": p}]} for p in PROMPTS[4:]]
    out = tmp_path / "head"
    assert train_cli(jsonl(tmp_path / "p.jsonl", rows), out, tiny4_dir) == 0
    assert sorted(p.name for p in out.iterdir()) == [E.CONFIG, E.WEIGHTS, "training.json"]  # checkpoint removed
    summary = json.loads((out / "training.json").read_text())
    assert summary["prompts"] == 6 and len(summary["epochs"]) == 2 and summary["answer_tokens"] > 0
    conf = json.loads((out / E.CONFIG).read_text())
    target = load_target(tiny4_dir)
    assert conf["specwise"]["target_sha256"] == E.target_origin(target)
    assert conf["specwise"]["data_sha256"] == summary["data_sha256"]
    engine = Engine(target, drafter=f"eagle:{out}", k=3)
    r = engine.generate(["hello world"], SamplingParams(max_new_tokens=16))[0]
    assert r.token_ids == Engine(target).generate(["hello world"], SamplingParams(max_new_tokens=16))[0].token_ids
    assert r.stats.drafted > 0
    assert "held-out acceptance length" in capsys.readouterr().out
    assert train_cli(tmp_path / "p.jsonl", out, tiny4_dir) == 2  # a finished head is not written over


def test_a_workload_file_and_a_request_log_with_text_are_read(tiny4_dir, tmp_path):
    from specwise.cli.train_draft import read_prompts

    wl = tmp_path / "w.yaml"
    wl.write_text("name: w\ntasks:\n  - id: a\n    max_tokens: 8\n    prompt: hello there\n  - id: b\n"
                  "    max_tokens: 8\n    messages:\n      - {role: user, content: hi}\n")  # fmt: skip
    assert read_prompts(wl) == ["hello there", [{"role": "user", "content": "hi"}]]
    log = RequestLog(tmp_path / "log.db")
    for prompt in ("plain text", json.dumps([{"role": "user", "content": "chat"}])):
        log.add(LogEntry(1.0, 3, 4, 0.1, 0.2, 1, False, None, prompt=prompt))
    log.close()
    assert read_prompts(tmp_path / "log.db") == ["plain text", [{"role": "user", "content": "chat"}]]


@pytest.mark.parametrize(
    "content,needle",
    [
        ("", "no prompts in it"),
        ('{"prompt": "one"}\n', "1 prompt; give at least 2"),
        ('{"prompt": "a"}\nnot json\n', "line 2: not JSON"),
        ('{"prompt": "a"}\n{"text": "b"}\n', "line 2: give an object with a 'prompt'"),
        ('{"prompt": "a"}\n{"messages": []}\n', "messages must be a non-empty list"),
        ('{"prompt": "a"}\n{"prompt": ""}\n', "'prompt' must be non-empty text"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(tiny4_dir, tmp_path, capsys, content, needle):
    src = tmp_path / "p.jsonl"
    src.write_text(content)
    out = tmp_path / "out"
    assert train_cli(src, out, tiny4_dir) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_a_log_without_text_or_a_missing_file_is_refused(tiny4_dir, tmp_path, capsys):
    log = RequestLog(tmp_path / "log.db")
    log.add(LogEntry(1.0, 3, 4, 0.1, 0.2, 1, False, None))
    log.close()
    out = tmp_path / "out"
    assert train_cli(tmp_path / "log.db", out, tiny4_dir) == 2
    assert "serve with --log-text" in capsys.readouterr().err and not out.exists()
    assert train_cli(tmp_path / "missing.jsonl", out, tiny4_dir) == 2
    assert "no such file" in capsys.readouterr().err and not out.exists()
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"SQLite format 3\x00" + b"\x00" * 200)
    assert train_cli(broken, out, tiny4_dir) == 2
    assert "not a specwise request log" in capsys.readouterr().err and not out.exists()
    with sqlite3.connect(tmp_path / "other.db") as con:
        con.execute("CREATE TABLE t (x)")
    assert train_cli(tmp_path / "other.db", out, tiny4_dir) == 2
    assert "not a specwise request log" in capsys.readouterr().err


def test_an_interrupted_training_resumes_and_ends_as_an_uninterrupted_one(tiny4_dir, tmp_path):
    target = load_target(tiny4_dir)
    examples = D.collect(target, [target.tokenizer.encode(p) for p in PROMPTS], max_new_tokens=24)
    ids, _ = D.draft_vocabulary(examples, 40)
    spec = E.HeadSpec(target.model.cfg, D.eagle_layers(target.model.num_layers), int(ids.numel()))
    options = T.TrainOptions(epochs=3, lr=5e-3, batch_tokens=64)
    whole = E.new_head(spec, ids, target.model)
    T.train(whole, examples, options, progress=False)

    class Stop(Exception):
        pass

    def stop_after_first(report):
        if report.epoch == 1:
            raise Stop

    resumed = E.new_head(spec, ids, target.model)
    with pytest.raises(Stop):
        T.train(resumed, examples, options, tmp_path, progress=False, report=stop_after_first)
    assert (tmp_path / T.CHECKPOINT).exists()
    again = E.new_head(spec, ids, target.model)  # a fresh process: only the checkpoint carries the first epoch
    history = T.train(again, examples, options, tmp_path, progress=False)
    assert [e.epoch for e in history.epochs] == [1, 2, 3]
    for name, t in whole.state().items():
        assert torch.allclose(t, again.state()[name], atol=1e-6), name


def test_evaluate_runs_a_trained_head_and_records_it_as_the_drafts_identity(tiny4_dir, tmp_path):
    """The loop the monitor points to: train on some prompts, then `evaluate` the head as a configuration; the run
    names the head (its directory's hash, the target it derives from, the data it was trained on)."""
    from test_evaluate import run_configs

    out = tmp_path / "head"
    assert train_cli(jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS]), out, tiny4_dir) == 0
    run = run_configs(
        tiny4_dir, tmp_path, f"configs:\n  - {{name: base}}\n  - {{name: head, drafter: 'eagle:{out}', k: 3}}\n"
    )
    assert run.analysis.configs == ["base", "head"]
    assert all(r.error is None for r in run.records), [r.error for r in run.records if r.error]
    identity = run.provenance.configs["head"].draft_identity
    summary = json.loads((out / "training.json").read_text())
    assert identity["name"] == f"eagle:{out}" and identity["trained_on"] == summary["data_sha256"]
    assert identity["derived_from"] == summary["target_sha256"] and len(identity["sha256"]) == 64


def test_a_long_prompt_within_the_targets_context_is_read(tiny4_dir, tmp_path):
    """Prompts are held to the target's context, not to a smaller encoder's: 1,500 tokens fit 2,048; 3,000 are
    refused before anything is written."""
    too_long = [{"prompt": "abc " * 750}, {"prompt": "hello world"}]
    assert train_cli(jsonl(tmp_path / "long.jsonl", too_long), tmp_path / "no", tiny4_dir) == 2
    assert not (tmp_path / "no").exists()
    rows = [{"prompt": "abc " * 375}, {"prompt": "hello world"}, {"prompt": "the cat"}]
    assert train_cli(jsonl(tmp_path / "p.jsonl", rows), tmp_path / "head", tiny4_dir, "--epochs", "1") == 0
    assert json.loads((tmp_path / "head" / "training.json").read_text())["prompts"] == 3


def test_training_precision_auto_takes_bfloat16_only_where_the_cpu_has_it(tiny4_dir, tmp_path, capsys):
    assert T.autocast_dtype("auto", frozenset({"avx2", "avx512f", "avx512_bf16"})) is torch.bfloat16
    assert T.autocast_dtype("auto", frozenset({"amx_bf16"})) is torch.bfloat16
    assert T.autocast_dtype("auto", frozenset({"avx2", "avx512f"})) is None  # emulated there: slower, not faster
    assert T.autocast_dtype("float32", frozenset({"avx512_bf16"})) is None
    assert T.autocast_dtype("bfloat16", frozenset()) is torch.bfloat16
    with pytest.raises(SpecwiseError, match="precision must be one of auto, bfloat16, float32"):
        T.TrainOptions(precision="float16").check()
    src = jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    assert train_cli(src, tmp_path / "out", tiny4_dir, "--precision", "half") == 2
    assert "precision must be one of" in capsys.readouterr().err and not (tmp_path / "out").exists()


class _Payload:
    """A pickle that, when loaded, creates a file: what a hostile `examples.pt` or `checkpoint.pt` would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["examples.pt", "checkpoint.pt", "examples.safetensors", "checkpoint.safetensors"])
def test_a_pickle_left_in_out_is_refused_and_never_run(tiny4_dir, tmp_path, capsys, name):
    """Issue 31 item 1: state in --out is read as safetensors + JSON only; a pickle there (under the old names or the
    new ones) is refused with the reason and its code never runs."""
    rows = [{"prompt": p} for p in PROMPTS]
    out = tmp_path / "head"
    out.mkdir()
    marker = tmp_path / "ran"
    torch.save({"key": "x", "examples": _Payload(marker)}, out / name)
    assert train_cli(jsonl(tmp_path / "p.jsonl", rows), out, tiny4_dir) == 2
    err = capsys.readouterr().err
    assert name in err and ("never read" in err or "not a specwise state file" in err), err
    assert not marker.exists()
    assert not (out / E.CONFIG).exists()


def test_a_checkpoint_pickle_is_refused_by_train_itself(tiny4_dir, tmp_path):
    target = load_target(tiny4_dir)
    examples = D.collect(target, [target.tokenizer.encode(p) for p in PROMPTS[:3]], max_new_tokens=8)
    ids, _ = D.draft_vocabulary(examples, 40)
    spec = E.HeadSpec(target.model.cfg, D.eagle_layers(target.model.num_layers), int(ids.numel()))
    marker = tmp_path / "ran"
    torch.save(_Payload(marker), tmp_path / "checkpoint.pt")
    with pytest.raises(SpecwiseError, match=r"checkpoint\.pt: pickled training state is never read"):
        T.train(E.new_head(spec, ids, target.model), examples, T.TrainOptions(epochs=1), tmp_path, progress=False)
    assert not marker.exists()


def test_collected_answers_round_trip_and_a_tampered_file_is_refused(tiny4_dir, tmp_path):
    from safetensors.torch import save_file

    target = load_target(tiny4_dir)
    examples = D.collect(target, [target.tokenizer.encode(p) for p in PROMPTS[:2]], max_new_tokens=8)
    path = tmp_path / "examples.safetensors"
    D.save_examples(path, "k1", examples)
    assert path.stat().st_mode & 0o077 == 0  # owner only
    back = D.load_examples(path, "k1")
    assert back is not None and len(back) == 2
    for a, b in zip(examples, back, strict=True):
        assert a.tokens == b.tokens and a.prompt_len == b.prompt_len
        assert torch.equal(a.features, b.features) and torch.equal(a.top_ids, b.top_ids)
        assert torch.equal(a.top_logprobs, b.top_logprobs)
    assert D.load_examples(path, "another key") is None  # collected from something else: collect again
    save_file({"w": torch.zeros(2)}, str(path))  # a safetensors file, but not ours
    with pytest.raises(SpecwiseError, match="without specwise's state"):
        D.load_examples(path, "k1")
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(SpecwiseError, match="not a specwise state file"):
        D.load_examples(path, "k1")
    ex = examples[0]
    D.save_examples(path, "k1", [D.Example(ex.tokens, len(ex.tokens), ex.features, ex.top_ids, ex.top_logprobs)])
    with pytest.raises(SpecwiseError, match="prompt length"):
        D.load_examples(path, "k1")
    D.save_examples(path, "k1", [D.Example(ex.tokens, ex.prompt_len, ex.features[:-1], ex.top_ids, ex.top_logprobs)])
    with pytest.raises(SpecwiseError, match="positions"):
        D.load_examples(path, "k1")


def test_a_logged_prompt_of_brackets_is_a_prompt_and_a_completion_never_turns_into_chat(tmp_path):
    """Issue 31 item 16: 2,000 '[' raised RecursionError past the JSON handler; a completion prompt that parses as
    a message list was re-read as chat. The log now says which a prompt was; older logs keep the guess, safely."""
    from specwise.cli.train_draft import read_prompts

    chat = [{"role": "user", "content": "chat"}]
    as_text = json.dumps(chat)  # a completion prompt that happens to be a message list's JSON
    log = RequestLog(tmp_path / "log.db")
    for prompt, is_chat in (("[" * 2000, False), (as_text, False), (json.dumps(chat), True)):
        log.add(LogEntry(1.0, 3, 4, 0.1, 0.2, 1, False, None, prompt=prompt, chat=is_chat))
    log.close()
    assert read_prompts(tmp_path / "log.db") == ["[" * 2000, as_text, chat]
    con = sqlite3.connect(tmp_path / "log.db")  # a log from before the kind was recorded
    con.execute("UPDATE log SET chat = NULL")
    con.commit()
    con.close()
    assert read_prompts(tmp_path / "log.db") == ["[" * 2000, chat, chat]
