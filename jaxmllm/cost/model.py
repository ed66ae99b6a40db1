"""Per-phase cost model: what one item (sample text, image, audio clip) costs to train on, from
the model config (FLOPs) or calibrated on a run's measured step times (seconds).

Per transformer layer and item of n tokens (hidden d, key/value width d_kv, gated-MLP width f):

    fwd(n) = 2*n*(2*d*d + 2*d*d_kv + 3*d*f) + 4*n*n*d      (x 1/2 on the n*n term when causal)

so an item costs `linear * n + quadratic * n * n`. Training multiplies the forward by 3 for a
trainable module, by 2 for a frozen module that still passes gradients to something trainable
below it (closer to the input), by 1 for a frozen module with nothing trainable below. Encoders
have nothing below them; the LLM has the projectors and encoders below it.

Units are the lengths index's: LLM tokens, vision patches, audio log-mel frames (the audio
transformer runs on frames / subsample rows, folded into the coefficients). An LLM item is a
document, what attention sees: a preference pair is two (its chosen and rejected documents,
n1 + n2 tokens of linear work, n1**2 + n2**2 of quadratic), as a step's FLOPs count them from
its segments (`jaxmllm.batch.counts`) and the planner from the index's `split`.

Calibrated on a run's measured step times: `jaxmllm.cost.calibrate` (`CostModel.from_file` reads
what it writes).

The planners do not read it yet: they equalise the sum of squared item sizes per phase across
devices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxmllm.config.checks import ConfigError, UserError
from jaxmllm.config.phases import ENCODERS, LLM, PHASES
from jaxmllm.cost import training
from jaxmllm.cost.flops import (
    ENCODER_ADAPTERS,
    ENCODER_FLOPS,
    decoder_adapters,
    decoder_linear,
    full_layer_count,
)
from jaxmllm.cost.training import multiplier

if TYPE_CHECKING:
    from jaxmllm.config import Config, ModelConfig


class CostFileError(UserError):
    """A timings or calibrated-cost file that cannot be used; the message names file and line."""


def window_sq(n, window: int) -> np.ndarray:
    """What a causal document of `n` tokens costs in a layer with a sliding window of `window`
    tokens, in the units of the quadratic term (n**2, twice the key-query pairs a causal
    document has): n**2 up to the window, 2 n w - w**2 beyond it, linear in n (each query
    sees w keys). 0: no window, n**2 (float64, elementwise)."""
    n = np.asarray(n, np.float64)
    if not window:
        return n * n
    return np.where(n <= window, n * n, 2.0 * n * window - float(window) ** 2)


@dataclass(frozen=True)
class PhaseCost:
    """Cost of one item of n units: linear * n + quadratic * n**2."""

    linear: float
    quadratic: float

    def item_cost(self, n: np.ndarray) -> np.ndarray:
        """Cost of items of `n` units each, elementwise (float64)."""
        n = np.asarray(n, np.float64)
        return self.linear * n + self.quadratic * n * n

    def work_cost(self, units, sq):
        """Cost of items with `units` in all and `sq` their summed squared sizes."""
        return self.linear * units + self.quadratic * sq


@dataclass(frozen=True)
class CostModel:
    """Coefficients per phase, in FLOPs from the model config or seconds from a calibration."""

    terms: Mapping[str, PhaseCost]  # per phase of the table (PHASES): an item's cost
    unit: str = "flops"  # flops (from_model) | seconds (from_file: calibrated on a run)
    overhead: float = 0.0  # per step, in `unit`: what a step costs besides its items

    def phase(self, name: str) -> PhaseCost:
        """Phase `name`'s coefficients."""
        return self.terms[name]

    def tile_weights(
        self, block: int, per_row: Mapping[str, int]
    ) -> dict[str, tuple[float, float]]:
        """Per phase (FLOPs per unit, FLOPs per computed attention tile of `block` rows):
        what a bucket's capacity costs whether it holds real work or padding. A tile is
        computed whole, so a causal phase's (the LLM's, whose quadratic term counts half the
        pairs) costs twice its coefficient per pair; an encoder row is `per_row[phase]` units
        (1 where missing)."""
        out = {}
        for p in PHASES:
            side = block * (1 if p == LLM else per_row.get(p, 1))
            half = 2.0 if p == LLM else 1.0
            out[p] = (self.phase(p).linear, half * self.phase(p).quadratic * side**2)
        return out

    def step_cost(self, work: dict[str, float]) -> float:
        """Overhead plus each phase's cost of `work` (`{phase}_units`, `{phase}_sq` keys)."""
        total = self.overhead
        for p in PHASES:
            total += self.phase(p).work_cost(work.get(f"{p}_units", 0.0), work.get(f"{p}_sq", 0.0))
        return float(total)

    def to_dict(self) -> dict:
        """The model as its JSON file holds it (`from_file` reads it back)."""
        terms = {p: self.phase(p) for p in PHASES}
        phases = {p: {"linear": c.linear, "quadratic": c.quadratic} for p, c in terms.items()}
        return {"unit": self.unit, "overhead": self.overhead, "phases": phases}

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        """A calibrated model (`--calibrate`'s output, or any `to_dict` JSON).

        Raises:
          CostFileError: naming the file and what is missing or wrong.
        """
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise CostFileError(f"cannot read cost file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CostFileError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        try:
            terms = {p: raw["phases"][p] for p in PHASES}
            phases = {
                p: PhaseCost(float(t["linear"]), float(t["quadratic"])) for p, t in terms.items()
            }
            model = cls(phases, unit=str(raw["unit"]), overhead=float(raw["overhead"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CostFileError(
                f"{path}: not a cost model ({type(e).__name__}: {e}); expected "
                '{"unit": ..., "overhead": ..., "phases": {"llm": {"linear": ..., '
                f'"quadratic": ...}}, one such per phase of {", ".join(PHASES)}}}'
            ) from None
        if model.unit not in ("flops", "seconds"):
            raise CostFileError(f"{path}: unit must be flops or seconds, got {model.unit!r}")
        return model

    @classmethod
    def from_model(cls, model: ModelConfig) -> CostModel:
        """Training FLOPs per item from the module sizes, what is frozen and the LoRA
        adapters (`jaxmllm.cost.training`: a tower under adapters costs its forward and its
        activations' gradients, 2x, plus its adapters' own, 3x)."""
        lm, how = model.llm, training.modules(model)
        head = lm.head_dim or lm.width // lm.heads
        q = head * lm.heads  # query (and output) width
        llm_lin = decoder_linear(lm) + 2 * lm.width * lm.vocab_size
        # causal: half of 4*d; full-attention layers only (a hybrid's linear ones: llm_lin)
        llm_quad = full_layer_count(lm) * 2.0 * q
        m_llm = how[LLM].multiplier
        adapters = 3 * decoder_adapters(lm, how[LLM])
        terms = {LLM: PhaseCost(m_llm * llm_lin + adapters, m_llm * llm_quad)}
        encoders = any(how[p.name].trains for p in ENCODERS if p.name in how)
        for p in ENCODERS:
            enc = p.encoder(model)
            lin, quad, proj = ENCODER_FLOPS[p.name](enc, lm.width)
            if p.name not in how:  # (disabled: it has no items; priced as it would train)
                m_enc = multiplier(enc.freeze, False)
                m_proj = multiplier(model.projector_freeze, encoders)
                terms[p.name] = PhaseCost(m_enc * lin + m_proj * proj, m_enc * quad)
                continue
            m_enc, m_proj = how[p.name].multiplier, how[f"{p.name}_projector"].multiplier
            adapters = 3 * ENCODER_ADAPTERS[p.name](enc, lm.width, how)
            terms[p.name] = PhaseCost(m_enc * lin + m_proj * proj + adapters, m_enc * quad)
        return cls(terms)


def calibrated_cost(cfg: Config) -> CostModel | None:
    """The model of `train.cost_file` (None when unset).

    Raises:
      ConfigError: naming the key and what is wrong with the file.
    """
    if not cfg.train.cost_file:
        return None
    try:
        return CostModel.from_file(cfg.train.cost_file)
    except CostFileError as e:
        raise ConfigError(f"train.cost_file: {e}") from None
