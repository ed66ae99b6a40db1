"""Per-phase cost model: what one item (sample text, image, audio clip) costs to train on.

Per transformer layer and item of n tokens (hidden d, key/value width d_kv, gated-MLP width f):

    fwd(n) = 2*n*(2*d*d + 2*d*d_kv + 3*d*f) + 4*n*n*d      (x 1/2 on the n*n term when causal)

so an item costs `linear * n + quadratic * n * n`. Training multiplies the forward by 3 for a
trainable module, by 2 for a frozen module that still passes gradients to something trainable
below it (closer to the input), by 1 for a frozen module with nothing trainable below. Encoders
have nothing below them; the LLM has the projectors and encoders below it.

Units are the lengths index's: LLM tokens, vision patches, audio log-mel frames (the audio
transformer runs on frames / subsample rows, folded into the coefficients).

Calibration refits the coefficients from measured step times (Entrain's macroscopic profiling):

    python -m jaxmllm.data.cost --calibrate TIMINGS.jsonl [--config CFG.yaml] [--out COST.json]

TIMINGS.jsonl holds one measured step a line: the step time in seconds and, per phase, the sum
of item sizes `n` and of squared item sizes `n2` on the busiest device (units as above), e.g.
`{"time_s": 0.731, "llm": {"n": 16384, "n2": 6.1e7}, "vision": {"n": 8192, "n2": 3.3e7}}`.
A missing phase counts as zero. The fit is a non-negative least-squares of
`time = overhead + sum_p (a_p * linear_p * n_p + b_p * quadratic_p * n2_p)`; with fewer lines than
unknowns only one common scale and the overhead are fitted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxmllm.config import ModelConfig

PHASES = ("llm", "vision", "audio")


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
    """Coefficients per phase (FLOPs from the model config, or seconds once calibrated)."""

    llm: PhaseCost
    vision: PhaseCost
    audio: PhaseCost
    overhead: float = 0.0  # fixed cost per step (seconds once calibrated)

    def phase(self, name: str) -> PhaseCost:
        return getattr(self, name)

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

    def step_time(self, features: dict) -> float:
        """Predicted time of a step from one timings line (see the module docstring)."""
        return self.overhead + float(_design_row(self, features)[1:].sum())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(**{p: PhaseCost(**d[p]) for p in PHASES}, overhead=float(d.get("overhead", 0)))


def _multiplier(frozen: bool, trainable_below: bool) -> int:
    if not frozen:
        return 3
    return 2 if trainable_below else 1


def _layer_linear(d: int, d_kv: int, f: int) -> float:
    return 2.0 * (2 * d * d + 2 * d * d_kv + 3 * d * f)


# ----------------------------------------------------------------------------- calibration


def _design_row(model: CostModel, features: dict) -> np.ndarray:
    row = [1.0]
    for p in PHASES:
        f = features.get(p) or {}
        c = model.phase(p)
        row += [c.linear * float(f.get("n", 0)), c.quadratic * float(f.get("n2", 0))]
    return np.array(row)


def calibrate(model: CostModel, timings: Iterable[dict]) -> CostModel:
    """Refits the coefficients to measured step times; returns a model in seconds.

    Args:
      model: the prior (usually `CostModel.from_model`): fixes the ratios that the data cannot.
      timings: dicts as in the module docstring ("time_s" and per-phase "n", "n2").
    """
    timings = list(timings)
    if not timings:
        raise ValueError("calibration needs at least one timed step")
    x = np.stack([_design_row(model, t) for t in timings])
    y = np.array([float(t["time_s"]) for t in timings])
    # First one common scale for all terms plus an overhead: always determined by >= 2 lines.
    common = np.stack([x[:, 0], x[:, 1:].sum(1)], 1)
    w0 = _nnls(common, y) if len(y) >= 2 else np.array([0.0, y[0] / max(common[0, 1], 1e-30)])
    w = np.concatenate([[w0[0]], np.full(x.shape[1] - 1, w0[1])])
    used = np.flatnonzero(np.ptp(x[:, 1:], axis=0) > 0) + 1
    if len(y) >= len(used) + 2:  # enough lines: a scale per term that varies in the data
        cols = np.concatenate([[0], used])
        rest = x[:, 1:].sum(1) * w0[1] - (x[:, used] * w0[1]).sum(1)
        fit = _nnls(x[:, cols], y - rest)
        w[cols] = fit
    out = {"overhead": float(w[0])}
    for i, p in enumerate(PHASES):
        c = model.phase(p)
        out[p] = {"linear": c.linear * w[1 + 2 * i], "quadratic": c.quadratic * w[2 + 2 * i]}
    return CostModel.from_dict(out)


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 50) -> np.ndarray:
    """Non-negative least squares by active set (small problems: a handful of columns)."""
    free = np.ones(a.shape[1], bool)
    w = np.zeros(a.shape[1])
    for _ in range(iters):
        w[:] = 0
        if not free.any():
            break
        w[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        neg = free & (w < 0)
        if not neg.any():
            break
        free[np.argmin(np.where(free, w, np.inf))] = False
    return np.maximum(w, 0.0)


def read_timings(path: str | Path) -> list[dict]:
    """Reads a timings JSONL file, naming the line of any malformed entry."""
    out = []
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            float(rec["time_s"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f'{path}:{k}: expected {{"time_s": ..., "llm": {{"n": ..., "n2": ...}}, ...}}: {e}'
            ) from None
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    from jaxmllm.config import load_config

    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.data.cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--calibrate", metavar="TIMINGS.jsonl", help="refit from measured steps")
    ap.add_argument("--config", help="experiment YAML (default: built-in defaults)")
    ap.add_argument("--out", help="write the fitted coefficients as JSON here")
    args = ap.parse_args(argv)
    model = CostModel.from_model(load_config(args.config).model)
    if args.calibrate:
        timings = read_timings(args.calibrate)
        fitted = calibrate(model, timings)
        for t in timings:
            print(f"measured {float(t['time_s']):.4f}s  predicted {fitted.step_time(t):.4f}s")
        model = fitted
    text = json.dumps(model.to_dict(), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
