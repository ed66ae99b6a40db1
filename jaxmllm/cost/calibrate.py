"""Calibration of the cost model (`jaxmllm.cost.model`) on a run's measured step times.

Calibration (Entrain's macroscopic profiling): the trainer writes `<output_dir>/timings.jsonl`
(`train.record_timings`, see jaxmllm/loop/timings.py), one line per step with its measured time and
the work of its slowest device (per microbatch, the device the cost model finds slowest: the
microbatches' collectives make every device wait for it), per phase: real units, the sum of
squared segment lengths, attention tiles (and with a decoder's sliding-window layers the LLM's
summed `window_sq`, `llm_wsq`, and with block-sparse attention the tiles of their own list,
`llm_window_tiles`). `python -m jaxmllm.cost.calibrate RUN_DIR` fits

    step_time = overhead + sum over phases of (a_p * units_p + b_p * sq_p + c_p * wsq_p)

by non-negative least squares on the steps without compilation or a checkpoint save, and
writes the coefficients (seconds per unit) that `CostModel.from_file` reads (`batch.cost_file`
for the trainer's metrics, `--cost-file` for the balance bench). A phase's units and squared
lengths move together from step to step (and the phases with each other when samples carry
several), so a free fit of 2 coefficients per phase (3 with windows) is ill-posed on a few
dozen steps. The default fit (`scaled`) keeps each phase's quadratic / linear and windowed /
linear ratios from the FLOP model and fits one scale per phase plus the overhead: 1 + phases
unknowns, each well determined whenever the phases' totals vary at all. `free` fits every
coefficient, with a ridge pull toward the scaled fit (so it only departs from it where the
data insist); `flops` is the FLOP model as assumed, one rate for all phases. The free fit
gives the windowed term a coefficient of its own where the FLOP model has a window (no column
elsewhere: a model without windows fits as it did before): a windowed layer's measured cost
need not follow its pairs at the FLOP model's ratio, since under context groups it scores
every tile of the row's causal list and masks by the window inside a tile (its time follows
`sq`), elsewhere the band of tiles its window reaches; a term folded into `sq` at the FLOP
model's ratio could not show which. The tiles are recorded but not fitted: with block-sparse
attention they follow the squared lengths (about sq / (2 * block**2) per causal document), and
keeping the fitted model in the FLOP model's form lets every reader of `PhaseCost` use it
unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxmllm.config import ConfigError, ModelConfig, from_dict
from jaxmllm.config.phases import PHASES
from jaxmllm.cost.model import CostFileError, CostModel, PhaseCost

# real units, sum of squared segment lengths, attention tiles, sum of sliding-window layers'
# window_sq (`cost.model.window_sq`), the tiles of those layers' own list (recorded, not fitted)
FEATURES = ("units", "sq", "tiles", "wsq", "window_tiles")
FITS = ("scaled", "free", "flops", "constant")
RIDGE = 0.01  # pull of a fit toward the simpler one, per step, in units of the mean step time
IRLS_ROUNDS = 20  # reweighted least-squares rounds toward the least absolute relative error
IRLS_FLOOR = 1e-3  # relative residuals below this weigh as this (keeps the weights finite)


# ----------------------------------------------------------------------------- timings


def read_timings(path: str | Path) -> list[dict]:
    """The rows of a timings.jsonl, one per step (a step written twice: the later row).

    Raises:
      CostFileError: a missing file, or a line that is not a timing row, naming file and line.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise CostFileError(f"cannot read timings file {path}: {e.strerror}") from None
    rows: dict[int, dict] = {}
    for n, line in enumerate(lines, 1):
        if line.strip():
            row = _timing_row(line, f"{path}:{n}")
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def _timing_row(line: str, where: str) -> dict:
    """One line of timings.jsonl as a row, checked: a step number, its time in seconds and the
    slowest device's work (`slowest`); refuses anything else naming `where` (file:line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise CostFileError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise CostFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, ok, want in (
        ("step", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        ("time_s", lambda v: _number(v) and v > 0, "a number of seconds > 0"),
        ("slowest", lambda v: isinstance(v, dict), 'an object {"llm_units": ...}'),
    ):
        if key not in row or not ok(row[key]):
            raise CostFileError(f"{where}: '{key}' must be {want}, got {row.get(key)!r}")
    for key, value in row["slowest"].items():
        phase, _, feature = key.partition("_")
        if phase not in PHASES or feature not in FEATURES or not (_number(value) and value >= 0):
            raise CostFileError(
                f"{where}: slowest.{key}={value!r}: expected <phase>_<feature> (phases "
                f"{', '.join(PHASES)}; features {', '.join(FEATURES)}) with a number >= 0"
            )
    return row


def _number(v: Any) -> bool:
    """Whether `v` is a finite int or float (a JSON bool is neither)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _excluded(row: dict) -> bool:
    """A step whose time holds more than its work: compilation, a checkpoint save, or an
    evaluation after it."""
    return any(bool(row.get(k)) for k in ("compile", "checkpoint", "eval"))


# ----------------------------------------------------------------------------- fitting


def fits(rows: list[dict], flops: CostModel, ridge: float = RIDGE) -> dict[str, CostModel]:
    """Every variant in seconds, fitted to `rows` (time_s against their slowest device's
    work), each pulled by `ridge` toward the one before: constant, flops (the FLOP model at one
    rate), scaled (a rate per phase, pulled toward that one), free (pulled toward scaled)."""
    y = np.array([r["time_s"] for r in rows])
    per_phase = np.array(
        [[flops.phase(p).work_cost(*_work_of(r, p)) for p in PHASES] for r in rows]
    )
    out = {"constant": _seconds_model(float(_nnls(np.zeros((len(y), 0)), y)[0]), {})}
    c, rate = _nnls(per_phase.sum(1, keepdims=True), y)
    out["flops"] = _seconds_model(c, {p: _scaled(flops.phase(p), rate) for p in PHASES})
    c, *scales = _nnls(per_phase, y, np.full(len(PHASES), rate), ridge)
    scaled = {p: _scaled(flops.phase(p), s) for p, s in zip(PHASES, scales, strict=True)}
    out["scaled"] = _seconds_model(c, scaled)
    out["free"] = _free_fit(rows, y, scaled, ridge)
    return out


def _work_of(row: dict, phase: str) -> tuple[float, float, float]:
    """A row's slowest device's (units, summed squared item sizes, summed window_sq) of
    `phase`."""
    work = row["slowest"]
    return tuple(work.get(f"{phase}_{k}", 0.0) for k in ("units", "sq", "wsq"))


def _scaled(cost: PhaseCost, scale: float) -> PhaseCost:
    """The phase's coefficients times `scale` (FLOPs to seconds at one rate), its window
    kept."""
    s = scale
    return PhaseCost(cost.linear * s, cost.quadratic * s, cost.windowed * s, cost.window)


def _seconds_model(overhead: float, phases: dict[str, PhaseCost]) -> CostModel:
    """A cost model in seconds: `overhead` a step and each phase's coefficients (0 where not
    fitted)."""
    zero = PhaseCost(0.0, 0.0)
    terms = {p: phases.get(p, zero) for p in PHASES}
    return CostModel(terms, unit="seconds", overhead=overhead)


def _nnls(x: np.ndarray, y: np.ndarray, prior: np.ndarray | None = None, ridge: float = 0.0):
    """(intercept, coefficients...) >= 0 of y ~ c + x @ w, minimising the summed absolute
    relative error (each step's residual over its time: what the errors report; absolute, by
    reweighted least squares, so that one stalled step does not drag the fit), on columns
    scaled to unit RMS (a column of zeros gets 0), with `ridge` per step pulling each scaled
    coefficient toward `prior`'s, in units of the mean step time."""
    from scipy.optimize import nnls

    rms = np.sqrt((x**2).mean(0))
    live = rms > 0
    a = np.hstack([np.ones((len(y), 1)), x[:, live] / rms[live]]) / y[:, None]
    b = np.ones(len(y))
    k = int(live.sum())
    pen = np.sqrt(ridge * len(y)) / y.mean() * np.hstack([np.zeros((k, 1)), np.eye(k)])
    pen_b = pen[:, 1:] @ (prior[live] * rms[live]) if ridge > 0 else np.zeros(k)
    weight = np.ones(len(y))
    for _ in range(IRLS_ROUNDS):
        z, _ = nnls(np.vstack([a * weight[:, None], pen]), np.concatenate([b * weight, pen_b]))
        weight = 1 / np.sqrt(np.maximum(np.abs(a @ z - b), IRLS_FLOOR))
    w = np.zeros(x.shape[1])
    w[live] = z[1:] / rms[live]
    return np.concatenate([z[:1], w])


def _free_fit(rows, y, scaled: dict[str, PhaseCost], ridge: float) -> CostModel:
    """Every phase's linear, quadratic and (where it has one) windowed coefficient, pulled
    toward the scaled fit's."""
    n_terms = {p: 3 if scaled[p].window else 2 for p in PHASES}  # (a window: its term too)
    x = np.array([[v for p in PHASES for v in _work_of(r, p)[: n_terms[p]]] for r in rows])
    prior = np.array([v for p in PHASES for v in _coefficients(scaled[p])[: n_terms[p]]])
    c, *w = _nnls(x, y, prior, ridge)
    phases, at = {}, 0
    for p in PHASES:
        phases[p] = PhaseCost(*w[at : at + n_terms[p]], window=scaled[p].window)
        at += n_terms[p]
    return _seconds_model(c, phases)


def _coefficients(cost: PhaseCost) -> tuple[float, float, float]:
    """(linear, quadratic, windowed): the coefficients on `_work_of`'s work."""
    return cost.linear, cost.quadratic, cost.windowed


def relative_errors(model: CostModel, rows: list[dict]) -> dict[str, float]:
    """Mean and max of |predicted - measured| / measured step time over `rows`."""
    if not rows:
        return {"mean": float("nan"), "max": float("nan")}
    err = [abs(model.step_cost(r["slowest"]) - r["time_s"]) / r["time_s"] for r in rows]
    return {"mean": float(np.mean(err)), "max": float(np.max(err))}


# ----------------------------------------------------------------------------- --calibrate


def calibrate(run_dir: Path, out: Path, holdout: float, chosen: str, ridge: float) -> dict:
    """Fits every variant on the run's earlier steps, prints their errors and coefficients,
    writes `chosen` to `out` and returns what was written."""
    flops = CostModel.from_model(_model_config(run_dir / "config.json"))
    rows = read_timings(run_dir / "timings.jsonl")
    used = [r for r in rows if not _excluded(r)]
    n_hold = int(round(holdout * len(used)))
    train, held = used[: len(used) - n_hold], used[len(used) - n_hold :]
    if len(train) < len(PHASES) + 2:
        raise CostFileError(
            f"{run_dir / 'timings.jsonl'}: {len(train)} steps to fit on ({len(rows)} rows, "
            f"{len(rows) - len(used)} with compilation or a checkpoint save, {n_hold} held out); "
            f"at least {len(PHASES) + 2} are needed: train longer or lower --holdout"
        )
    models = fits(train, flops, ridge)
    errors = {
        name: {"train": relative_errors(m, train), "holdout": relative_errors(m, held)}
        for name, m in models.items()
    }
    print(_summary(rows, train, held))
    print(_error_table(errors, chosen))
    print(_coefficient_table(models))
    result = {
        **models[chosen].to_dict(),
        "fit": chosen,
        "errors": errors[chosen],
        "steps": {"train": [r["step"] for r in train], "holdout": [r["step"] for r in held]},
        "run_dir": str(run_dir),
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({chosen} fit)")
    return result


def _model_config(path: Path) -> ModelConfig:
    """The run's model section (what `from_model` reads), typed as the trainer had it:
    config.json is its whole resolved config; a key written since is its default, as it was
    when the run trained (`generate` reads the same file so)."""
    try:
        raw = json.loads(path.read_text())
        return from_dict(ModelConfig, raw["model"], source=str(path), prefix="model.")
    except OSError as e:
        raise CostFileError(f"cannot read the run's config {path}: {e.strerror}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CostFileError(f"{path}: not a run config with a model section ({e})") from None
    except ConfigError as e:
        raise CostFileError(
            f"{path}: its model section is not one this version reads ({e})"
        ) from None


def _summary(rows: list[dict], train: list[dict], held: list[dict]) -> str:
    """One line on what the fit used: the steps fitted on and held out, those left out (a
    compilation, a checkpoint save), the mean step time in ms."""
    span = lambda rs: f"{len(rs)} steps ({rs[0]['step']}..{rs[-1]['step']})" if rs else "none"
    left = len(rows) - len(train) - len(held)
    mean = np.mean([r["time_s"] for r in train + held])
    return (
        f"fitted on {span(train)}, held out {span(held)}; {left} with compilation or a "
        f"checkpoint save left out; mean step {mean * 1e3:.1f} ms"
    )


def _error_table(errors: dict, chosen: str) -> str:
    """Each fit's mean and worst relative error on the fitted and held-out steps, the chosen
    one starred."""
    lines = ["fit        train mean  train max   held-out mean  held-out max"]
    for name, e in errors.items():
        t, h = e["train"], e["holdout"]
        mark = "*" if name == chosen else " "
        cells = f"{t['mean']:8.1%}  {t['max']:8.1%}   {h['mean']:12.1%}  {h['max']:11.1%}"
        lines.append(f"{name:<9}{mark}  {cells}")
    return "\n".join(lines)


def _coefficient_table(models: dict[str, CostModel]) -> str:
    """Each fit's seconds per step and per unit (and unit squared) of each phase, side by side."""
    names = [n for n in FITS if n != "constant"]
    lines = ["seconds per    " + "".join(f"{n:>12}" for n in names)]
    lines.append("step overhead  " + "".join(f"{models[n].overhead:12.3e}" for n in names))
    for p in PHASES:
        terms = ("linear", "unit"), ("quadratic", "unit^2"), ("windowed", "wsq")
        for term, unit in terms[: 3 if models["flops"].phase(p).window else 2]:
            values = "".join(f"{getattr(models[n].phase(p), term):12.3e}" for n in names)
            lines.append(f"{p + ' ' + unit:<15}{values}")
    lines.append("(flops: the FLOP model's coefficients at its one fitted rate)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.cost.calibrate RUN_DIR`: fits the cost model on the run's step times
    and writes the chosen fit (`calibrate`); 0 on success, 2 with the reason on a bad holdout
    or a file it cannot use."""
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.cost.calibrate",
        description="Calibrate the cost model on a run's measured step times (timings.jsonl).",
    )
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a train.output_dir")
    ap.add_argument("--out", help="calibrated model JSON (default RUN_DIR/cost_calibrated.json)")
    ap.add_argument("--holdout", type=float, default=0.2, help="share of later steps held out")
    ap.add_argument("--fit", choices=FITS, default="scaled", help="the variant written")
    ap.add_argument("--ridge", type=float, default=RIDGE, help="free fit: pull toward scaled")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "cost_calibrated.json"
    if not 0 <= args.holdout < 1:
        print(f"error: --holdout {args.holdout}: must be in [0, 1)", file=sys.stderr)
        return 2
    try:
        calibrate(run_dir, out, args.holdout, args.fit, args.ridge)
    except (CostFileError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
