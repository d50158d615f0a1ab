"""Logits processing shared by draft and target: temperature, top-k, top-p; and the request's bad values."""

import pytest
import torch

from specwise.engine.sampling import SamplingParams, probabilities
from specwise.errors import SpecwiseError


def test_top_k_keeps_only_k_tokens():
    p = probabilities(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (p[0] > 0).tolist() == [False, True, True, False]
    assert p.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert p[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_top_p_always_keeps_the_top_token():
    p = probabilities(torch.tensor([[5.0, 0.0]]), SamplingParams(temperature=1.0, top_p=0.01))
    assert p[0].tolist() == [1.0, 0.0]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = probabilities(logits, SamplingParams(temperature=2.0))[0, 0]
    cold = probabilities(logits, SamplingParams(temperature=0.5))[0, 0]
    assert cold > hot


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": -3}, "max_new_tokens=-3"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -1}, "top_k=-1"),
        ({"seed": -1}, "seed=-1"),
        ({"stop": ("",)}, "stop="),
    ],
)
def test_bad_sampling_values_raise_a_clear_error(kwargs, needle):
    with pytest.raises(SpecwiseError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value) and ("must" in str(err.value))
