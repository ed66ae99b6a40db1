"""The pipelined loss on the devices: one `shard_map` over the `stage` axis (the data, fsdp and
tensor axes stay automatic inside it, sharded as without a pipeline).

    passes before:  each stage rank encodes its share of the microbatches for the encoders that
                    run data-parallel (ranks s, s + S, ...), then every rank gathers them all
    tick loop:      stage s runs microbatch t - s of its segment: an encoder's layers (its first
                    stage embeds, its last projects), or the LLM's (its first stage embeds the
                    tokens and fills the placeholder slots, routed by the exchange as without a
                    pipeline); activations move one stage on with `ppermute`, an encoder's rows
                    ride along to the first LLM stage
    passes after:   the last stage's final hidden states go to every rank, each runs the final
                    norm, head and loss of its share of the microbatches

Every stage runs one program: `lax.switch` on its segment (an encoder's or the LLM's), with its
layer count and ends read from small per-stage tables, so a stage of padding slots skips them
(`Transformer.layers(count=...)`) and a stage computes no other segment's work. Differentiating
this forward (GPipe) gives the backward: the tick loop runs in reverse, each `ppermute`
transposed into the reverse move, frozen stages with nothing trainable below them skipped.

Values that are the same on every stage (replicated parameters, the batch) are made
stage-varying once, before the loop: their gradient's sum over stages then happens once, after
the backward, and never inside a branch that only some stages take (it would wait forever).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxmllm.models import lora
from jaxmllm.models.llm import chunked_token_losses
from jaxmllm.models.mllm import encoder_args
from jaxmllm.step.stages.layout import Layout
from sharding import STAGE_AXIS, varying_axes
from sharding.rules import key_parts

IDLE = 0  # the switch branch of a stage with no microbatch this tick


def pipeline_loss(parts: Any, layout: Layout) -> Callable:
    """(params, frozen, batch [M, D, ...]) -> loss, both trees in the pipelined layout.

    The loss is the sum of token losses over the step / the step's loss tokens, as without a
    pipeline; `jax.grad` of it is the GPipe backward.
    """

    def loss_fn(params, frozen, batch):
        """The pipelined loss: `_body` in a shard_map manual over the stage axis only (each stage
        its slab of the stacks, the rest auto-sharded), the adapters' dropout key passed in."""
        key = lora.current_key()  # (the adapters' dropout: passed in, not closed over)
        specs = (layout.in_spec(params), layout.in_spec(frozen), PartitionSpec())

        def body(p, f, b, *key):
            with lora.dropout_key(key[0] if key else None):
                return _body(parts, layout, p, f, b)

        return jax.shard_map(
            body,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(*specs, *([PartitionSpec()] if key is not None else [])),
            out_specs=PartitionSpec(),
            axis_names={STAGE_AXIS},
        )(params, frozen, batch, *([] if key is None else [key]))

    return loss_fn


def vary(tree: Any) -> Any:
    """Marks stage-invariant values as varying over the stage axis (see the module docstring)."""

    def one(x):
        if STAGE_AXIS in varying_axes(x):
            return x
        return jax.lax.pcast(x, (STAGE_AXIS,), to="varying")

    return jax.tree.map(one, tree)


def _body(parts, layout: Layout, params, frozen, batch):
    stages = layout.stages
    m = batch["llm_tokens"].shape[0]
    s = jax.lax.axis_index(STAGE_AXIS)
    denom = jnp.maximum(batch["llm_loss_mask"].sum(), 1.0)
    params, frozen, batch = vary((params, frozen, batch))
    own = lambda tree: jax.tree_util.tree_map_with_path(
        lambda kp, x: x[0] if layout.segment_of(key_parts(kp)) else x, tree
    )
    model = parts.merge(own(params), own(frozen))  # the pipelined stacks: this stage's slab
    phases = [p for p in model.phases if f"{p}_segment_ids" in batch]  # (a variant may skip one)
    piped = [p for p in phases if p in layout.spans]
    dp_rows = _encode_shares(model, batch, [p for p in phases if p not in layout.spans], s, stages)
    ticks = _Ticks(model, layout, batch, piped, dp_rows, s)
    carry = ticks.initial()
    _, hidden = jax.lax.scan(ticks, carry, jnp.arange(m + stages - 1))
    # Microbatch i left the last stage at tick i + S - 1; every rank takes a share of the head.
    final = jnp.where(s == stages - 1, hidden[stages - 1 :], jnp.zeros((), hidden.dtype))
    final = _to_every_stage(final)
    losses = _shares(s, stages, m, lambda mb, i: _head_loss(model, mb, final[i]), batch)
    return jax.lax.psum(losses.sum(), STAGE_AXIS) / denom


def _to_every_stage(x: jax.Array) -> jax.Array:
    """The sum over the stages (one sends, the others send zeros), varying again."""
    return _wide(lambda x: vary(jax.lax.psum(x, STAGE_AXIS)), x)


def _wide(collective: Callable, x: jax.Array) -> jax.Array:
    """`collective(x)`, a bfloat16 x carried in float32 on CPU: XLA's CPU compiler aborts
    promoting the bfloat16 all-reduce and reduce-scatter these collectives' backward passes
    become ("Invalid binary instruction opcode copy"). Exact: the values gathered or summed
    with zeros are bfloat16 values. As it is on GPU and TPU."""
    if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return collective(x.astype(jnp.float32)).astype(x.dtype)
    return collective(x)


def _head_loss(model, mb, x_bsw):
    """The summed token losses of a microbatch's last-stage hidden states, the logits projected
    `model.llm.logits_chunk` tokens at a time as without a pipeline."""
    d = mb["llm_tokens"].shape[0]
    h = model.llm.transformer.final_norm(x_bsw)
    return chunked_token_losses(
        model.llm,
        h.reshape(d, -1, h.shape[-1]),
        mb["llm_targets"].reshape(d, -1),
        mb["llm_loss_mask"].reshape(d, -1),
    )[0]


def _shares(s, stages: int, m: int, fn: Callable, batch) -> jax.Array:
    """fn(microbatch, i) over this rank's share of the microbatches (i = s, s + S, ...),
    stacked [ceil(M / S), ...]; a share past M is skipped (zeros)."""
    shape = jax.eval_shape(fn, _take(batch, 0), 0)
    zero = vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shape))

    def one(j):
        i = s + stages * j
        ic = jnp.minimum(i, m - 1)
        return jax.lax.cond(i < m, lambda: fn(_take(batch, ic), ic), lambda: zero)

    return jax.lax.map(one, jnp.arange(math.ceil(m / stages)))


def _encode_shares(model, batch, phases: list[str], s, stages: int) -> dict[str, jax.Array]:
    """The data-parallel encoders' projector rows of every microbatch [M, D, N, W], each rank
    encoding its share and gathering the others'."""
    if not phases:
        return {}
    m = batch["llm_tokens"].shape[0]
    rows = _shares(s, stages, m, lambda mb, _: {p: model.encode(mb, p) for p in phases}, batch)
    out = {}
    for p, r in rows.items():
        # [S, J, ...]: microbatch s + S * j
        gathered = _wide(lambda r: jax.lax.all_gather(r, STAGE_AXIS), r)
        flat = gathered.swapaxes(0, 1).reshape((-1,) + gathered.shape[2:])
        out[p] = flat[:m]
    return vary(out)


def _take(batch: dict, i) -> dict:
    """Microbatch `i` of a batch whose arrays lead with the microbatch axis."""
    return {k: v[i] for k, v in batch.items()}


class _Ticks:
    """The body of the tick loop: per stage, its segment's work on microbatch t - s."""

    def __init__(self, model, layout: Layout, batch, piped, dp_rows, s):
        self.model, self.layout, self.batch, self.s = model, layout, batch, s
        self.piped, self.dp_rows = piped, dp_rows
        self.m = batch["llm_tokens"].shape[0]
        self.phases = [*piped, *dp_rows]
        table = lambda a: jnp.asarray(a)[s]
        segs = ["llm", *piped]
        self.count = {g: table(layout.counts(g)) for g in segs}
        ranges = {g: [i for i, n in enumerate(layout.counts(g)) if n] for g in segs}
        self.first = {g: table(np.arange(layout.stages) == r[0]) for g, r in ranges.items()}
        self.last = {g: table(np.arange(layout.stages) == r[-1]) for g, r in ranges.items()}
        self.single = {g: len(r) == 1 for g, r in ranges.items()}
        branch = np.zeros(layout.stages, np.int32)  # IDLE on the stages of a skipped encoder
        for k, g in enumerate(segs, start=1):
            branch[ranges[g]] = k
        self.branch = table(branch)
        self.branches = [self._idle, self._llm, *(self._encoder(p) for p in piped)]
        self.perms = self._perms(ranges)

    def _perms(self, ranges) -> dict[str, list[tuple[int, int]]]:
        """Per carried value, the stage pairs it moves between (none: not carried)."""
        llm0 = ranges["llm"][0]
        perms = {"llm_x": [(i, i + 1) for i in ranges["llm"][:-1]]}
        for p in self.piped:
            perms[f"{p}_x"] = [(i, i + 1) for i in ranges[p][:-1]]
            perms[f"{p}_rows"] = [(i, i + 1) for i in range(ranges[p][-1], llm0)]
        return {k: v for k, v in perms.items() if v}

    def initial(self) -> dict[str, jax.Array]:
        """Zeros of each carried value's shape (what a stage receives before the pipeline is
        full, and what a stage outside a value's path receives)."""
        mb = _take(self.batch, 0)
        shapes = jax.eval_shape(lambda: self._produce(mb))
        self.zeros = vary({k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()})
        self.zero_hidden = self.zeros["llm_x"]
        return {k: self.zeros[k] for k in self.perms}

    def _produce(self, mb) -> dict[str, jax.Array]:
        """Every value a tick can carry, computed from scratch (for their shapes only)."""
        out = {}
        for p in self.piped:
            x = getattr(self.model, p).prepare(*encoder_args(mb, p))[0]
            out[f"{p}_x"], out[f"{p}_rows"] = x, self._project(p, x)
        rows = {p: out[f"{p}_rows"] if p in self.piped else self.dp_rows[p][0] for p in self.phases}
        out["llm_x"] = self.model.decoder_inputs(mb, rows)[0]
        return out

    def __call__(self, carry, t):
        i = t - self.s
        ic = jnp.clip(i, 0, self.m - 1)
        which = jnp.where((i >= 0) & (i < self.m), self.branch, IDLE)
        mb = _take(self.batch, ic)
        with lora.salted(self.s, t):  # (the adapters' dropout: a stage and tick's own masks)
            out, hidden = jax.lax.switch(which, self.branches, carry, mb, ic)
        moved = {k: jax.lax.ppermute(v, STAGE_AXIS, self.perms[k]) for k, v in out.items()}
        return moved, hidden

    def _idle(self, carry, mb, ic):
        """A stage with nothing this tick (the ramps, a skipped encoder): carry kept, no hidden
        states."""
        return carry, self.zero_hidden

    def _llm(self, carry, mb, ic):
        model = self.model
        segment_ids, positions = model.decoder_rows(mb)
        pack = model.llm.packing(
            segment_ids,
            mb.get("llm_tiles"),
            order_bt=model.decoder_order(mb),
            window_tiles_bk2=mb.get("llm_window_tiles"),
            spans_bt=model.decoder_spans(mb),
        )

        def enter(carry):
            rows = {
                p: carry[f"{p}_rows"] if p in self.piped else self.dp_rows[p][ic]
                for p in self.phases
            }
            return model.decoder_inputs(mb, rows)[0]

        x = self._entry("llm", enter, carry)
        x = model.llm.transformer.layers(x, pack, positions, count=self.count["llm"])
        return self._update(carry, {"llm_x": x}), x

    def _encoder(self, p: str) -> Callable:
        def branch(carry, mb, ic):
            encoder = getattr(self.model, p)
            args = encoder_args(mb, p)
            _, pack, positions = encoder.prepare(*args)  # (its embedding unused here: removed)
            x = self._entry(p, lambda _: encoder.prepare(*args)[0], carry)
            x = encoder.transformer.layers(x, pack, positions, count=self.count[p])
            if self.single[p]:
                rows = self._project(p, x)
            else:
                zero = self.zeros[f"{p}_rows"]
                rows = jax.lax.cond(self.last[p], lambda x: self._project(p, x), lambda x: zero, x)
            return self._update(carry, {f"{p}_x": x, f"{p}_rows": rows}), self.zero_hidden

        return branch

    def _entry(self, segment: str, embed: Callable, carry):
        """A segment's input: embedded on its first stage, received on the others."""
        if self.single[segment]:
            return embed(carry)
        key = f"{segment}_x"
        return jax.lax.cond(self.first[segment], embed, lambda c: c[key], carry)

    def _project(self, p: str, x):
        """An encoder's output rows: its final norm, then its projector to the LLM's width."""
        encoder = getattr(self.model, p)
        return getattr(self.model, f"{p}_projector")(encoder.transformer.final_norm(x))

    def _update(self, carry, new: dict) -> dict:
        """The carry with the entries of `new` replaced (the carry's keys and shapes are fixed
        across ticks)."""
        return {k: new.get(k, v) for k, v in carry.items()}
