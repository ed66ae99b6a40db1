"""What a step carries beside its arrays, from the feed's thread to the loop (`StepInfo`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxmllm.feed.times import HostTimes


@dataclass
class StepInfo:
    """One step's plan summary and counts, as the feed made them on this host.

    The loop reads it for the metrics window (`tokens`, `flops`, `predicted_s`, `fill`,
    `rejects`, `host`), the ledger (`parts`), the timings (`work`), the logged row (`samples`,
    `sources`) and the terminal's report of load-time rejects (`new_rejects`, `first_reject`).
    """

    step: int
    samples: np.ndarray  # the whole step's samples (every host plans all of them)
    # what this host read ("read"), trains ("text") and encodes (per encoder phase: [k, 2]
    # (sample, item) pairs): `jaxmllm.feed.iterator.local_parts`
    parts: dict[str, np.ndarray]
    deferred: int  # samples waiting for a later step after this one
    fill: dict[str, float]  # per phase: the real share of this host's buckets
    rejects: dict[str, float]  # cumulative bad-input counts, by reason (metrics keys)
    tokens: float  # this host's real LLM tokens
    flops: float  # their analytic model FLOPs
    llm_flops: float = 0.0  # ... of the LLM phase alone (the towers' left out)
    # the step's variant: the pipelined program's (pipeline.encoder_fractions), "+long<v>" for
    # a long step (block-sparse attention's long tile lists, `jaxmllm.plan.ladder`)
    variant: str = "whole"
    # ... its ladder variant (0: the base; v: the long variant v), whose model the step runs
    # (`Program.step_of`: with a context degree per step the long ones split rows over groups)
    long: int = 0
    # the slowest and the mean device's work per phase (`counts.step_work`: timings and the
    # calibrated cost model), when recorded; the calibrated model's predicted step time
    work: dict | None = None
    predicted_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # a mixture's samples per source
    # this step's load-time rejects on this host, by reason, and the first of them (the
    # terminal shows them per logging window)
    new_rejects: dict[str, int] = field(default_factory=dict)
    first_reject: dict | None = None
    # ... and their entries, each as the rejects file lists it (the trainer writes them when
    # it takes the step: a step loaded ahead and never trained is in no log)
    reject_entries: list[dict] = field(default_factory=list)
    host: HostTimes | None = None  # the feed's time per stage on this step (metrics host/*)
    extra: dict = field(default_factory=dict)  # anything a caller adds (benches)
