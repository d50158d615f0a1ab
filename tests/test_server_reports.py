"""Reading other servers' speculation figures. llama.cpp's forms were copied from a real `llama-server` run (this
machine's build, ngram-simple speculation); vLLM's and SGLang's are written from their documentation (vLLM:
docs/features/speculative_decoding/acceptance_metrics.md and the metrics design doc; SGLang: the request `meta_info`
fields and the `sglang:spec_accept_*` gauges) — neither server runs here (no GPU)."""

import pytest

from specwise.harness.server_reports import (
    counter_delta,
    counts_from_counters,
    parse_spec_counters,
    spec_from_payload,
)

LLAMACPP_METRICS = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {drafted}
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {steps}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {steps}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} 1
"""


def test_llamacpp_counters_and_their_phase_delta():
    before = parse_spec_counters(LLAMACPP_METRICS.format(drafted=10, accepted=4, steps=3))
    after = parse_spec_counters(LLAMACPP_METRICS.format(drafted=40, accepted=24, steps=13))
    assert before["source"] == "llamacpp"
    d = counter_delta(before, after)
    c = counts_from_counters([d])
    assert (c.steps, c.drafted, c.accepted) == (10, 30, 20)
    assert c.acceptance_rate == pytest.approx(20 / 30) and c.mean_acceptance_length == pytest.approx(3.0)
    assert d.accepted_per_pos == [10, 0]


def test_llamacpp_per_request_timings():
    chunk = {
        "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
        "usage": {"completion_tokens": 48, "prompt_tokens": 19, "total_tokens": 67},
        "timings": {"prompt_n": 19, "predicted_n": 48, "draft_n": 30, "draft_n_accepted": 21, "predicted_ms": 320.1},
    }
    c = spec_from_payload(chunk)
    assert (c.drafted, c.accepted, c.steps) == (30, 21, 0)
    assert c.acceptance_rate == pytest.approx(0.7) and c.mean_acceptance_length is None  # no step count per request
    no_spec = {"timings": {"prompt_n": 19, "predicted_n": 24}}  # llama-server without speculation
    assert spec_from_payload(no_spec) is None


def test_vllm_per_request_summary_as_vllm_0_32_sends_it():
    body = {
        "choices": [],
        "usage": {},
        "metrics": {
            "speculative_decoding": {
                "mean_acceptance_length": 1.2325581395348837,
                "draft_acceptance_rate": 0.07751937984496124,
                "acceptance_histogram": [39, 1, 0, 3],
                "num_spec_steps": 43,
                "num_accepted_draft_tokens": 10,
                "num_draft_tokens": 129,
                "num_spec_tokens": 3,
            }
        },
    }
    c = spec_from_payload(body)
    assert (c.steps, c.drafted, c.accepted) == (43, 129, 10)
    # the figures vLLM reports, recomputed by SpecCounts from the counts
    assert c.mean_acceptance_length == pytest.approx(1.2325581395348837)
    assert c.acceptance_rate == pytest.approx(0.07751937984496124)
    assert c.accepted_per_position == [4, 3, 3]  # steps that kept position 1, 2, 3
    assert c.drafted_per_position == [43, 43, 43] and c.rejections == 40  # 129 = 43 × 3: every step drafted 3


def test_vllm_per_request_detailed_gives_every_steps_counts():
    """`--per-request-spec-decode-metrics detailed`: per-step arrays; n-gram steps draft fewer than k at times."""
    m = {
        "acceptance_histogram": [1, 1, 0, 1],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 4,
        "num_draft_tokens": 7,
        "num_spec_tokens": 3,
        "per_step_accepted": [3, 0, 1],
        "per_step_drafted": [3, 1, 3],
    }
    c = spec_from_payload({"choices": [], "metrics": {"speculative_decoding": m}})
    assert (c.steps, c.drafted, c.accepted, c.rejections) == (3, 7, 4, 2)
    assert c.drafted_per_position == [3, 2, 2] and c.accepted_per_position == [2, 1, 1]
    summary = spec_from_payload({"metrics": {"speculative_decoding": {k: v for k, v in m.items() if "step_" not in k}}})
    assert (summary.steps, summary.drafted, summary.accepted) == (3, 7, 4)
    assert summary.drafted_per_position == []  # 7 ≠ 3 × 3: which positions were drafted is not known


def test_vllm_counters_with_positions():
    text = (
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 15.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0\n'
    )
    c = parse_spec_counters(text)
    assert c["source"] == "vllm" and c["num_accepted_tokens"] == 9 and c["accepted_per_pos"] == {0: 5, 1: 4}


def test_sglang_meta_info_and_gauges():
    chunk = {
        "choices": [
            {
                "index": 0,
                "text": "x",
                "meta_info": {
                    "spec_verify_ct": 7,
                    "spec_accept_token_num": 12,
                    "spec_draft_token_num": 21,
                    "spec_accept_rate": 0.571,
                    "spec_accept_length": 2.71,
                },
            }
        ]
    }
    c = spec_from_payload(chunk)
    assert (c.steps, c.drafted, c.accepted) == (7, 21, 12)
    assert c.mean_acceptance_length == pytest.approx(19 / 7)
    g = parse_spec_counters(
        'sglang:spec_accept_length{model_name="m"} 2.5\nsglang:spec_accept_rate{model_name="m"} 0.6\n'
    )
    assert g["source"] == "sglang" and g["accept_length"] == 2.5 and g["accept_rate"] == 0.6


def test_specwise_usage_and_nothing():
    c = spec_from_payload(
        {"usage": {"speculative": {"verification_steps": 3, "drafted_tokens": 13, "accepted_tokens": 12}}}
    )
    assert (c.steps, c.drafted, c.accepted) == (3, 13, 12)
    assert spec_from_payload({"choices": [{"text": "a"}]}) is None
    assert parse_spec_counters("process_cpu_seconds_total 1.0\n") is None
