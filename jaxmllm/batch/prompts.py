"""Prompt batches: prompts laid out in the batch contract, so generation sees what training saw.

A prompt is a `Sample` (tokens with one placeholder id per encoder output row, the images'
patches, the clips' frames), made by the same preprocessing as training samples (a template,
`jaxmllm.data.text.template`, or a data set's own sample cut before its answer, `split_answer`).
`prompt_batch` lays B of them out as a microbatch of B device buckets with `bucketize` itself:
prompt b in bucket b's one LLM row from token 0 (right padding), its images packed into that
bucket's vision row and its clips into its audio row, their projector rows routed to the
placeholder slots locally. Under a mesh the prompts then spread over the data-parallel devices
like training buckets do. The shapes (`PromptShapes`) are fixed per generator, so its programs
compile once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxmllm.batch.bucketize import bucketize
from jaxmllm.config import Config, ConfigError
from jaxmllm.config.phases import ENCODERS
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import RESERVED, Specials
from jaxmllm.plan.contract import Capacities, ItemPlan, StepPlan

ROUND = 16  # lengths are rounded up to multiples of this, so nearby prompts share programs


@dataclasses.dataclass(frozen=True)
class PromptShapes:
    """The fixed shapes of a generator's programs."""

    rows: int  # B: prompts decoded together, one per bucket
    prompt_len: int  # P: tokens per prompt row (right-padded)
    total_len: int  # S: the KV cache's length, a row's prompt and generated tokens
    units: dict[str, int]  # per encoder phase, a bucket's row: the items of a prompt

    @classmethod
    def fit(
        cls, prompts: Sequence[Sample], cfg: Config, max_new_tokens: int, rows: int = 0
    ) -> PromptShapes:
        """The smallest shapes (rounded up) that hold `prompts` and `max_new_tokens` more
        tokens per row; `rows` (default: as many as prompts) may leave rows spare."""
        rows = rows or len(prompts)
        if not 0 < len(prompts) <= rows:
            raise ValueError(f"{len(prompts)} prompts for {rows} rows")
        longest = max(len(p.tokens) for p in prompts)
        units = {}
        for phase in ENCODERS:
            most = max(_units(p, phase.name) for p in prompts)
            units[phase.name] = _round(max(most, 1), ROUND * phase.per_token(cfg.model))
        prompt_len = _round(longest, prompt_round(cfg))
        return cls(
            rows=rows,
            prompt_len=prompt_len,
            total_len=_round(prompt_len + max_new_tokens, ROUND),
            units=units,
        )


def prompt_round(cfg: Config) -> int:
    """What a prompt length is a multiple of: ROUND, and where prefill may score the prompt
    with block-sparse attention (as training does; cuDNN's runs fall back to it where no
    Hopper GPU is) the blocks' tokens too."""
    if cfg.model.attention != "dense":
        return math.lcm(ROUND, cfg.batch.attention_block)
    return ROUND


def _round(n: int, step: int) -> int:
    return -(-n // step) * step


def _units(prompt: Sample, phase: str) -> int:
    return sum(len(m[0]) for m in prompt.media[phase])


def prompt_config(cfg: Config, shapes: PromptShapes) -> Config:
    """`cfg` for prompt batches: one microbatch of `shapes.rows` buckets of one row each,
    encoder rows read locally, dense attention (no tile lists: prompts are short, and the
    decoder's cache attention is dense anyway), rows whole on a device. The parameters are the
    same as `cfg`'s."""
    batch = dataclasses.replace(
        cfg.batch,
        microbatches=1,
        llm_rows=1,
        llm_row_len=shapes.prompt_len,
        **{p.capacity: shapes.units[p.name] for p in ENCODERS},
        capacity="fixed",
        route_pair_capacity=0,
        planner="first_fit",  # (orchestrated refuses local routing; no planner runs here)
        # (class-token rows: as many as a prompt's images can need, whatever the run's bound)
        **{p.documents: -1 for p in ENCODERS},
    )
    model = dataclasses.replace(cfg.model, attention="dense")
    # A prompt row is whole on its device and the model is whole in each program (evaluation
    # reads the parameters in their [depth, ...] form): no context groups, no stages.
    mesh = dataclasses.replace(cfg.mesh, context=1, context_steps="all", stage=1)
    return dataclasses.replace(cfg, batch=batch, model=model, mesh=mesh)


def prompt_batch(
    prompts: Sequence[Sample], shapes: PromptShapes, cfg: Config, specials: Specials = RESERVED
) -> dict:
    """The prompts as a microbatch [B, 1, P, ...] of the batch contract, one bucket each;
    buckets past the prompts hold one padding token (decoded and ignored). `specials`: the
    tokenizer's (its padding, and the placeholder ids whose slots encoder rows fill).

    Raises:
      ValueError: a prompt longer than the shapes' prompt length, or media over its buckets.
    """
    pcfg = prompt_config(cfg, shapes)
    filler = Sample(id=-1, tokens=np.array([specials.pad], np.int32), loss=np.zeros(1, bool))
    prompts = list(prompts) + [filler] * (shapes.rows - len(prompts))
    if len(prompts) > shapes.rows or max(len(p.tokens) for p in prompts) > shapes.prompt_len:
        raise ValueError(f"prompts do not fit {shapes}")
    for phase in ENCODERS:
        if max(_units(p, phase.name) for p in prompts) > shapes.units[phase.name]:
            raise ValueError(f"a prompt's {phase.items} do not fit {shapes}")
        if any(p.media[phase.name] for p in prompts) and not phase.enabled(cfg.model):
            raise ConfigError(
                f"a prompt has {phase.items} but the model has no encoder for them "
                f"(model.{phase.name}.enabled)"
            )
    n = len(prompts)
    zeros = np.zeros(n, np.int64)
    plan = StepPlan(
        step=0,
        samples=np.arange(n),
        micro=zeros,
        device=np.arange(n),
        row=zeros,
        offset=zeros,
        items={
            e.name: _packed([[len(m[0]) for m in p.media[e.name]] for p in prompts])
            for e in ENCODERS
        },
    )
    caps = Capacities.of(BatchSpec.of(pcfg, resolved=False), n)  # (class rows: -1, unbounded)
    batch = bucketize(plan, dict(enumerate(prompts)), pcfg, caps, specials=specials)
    return {k: v[0] for k, v in batch.items()}  # the one microbatch


def packed_row(
    samples: Sequence[Sample], cfg: Config, specials: Specials = RESERVED
) -> tuple[dict, np.ndarray]:
    """`samples` packed one after another into ONE row of one bucket, as training packs a row
    (`bucketize` itself: segment ids 1, 2, ... a sample, positions restarting at each, M-RoPE's
    per sample, each sample's images and clips packed into the bucket's encoder rows in order):
    (the microbatch [1, 1, L, ...], each sample's first token in the row). What `hf check`
    compares sample by sample with transformers run on each alone."""
    lengths = [len(s.tokens) for s in samples]
    shapes = PromptShapes.fit([_joined(samples)], cfg, 0)
    pcfg = prompt_config(cfg, shapes)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    n = len(samples)
    plan = StepPlan(
        step=0,
        samples=np.arange(n),
        micro=np.zeros(n, np.int64),
        device=np.zeros(n, np.int64),
        row=np.zeros(n, np.int64),
        offset=starts,
        items={
            e.name: _one_row([[len(m[0]) for m in s.media[e.name]] for s in samples])
            for e in ENCODERS
        },
    )
    caps = Capacities.of(BatchSpec.of(pcfg, resolved=False), 1)  # (as prompt_batch's)
    batch = bucketize(plan, dict(enumerate(samples)), pcfg, caps, specials=specials)
    return {k: v[0] for k, v in batch.items()}, starts


def _joined(samples: Sequence[Sample]) -> Sample:
    """One sample holding every sample's tokens and items (what one row must fit)."""
    media = {e.name: [m for s in samples for m in s.media[e.name]] for e in ENCODERS}
    tokens = np.concatenate([s.tokens for s in samples])
    return Sample(-1, tokens, np.zeros(len(tokens), bool), media)


def _one_row(sizes: list[list[int]]) -> ItemPlan:
    """Every sample's items, in order, one after another in the one bucket."""
    owner = [b for b, items in enumerate(sizes) for _ in items]
    item = [j for items in sizes for j in range(len(items))]
    flat = [u for items in sizes for u in items]
    offset = np.concatenate([[0], np.cumsum(flat)[:-1]]) if flat else []
    as_int = lambda x: np.asarray(x, np.int64)
    return ItemPlan(as_int(owner), as_int(item), as_int([0] * len(owner)), as_int(offset))


def _packed(sizes: list[list[int]]) -> ItemPlan:
    """Each prompt's items, in order, one after another in its own bucket."""
    owner, item, offset = [], [], []
    for b, items in enumerate(sizes):
        owner += [b] * len(items)
        item += list(range(len(items)))
        offset += np.concatenate([[0], np.cumsum(items)[:-1]]).tolist() if items else []
    as_int = lambda x: np.asarray(x, np.int64)
    return ItemPlan(as_int(owner), as_int(item), as_int(owner), as_int(offset))


def split_answer(sample: Sample, specials: Specials = RESERVED) -> tuple[Sample, np.ndarray] | None:
    """A data set's sample as (its prompt: the tokens before its first loss token, with all its
    media; the answer's ids), or None when it has no prompt (text learned from its first token
    on, a sample whose media come after its answer starts); a preference pair's: its chosen
    document's."""
    if sample.documents:
        n = sample.documents[0]
        sample = dataclasses.replace(
            sample, tokens=sample.tokens[:n], loss=sample.loss[:n], documents=()
        )
    learned = np.flatnonzero(sample.loss)
    if not len(learned) or learned[0] < 2:  # (BOS alone is no prompt)
        return None
    cut = int(learned[0])
    rows = np.isin(sample.tokens[cut:], list(specials.media.values()))
    if rows.any():
        return None
    prompt = dataclasses.replace(sample, tokens=sample.tokens[:cut], loss=sample.loss[:cut])
    return prompt, sample.tokens[cut:]
