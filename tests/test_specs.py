"""The shared limits and spec grammars (specwise/specs.py): one rule, used by CLI, config files, protocol, engine."""

import pytest

from specwise.errors import SpecwiseError
from specwise.specs import K_MAX, check_drafter_spec, parse_k, split_draft_model, split_head_precision


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (1, 1), ("7", 7), (K_MAX, K_MAX)])
def test_parse_k_accepts(value, expected):
    assert parse_k(value) == expected


@pytest.mark.parametrize("value", [0, K_MAX + 1, "x", "", -1, 2.5, True, None, "1.5"])
def test_parse_k_refuses_with_the_allowed_range(value):
    with pytest.raises(SpecwiseError, match=f"from 1 to {K_MAX}") as e:
        parse_k(value)
    assert e.value.param == "k"


@pytest.mark.parametrize(
    "spec",
    [
        "ngram",
        "ngram:2",
        "model:/a/path",
        "model:/p@32768",
        "model:/p@full",
        "model:/v@2/m",
        "model:/p@int4",
        "model:/p@int4@16384",
        "model:/p@full@int4",
        "int8",
        "layerskip:0-2",
    ],
)
def test_drafter_grammar_accepts(spec):
    assert check_drafter_spec(spec) == spec


def test_a_draft_models_vocabulary_and_precision_are_split_from_its_path():
    assert split_draft_model("/m/qwen@32768") == ("/m/qwen", None, 32768)
    assert split_draft_model("qwen@full") == ("qwen", None, 0)
    assert split_draft_model("/v@2/model") == ("/v@2/model", None, None)  # an '@' inside the path stays the path's
    assert split_draft_model("qwen") == ("qwen", None, None)
    assert split_draft_model("qwen@int4") == ("qwen", "int4", None)
    assert split_draft_model("qwen@int4@16384") == split_draft_model("qwen@16384@int4") == ("qwen", "int4", 16384)
    assert split_draft_model("qwen@int4@int4") == ("qwen@int4", "int4", None)  # once each: the rest is the path's
    assert split_draft_model("qwen@int3") == ("qwen@int3", None, None)  # not an option: part of the path


def test_a_heads_precision_is_split_from_its_path():
    assert split_head_precision("/h/chat") == ("/h/chat", "int4")  # the default
    assert split_head_precision("/h/chat@int8") == ("/h/chat", "int8")
    assert split_head_precision("/h/chat@float32") == ("/h/chat", "float32")
    assert split_head_precision("/h@2/chat") == ("/h@2/chat", "int4")  # an '@' inside the path stays the path's
    assert split_head_precision("/h/chat@int3") == ("/h/chat@int3", "int4")  # not a precision: part of the path


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("medusa", "unknown drafter 'medusa'"),
        ("eagle", "eagle:PATH needs the directory of a trained head"),
        ("ngram:x", "whole number"),
        ("ngram:0", "whole number"),
        ("model:", "needs a path"),
        ("model:/p@16", "32 or more ids, or @full"),
        ("model:/p@0", "32 or more ids, or @full"),
        ("int8:4", "no argument"),
        ("layerskip:", "layer spec"),
        (3, "unknown drafter 3"),
    ],
)
def test_drafter_grammar_refuses(spec, needle):
    with pytest.raises(SpecwiseError, match=needle) as e:
        check_drafter_spec(spec)
    assert e.value.param == "drafter" and "allowed: ngram" in str(e.value)


def test_protocol_and_cli_use_the_same_limit():
    """The server's request model and the CLI's parser refuse exactly above K_MAX."""
    import argparse

    from pydantic import ValidationError

    from specwise.cli.common import k_arg as _k
    from specwise.server.protocol import SpeculativeOptions

    assert SpeculativeOptions(k=K_MAX).k == K_MAX and _k(str(K_MAX)) == K_MAX
    with pytest.raises(ValidationError):
        SpeculativeOptions(k=K_MAX + 1)
    with pytest.raises(argparse.ArgumentTypeError):
        _k(str(K_MAX + 1))


def test_the_protocols_verify_methods_are_the_specs():
    from typing import get_args

    from specwise.server.protocol import VERIFY
    from specwise.specs import VERIFY_METHODS

    assert get_args(VERIFY) == VERIFY_METHODS
