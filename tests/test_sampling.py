"""Sampling: lossless rejection sampling preserves the target distribution (chi-square, fixed seed,
significance 0.001); top-k/top-p filtering; speculative configs of TensorRT-LLM and vLLM."""

import json

import numpy as np
import pytest

from mtp_trt.errors import MtpTrtError
from mtp_trt.sampling import SamplingParams, probabilities, speculative_accept
from mtp_trt.spec_config import SpecConfig, load_spec_config, parse_spec_config

CHI2_CRIT_001 = {5: 20.515, 24: 51.179}  # chi-square critical values at significance 0.001, by degrees of freedom


def chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_preserves_the_target_distribution():
    """V = 6, K = 2, a drafter q far from the target p.  Over 20000 draws with seed 0 the first emitted
    token follows p_0 and, when the first draft was accepted, the second follows p_1 (chi-square at
    significance 0.001, df = 5); a drafter equal to the target accepts every draft."""
    rng = np.random.default_rng(0)
    v, n = 6, 20000
    p = rng.dirichlet(np.ones(v), size=3)  # target at positions 0, 1, 2
    q = rng.dirichlet(np.ones(v) * 0.5, size=2)  # drafter at positions 0, 1
    first, second = np.zeros(v), np.zeros(v)
    accepted = 0
    chunk = 500
    for _ in range(n // chunk):
        drafts = np.stack([rng.choice(v, size=chunk, p=q[0]), rng.choice(v, size=chunk, p=q[1])], 1)
        tokens, num = speculative_accept(np.broadcast_to(p, (chunk, 3, v)), np.broadcast_to(q, (chunk, 2, v)),
                                         drafts, rng)
        np.add.at(first, tokens[:, 0], 1)
        ok = num >= 1
        np.add.at(second, tokens[ok, 1], 1)
        accepted += int(ok.sum())
    assert chi2(first, p[0]) < CHI2_CRIT_001[5]
    assert chi2(second, p[1]) < CHI2_CRIT_001[5]
    assert 0.2 * n < accepted < 0.9 * n
    # The test can fail: sampling the first token from q instead of correcting it is detected.
    wrong = np.bincount(rng.choice(v, size=n, p=q[0]), minlength=v)
    assert chi2(wrong, p[0]) > CHI2_CRIT_001[5]
    same = speculative_accept(np.broadcast_to(p, (50, 3, v)), np.broadcast_to(p[:2], (50, 2, v)),
                              np.stack([rng.choice(v, 50, p=p[0]), rng.choice(v, 50, p=p[1])], 1), rng)[1]
    assert (same == 2).all()


def test_probabilities_filters():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]]))
    np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0)), [[0.4, 0.3, 0.2, 0.1]])
    np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0, top_k=2)), [[4 / 7, 3 / 7, 0, 0]])
    np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0, top_p=0.65)), [[4 / 7, 3 / 7, 0, 0]])
    np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0, top_p=0.75)), [[4 / 9, 3 / 9, 2 / 9, 0]])
    hot = probabilities(logits, SamplingParams(100.0))
    assert hot.max() - hot.min() < 0.01
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(MtpTrtError):
            SamplingParams(**{"temperature": 1.0, **bad})


@pytest.mark.parametrize("data,expected", [
    ({"decoding_type": "MTP", "num_nextn_predict_layers": 3}, SpecConfig(3)),
    ({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2, "use_mtp_vanilla": True}},
     SpecConfig(2, "vanilla")),
    ({"decoding_type": "MTP", "num_nextn_predict_layers": 3, "use_relaxed_acceptance_for_thinking": True,
      "relaxed_topk": 10, "relaxed_delta": 0.6}, SpecConfig(3, None, 10, 0.6)),
    ({"decoding_type": "MTP", "num_nextn_predict_layers": 1, "relaxed_topk": 10}, SpecConfig(1)),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 2}, SpecConfig(2)),
    ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, SpecConfig(1)),
])
def test_spec_configs(data, expected, tmp_path):
    assert parse_spec_config(data) == expected
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(data))
    assert load_spec_config(f) == expected


@pytest.mark.parametrize("data,message", [
    ({"decoding_type": "MTP", "num_nextn_predict_layer": 3},
     "unknown TensorRT-LLM speculative_config key(s) 'num_nextn_predict_layer'; valid keys: decoding_type, "),
    ({"decoding_type": "Eagle", "num_nextn_predict_layers": 3}, "decoding_type 'Eagle' is not supported; valid: 'MTP'"),
    ({"method": "ngram", "num_speculative_tokens": 3}, "method 'ngram' is not supported; valid methods: deepseek_mtp, mtp"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": -1}, "'num_speculative_tokens' must be an integer in 0..16, got -1"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 17}, "'num_speculative_tokens' must be an integer in 0..16, got 17"),
    ({"method": "deepseek_mtp", "n": 1}, "unknown vLLM speculative_config key(s) 'n'; valid keys: "),
    ({"nextn": 3}, "expected TensorRT-LLM's 'decoding_type' or vLLM's 'method' key"),
])
def test_bad_spec_configs(data, message):
    with pytest.raises(MtpTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec_config(data, "spec.json")
