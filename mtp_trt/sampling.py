"""Sampling for temperature > 0: logits -> filtered distributions, and lossless speculative rejection sampling.

The acceptance rule is the one the CUDA kernel implements (plugins/reference.accept_rejection):
draft i is accepted when u_i < p_i(d_i) / q_i(d_i); at the first rejection the token is drawn from
normalize(max(p_i - q_i, 0)); if every draft is accepted the bonus token is drawn from p_K.  The
drafts themselves must be drawn from q, the drafter's own (filtered) distribution.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins.reference import accept_rejection


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise MtpTrtError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise MtpTrtError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise MtpTrtError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [..., V] -> the distribution tokens are drawn from: softmax(logits / T), restricted to the
    top-k tokens and to the smallest set whose mass reaches top-p, renormalized (float64)."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass strictly before each token
        drop = np.zeros_like(p, dtype=bool)
        np.put_along_axis(drop, order, before >= params.top_p, -1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(-1, keepdims=True)
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draw one token per row of p [..., V] (inverse CDF)."""
    flat = p.reshape(-1, p.shape[-1])
    u = rng.random(flat.shape[0])
    cdf = np.cumsum(flat, -1)
    idx = (cdf < (u * cdf[:, -1])[:, None]).sum(-1)
    return np.minimum(idx, p.shape[-1] - 1).reshape(p.shape[:-1]).astype(np.int32)


def speculative_accept(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, rng: np.random.Generator):
    """p [B, K+1, V] target, q [B, K, V] drafter distributions, drafts [B, K] drawn from q.

    Returns accepted_tokens [B, K+1] (accepted drafts, the corrected or bonus token, then -1) and
    num_accepted [B].  The output tokens are distributed exactly as sampling from p one at a time."""
    b, k1, _ = p.shape
    uniforms = rng.random((b, k1)).astype(np.float32)
    tokens, n, _ = accept_rejection(p.astype(np.float32), q.astype(np.float32), drafts.astype(np.int32), uniforms)
    return tokens, n
