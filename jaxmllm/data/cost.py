"""Per-phase cost model: what one item (sample text, image, audio clip) costs to train on.

Per transformer layer and item of n tokens (hidden d, key/value width d_kv, gated-MLP width f):

    fwd(n) = 2*n*(2*d*d + 2*d*d_kv + 3*d*f) + 4*n*n*d      (x 1/2 on the n*n term when causal)

so an item costs `linear * n + quadratic * n * n`. Training multiplies the forward by 3 for a
trainable module, by 2 for a frozen module that still passes gradients to something trainable
below it (closer to the input), by 1 for a frozen module with nothing trainable below. Encoders
have nothing below them; the LLM has the projectors and encoders below it.

Units are the lengths index's: LLM tokens, vision patches, audio log-mel frames (the audio
transformer runs on frames / subsample rows, folded into the coefficients).

The planners do not read it yet: they equalise the sum of squared item sizes per phase across
devices. Fitting the coefficients to measured step
times (Entrain's macroscopic profiling) waits for a trainer that writes those timings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (config imports the planner registry: cost must not import config)
    from jaxmllm.config import ModelConfig


@dataclass(frozen=True)
class PhaseCost:
    """Cost of one item of n units: linear * n + quadratic * n**2."""

    linear: float
    quadratic: float

    def item_cost(self, n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, np.float64)
        return self.linear * n + self.quadratic * n * n


@dataclass(frozen=True)
class CostModel:
    """Coefficients per phase, in FLOPs, from the model config."""

    llm: PhaseCost
    vision: PhaseCost
    audio: PhaseCost

    def phase(self, name: str) -> PhaseCost:
        return getattr(self, name)

    def tile_weights(self, block: int, subsample: int) -> dict[str, tuple[float, float]]:
        """Per phase (FLOPs per unit, FLOPs per computed attention tile of `block` rows):
        what a bucket's capacity costs whether it holds real work or padding. A tile is
        computed whole, so a causal phase's (whose quadratic term counts half the pairs) costs
        twice its coefficient per pair; an audio row is `subsample` frames."""
        side = {"llm": block, "vision": block, "audio": block * subsample}
        half = {"llm": 2.0, "vision": 1.0, "audio": 1.0}
        return {
            p: (self.phase(p).linear, half[p] * self.phase(p).quadratic * side[p] ** 2)
            for p in ("llm", "vision", "audio")
        }

    @classmethod
    def from_model(cls, model: ModelConfig) -> CostModel:
        """Training FLOPs per item from the module sizes and what is frozen."""
        v, a, lm = model.vision, model.audio, model.llm
        enc_trainable = (v.enabled and not v.freeze) or (a.enabled and not a.freeze)
        below_llm = enc_trainable or not model.projector_freeze
        m_llm = _multiplier(lm.freeze, below_llm)
        m_vis, m_aud = _multiplier(v.freeze, False), _multiplier(a.freeze, False)
        m_proj = _multiplier(model.projector_freeze, enc_trainable)
        kv = lm.width // lm.heads * lm.kv_heads
        llm_lin = lm.depth * _layer_linear(lm.width, kv, lm.mlp_dim) + 2 * lm.width * lm.vocab_size
        llm_quad = lm.depth * 2.0 * lm.width  # causal: half of 4*d
        area = v.merge**2
        proj_v = 2 * (area * v.width * lm.width + lm.width * lm.width) / area  # per patch
        vis_lin = v.depth * _layer_linear(v.width, v.width, v.mlp_dim)
        vis_quad = v.depth * 4.0 * v.width
        s = a.subsample
        proj_a = 2 * (a.width * lm.width + lm.width * lm.width) / s  # per frame
        conv = 2 * 9 * a.width * (a.n_mels + a.width) / s  # two 3-tap stride-2 convs, per frame
        aud_lin = a.depth * _layer_linear(a.width, a.width, a.mlp_dim) / s + conv
        aud_quad = a.depth * 4.0 * a.width / (s * s)
        return cls(
            llm=PhaseCost(m_llm * llm_lin, m_llm * llm_quad),
            vision=PhaseCost(m_vis * vis_lin + m_proj * proj_v, m_vis * vis_quad),
            audio=PhaseCost(m_aud * aud_lin + m_proj * proj_a, m_aud * aud_quad),
        )


def _multiplier(frozen: bool, trainable_below: bool) -> int:
    if not frozen:
        return 3
    return 2 if trainable_below else 1


def _layer_linear(d: int, d_kv: int, f: int) -> float:
    return 2.0 * (2 * d * d + 2 * d * d_kv + 3 * d * f)
