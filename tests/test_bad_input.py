"""Every bad input named in the engine issue: one clear error naming the value and what is allowed."""

import json
import re
import subprocess
import sys

import pytest
from conftest import write_tiny_model

from specwise.engine import Engine, SamplingParams, load_target
from specwise.errors import SpecwiseError


def test_empty_prompt(tiny):
    with pytest.raises(SpecwiseError, match="prompt is empty"):
        Engine(tiny).generate("", SamplingParams())


def test_empty_chat_messages(tiny):
    with pytest.raises(SpecwiseError, match="chat messages"):
        Engine(tiny).encode_prompt([{"content": "no role"}])


def test_prompt_longer_than_context(tiny):
    engine = Engine(tiny, max_len=64)
    with pytest.raises(SpecwiseError, match=r"exceed the context of 64 tokens"):
        engine.generate("a" * 80, SamplingParams(max_new_tokens=4))
    with pytest.raises(SpecwiseError, match="together they exceed"):
        engine.generate("a" * 40, SamplingParams(max_new_tokens=40))


def test_missing_weights_path():
    with pytest.raises(SpecwiseError, match="does not exist"):
        load_target("/no/such/model")


def test_corrupt_safetensors(tmp_path):
    d = write_tiny_model(tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(SpecwiseError, match="corrupt or unreadable"):
        load_target(d)


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECWISE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(SpecwiseError, match=r"not a readable GGUF file"):
        load_target(bad)


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(SpecwiseError, match=r"must be \.gguf"):
        load_target(f)


def test_directory_without_config(tmp_path):
    with pytest.raises(SpecwiseError, match=r"no config\.json"):
        load_target(tmp_path)


def test_draft_model_with_another_vocabulary(tiny, tmp_path):
    other = write_tiny_model(tmp_path / "other", chars=list("abcdefgh"))
    with pytest.raises(SpecwiseError, match="another vocabulary"):
        Engine(tiny, drafter=f"model:{other}")


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("foo", "unknown drafter"),
        ("ngram:x", "whole number"),
        ("layerskip:5-9", "outside 0..1"),
        ("layerskip:a", "does not parse"),
        ("model:/no/such/dir", "does not exist"),
    ],
)
def test_bad_drafter_specs(tiny, spec, needle):
    with pytest.raises(SpecwiseError, match=needle):
        Engine(tiny, drafter=spec)


@pytest.mark.parametrize(
    "kind, tail, allowed", [("model", "fulll", "or full"), ("eagle", "int3", "int4 (the default)")]
)
def test_a_mistyped_option_after_at_is_named_not_taken_for_a_missing_path(tiny, tiny_dir, kind, tail, allowed):
    # model:DIR@fulll and eagle:DIR@int3 name an existing DIR: the '@' part is the mistake, not the path
    with pytest.raises(SpecwiseError, match=rf"{tail}' after '@' is not allowed \(allowed: .*{re.escape(allowed)}"):
        Engine(tiny, drafter=f"{kind}:{tiny_dir}@{tail}")


def test_an_unknown_model_name_lists_the_known_ones():
    with pytest.raises(SpecwiseError, match=r"does not exist: it is neither a model name .*qwen2.5-coder-1.5b"):
        load_target("qwen2.5-coder-7b")


@pytest.mark.parametrize("k", [0, 17, "fast", -2])
def test_bad_draft_length(tiny, k):
    with pytest.raises(SpecwiseError, match="draft length from 1 to 16"):
        Engine(tiny, drafter="ngram", k=k)


def test_bad_device(tiny_dir):
    with pytest.raises(SpecwiseError, match="device"):
        load_target(tiny_dir, device="tpu")


def test_bad_dtype(tiny_dir):
    with pytest.raises(SpecwiseError, match="dtype 'int4'"):
        load_target(tiny_dir, dtype="int4")
    with pytest.raises(SpecwiseError, match=r"quantize 'int3'.*allowed: int4, int8"):
        load_target(tiny_dir, quantize="int3")
    with pytest.raises(SpecwiseError, match="float16 runs on CUDA only"):
        load_target(tiny_dir, dtype="float16")


@pytest.mark.embedded
def test_quantizing_an_already_quantised_gguf_is_refused():
    with pytest.raises(SpecwiseError, match=r"already quantised \(Q4_1, Q8_0\)"):
        load_target(quantize="int4")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specwise.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--temperature", "-1"], "temperature=-1.0"),
        (["generate", "hi", "--top-p", "0"], "top_p=0.0"),
        (["generate", "hi", "--top-k", "-1"], "top_k=-1"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens=0"),
        (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
        (["generate", "hi", "--k", "many"], "give a draft length from 1 to 16"),
        (["generate", "hi", "--k", "17"], "k=17 is not allowed"),
        (["evaluate", "--endpoint", "http://127.0.0.1:9", "--dtype", "bfloat16"], "the server decides it"),
    ],
)
def test_cli_reports_bad_input_without_traceback(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["generate hi", "serve", "evaluate"])
@pytest.mark.parametrize(
    "flag, value, allowed",
    [("--dtype", "int4", ["auto", "float32", "bfloat16", "float16"]), ("--quantize", "int2", ["int4", "int8"])],
)
def test_cli_precision_flags_name_the_allowed_values(command, flag, value, allowed):
    proc = run_cli(*command.split(), flag, value)
    assert proc.returncode == 2 and f"invalid choice: '{value}'" in proc.stderr, proc.stderr
    assert all(a in proc.stderr.rsplit("choose from", 1)[1] for a in allowed)


def test_cli_generate_with_stats_on_a_tiny_model(tiny_dir):
    proc = run_cli(
        "generate",
        "abc abc abc",
        "--model",
        str(tiny_dir),
        "--drafter",
        "ngram",
        "--k",
        "auto",
        "--max-new-tokens",
        "12",
        "--stats",
    )
    assert proc.returncode == 0, proc.stderr
    assert "acceptance" in proc.stderr and "verification" in proc.stderr


def test_cli_json_output(tiny_dir):
    # --max-tokens, as evaluate, predict and the OpenAI API spell it (--max-new-tokens is the same flag)
    proc = run_cli("generate", "abc", "--model", str(tiny_dir), "--raw", "--max-tokens", "5", "--json")
    result = json.loads(proc.stdout)
    assert result["stats"]["generated_tokens"] <= 5 and result["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "hi", "--tempreature", "0.5"], "--tempreature is not an option of `specwise generate` (did you "
         "mean --temperature?); its options: `specwise generate --help`"),
        (["evaluate", "--max-new-tokens", "5"], "--max-new-tokens is not an option of `specwise evaluate` (did you "
         "mean --max-tokens?)"),
        (["generate", "--max_new_tokens", "3", "hi"], "(did you mean --max-new-tokens or --max-tokens?)"),
        (["serve", "--bogus=1"], "--bogus is not an option of `specwise serve`; its options: `specwise serve --help`"),
        (["generate", "hello", "world"], "`specwise generate` does not take 'world' (a value with spaces needs "
         "quotes)"),
    ],
)  # fmt: skip
def test_cli_names_an_unknown_flag_and_the_one_it_probably_meant(argv, needle, capsys):
    """argparse alone says "unrecognized arguments" and lists the words; the error names the flag the subcommand
    does not have, the nearest one it has, and where its options are listed — and nothing runs."""
    from specwise.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and needle in err, err
    assert "unrecognized arguments" not in err and "Traceback" not in err
