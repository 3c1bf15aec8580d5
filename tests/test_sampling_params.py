import pytest

from ridge import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", "[0, 100]"),
        ({"temperature": float("inf")}, "temperature", "[0, 100]"),
        ({"temperature": float("nan")}, "temperature", "[0, 100]"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "[0.01, 100]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "[0.01, 100]"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty", "[-2, 2]"),
        ({"n": True}, "n", ">= 1"),
        ({"max_tokens": 4.0}, "max_tokens", ">= 1"),
        ({"top_k": 2.5}, "top_k", ">= 1"),
        ({"seed": 2**70}, "seed", "2**63"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias", "[-100, 100]"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -3}, "top_k", ">= 1"),
        ({"min_p": 2.0}, "min_p", "[0, 1]"),
        ({"n": 0}, "n", ">= 1"),
        ({"logprobs": 50}, "logprobs", "[0, 20]"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens=4"),
        ({"stop": [""]}, "stop", "non-empty"),
    ],
)
def test_bad_values_name_field_and_limit(kwargs, field, limit):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value) and limit in str(info.value)


def test_stop_string_normalised():
    assert SamplingParams(stop="###").stop_strings == ("###",)
    assert SamplingParams(top_k=-1).top_k == 0
