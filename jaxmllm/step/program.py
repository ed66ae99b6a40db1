"""The train step: the model split into trained and frozen parts, the optimizer, the loss and
gradients over a step's microbatches, and the one compiled program a config becomes on a mesh.

    parts, axes = model_parts(cfg)          # shape-only model, logical axes of every parameter
    prog = build_program(cfg, mesh)         # shardings + jitted, state-donating train step
    state = prog.init()                     # or restored into prog.abstract_sharded()
    state, metrics = prog.step(state, batch)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import sharding
from jaxmllm.config import Config
from jaxmllm.config.phases import ENCODERS
from jaxmllm.config.spec import BatchSpec
from jaxmllm.models import MultimodalLM, param_axes

# Top-level model attributes, and the config switch that freezes each: per encoder phase its
# encoder (model.<phase>.freeze) and projector (model.projector_freeze), then the LLM. An encoder
# phase with a zero bucket (the data has none of its items) is left out of the step, so its
# encoder and projector are frozen too: no gradient reaches them, and weight decay would
# otherwise shrink them for nothing.
FREEZE_SWITCHES = {}
for _p in ENCODERS:
    FREEZE_SWITCHES[_p.name] = lambda c, p=_p: p.encoder(c.model).freeze or not p.bucket(c.batch)
    FREEZE_SWITCHES[f"{_p.name}_projector"] = lambda c, p=_p: (
        c.model.projector_freeze or not p.bucket(c.batch)
    )
FREEZE_SWITCHES["llm"] = lambda c: c.model.llm.freeze


# ----------------------------------------------------------------------------- model state


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """How to rebuild the model from pure-dict params: the graph and the state template."""

    graphdef: Any
    template: Any  # abstract nnx.State the pure dicts are poured into
    frozen_keys: tuple[str, ...]  # top-level modules whose params are not trained

    def merge(self, params: dict, frozen: dict) -> MultimodalLM:
        state = jax.tree.map(lambda x: x, self.template)  # a fresh copy to fill
        nnx.replace_by_pure_dict(state, {**params, **frozen})
        return nnx.merge(self.graphdef, state)


def build_model(cfg: Config, seed: int) -> tuple[dict, dict]:
    """Initialises the model; returns (trainable params, frozen params) as pure dicts."""
    return split_frozen(cfg, MultimodalLM(cfg.model, BatchSpec.of(cfg), rngs=nnx.Rngs(seed)))


def split_frozen(cfg: Config, model: MultimodalLM) -> tuple[dict, dict]:
    """A model's parameters as (trainable, frozen) pure dicts, by the config's freeze keys."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    frozen = {k for k, is_frozen in FREEZE_SWITCHES.items() if k in pure and is_frozen(cfg)}
    return (
        {k: v for k, v in pure.items() if k not in frozen},
        {k: v for k, v in pure.items() if k in frozen},
    )


def model_parts(cfg: Config) -> tuple[ModelParts, dict]:
    """Shape-only model build: graph, state template, and logical axes of every parameter."""
    spec = BatchSpec.of(cfg)
    abstract = nnx.eval_shape(lambda: MultimodalLM(cfg.model, spec, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    frozen = tuple(k for k, f in FREEZE_SWITCHES.items() if k in state and f(cfg))
    return ModelParts(graphdef, state, frozen), param_axes(state)


def overlay(tree: dict, given: dict) -> dict:
    """`tree` with the leaves `given` has (same nesting) replaced by them."""
    out = dict(tree)
    for key, value in given.items():
        if key in out:
            out[key] = overlay(out[key], value) if isinstance(value, dict) else value
    return out


# ----------------------------------------------------------------------------- optimizer


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warm-up then cosine decay, global-norm clipping, no decay on vectors."""
    o = cfg.optim
    warmup = min(o.warmup_steps, max(cfg.train.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.train.steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )
    chain = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    chain.append(
        optax.adamw(
            schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
        )
    )
    return optax.chain(*chain), schedule


def decay_mask(params: dict) -> dict:
    """True for matrices (kernels, embeddings), False for norm scales and biases.

    By name, not ndim: scanned layers give a norm scale a leading `layers` dim.
    """
    decayed = lambda path, _: sharding.rules.key_parts(path)[-1] in ("kernel", "embedding")
    return jax.tree_util.tree_map_with_path(decayed, params)


# ----------------------------------------------------------------------------- train step


def make_loss_and_grads(parts: ModelParts) -> Callable:
    """(params, frozen, batch [M, D, ...]) -> (loss, grads) over all microbatches of a step.

    loss = sum of token losses / global count of loss tokens in the whole step, so the loss and
    the gradient do not depend on how the planner spread samples over devices or microbatches.
    Only `params` are differentiated: frozen modules get no gradient, and a frozen encoder with
    nothing trainable below it runs forward only.
    """

    def loss_fn(params, frozen, mb, denom):
        loss_sum, count = parts.merge(params, frozen).losses(mb)
        return loss_sum / denom, count

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, frozen, batch):
        denom = jnp.maximum(batch["llm_loss_mask"].sum(), 1.0)

        def microbatch(acc, mb):
            (loss, _), grads = grad_fn(params, frozen, mb, denom)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(microbatch, zero, batch)
        return loss, grads

    return loss_and_grads


def make_train_step(
    parts: ModelParts,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss_and_grads: Callable | None = None,
) -> Callable:
    """One optimizer step over all microbatches of a step batch [M, D, ...]; `loss_and_grads`
    (params, frozen, batch) -> (loss, grads) defaults to `make_loss_and_grads(parts)`."""
    loss_and_grads = loss_and_grads or make_loss_and_grads(parts)

    def train_step(state, batch):
        loss, grads = loss_and_grads(state["params"], state["frozen"], batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # A non-finite loss, gradient or updated parameter skips the update: params and
        # optimizer state stay. (An update can be non-finite with a finite gradient: an
        # overflowing step size, an optimizer state gone bad; no checkpoint may hold it.)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(params)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {
            **state,
            "params": keep(params, state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
            "step": state["step"] + 1,
        }
        metrics = {
            "nonfinite": 1.0 - finite.astype(jnp.float32),
            "loss": loss,
            "grad_norm": grad_norm,
            # The optimizer's own update count: it does not advance on skipped steps.
            "lr": schedule(
                optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")[0][1]
            ),
            "loss_tokens": jnp.maximum(batch["llm_loss_mask"].sum(), 1.0),
        }
        return new_state, metrics

    return train_step


def all_finite(tree) -> jax.Array:
    """Whether every element of every array of `tree` is finite (a scalar bool)."""
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


# ----------------------------------------------------------------------------- program


def init_state(cfg: Config, optimizer: optax.GradientTransformation, given: dict | None = None):
    """A fresh train state: trainable and frozen params, optimizer state, step 0.

    `given`: parameters that replace the random ones (pretrained weights: a nested dict keyed
    like the params, holding any subset of them). Under jit the random init of what they
    replace is dead code, so it is never computed.
    """
    params, frozen = build_model(cfg, cfg.train.seed)
    params, frozen = overlay(params, given or {}), overlay(frozen, given or {})
    return {
        "params": params,
        "frozen": frozen,
        "opt_state": optimizer.init(params),
        "step": jnp.zeros((), jnp.int32),
    }


@dataclasses.dataclass
class Program:
    """What a config compiles to on a mesh: shapes, shardings, init and the train step."""

    cfg: Config
    mesh: Any
    parts: ModelParts
    axes: dict
    optimizer: optax.GradientTransformation
    abstract: dict  # eval_shape of the train state
    shardings: dict  # NamedSharding per train-state leaf
    step: Callable  # jitted (state, batch) -> (state, metrics); the state is donated

    def abstract_sharded(self) -> dict:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract,
            self.shardings,
        )

    def init(self, given: dict | None = None) -> dict:
        """A fresh train state, created by a jitted init straight into its shardings; `given`
        parameters (pretrained, already in their shardings) replace the random ones."""
        init = lambda given: init_state(self.cfg, self.optimizer, given)
        return jax.jit(init, out_shardings=self.shardings, donate_argnums=0)(given or {})

    def abstract_params(self) -> dict:
        """Every parameter, trained and frozen, as a ShapeDtypeStruct with its sharding."""
        sharded = self.abstract_sharded()
        return {**sharded["params"], **sharded["frozen"]}

    def describe(self) -> str:
        params = {**self.abstract["params"], **self.abstract["frozen"]}
        return sharding.describe(self.axes, params, self.mesh)

    # A checkpoint holds the train state in a form that does not depend on the mesh; a
    # pipelined program (jaxmllm/step/stages/program.py) converts its own to and from it.

    def checkpoint_abstract(self) -> dict:
        """What a checkpoint restores into: shapes and shardings of the saved train state."""
        return self.abstract_sharded()

    def to_checkpoint(self, state: dict) -> dict:
        return state

    def from_checkpoint(self, state: dict) -> dict:
        return state


def build_program(cfg: Config, mesh) -> Program:
    """Abstract model -> logical axes -> physical shardings -> jitted train step.

    `cfg` must be resolved against the data (`resolve_batch`).
    """
    parts, axes = model_parts(cfg)
    optimizer, schedule = make_optimizer(cfg)
    abstract = jax.eval_shape(lambda: init_state(cfg, optimizer))
    sharding.validate(axes)
    trained = {k: v for k, v in axes.items() if k not in parts.frozen_keys}
    frozen = {k: v for k, v in axes.items() if k in parts.frozen_keys}
    shardings = {
        "params": sharding.param_shardings(trained, abstract["params"], mesh),
        "frozen": sharding.param_shardings(frozen, abstract["frozen"], mesh),
        "step": sharding.replicated(mesh),
    }
    shardings["opt_state"] = sharding.opt_state_shardings(
        optimizer, abstract["opt_state"], shardings["params"], mesh
    )
    # One compiled program; the state is donated so params are updated in place.
    step = jax.jit(
        make_train_step(parts, optimizer, schedule),
        donate_argnums=0,
        out_shardings=(shardings, sharding.replicated(mesh)),
    )
    return Program(cfg, mesh, parts, axes, optimizer, abstract, shardings, step)
