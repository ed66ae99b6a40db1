"""What a batch holds, counted on the host for the metrics: real tokens, analytic FLOPs, and each
bucket's work per phase (real units, squared segment lengths, attention tiles; with a decoder's
sliding-window layers, the LLM's documents' `window_sq` too, and the tiles of their own list).

The feed counts each step's batch on its own thread (`StepCounter`); the loop adds the counts
into its metrics window and its timings (`jaxmllm.loop.metrics`, `jaxmllm.loop.timings`). A
step's microbatches each end in collectives (the encoder-row all-to-all, fsdp's gathers), so
every device waits for the slowest one of each microbatch: a step's work is, per microbatch,
that of the device the cost model finds slowest, summed over microbatches (`step_work`).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config import Config
from jaxmllm.config.phases import LLM, PHASES
from jaxmllm.cost.flops import sliding_window
from jaxmllm.cost.model import CostModel, calibrated_cost, window_sq


def _segment_lengths(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(real units [M, D], segment lengths [M, D, K], 0 where no segment) per bucket of segment
    ids [M, D, ..., n].

    A segment is a run of one id > 0 within a row (the last axis); padding (0) is no segment.
    """
    lead = seg.shape[:2]
    rows = seg.reshape(lead[0] * lead[1], -1, seg.shape[-1]).astype(np.int64)
    ids = int(rows.max(initial=0)) + 1
    row_ids = np.arange(rows.shape[0] * rows.shape[1]).reshape(rows.shape[:2] + (1,))
    real = rows > 0
    counts = np.bincount((row_ids * ids + rows)[real], minlength=row_ids.size * ids)
    lengths = counts.astype(np.float64).reshape(lead + (-1,))
    return real.sum((1, 2)).reshape(lead).astype(np.float64), lengths


def segment_work(seg: np.ndarray, window: int = 0) -> dict[str, np.ndarray]:
    """`units` (real units), `sq` (sum of squared segment lengths) and, with a `window`, `wsq`
    (sum of their `window_sq`) per bucket of segment ids [M, D, ..., n] (`_segment_lengths`)."""
    units, lengths = _segment_lengths(seg)
    work = {"units": units, "sq": (lengths**2).sum(-1)}
    if window:
        work["wsq"] = window_sq(lengths, window).sum(-1)
    return work


def bucket_work(
    batch: dict[str, np.ndarray], context: int = 1, window: int = 0
) -> dict[str, np.ndarray]:
    """`{phase}_units`, `{phase}_sq`, with a `window` (the decoder's sliding-window layers',
    `cost.flops.sliding_window`) `llm_wsq`, and where the batch has tile lists `{phase}_tiles`
    (and the windowed layers' own, `llm_window_tiles`): each an [M, D] array over the batch's
    buckets (microbatch, device). Tiles count real ones, not the list's padding.

    The windowed layers' real tiles are counted as the full layers' are, for the timings: with
    block-sparse attention those layers' time follows the tiles their window reaches, not the
    causal list (`cost.model.CostModel.tile_weights`), so a step's record says what both kinds
    computed; the calibration reads them as it reads `tiles`, recorded, not fitted.

    With context groups (`context` > 1: consecutive devices split rows whose documents they
    share, segment ids counting over a group) a document's squared length (and window_sq) is
    its group's: each device of a group gets an equal share of the group's (its tiles are its
    own)."""
    work = {}
    for phase in PHASES:
        seg = batch.get(f"{phase}_segment_ids")
        if seg is None:
            continue
        own = segment_work(seg, window if phase == LLM else 0)
        if phase == LLM and context > 1:
            m_n, d_n = seg.shape[:2]
            group = segment_work(seg.reshape(m_n, d_n // context, 1, -1), window)
            for k in group.keys() - {"units"}:
                own[k] = np.repeat(group[k] / context, context, axis=1)
        work.update({f"{phase}_{k}": v for k, v in own.items()})
        for key in (f"{phase}_tiles", f"{phase}_window_tiles"):
            tiles = batch.get(key)
            if tiles is not None:  # (query block, key block) pairs, (-1, -1) for padding
                work[key] = (tiles[..., 0] >= 0).sum(-1).astype(np.float64)
    return work


def step_work(
    batch: dict[str, np.ndarray], cost: CostModel, work: dict[str, np.ndarray] | None = None
) -> dict:
    """A step's work on its slowest device and on the mean device (sums over microbatches).

    Per microbatch the slowest device is the one `cost` finds costliest; `devices` is how many
    this host's batch holds (on several processes, process 0 sees only its own). `work`: the
    batch's `bucket_work`, when the caller has it.
    """
    work = bucket_work(batch, window=cost.phase(LLM).window) if work is None else work
    per_bucket = cost.phases_cost(work)
    slowest = np.argmax(per_bucket, axis=1)  # [M]
    micro = np.arange(len(slowest))
    return {
        "devices": int(per_bucket.shape[1]),
        "microbatches": int(per_bucket.shape[0]),
        "slowest": {k: float(v[micro, slowest].sum()) for k, v in work.items()},
        "mean": {k: float(v.sum(0).mean()) for k, v in work.items()},
    }


def step_flops(cfg: Config, batch: dict[str, np.ndarray], cost: CostModel | None = None) -> float:
    """Model FLOPs of one step's real (non-padding) items, from the planner's cost model.

    Per phase: linear * (real units) + quadratic * (sum of squared segment lengths) + windowed
    * (sum of the LLM's documents' window_sq), with the training multipliers for trained and
    frozen modules (see jaxmllm/cost/model.py).
    """
    work = bucket_work(batch, cfg.mesh.context, sliding_window(cfg.model.llm))
    return _flops(work, cost or CostModel.from_model(cfg.model))


def _flops(work: dict[str, np.ndarray], cost: CostModel, phases=PHASES) -> float:
    """Model FLOPs of a batch's per-bucket work (`bucket_work`), all buckets, of `phases`."""
    totals = {k: v.sum() for k, v in work.items() if k.partition("_")[0] in phases}
    return float(cost.phases_cost(totals))


class StepCounter:
    """Counts what a host batch holds for the metrics: real LLM tokens, analytic FLOPs and, for
    the timings and the predicted step time, the work of its slowest and its mean device.

    The pipeline calls it on its own thread, per step, with the run's cost models (`cost`: the
    FLOP model; `calibrated`: train.cost_file's, None without; both default to the config's).
    The slowest device is the one the calibrated model finds slowest, else the FLOP model.
    """

    def __init__(
        self, cfg: Config, cost: CostModel | None = None, calibrated: CostModel | None = None
    ):
        self.cfg = cfg
        self.cost = CostModel.from_model(cfg.model) if cost is None else cost
        self.calibrated = calibrated_cost(cfg) if calibrated is None else calibrated
        self.work = cfg.train.record_timings or self.calibrated is not None
        self.window = sliding_window(cfg.model.llm)  # (the LLM's documents' window_sq: wsq)

    def __call__(self, batch: dict[str, np.ndarray], context: int | None = None) -> dict:
        """The counts of a host batch whose LLM rows split over groups of `context` devices
        (default mesh.context; a step planned without groups under a context degree per
        step: 1, `Capacities.at`)."""
        tokens = float((batch["llm_segment_ids"] > 0).sum())
        context = self.cfg.mesh.context if context is None else context
        # (once: the FLOPs and the timings' work both read it)
        work = bucket_work(batch, context, self.window)
        out = {"tokens": tokens, "flops": _flops(work, self.cost)}
        # (the LLM's own share: MFU counted without the towers, `bench.node`)
        out["llm_flops"] = _flops(work, self.cost, (LLM,))
        if self.work:
            out["work"] = step_work(batch, self.calibrated or self.cost, work)
        if self.calibrated is not None:
            out["predicted_s"] = self.calibrated.step_cost(out["work"]["slowest"])
        return out
