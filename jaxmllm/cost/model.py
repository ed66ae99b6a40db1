"""Per-phase cost model: what one item (sample text, image, audio clip) costs to train on, from
the model config (FLOPs) or calibrated on a run's measured step times (seconds).

Per transformer layer and item of n tokens (hidden d, key/value width d_kv, gated-MLP width f):

    fwd(n) = 2*n*(2*d*d + 2*d*d_kv + 3*d*f) + 4*n*n*d      (x 1/2 on the n*n term when causal)

so an item costs `linear * n + quadratic * n * n`; a decoder's sliding-window layers (window
w) see at most w keys a query, and add `windowed * window_sq(n, w)` instead (n * n up to the
window, 2 n w - w * w beyond it: linear in n). Training multiplies the forward by 3 for a
trainable module, by 2 for a frozen module that still passes gradients to something trainable
below it (closer to the input), by 1 for a frozen module with nothing trainable below. Encoders
have nothing below them; the LLM has the projectors and encoders below it.

Units are the lengths index's: LLM tokens, vision patches, audio log-mel frames (the audio
transformer runs on frames / subsample rows, folded into the coefficients). An LLM item is a
document, what attention sees: a preference pair is two (its chosen and rejected documents,
n1 + n2 tokens of linear work, n1**2 + n2**2 of quadratic, its windowed term per document
too), as a step's FLOPs count them from its segments (`jaxmllm.batch.counts`) and the planner
from the index's `split`.

Calibrated on a run's measured step times: `jaxmllm.cost.calibrate` (`CostModel.from_file` reads
what it writes).

The planners do not read it yet: they equalise each phase's attention cost across devices,
squared item sizes or, with block-sparse attention, the tiles every attention layer computes
(`jaxmllm.plan.bins`), blind to windows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

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
    query_width,
    sliding_layer_count,
    sliding_window,
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
    """Cost of one item of n units: linear * n + quadratic * n**2 + windowed * window_sq(n,
    window) (the last the LLM's sliding-window layers'; 0 elsewhere)."""

    linear: float
    quadratic: float
    windowed: float = 0.0  # the coefficient on window_sq(n, window)
    window: int = 0  # tokens a sliding-window layer's query sees (0: no such layers)

    def attention_cost(self, n: np.ndarray) -> np.ndarray:
        """The quadratic and windowed part of items of `n` units each (float64)."""
        n = np.asarray(n, np.float64)
        return self.quadratic * n * n + self.windowed * window_sq(n, self.window)

    def item_cost(self, n: np.ndarray) -> np.ndarray:
        """Cost of items of `n` units each, elementwise (float64)."""
        return self.linear * np.asarray(n, np.float64) + self.attention_cost(n)

    def work_cost(self, units, sq, wsq=0.0):
        """Cost of items with `units` in all, `sq` their summed squared sizes and `wsq` their
        summed `window_sq(size, window)`."""
        return self.linear * units + self.quadratic * sq + self.windowed * wsq


class TileWeights(NamedTuple):
    """What a phase's bucket capacity costs (`CostModel.tile_weights`): per unit, per tile of
    its tile list and, for a decoder whose sliding-window layers compute a list of their own,
    per tile of that list (`window`: their window in tokens; 0 and 0 without). A bucket of
    `units` units, `tiles` tiles and `window_tiles` windowed tiles costs `cost(...)`."""

    unit: float
    tile: float
    window_tile: float = 0.0
    window: int = 0

    def cost(self, units, tiles, window_tiles=0.0):
        """What `units` units, `tiles` tiles of the phase's list and `window_tiles` of the
        windowed layers' own cost (floats, or arrays elementwise)."""
        return self.unit * units + self.tile * tiles + self.window_tile * window_tiles


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
        self, block: int, per_row: Mapping[str, int], context: int = 1
    ) -> dict[str, TileWeights]:
        """Per phase, what a bucket's capacity costs whether it holds real work or padding, per
        unit and per computed attention tile of `block` rows (`TileWeights`). A tile is
        computed whole, so a causal phase's (the LLM's, whose quadratic term counts half the
        pairs) costs twice its coefficient per pair; an encoder row is `per_row[phase]` units
        (1 where missing).

        A decoder's full-attention layers compute the row's causal list (`tile`); its
        sliding-window layers their own, the tiles their window reaches (`window_tile`, per
        tile of `llm_window_tiles`, whose capacity is `batch.bucketize.window_tile_cap`),
        except under context groups (`context` > 1), where those lists go with the blocks the
        group deals by their causal tiles (`batch.context.Split.deal`): a rank's windowed
        tiles follow its causal ones, so the sizing prices them as those (an upper bound).
        There, and where the model has no window, the windowed coefficient is in `tile`."""
        out = {}
        for p in PHASES:
            c = self.phase(p)
            side = block * (1 if p == LLM else per_row.get(p, 1))
            pair = (2.0 if p == LLM else 1.0) * side**2  # (the pairs a tile computes)
            if c.window and context == 1:
                out[p] = TileWeights(c.linear, pair * c.quadratic, pair * c.windowed, c.window)
            else:
                out[p] = TileWeights(c.linear, pair * (c.quadratic + c.windowed))
        return out

    def phases_cost(self, work: Mapping) -> np.ndarray | float:
        """Each phase's cost of `work` summed, no overhead (`{phase}_units`, `{phase}_sq` and
        `{phase}_wsq` keys, 0 where missing; floats, or arrays over buckets elementwise)."""
        return sum(self._each_phase(work))

    def step_cost(self, work: Mapping) -> float:
        """Overhead plus each phase's cost of a step's `work` (`phases_cost`)."""
        return float(sum(self._each_phase(work), self.overhead))

    def _each_phase(self, work: Mapping):
        """Each phase's cost of `work`, in the table's order."""
        for p in PHASES:
            units, sq, wsq = (work.get(f"{p}_{k}", 0.0) for k in ("units", "sq", "wsq"))
            yield self.phase(p).work_cost(units, sq, wsq)

    def to_dict(self) -> dict:
        """The model as its JSON file holds it (`from_file` reads it back)."""
        phases = {p: dataclasses.asdict(self.phase(p)) for p in PHASES}
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
            phases = {p: _phase_cost(raw["phases"][p]) for p in PHASES}
            model = cls(phases, unit=str(raw["unit"]), overhead=float(raw["overhead"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CostFileError(
                f"{path}: not a cost model ({type(e).__name__}: {e}); expected "
                '{"unit": ..., "overhead": ..., "phases": {"llm": {"linear": ..., '
                '"quadratic": ..., "windowed": ..., "window": ...}}, one such per phase of '
                f"{', '.join(PHASES)}}} (windowed and window optional, 0 without)"
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
        llm_lin = decoder_linear(lm) + 2 * lm.width * lm.vocab_size
        # causal: half of 4*d_q a layer; full-attention layers on n**2 (at their own head
        # width beside windowed ones: Gemma 4's), sliding-window ones on window_sq (a hybrid's
        # linear ones: all in llm_lin)
        full_quad, sliding_quad = 2.0 * query_width(lm, True), 2.0 * query_width(lm, False)
        m_llm = how[LLM].multiplier
        adapters = 3 * decoder_adapters(lm, how[LLM])
        terms = {
            LLM: PhaseCost(
                m_llm * llm_lin + adapters,
                m_llm * full_layer_count(lm) * full_quad,
                m_llm * sliding_layer_count(lm) * sliding_quad,
                sliding_window(lm),
            )
        }
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


def _phase_cost(raw: Mapping) -> PhaseCost:
    """A phase's coefficients as a cost file holds them (a file written before windows, with
    no windowed term: 0 and 0).

    Raises:
      ValueError: a window that is not a whole number of tokens >= 0.
    """
    window = raw.get("window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a whole number of tokens >= 0, got {window!r}")
    windowed = float(raw.get("windowed", 0.0))
    return PhaseCost(float(raw["linear"]), float(raw["quadratic"]), windowed, window)


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
