"""Where a device's step time goes: each phase of the train step compiled as its own program
and timed on the buckets of real steps (`python -m jaxmllm.bench.throughput --phases`).

- each encoder phase (`vision`, `audio`): the encoder and its projector over one device's
  bucket, forward and backward as the step runs them (a frozen encoder gets no weight
  gradient; one with nothing trainable below it runs forward only);
- `llm`: the decoder from its input embeddings (token embeddings, the placeholder slots filled
  with constant encoder rows) through the loss, forward and backward (to the rows too);
- `exchange`: the encoder rows' all-to-all and its transpose (the backward's), all phases, on
  the whole mesh with the step's send tables (0 when nothing is routed);
- `optimizer`: the optimizer's update of the whole train state on one device, over the
  shards a device holds (`mesh.fsdp x tensor`: its share of the update).

Every phase runs each of the step's microbatches (the optimizer once), one device at a time
like the max-device measure; what the whole step takes beyond their sum is the embedding
lookups, the loss head's share outside `llm`, the gradient accumulation and reductions, and
dispatch. Compiled separately, phases are not fused with each other as in the step: the sum is
an estimate of the step's own split, close where phases are large.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sharding
from jaxmllm.config import Config, phases
from jaxmllm.config.phases import LLM, enabled
from jaxmllm.models.llm import chunked_token_losses
from jaxmllm.models.mllm import exchange_rows

PHASES = (*phases.NAMES, LLM, "exchange", "optimizer")


class PhaseTimer:
    """The phase programs of one config: per-device ones on a one-device mesh, the exchange on
    the whole mesh."""

    def __init__(self, cfg: Config, prog1, state1: dict, mesh, mesh1):
        self.cfg, self.mesh, self.mesh1 = cfg, mesh, mesh1
        self.params, self.frozen = state1["params"], state1["frozen"]
        self.opt_state = state1["opt_state"]
        parts = prog1.parts
        self.encoders = [p.name for p in enabled(cfg.model)]
        self.programs = {p: jax.jit(encoder_program(parts, p)) for p in self.encoders}
        self.programs[LLM] = jax.jit(llm_program(parts, self.encoders))
        self.optimizer = jax.jit(update_program(prog1.optimizer))
        self.width = cfg.model.llm.width
        self.dtype = jnp.dtype(cfg.model.compute_dtype)
        self.shards = cfg.mesh.fsdp * cfg.mesh.tensor  # (a device updates its shard)

    def time(self, host: dict[str, np.ndarray], device_batch: Callable) -> dict[str, float]:
        """Seconds per phase of this step: the slowest device's, each phase on its own
        (`device_batch(host, d)`: device d's bucket, shaped for the one-device programs)."""
        worst = dict.fromkeys([*self.encoders, LLM], 0.0)
        devices = next(iter(host.values())).shape[1]
        with jax.set_mesh(self.mesh1):
            for d in range(devices):
                mb_all = sharding.make_global_batch(device_batch(host, d), self.mesh1)
                for phase in worst:
                    worst[phase] = max(worst[phase], self._phase(phase, mb_all))
            worst["optimizer"] = timed(self.optimizer, self.params, self.opt_state) / self.shards
        worst["exchange"] = self._exchange(host)
        return worst

    def _phase(self, phase: str, batch: dict) -> float:
        """One device's bucket of every microbatch of the step through `phase`."""
        program, total = self.programs[phase], 0.0
        for m in range(next(iter(batch.values())).shape[0]):
            mb = {k: v[m] for k, v in batch.items()}
            if phase == LLM:
                total += timed(program, self.params, self.frozen, mb, self._rows(mb))
            else:
                total += timed(program, self.params, self.frozen, mb)
        return total

    def _rows(self, mb: dict) -> dict[str, jax.Array]:
        """Constant encoder rows of the shapes the projectors give (what the LLM reads)."""
        rows = lambda p: mb[p.capacity].shape[1] // p.per_token(self.cfg.model)
        return {
            p.name: jnp.zeros((1, rows(p), self.width), self.dtype) for p in enabled(self.cfg.model)
        }

    def _exchange(self, host: dict[str, np.ndarray]) -> float:
        """The step's all-to-alls (every microbatch) forward and transposed, on the mesh."""
        sends = [f"{p}_send" for p in self.encoders if f"{p}_send" in host]
        if not sends or sharding.data_parallel_size(self.mesh) == 1:
            return 0.0
        total = 0.0
        with jax.set_mesh(self.mesh):
            for m in range(host[sends[0]].shape[0]):
                tables = {k: host[k][m : m + 1] for k in sends}
                batch = sharding.make_global_batch(tables, self.mesh)
                send = [batch[k][0] for k in sends]
                rows = [self._global_rows(host, p) for p in self.encoders if f"{p}_send" in host]
                total += timed(EXCHANGE, rows, send, self.cfg.mesh.context)
        return total

    def _global_rows(self, host: dict, name: str) -> jax.Array:
        """Every device's encoder rows [D, N, width], sharded like the step's."""
        p = phases.phase(name)
        key = p.capacity
        d, n = host[key].shape[1], host[key].shape[2] // p.per_token(self.cfg.model)
        spec = jax.sharding.PartitionSpec(sharding.DATA_AXES)
        return jax.device_put(
            jnp.ones((d, n, self.width), self.dtype), jax.sharding.NamedSharding(self.mesh, spec)
        )


def _exchange_fwd_bwd(rows: list, sends: list, context: int) -> list:
    """The exchange and its transpose (the backward pass's reverse all-to-all); `context`: the
    context groups' devices the send tables were written for."""
    out, back = jax.vjp(lambda r: exchange_rows(r, sends, context=context), rows)
    return back(out)


EXCHANGE = jax.jit(_exchange_fwd_bwd, static_argnums=2)


def encoder_program(parts, phase: str) -> Callable:
    """(params, frozen, microbatch) -> the encoder's and projector's gradient (its output
    summed, so the backward pass gets a cotangent of ones), or its output when both are
    frozen (forward only)."""
    own = (phase, f"{phase}_projector")

    def output(trained, params, frozen, mb):
        model = parts.merge({**params, **trained}, frozen)
        return jnp.sum(model.encode(mb, phase).astype(jnp.float32))

    def program(params, frozen, mb):
        trained = {k: v for k, v in params.items() if k in own}
        if not trained:
            return output({}, params, frozen, mb)
        return jax.value_and_grad(output)(trained, params, frozen, mb)

    return program


def llm_program(parts, phases: list[str]) -> Callable:
    """(params, frozen, microbatch, encoder rows) -> the decoder's loss and its gradient
    (`MultimodalLM.losses` from the embeddings on, the encoder rows given)."""

    def loss(llm, params, frozen, mb, rows):
        model = parts.merge({**params, **llm}, frozen)
        x, seg, pos = model.decoder_inputs(mb, rows)
        h, _ = model.llm.hidden_and_router(  # (as the step's decoder runs: `hidden_and_router`)
            x,
            seg,
            pos,
            mb.get("llm_tiles"),
            row=mb["llm_segment_ids"].shape[-1],
            order_bt=model.decoder_order(mb),
            window_tiles_bk2=mb.get("llm_window_tiles"),
            spans_bt=model.decoder_spans(mb),
            ids_bt=model.per_layer_ids(mb, seg.shape),
            blocks_bn=mb.get("llm_blocks"),
        )
        d, width = mb["llm_tokens"].shape[0], h.shape[-1]
        total, _ = chunked_token_losses(
            model.llm,
            h.reshape(d, -1, width),
            mb["llm_targets"].reshape(d, -1),
            mb["llm_loss_mask"].reshape(d, -1),
        )
        return total

    def program(params, frozen, mb, rows):
        llm = {k: v for k, v in params.items() if k == LLM}  # (frozen: the rows' gradient)
        grad = jax.value_and_grad(lambda llm, rows: loss(llm, params, frozen, mb, rows), (0, 1))
        return grad(llm, rows)

    return program


def update_program(optimizer: optax.GradientTransformation) -> Callable:
    """(params, optimizer state) -> the updated params and state (the gradient: the params)."""

    def program(params, opt_state):
        updates, opt_state = optimizer.update(params, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return program


def timed(program: Callable, *args) -> float:
    """Seconds one call of `program` takes, waiting for its result."""
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    return time.perf_counter() - start
