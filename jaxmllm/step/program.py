"""The train step: the model split into trained and frozen parts, the optimizer, the loss and
gradients over a step's microbatches, and the one compiled program a config becomes on a mesh.

    parts, axes = model_parts(cfg)          # shape-only model, logical axes of every parameter
    prog = build_program(cfg, mesh)         # shardings + jitted, state-donating train step
    state = prog.init()                     # or restored into prog.abstract_sharded()
    state, metrics = prog.step(state, batch)
"""

from __future__ import annotations

import dataclasses
import math
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
from jaxmllm.models import MultimodalLM, lora, moe, param_axes
from jaxmllm.step.grpo import make_grpo_loss_and_grads
from jaxmllm.step.preference import (
    make_preference_loss_and_grads,
    reference_keeps,
    uses_reference,
)
from jaxmllm.step.router import RouterLoss, add_microbatch, router_metrics
from jaxmllm.step.trees import join, overlay, split_tree

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
# Beside the modules frozen outright, those with LoRA adapters (`model.<tower>.lora`,
# `model.projector_lora`) train their adapters alone: the rest of such a module (its base) is
# frozen, leaf by leaf (`ModelParts.trains`).


def adapted_modules(cfg: Config, modules) -> tuple[str, ...]:
    """The top-level modules among `modules` whose adapters train (not frozen outright)."""
    frozen = {k for k, is_frozen in FREEZE_SWITCHES.items() if is_frozen(cfg)}
    return tuple(k for k in modules if k not in frozen and cfg.model.adapted(k))


# ----------------------------------------------------------------------------- model state


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """How to rebuild the model from pure-dict params: the graph and the state template."""

    graphdef: Any
    template: Any  # abstract nnx.State the pure dicts are poured into
    frozen_keys: tuple[str, ...]  # top-level modules whose params are not trained
    adapted: tuple[str, ...] = ()  # top-level modules that train their LoRA adapters alone

    def trains(self, path: tuple[str, ...]) -> bool:
        """Whether the parameter at `path` (keys from the model's root) is trained."""
        if path[0] in self.frozen_keys:
            return False
        return path[0] not in self.adapted or lora.is_adapter(path)

    def split(self, tree: dict) -> tuple[dict, dict]:
        """A tree keyed like the parameters (values, shapes, axes) as (trained, frozen)."""
        return split_tree(tree, self.trains)

    def merge(self, params: dict, frozen: dict) -> MultimodalLM:
        """The model with these parameters: a fresh copy of the state template filled with
        `params` and `frozen` joined, merged with the graph (traceable; nothing is copied on the
        host)."""
        state = jax.tree.map(lambda x: x, self.template)  # a fresh copy to fill
        nnx.replace_by_pure_dict(state, join(params, frozen))
        return nnx.merge(self.graphdef, state)


def build_model(cfg: Config, seed: int) -> tuple[dict, dict]:
    """Initialises the model; returns (trainable params, frozen params) as pure dicts."""
    return split_frozen(cfg, MultimodalLM(cfg.model, BatchSpec.of(cfg), rngs=nnx.Rngs(seed)))


def split_frozen(cfg: Config, model: MultimodalLM) -> tuple[dict, dict]:
    """A model's parameters as (trainable, frozen) pure dicts, by the config's freeze keys
    and adapters."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return _parts_of(cfg, pure).split(pure)


def _parts_of(cfg: Config, modules) -> ModelParts:
    """What trains of the top-level `modules` (no graph: `model_parts` has it)."""
    frozen = tuple(k for k, f in FREEZE_SWITCHES.items() if k in modules and f(cfg))
    return ModelParts(None, None, frozen, adapted_modules(cfg, modules))


def model_parts(cfg: Config, variant: int = 0) -> tuple[ModelParts, dict]:
    """Shape-only model build: graph, state template, and logical axes of every parameter; the
    model of a step of ladder `variant` (with a context degree per step a long variant's
    splits its rows over the context groups, the base's not: `BatchSpec.at`; the parameters
    are the same)."""
    spec = BatchSpec.of(cfg).at(variant)
    abstract = nnx.eval_shape(lambda: MultimodalLM(cfg.model, spec, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    which = _parts_of(cfg, state)
    parts = ModelParts(graphdef, state, which.frozen_keys, which.adapted)
    return parts, param_axes(state)


def base_dtypes(cfg: Config, frozen: dict) -> dict:
    """The frozen parameters in their towers' `base_dtype` (`model.<tower>.base_dtype`; the
    projectors keep theirs)."""
    out = dict(frozen)
    for tower in ("vision", "audio", "llm"):
        dtype = getattr(cfg.model, tower).base_dtype
        if dtype and tower in out:
            out[tower] = jax.tree.map(lambda x, d=dtype: x.astype(d), out[tower])
    return out


# ----------------------------------------------------------------------------- optimizer


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warm-up then cosine decay, global-norm clipping, no decay on vectors."""
    o = cfg.optim
    warmup = warmup_steps(cfg)
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
    scales = {"llm": cfg.model.llm.lr_scale}
    for p in ENCODERS:
        scales[p.name] = p.encoder(cfg.model).lr_scale
        scales[f"{p.name}_projector"] = cfg.model.projector_lr_scale
    scales = {name: s for name, s in scales.items() if s != 1.0}
    if scales:
        chain.append(scale_modules(scales))
    return optax.chain(*chain), schedule


def scale_modules(scales: dict[str, float]) -> optax.GradientTransformation:
    """AdamW's updates (its decoupled weight decay included) of the top-level modules in
    `scales` times their scale: the same as training each of them at that multiple of the
    learning rate (`model.<tower>.lr_scale`, `model.projector_lr_scale`). optax's `scale` on
    each module's leaves (`masked`); the others pass through."""

    def of(name: str):
        def mask(tree):
            top = lambda path, _: sharding.rules.key_parts(path)[0] == name  # noqa: E731
            return jax.tree_util.tree_map_with_path(top, tree)

        return mask

    return optax.chain(*(optax.masked(optax.scale(s), of(n)) for n, s in scales.items()))


def warmup_steps(cfg: Config) -> int:
    """The schedule's warm-up steps: optim.warmup_steps, held below the run's length."""
    return min(cfg.optim.warmup_steps, max(cfg.train.steps - 1, 0))


DECAYED = ("kernel", "embedding", *lora.LEAVES)  # the matrices weight decay shrinks


def decay_mask(params: dict) -> dict:
    """True for matrices (kernels, embeddings, LoRA adapters), False for norm scales and
    biases.

    By name, not ndim: scanned layers give a norm scale a leading `layers` dim.
    """
    decayed = lambda path, _: sharding.rules.key_parts(path)[-1] in DECAYED
    return jax.tree_util.tree_map_with_path(decayed, params)


# ----------------------------------------------------------------------------- train step


def make_loss_and_grads(parts: ModelParts, router: RouterLoss | None = None) -> Callable:
    """(params, frozen, batch [M, D, ...]) -> (loss, grads) over all microbatches of a step;
    with `router` (an MoE decoder's), (loss, grads, router metrics).

    loss = sum of token losses / global count of loss tokens in the whole step, so the loss and
    the gradient do not depend on how the planner spread samples over devices or microbatches.
    Only `params` are differentiated: frozen modules get no gradient, and a frozen encoder with
    nothing trainable below it runs forward only. An MoE decoder's router losses are added:
    each microbatch's load-balancing loss is the global batch's (its statistics are sums over
    every device's tokens, `models.moe`), and the step's is their mean over the microbatches.
    """

    def loss_fn(params, frozen, mb, denom, m):
        """One microbatch's token loss over the whole step's loss tokens (`denom`), so the
        microbatches' losses add up to the step's mean; with experts, the router losses a 1/m
        share each and their statistics."""
        model = parts.merge(params, frozen)
        if router is None:
            loss_sum, count = model.losses(mb)
            return loss_sum / denom, (count, None)
        loss_sum, count, stats = model.losses_and_router(mb)
        aux, z = moe.balance_loss(stats), moe.z_loss(stats)
        loss = loss_sum / denom + (router.aux * aux + router.z * z) / m
        return loss, (count, (stats, aux / m, z / m))

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, frozen, batch):
        """The step's loss and gradients summed over its microbatches (a scan over the batch's
        leading axis), and with experts the router statistics summed likewise."""
        denom = jnp.maximum(batch["llm_loss_mask"].sum(), 1.0)
        m = batch["llm_tokens"].shape[0]

        def microbatch(acc, xs):
            """Adds one microbatch's loss and gradients (and router statistics) to the running
            sums; the adapters' dropout salted by its index."""
            mb, i = xs
            with lora.salted(i):  # (the adapters' dropout: each microbatch its own masks)
                (loss, (_, routed)), grads = grad_fn(params, frozen, mb, denom, m)
            return add_microbatch(acc, (loss, grads), routed), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        if router is not None:  # (the statistics' shapes: one microbatch's, traced only)
            first = jax.tree.map(lambda x: x[0], batch)
            shapes = jax.eval_shape(lambda: grad_fn(params, frozen, first, denom, m)[0][1][1])
            zero = (*zero, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        out, _ = jax.lax.scan(microbatch, zero, (batch, jnp.arange(m)))
        if router is None:
            return out
        return out[0], out[1], router_metrics(router, *out[2])

    return loss_and_grads


def make_train_step(
    parts: ModelParts,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss_and_grads: Callable | None = None,
    dropout_seed: int | None = None,
) -> Callable:
    """One optimizer step over all microbatches of a step batch [M, D, ...]; `loss_and_grads`
    (params, frozen, batch) -> (loss, grads[, metrics]) defaults to
    `make_loss_and_grads(parts)`.
    `dropout_seed`: the adapters' dropout draws from it and the step (None: no dropout)."""
    loss_and_grads = loss_and_grads or make_loss_and_grads(parts)

    def train_step(state, batch):
        """One optimizer step: loss and gradients over the batch, the update applied only when
        the loss, the gradient norm and the new parameters are finite (else state kept and
        `nonfinite` set); returns the new state and the step's metrics."""
        key = None
        if dropout_seed is not None:
            key = jax.random.fold_in(jax.random.PRNGKey(dropout_seed), state["step"])
        more = {"reference": state["reference"]} if "reference" in state else {}
        with lora.dropout_key(key):
            loss, grads, *extra = loss_and_grads(state["params"], state["frozen"], batch, **more)
        grad_norm = optax.tree.norm(grads)

        def updated():
            """The parameters and optimizer state after applying this step's gradients."""
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            return optax.apply_updates(state["params"], updates), opt_state

        # A non-finite loss, gradient or updated parameter skips the update: params and
        # optimizer state stay. (An update can be non-finite with a finite gradient: an
        # overflowing step size, an optimizer state gone bad; no checkpoint may hold it.)
        # The updated parameters are computed twice: once to be checked only (each leaf's
        # update fused into its finiteness reduction, never stored), then under a cond that
        # keeps the old state otherwise, updating it in place. Selecting between a computed new
        # state and the old one held both whole at once: 17.8 GiB of the 30B-A3B recipe's
        # 88.9 GiB per GPU (bench.memory), for one more elementwise pass over the state.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(updated()[0])
        kept = lambda: (state["params"], state["opt_state"])
        params, opt_state = jax.lax.cond(finite, updated, kept)
        new_state = {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1}
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
        for more in extra:  # (an MoE decoder's router metrics)
            metrics.update(more)
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
    frozen = base_dtypes(cfg, frozen)
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
    # Which parameters a preference run's reference policy holds (None: no reference)
    reference_keeps: Callable | None = None
    # With a context degree per step (mesh.context_steps: long): the long variants' model,
    # which splits their rows over the context groups, and its train step (as `step`); None
    # where every step's model is `parts`'
    long_parts: ModelParts | None = None
    long_step: Callable | None = None

    def parts_of(self, variant: int) -> ModelParts:
        """The model of a step of ladder `variant` (`jaxmllm.plan.ladder`; 0: the base)."""
        return self.long_parts if variant and self.long_parts is not None else self.parts

    def step_of(self, variant: int) -> Callable:
        """The train step of a step of ladder `variant` (`StepInfo.long`): the long variants'
        own with a context degree per step, else `step`."""
        return self.long_step if variant and self.long_step is not None else self.step

    def abstract_sharded(self) -> dict:
        """The train state's shapes and dtypes with their shardings (ShapeDtypeStruct leaves), as
        a restore or a compile takes them."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract,
            self.shardings,
        )

    def init(self, given: dict | None = None) -> dict:
        """A fresh train state, created by a jitted init straight into its shardings; `given`
        parameters (pretrained, already in their shardings) replace the random ones."""
        init = lambda given: init_state(self.cfg, self.optimizer, given)
        out = {k: v for k, v in self.shardings.items() if k != "reference"}
        return jax.jit(init, out_shardings=out, donate_argnums=0)(given or {})

    def initial_weights(self, given: dict | None = None) -> dict:
        """{"params", "frozen"} of a fresh state (`init`'s, with no optimizer state made):
        what a preference run's reference policy starts from."""
        keys = ("params", "frozen")
        init = lambda given: {k: init_state(self.cfg, self.optimizer, given)[k] for k in keys}
        out = {k: self.shardings[k] for k in keys}
        return jax.jit(init, out_shardings=out, donate_argnums=0)(given or {})

    def abstract_params(self) -> dict:
        """Every parameter, trained and frozen, as a ShapeDtypeStruct with its sharding."""
        sharded = self.abstract_sharded()
        return join(sharded["params"], sharded["frozen"])

    def describe(self) -> str:
        """The start-up table of every parameter's shape, logical axes, spec and local shape,
        with totals; with experts, the share of the parameters a token uses."""
        params = join(self.abstract["params"], self.abstract["frozen"])
        text = sharding.describe(self.axes, params, self.mesh)
        moe = self.cfg.model.llm.moe
        if moe.enabled:  # (a token visits top_k of the experts: what a step computes)
            total, active = active_parameters(params, moe.top_k / moe.experts)
            text += (
                f"\n{active:,} of the {total:,} parameters active a token (top {moe.top_k} of "
                f"{moe.experts} experts a layer: {active / total:.1%})"
            )
        return text

    # The train state's other forms, each named by what it is: what a checkpoint saves
    # (`saved`, restored by `restored`), and the model's weights as a reader outside the step
    # takes them (`weights`: evaluation, an adapter run's base). Both hold stacks in a form the
    # mesh does not change: a pipelined program (jaxmllm/step/stages/program.py) converts its
    # own to and from it. With LoRA adapters a checkpoint holds no frozen base: that is read
    # again at every start (`saves_base`).

    @property
    def saves_base(self) -> bool:
        """Whether checkpoints hold the frozen parameters: not with adapters (their base is
        read again from model.init_from, `jaxmllm.loop.base`)."""
        return not self.parts.adapted

    def saved_abstract(self) -> dict:
        """What a checkpoint restores into: the shapes and shardings of `saved(state)`."""
        return self._less_base(self.abstract_sharded())

    def saved(self, state: dict) -> dict:
        """What a checkpoint saves of a train state (`saved_abstract`'s tree)."""
        return self._less_base(state)

    def restored(self, saved: dict, base: dict | None) -> dict:
        """The train state from what a checkpoint restored (`saved`'s tree) and, where that
        holds none, the frozen base (`weights(fresh)["frozen"]` of the base read again)."""
        return saved if base is None else {**saved, "frozen": base}

    def weights(self, state: dict) -> dict:
        """The model's parameters of a train state, {"params", "frozen"} (and "reference",
        a preference run's reference policy's own leaves), as a reader outside the step takes
        them (the form checkpoints hold: `abstract_params`)."""
        out = {"params": state["params"], "frozen": state["frozen"]}
        if "reference" in state:
            out["reference"] = state["reference"]
        return out

    # A preference run's reference policy (`jaxmllm.step.preference`): the leaves where it
    # differs from the policy's frozen parameters, in the policy's shardings, neither trained
    # nor saved: read again at every start (`with_reference`), as an adapter run's base.

    def reference_of(self, tree: dict) -> dict:
        """The leaves of a tree keyed like every parameter (`join(params, frozen)`) that the
        state's `reference` holds (`preference.reference_keeps`); {} for a run without one."""
        if not self.reference_keeps:
            return {}
        return split_tree(tree, self.reference_keeps)[0]

    def with_reference(self, state: dict, weights: dict) -> dict:
        """`state` with its reference policy taken from `weights` ({"params", "frozen"}: the
        starting weights, or a reference checkpoint's), copied (never the policy's buffers,
        which the step donates)."""
        if not self.reference_keeps:
            return state
        ref = self.reference_of(join(weights["params"], weights["frozen"]))
        copy = lambda t: jax.tree.map(jnp.copy, t)
        return {**state, "reference": jax.jit(copy, out_shardings=self.shardings["reference"])(ref)}

    def _less_base(self, tree: dict) -> dict:
        """A train-state tree less its frozen base when checkpoints do not hold it, and less
        its reference policy (never saved)."""
        drop = {"reference"} if self.saves_base else {"frozen", "reference"}
        return {k: v for k, v in tree.items() if k not in drop}


def active_parameters(params: dict, share: float) -> tuple[int, int]:
    """(every parameter, those a token uses): a mixture of experts' routed experts count at
    `share` (top_k / experts), their adapters too."""
    total = active = 0
    for path, leaf in sharding.rules.keyed_leaves(params).items():
        n = math.prod(leaf.shape)
        total += n
        active += round(n * share) if "/mlp/experts/" in path else n
    return total, active


def build_program(cfg: Config, mesh) -> Program:
    """Abstract model -> logical axes -> physical shardings -> jitted train step.

    `cfg` must be resolved against the data (`resolve_batch`).
    """
    parts, axes = model_parts(cfg)
    optimizer, schedule = make_optimizer(cfg)
    abstract = jax.eval_shape(lambda: init_state(cfg, optimizer))
    sharding.validate(axes)
    trained, frozen = parts.split(axes)
    shardings = {
        "params": sharding.param_shardings(trained, abstract["params"], mesh),
        "frozen": sharding.param_shardings(frozen, abstract["frozen"], mesh),
        "step": sharding.replicated(mesh),
    }
    shardings["opt_state"] = sharding.opt_state_shardings(
        optimizer, abstract["opt_state"], shardings["params"], mesh
    )
    # A preference run's reference policy: its own leaves, sharded as the policy's
    keeps = reference_keeps(cfg, parts) if uses_reference(cfg) else None
    if keeps is not None:
        every = join(shardings["params"], shardings["frozen"])
        shardings["reference"] = split_tree(every, keeps)[0]
        every = join(abstract["params"], abstract["frozen"])
        abstract = {**abstract, "reference": split_tree(every, keeps)[0]}
    # One compiled program (one per step shape); the state is donated so params are updated
    # in place. A context degree per step: the long variants' model splits rows over groups.
    step = jit_train_step(cfg, parts, optimizer, schedule, shardings, mesh)
    long_parts = long_step = None
    if BatchSpec.of(cfg).long_context:
        long_parts = model_parts(cfg, 1)[0]
        long_step = jit_train_step(cfg, long_parts, optimizer, schedule, shardings, mesh)
    return Program(
        cfg, mesh, parts, axes, optimizer, abstract, shardings, step, keeps, long_parts, long_step
    )


def jit_train_step(cfg: Config, parts: ModelParts, optimizer, schedule, shardings, mesh):
    """The jitted train step of model `parts` (the state donated, kept in `shardings`), with
    the loss of train.objective."""
    if cfg.train.objective == "dpo":
        loss_and_grads = make_preference_loss_and_grads(cfg, parts, RouterLoss.of(cfg))
    elif cfg.train.objective == "grpo":
        loss_and_grads = make_grpo_loss_and_grads(cfg, parts, RouterLoss.of(cfg))
    else:
        loss_and_grads = make_loss_and_grads(parts, RouterLoss.of(cfg))
    return jax.jit(
        make_train_step(
            parts, optimizer, schedule, loss_and_grads, dropout_seed=dropout_seed(cfg, parts)
        ),
        donate_argnums=0,
        out_shardings=(shardings, sharding.replicated(mesh)),
    )


def dropout_seed(cfg: Config, parts: ModelParts) -> int | None:
    """The seed of the adapters' dropout masks (`train.seed`), None when no trained adapter
    drops anything."""
    rates = [cfg.model.lora_of(m).dropout for m in parts.adapted]
    return cfg.train.seed if any(r > 0 for r in rates) else None
