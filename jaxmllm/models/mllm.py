"""The multimodal LM: encoders and projectors feeding placeholder slots of a decoder.

Encoder output rows reach the LLM through per-token source indices (`llm_*_src`): -1 keeps the
token's own embedding, i >= 0 replaces it with row i of the device's row buffer. In local mode the
buffer is the device's own projector output [N rows]. In routed mode it is [own N rows | B*C
received rows]: rows encoded on the text's device take the local path, the others arrive by one
all-to-all at a fixed capacity C per (device, LLM bucket) pair, so encoder load can be balanced
independently of where the text lands; B = the LLM buckets (the devices). With context groups
(`mesh.context` = G > 1) a bucket is a group of G devices (B = D / G): a row for another group
travels to the device at its encoder's place in that group (the all-to-all runs between the
devices of one place in every group, over the data axes but `context`), and each device's buffer
is gathered over its group (`models.context.gather_rows`): a slot indexes the group's buffers,
device after device, G (N + B C) rows = the group's own rows and all it received, each row once.
With one bucket (one device, or one group) nothing is received: the buffer is the own rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmllm.config import ModelConfig
from jaxmllm.config.lora import LINEAR_TARGETS
from jaxmllm.config.phases import ENCODERS, LLM, phase
from jaxmllm.config.spec import BatchSpec
from jaxmllm.models.context import gather_rows
from jaxmllm.models.encoders import ENCODER_MODULES
from jaxmllm.models.layers import Axes
from jaxmllm.models.llm import (
    MLP_TARGETS,
    Decoder,
    chunked_token_logps,
    chunked_token_logps_and_entropy,
    chunked_token_losses,
    kind_stacks,
)
from jaxmllm.models.lora import BLOCK_PATHS, CONFORMER_PATHS, PROJECTOR_PATHS
from jaxmllm.models.per_layer import per_layer_ids
from sharding import CONTEXT_AXIS, DATA_AXES, STAGE_AXIS


class MultimodalLM(nnx.Module):
    """An encoder and projector per encoder phase of the table, and a decoder LLM.

    Top-level attributes are exactly, per encoder phase, `<phase>` and `<phase>_projector`
    (`vision`, `vision_projector`, `audio`, `audio_projector`; None for a disabled encoder,
    holding no parameters), and `llm`, so a parameter's first path element says which part to
    freeze.
    """

    def __init__(self, cfg: ModelConfig, spec: BatchSpec, *, rngs: nnx.Rngs):
        """`spec`: the resolved batch (`BatchSpec.of(config)`): attention blocks, documents,
        the route capacity and the exchange the model is built for."""
        kw = dict(
            dtype=jnp.dtype(cfg.compute_dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs
        )
        shared = dict(attention=cfg.attention, block=spec.attention_block)
        # Each tower's own: cuDNN's documents bound (0 for the other kernels), remat policy.
        own = lambda name: dict(documents=spec.documents.get(name, 0), remat=cfg.remat_of(name))
        inputs = lambda name: dict(inputs=spec.inputs.get(name))  # (uint8 pixels: normalised)
        for p in ENCODERS:  # (in the table's order: the parameters' random init follows it)
            encoder, projector = ENCODER_MODULES[p.name]
            on = p.enabled(cfg)
            setattr(
                self,
                p.name,
                encoder(p.encoder(cfg), **shared, **own(p.name), **inputs(p.name), **kw)
                if on
                else None,
            )
            setattr(self, f"{p.name}_projector", projector(cfg, **kw) if on else None)
        strategy = spec.context_strategy
        grouped = spec.context > 1
        self.llm = Decoder(
            cfg.llm, **shared, **own(LLM), context_strategy=strategy, grouped=grouped, **kw
        )
        self.route_capacity = spec.route_pair_capacity
        self.exchange = spec.exchange
        # (a sample's media rows fill each of its documents' slots: a pair's two, a group's G)
        self.copies = spec.media_copies
        # mesh.context groups its rows were planned for (a prompt batch's: none, whatever
        # mesh it runs under: each prompt row is whole on its device)
        self.context = spec.context

    def __call__(self, mb: dict[str, jax.Array]) -> jax.Array:
        """Logits for one microbatch.

        Args:
          mb: the batch contract arrays (see the package docs); leading axis D = device buckets.

        Returns:
          Logits [D, R, L, vocab] in float32.
        """
        return self.llm.logits(self.hidden(mb))

    @property
    def phases(self) -> tuple[str, ...]:
        """The encoder phases this model has, in the order their rows are exchanged."""
        return tuple(p.name for p in ENCODERS if getattr(self, p.name) is not None)

    def encode(self, mb: dict[str, jax.Array], name: str) -> jax.Array:
        """One phase's projector output rows [D, N, llm width]: its encoder, then projector."""
        encoder, projector = getattr(self, name), getattr(self, f"{name}_projector")
        return projector(encoder(*encoder_args(mb, name)))

    def encode_deep(self, mb: dict[str, jax.Array], name: str) -> tuple:
        """`encode`'s rows and, for a tower with DeepStack (`model.vision.deepstack`), its
        tapped blocks' rows through their own projectors [K, D, N, llm width] (else None)."""
        encoder, projector = getattr(self, name), getattr(self, f"{name}_projector")
        if not getattr(encoder, "deepstack", ()):
            return self.encode(mb, name), None
        features, taps = encoder.tapped(*encoder_args(mb, name))
        return projector(features), projector.deep(taps)

    def losses(self, mb: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(summed masked cross entropy, loss-token count) of one microbatch; the logits are
        projected a slice of tokens at a time (`model.llm.logits_chunk`)."""
        return self.losses_and_router(mb)[:2]

    def losses_and_router(self, mb: dict[str, jax.Array]) -> tuple:
        """`losses`, and the decoder's MoE router statistics (`moe.RouterStats` per MoE layer;
        None for a dense decoder): what the load-balancing loss is made of."""
        h_drlw, stats = self.hidden_and_router(mb)
        d, width = h_drlw.shape[0], h_drlw.shape[-1]
        loss_sum, count = chunked_token_losses(
            self.llm,
            h_drlw.reshape(d, -1, width),
            mb["llm_targets"].reshape(d, -1),
            mb["llm_loss_mask"].reshape(d, -1),
        )
        return loss_sum, count, stats

    def token_logps_and_router(self, mb: dict[str, jax.Array], temperature: float = 1.0) -> tuple:
        """Each token's target log-probability [D, R, L] (fp32; the fused projection's, no
        [tokens, vocab] logits), and the decoder's MoE router statistics (None if dense).
        `temperature`: of the distribution sampled at it, logits / t (the final hidden state
        divided by t: the projection is linear; GRPO's policy is the one it sampled from)."""
        logps, _, stats = self._token_scores(mb, temperature, entropy=False)
        return logps, stats

    def token_logps_entropy_and_router(
        self, mb: dict[str, jax.Array], temperature: float = 1.0
    ) -> tuple:
        """`token_logps_and_router` with each token's entropy of its next-token distribution
        at `temperature` [D, R, L] between them (a metric, no gradient: an RL policy's)."""
        return self._token_scores(mb, temperature, entropy=True)

    def _token_scores(self, mb: dict[str, jax.Array], temperature: float, entropy: bool):
        """(log-probs, entropies or None, router statistics) of one microbatch's targets."""
        h_drlw, stats = self.hidden_and_router(mb)
        if temperature != 1.0:
            h_drlw = h_drlw / jnp.asarray(temperature, h_drlw.dtype)
        d, width = h_drlw.shape[0], h_drlw.shape[-1]
        targets = mb["llm_targets"]
        h_dnw, targets_dn = h_drlw.reshape(d, -1, width), targets.reshape(d, -1)
        if not entropy:
            logps = chunked_token_logps(self.llm, h_dnw, targets_dn)
            return logps.reshape(targets.shape), None, stats
        logps, ent = chunked_token_logps_and_entropy(self.llm, h_dnw, targets_dn)
        return logps.reshape(targets.shape), ent.reshape(targets.shape), stats

    def hidden(self, mb: dict[str, jax.Array]) -> jax.Array:
        """The decoder's final hidden states [D, R, L, width] for one microbatch."""
        return self.hidden_and_router(mb)[0]

    def hidden_and_router(self, mb: dict[str, jax.Array]) -> tuple:
        """`hidden`, and the decoder's MoE router statistics (None for a dense decoder)."""
        segment_ids_bs, positions_bs = self.decoder_rows(mb)
        x_drlw, added_kdrlw = self.inputs_and_added(mb)
        as_rows = lambda a: a.reshape(*a.shape[: a.ndim - 4], *segment_ids_bs.shape, -1)
        h, stats = self.llm.hidden_and_router(
            as_rows(x_drlw),
            segment_ids_bs,
            positions_bs,
            mb.get("llm_tiles"),
            row=mb["llm_segment_ids"].shape[-1],  # (block-sparse lays a device's rows end to end)
            added_kbtd=None if added_kdrlw is None else as_rows(added_kdrlw),
            order_bt=self.decoder_order(mb),
            window_tiles_bk2=mb.get("llm_window_tiles"),
            spans_bt=self.decoder_spans(mb),
            ids_bt=self.per_layer_ids(mb, segment_ids_bs.shape),
            blocks_bn=mb.get("llm_blocks"),
        )
        return h.reshape(*mb["llm_tokens"].shape, -1), stats

    def per_layer_ids(self, mb: dict[str, jax.Array], shape: tuple) -> jax.Array | None:
        """The ids the decoder's per-layer table is read at, as its rows lay them (`shape`):
        the tokens', the pad id in an encoder row's slot (`per_layer.per_layer_ids`), past
        the table in padding (zeros, no gradient); None without per-layer inputs."""
        if self.llm.per_layer is None:
            return None
        slots = jnp.zeros(mb["llm_tokens"].shape, bool)
        for name in self.phases:
            if phase(name).src in mb:
                slots = slots | (mb[phase(name).src] >= 0)
        ids = per_layer_ids(mb["llm_tokens"], slots, self.llm.per_layer_pad_id)
        if "llm_segment_ids" in mb:
            ids = jnp.where(mb["llm_segment_ids"] == 0, self.llm.per_layer.embed.vocab_size, ids)
        return ids.reshape(shape)

    def decoder_inputs(
        self, mb: dict[str, jax.Array], rows: dict[str, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`inputs` as the decoder takes them, with their segment ids and positions
        ([rows, T, W], [rows, T], [rows, T] or [rows, T, 3]; see `decoder_rows`)."""
        segment_ids_bs, positions_bs = self.decoder_rows(mb)
        x_drlw = self.inputs(mb, rows)
        return x_drlw.reshape(*segment_ids_bs.shape, -1), segment_ids_bs, positions_bs

    def decoder_order(self, mb: dict[str, jax.Array]) -> jax.Array | None:
        """Each token's index in its document, as the decoder's rows lay them (`decoder_rows`),
        where the batch has it apart from the positions (context groups with M-RoPE); None."""
        if "llm_order" not in mb:
            return None
        return mb["llm_order"].reshape(self.decoder_rows(mb)[0].shape)

    def decoder_spans(self, mb: dict[str, jax.Array]) -> jax.Array | None:
        """The bidirectional spans as the decoder's rows lay them (`decoder_rows`), where the
        batch has them (`llm_spans`: `model.llm.bidirectional`); None."""
        if "llm_spans" not in mb:
            return None
        return mb["llm_spans"].reshape(self.decoder_rows(mb)[0].shape)

    def decoder_rows(self, mb: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """The decoder's rows' segment ids and positions: block-sparse attention takes a device's
        rows as one row (its tiles say which blocks meet); the others attend within each row."""
        d, r, _ = mb["llm_segment_ids"].shape
        n = d if self.llm.attention == "block_sparse" else d * r
        positions = mb["llm_positions"]
        return mb["llm_segment_ids"].reshape(n, -1), positions.reshape(n, -1, *positions.shape[3:])

    def inputs(
        self, mb: dict[str, jax.Array], rows: dict[str, jax.Array] | None = None
    ) -> jax.Array:
        """The decoder's input embeddings [D, R, L, width]: token embeddings, the placeholder
        slots filled with the projected encoder rows (what KV-cache decoding prefills too);
        `rows`: each phase's projector rows when computed already (a pipeline's encoder
        stages), else encoded here."""
        return self.inputs_and_added(mb, rows)[0]

    def inputs_and_added(
        self, mb: dict[str, jax.Array], rows: dict[str, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """`inputs`, and DeepStack's additions [K, D, R, L, width] (`encode_deep`: each tapped
        block's rows in its phase's slots, zero elsewhere; None without DeepStack): the K
        levels travel with their phase's rows, in the same exchange."""
        deep: dict[str, jax.Array] = {}
        if rows is None:  # (a phase whose bucket is zero has no arrays: it is left out)
            rows = {}
            for name in self.phases:
                if phase(name).capacity in mb:
                    rows[name], levels = self.encode_deep(mb, name)
                    if levels is not None:
                        deep[name] = levels
        # The table is sharded on `embed`; pin the lookup to the batch layout so XLA does not
        # carry the table's layout into the activations (a full rematerialisation otherwise).
        names = list(rows)
        x_drlw = shard_like_batch(self.llm.embed(self.looked_up(mb, names)))
        # Each phase's rows, then each DeepStack level of a phase that has them, in one exchange
        sent = [(p, rows[p]) for p in names] + [(p, r) for p in deep for r in deep[p]]
        buffers = self._route(
            [r for _, r in sent],
            [mb.get(f"{p}_send") for p, _ in sent],
            [mb.get(f"{p}_send_count") for p, _ in sent],
        )
        if self.context > 1:  # (a context group's slots read its rows, wherever they arrived)
            buffers = [gather_rows(b) for b in buffers]
        for buffer, name in zip(buffers[: len(names)], names, strict=True):
            x_drlw = fill_slots(x_drlw, buffer, mb[phase(name).src], self.copies)
        if not deep:
            return x_drlw, None
        added = [
            fill_slots(jnp.zeros_like(x_drlw), buffer, mb[phase(name).src], self.copies)
            for (name, _), buffer in zip(sent[len(names) :], buffers[len(names) :], strict=True)
        ]
        return x_drlw, jnp.stack(added)

    def looked_up(self, mb: dict[str, jax.Array], names: list[str]) -> jax.Array:
        """The token ids whose embeddings are used, the others (placeholder slots, which encoder
        rows fill, and padding) past the vocabulary: they look up zeros, and the table's
        gradient drops theirs instead of adding zeros for every one of them onto their id's
        row (an image's hundreds of placeholders share one id)."""
        unused = mb["llm_segment_ids"] == 0 if "llm_segment_ids" in mb else False
        for name in names:
            unused = unused | (mb[phase(name).src] >= 0)
        return jnp.where(unused, self.llm.embed.vocab_size, mb["llm_tokens"])

    def _route(
        self, rows: list[jax.Array], sends: list[jax.Array | None], counts: list
    ) -> list[jax.Array]:
        """The rows each phase's slots read: the device's own, then (routed) received ones
        (none with one LLM bucket: one device, or one context group, receives from no other)."""
        if self.route_capacity == 0 or not rows:
            return rows
        for send in sends:
            if send is None or send.shape[-1] != self.route_capacity:
                raise ValueError(
                    f"routed mode (route_pair_capacity={self.route_capacity}) needs "
                    f"*_send arrays [D, buckets, {self.route_capacity}]"
                )
        if sends[0].shape[-2] == 1:  # (its own slots: what the exchange would leave unused)
            return rows
        # Local rows take the local path (index < N); only the others cross devices, all
        # phases in one all-to-all (a collective's latency is paid once).
        ragged = self.exchange == "ragged"
        received = exchange_rows(rows, sends, counts, ragged=ragged, context=self.context)
        return [jnp.concatenate([r, x], axis=1) for r, x in zip(rows, received, strict=True)]


def encoder_args(mb: dict[str, jax.Array], name: str) -> tuple:
    """An encoder phase's inputs from a microbatch: (its inputs: patches, frames; segment ids;
    positions; tiles or None), as its encoder (and its `prepare`) takes them."""
    p = phase(name)
    return mb[p.capacity], mb[f"{name}_segment_ids"], mb[f"{name}_positions"], mb.get(p.tiles)


def exchange_rows(
    rows: list[jax.Array],
    sends: list[jax.Array],
    counts: list[jax.Array | None] | None = None,
    ragged: bool = False,
    context: int = 1,
) -> list[jax.Array]:
    """Sends encoder rows to their LLM buckets with one all-to-all at a fixed per-pair capacity.

    Args:
      rows: per phase, each device's projector output [D, N_p, width].
      sends: per phase, `send[src, b, c]` = which of src's rows goes to LLM bucket b in slot c
        [D, B, C_p]: B = D / `context` buckets (devices, or context groups of `context`
        devices); a group's rows from src arrive on its device at src's place in its own group
        (`b * context + src % context`).
      context: the devices of a context group the sends were written for (1: none).

    Returns:
      Per phase, each device's received buffer [D, B * C_p, width]; row `g * C_p + c` came from
      the device at this one's place in group g (`g * context + this % context`; device g
      without groups). Under a mesh (`jax.set_mesh`) with one bucket per data-parallel shard,
      this is a `shard_map` whose body gathers every phase's send buffer into one and calls
      `lax.all_to_all` once over the data axes, `context` left out: a device exchanges with
      its peers at its place in the other groups, the only devices that send it anything, so
      a buffer holds B, not D, pairs' slots. Its transpose (the backward pass) is the reverse
      all-to-all. Without a mesh, the same exchange is written as a transpose (single device,
      reference tests).

    `counts` (per phase, rows src sends bucket b [D, B]): the slots past a pair's count gather
    nothing (zeros), so the backward pass does not add their zero cotangents onto the row their
    unused index names. With `ragged` (and a mesh) the exchange is one
    `lax.ragged_all_to_all` that moves only the filled slots (same buffers, same layout), for
    backends that implement it (GPU; XLA:CPU does not).
    """
    caps = [s.shape[-1] for s in sends]
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = () if mesh.empty else tuple(a for a in DATA_AXES if a in mesh.axis_names)
    shards = 1
    for a in batch_axes:
        shards *= mesh.shape[a]
    # (the groups' places exchange apart: the context axis, which is minor in the batch's
    # device order, is left out, so the others' index is the group's)
    axes = tuple(a for a in batch_axes if context == 1 or a != CONTEXT_AXIS)
    if context > 1 and batch_axes and mesh.shape.get(CONTEXT_AXIS, 1) != context:
        raise ValueError(
            f"sends written for context groups of {context} devices, under a mesh whose "
            f"context axis is {mesh.shape.get(CONTEXT_AXIS, 1)}"
        )

    counts = None if counts is None or any(c is None for c in counts) else counts
    if ragged and counts is None:
        raise ValueError("the ragged exchange needs the *_send_count arrays")

    def gather(rows_nw, send_bc, count_b=None):  # one device: [B, sum C_p, W], side by side
        if count_b is None:
            count_b = [None] * len(rows_nw)
        return jnp.concatenate(
            [_sent(r, s, c) for r, s, c in zip(rows_nw, send_bc, count_b, strict=True)], axis=1
        )

    def split(received_bcw):  # [B, sum C_p, W] -> per phase [B * C_p, W]
        parts = jnp.split(received_bcw, np.cumsum(caps)[:-1].tolist(), axis=1)
        return [p.reshape(-1, p.shape[-1]) for p in parts]

    if not batch_axes or shards == 1 or STAGE_AXIS in mesh.manual_axes:
        # Inside a pipeline's shard_map over the stages a nested one over the data axes does not
        # lower (stage-varying operands): the transpose, resharded by XLA (an all-to-all).
        sent_dbcw = jax.vmap(gather)(rows, sends, counts)
        d, b = sent_dbcw.shape[:2]
        # (device g * context + r receives, from each group h, what h's device at r sent g)
        sent = sent_dbcw.reshape(b, context, b, *sent_dbcw.shape[2:])  # [h, r, g, ...]
        received = jnp.transpose(sent, (2, 1, 0, 3, 4)).reshape(sent_dbcw.shape)
        return jax.vmap(split)(shard_like_batch(received))
    if rows[0].shape[0] != shards:
        raise ValueError(
            f"the exchange needs one bucket per data-parallel shard: got {rows[0].shape[0]} "
            f"buckets for {shards} shards of mesh axes {batch_axes}"
        )
    spec = PartitionSpec(batch_axes)
    peers = shards // (mesh.shape[CONTEXT_AXIS] if axes != batch_axes else 1)

    def per_shard(rows_1nw, sends_1bc, counts_1b):
        own = None if counts_1b is None else [c[0] for c in counts_1b]
        sent_bcw = gather([r[0] for r in rows_1nw], [s[0] for s in sends_1bc], own)
        if peers == 1:  # (one group: nothing crosses it)
            received_bcw = sent_bcw
        elif not ragged:
            # Chunk b of the send buffer goes to bucket b's peer; chunk g of the result came
            # from group g's.
            received_bcw = jax.lax.all_to_all(sent_bcw, axes, 0, 0, tiled=True)
        else:
            received_bcw = _ragged_exchange(sent_bcw, [c[0] for c in counts_1b], caps, axes)
        return [p[None] for p in split(received_bcw)]

    return jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec)(rows, sends, counts)


def _sent(rows_nw: jax.Array, send_bc: jax.Array, count_b: jax.Array | None) -> jax.Array:
    """One device's send buffer of one phase [B, C, W]: `rows[send]`, slots past each
    bucket's count zeros (an index past the rows, dropped in the backward pass)."""
    if count_b is not None:
        used = jnp.arange(send_bc.shape[-1]) < count_b[:, None]
        send_bc = jnp.where(used, send_bc, rows_nw.shape[0])
    return jnp.take(rows_nw, send_bc, axis=0, mode="fill", fill_value=0)


def ragged_args(me, counts_pd, caps: list[int]):
    """(input_offsets, send_sizes, output_offsets) of one device's ragged send.

    One slice per (destination, phase), i = dst * P + p: the filled prefix of that phase's slots
    in the destination's chunk of the dense send buffer [B, sum C_p] (a destination: an LLM
    bucket's device that receives from this one, `exchange_rows`; `me`: this device's index
    among those it exchanges with), written where the dense exchange would put it on the
    receiver (source-major: me * sum C_p + the phase's offset).
    """
    num_dev = counts_pd[0].shape[0]
    total = sum(caps)
    offsets = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int32)
    dst = jnp.repeat(jnp.arange(num_dev, dtype=jnp.int32), len(caps))
    phase_off = jnp.tile(jnp.asarray(offsets), num_dev)
    input_offsets = dst * total + phase_off
    send_sizes = jnp.stack(counts_pd, axis=1).reshape(-1).astype(jnp.int32)
    output_offsets = jnp.asarray(me, jnp.int32) * total + phase_off
    return input_offsets, send_sizes, output_offsets


def _ragged_exchange(sent_dcw, counts_pd, caps, axes):
    num_dev, total, width = sent_dcw.shape
    me = jax.lax.axis_index(axes)
    input_offsets, send_sizes, output_offsets = ragged_args(me, counts_pd, caps)
    # Receivers learn how much arrives from whom from the senders (a tiny all-to-all of sizes).
    recv_sizes = jax.lax.all_to_all(send_sizes, axes, 0, 0, tiled=True)
    operand = sent_dcw.reshape(num_dev * total, width)
    out = jax.lax.ragged_all_to_all(
        operand,
        jnp.zeros_like(operand),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axes,
    )
    return out.reshape(num_dev, total, width)


def shard_like_batch(x: jax.Array) -> jax.Array:
    """Splits dim 0 over the data-parallel mesh axes, when a mesh is set (`jax.set_mesh`).

    Without this XLA keeps the exchanged rows sharded on their source dim and gathers them
    everywhere instead of doing one all-to-all. With no mesh set it returns x unchanged.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in DATA_AXES if a in mesh.axis_names)
    if not axes:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes))


def fill_slots(
    x_drlw: jax.Array, rows_dnw: jax.Array, src_drl: jax.Array, copies: int = 1
) -> jax.Array:
    """Replaces token embeddings where `src >= 0` with row `src` of the same device's `rows`.

    `copies` > 1: a row may fill up to that many slots (the media of a sample of several
    documents, encoded once and read by each: a preference pair's chosen and rejected, 2; a
    GRPO group's completions of one prompt, G): the tokens naming it, in order, found one a
    pass (the k-th: a scatter-min of the indices of the tokens past the (k-1)-th), each pass
    taking the N rows by a scatter; the backward pass gathers each row's cotangents, one per
    slot it filled.

    A row fills at most `copies` slots (an item's rows fill its placeholders one each, in each
    document), so the rows are scattered into their slots: the forward pass adds N rows into
    zeros and the backward pass gathers N rows' cotangents, where gathering a row for every
    token would make the backward pass scatter-add every token's cotangent, nearly all of them
    onto the row that non-slot tokens read (on a GPU, tokens x width atomic adds into one row).
    The slot of each row is found by a scatter of token indices (an int per token: no width, no
    gradient).
    """
    d, rows, length, width = x_drlw.shape
    n, tokens = rows_dnw.shape[1], rows * length

    def one(x_tw, rows_nw, src_t):
        # Row i's slot: the token whose src is i (`tokens`, past the end: a row no slot reads).
        named = jnp.where(src_t >= 0, src_t, n)  # (non-slot tokens name no row: dropped)
        index = jnp.arange(tokens, dtype=jnp.int32)
        values = rows_nw.astype(x_tw.dtype)
        placed = jnp.zeros_like(x_tw)
        if copies == 1:
            slot = jnp.full((n,), tokens, jnp.int32).at[named].set(index, mode="drop")
            placed = placed.at[slot].add(values, mode="drop")
        else:  # (row i's k-th slot: the first token naming it past its (k-1)-th)
            slot = jnp.full((n + 1,), -1, jnp.int32).at[n].set(tokens)  # (n: no row's)
            for _ in range(copies):
                later = jnp.where(index > slot[named], index, tokens)
                found = jnp.full((n,), tokens, jnp.int32).at[named].min(later, mode="drop")
                placed = placed.at[found].add(values, mode="drop")
                slot = slot.at[:n].set(found)
        return jnp.where((src_t >= 0)[:, None], placed, x_tw)

    filled = jax.vmap(one)(x_drlw.reshape(d, tokens, width), rows_dnw, src_drl.reshape(d, -1))
    return filled.reshape(d, rows, length, width)


def token_losses(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed masked cross entropy and the number of counted tokens.

    Sums (not means) so microbatches and devices can be combined exactly before dividing.

    Args:
      logits: [..., vocab] (any float dtype; computed in float32).
      targets: int target ids [...].
      loss_mask: float weights [...], 0 for tokens that carry no loss.

    Returns:
      (sum of loss * mask, sum of mask), both float32 scalars.
    """
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(loss * mask), jnp.sum(mask)


def param_axes(state: nnx.State) -> dict:
    """Logical axis names of every parameter, shaped like `nnx.to_pure_dict(state)`.

    Leaves are tuples (possibly holding None), so map over the result with
    `is_leaf=lambda x: isinstance(x, tuple)`.

    Args:
      state: the state from `nnx.split(model)` (concrete or abstract from `nnx.eval_shape`).
    """
    tree: dict = {}
    for path, variable in nnx.to_flat_state(state):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _axes_of(variable)
    return tree


def _axes_of(variable: nnx.Variable) -> Axes:
    axes = variable.get_metadata().get("axes")
    if axes is None:  # non-parameter state (none today): never sharded
        return (None,) * len(variable.get_value().shape)
    return tuple(axes)


def kernel_paths(model: ModelConfig) -> dict[str, tuple[str, str]]:
    """Every kernel with an adapter under a `config.ModelConfig` (its `model.*.lora`):
    path -> (top-level module, target), from the config alone. A mixture of experts' MLP
    targets adapt its routed experts instead (`expert_adapters`)."""
    out = {}
    for module in ("vision", "vision_projector", "audio", "audio_projector", "llm"):
        tower = module.removesuffix("_projector")
        if tower != "llm" and not getattr(model, tower).enabled:
            continue
        for target in model.adapted(module):
            for where in _kernel_places(model, module, target):
                out["/".join((module, *where, "kernel"))] = (module, target)
    return out


def _kernel_places(model: ModelConfig, module: str, target: str) -> list[tuple[str, ...]]:
    """Where a target's kernels sit under a top-level module (none, one or one per stack)."""
    if module.endswith("_projector"):
        deep = module == "vision_projector" and model.vision.deepstack  # (stacked: DeepStack's)
        return [PROJECTOR_PATHS[target]] + (
            [("deepstack", *PROJECTOR_PATHS[target])] if deep else []
        )
    if module == "audio" and model.audio.stem == "conformer":
        return CONFORMER_PATHS[target]
    if module != "llm":
        return [("transformer", "blocks", *BLOCK_PATHS[target])]
    moe = model.llm.moe
    if moe.enabled and target in MLP_TARGETS:
        if not moe.shared_mlp_dim:
            return []  # (the routed experts': expert_adapters)
        # (a shared expert's, and a dense layer's MLP: `moe.MoE`)
        return [
            ("transformer", stack, "mlp", *(("shared",) if kind.moe else ()), target)
            for stack, kind, _ in kind_stacks(model.llm)
        ]
    linear = target in LINEAR_TARGETS  # (a hybrid's linear-attention layers have their own)
    return [
        ("transformer", stack, *BLOCK_PATHS[target])
        for stack, kind, _ in kind_stacks(model.llm)
        if target in MLP_TARGETS
        or (linear == kind.linear and has_projection(model.llm, kind, target))
    ]


def has_projection(llm, kind, target: str) -> bool:
    """Whether attention layers of `kind` have the projection `target` names: no k or v where
    they reuse another layer's keys (`kv_shared`), no v in full layers beside windows whose
    values are their keys (`full_k_eq_v`)."""
    if kind.kv_shared and target in ("k", "v"):
        return False
    return not (target == "v" and llm.full_k_eq_v and llm.window.enabled and not kind.sliding)


def expert_adapters(model: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The stacked experts with adapters: their module's path -> the adapted matrices of
    `moe.Experts` (gate_up, down), from the config alone."""
    targets = set(model.adapted("llm")) & set(MLP_TARGETS)
    if not (model.llm.moe.enabled and targets) or model.llm.moe.shared_mlp_dim:
        return {}  # (none, or a shared expert's: `kernel_paths`)
    which = tuple(m for m, t in (("gate_up", "gate"), ("down", "down")) if t in targets)
    return {
        f"llm/transformer/{stack}/mlp/experts": which
        for stack, kind, _ in kind_stacks(model.llm)
        if kind.moe
    }
