"""What a config with `mesh.stage` > 1 compiles to: the partition plan, the pipelined train
state (`[stage, slots, ...]` stacks, the stage dim split over the `stage` axis), the jitted step
and the conversion of the state to and from its checkpoint form (`[depth, ...]`, as without a
pipeline, so a checkpoint resumes under any stage count).

    prog = build_program(cfg, mesh)   # step.build_program when mesh.stage == 1
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import sharding
from jaxmllm.config import Config
from jaxmllm.pipeline.choose import plan_of
from jaxmllm.pipeline.partition import Plan
from jaxmllm.step import program as unpipelined
from jaxmllm.step.stages.layout import Layout
from jaxmllm.step.stages.loop import pipeline_loss
from sharding import STAGE_AXIS


@dataclasses.dataclass
class PipelineProgram(unpipelined.Program):
    """A `Program` whose state holds pipelined stacks; checkpoints hold the `[depth, ...]` form."""

    plan: Plan = None
    layout: Layout = None
    checkpoint_shardings: dict = None
    depth_abstract: dict = None

    def __post_init__(self):  # the conversions, compiled once each
        saved = self._less_base(self.checkpoint_shardings)  # (no base: it is not converted)
        self._saved_depth = jax.jit(self.layout.to_depth, out_shardings=saved)
        self._stages = jax.jit(self.layout.to_stages, out_shardings=self.shardings)
        weights = {k: self.checkpoint_shardings[k] for k in ("params", "frozen")}
        self._weights_depth = jax.jit(self.layout.to_depth, out_shardings=weights)

    def init(self, given: dict | None = None) -> dict:
        """A fresh pipelined train state; `given` parameters ([depth, ...] form, as
        `abstract_params` describes them) replace the random ones."""
        init = lambda given: self.layout.to_stages(
            unpipelined.init_state(self.cfg, self.optimizer, given)
        )
        return jax.jit(init, out_shardings=self.shardings)(given or {})

    def abstract_params(self) -> dict:
        """Every parameter in its [depth, ...] (checkpoint) form, with that form's sharding."""
        saved = self._depth_sharded()
        return unpipelined.join(saved["params"], saved["frozen"])

    def describe(self) -> str:
        """The parameter table, then the pipeline plan (stages, schedule, predicted bubble)."""
        return super().describe() + "\n" + self.plan.describe()

    def _depth_sharded(self) -> dict:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.depth_abstract,
            self.checkpoint_shardings,
        )

    def saved_abstract(self) -> dict:
        """What a checkpoint restores into: the [depth, ...] form's shapes and shardings (the
        frozen base left out), so checkpoints do not depend on the stage count."""
        return self._less_base(self._depth_sharded())

    def saved(self, state: dict) -> dict:
        """The state in the [depth, ...] form a checkpoint holds (the frozen base left out)."""
        return self._saved_depth(self._less_base(state))

    def restored(self, saved: dict, base: dict | None) -> dict:
        """The train state from a checkpoint's [depth, ...] form, converted to this layout's
        [stage, slots, ...]."""
        return self._stages(super().restored(saved, base))

    def weights(self, state: dict) -> dict:
        """The model's parameters in the [depth, ...] form readers outside the step take
        (evaluation, export)."""
        return self._weights_depth(super().weights(state))


def build_program(cfg: Config, mesh) -> unpipelined.Program:
    """`step.build_program`, pipelined over the mesh's `stage` axis when it has more than one."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages == 1:
        return unpipelined.build_program(cfg, mesh)
    plan = plan_of(cfg, stages)
    layout = Layout.of(plan)
    parts, axes = unpipelined.model_parts(cfg)
    optimizer, schedule = unpipelined.make_optimizer(cfg)
    depth = jax.eval_shape(lambda: unpipelined.init_state(cfg, optimizer))
    abstract = jax.eval_shape(layout.to_stages, depth)
    stage_axes = layout.axes(axes)
    shardings = _shardings(stage_axes, abstract, parts, optimizer, mesh, sharding.RULES)
    # Checkpoints: the [depth, ...] stacks, their layers split over the stages where they divide.
    saved = _shardings(axes, depth, parts, optimizer, mesh, {**sharding.RULES, "layers": "stage"})
    loss = pipeline_loss(parts, layout)
    dropout = unpipelined.dropout_seed(cfg, parts)
    train_step = unpipelined.make_train_step(
        parts, optimizer, schedule, jax.value_and_grad(loss), dropout_seed=dropout
    )
    step = jax.jit(
        train_step,
        donate_argnums=0,
        out_shardings=(shardings, sharding.replicated(mesh)),
    )
    return PipelineProgram(
        cfg,
        mesh,
        parts,
        stage_axes,
        optimizer,
        abstract,
        shardings,
        step,
        plan=plan,
        layout=layout,
        checkpoint_shardings=saved,
        depth_abstract=depth,
    )


def _shardings(axes, abstract, parts, optimizer, mesh, rules) -> dict[str, Any]:
    """NamedShardings of a train state (params, frozen, optimizer state, step) under `rules`."""
    sharding.validate(axes, rules)
    trained, frozen = parts.split(axes)
    out = {
        "params": sharding.param_shardings(trained, abstract["params"], mesh, rules),
        "frozen": sharding.param_shardings(frozen, abstract["frozen"], mesh, rules),
        "step": sharding.replicated(mesh),
    }
    out["opt_state"] = sharding.opt_state_shardings(
        optimizer, abstract["opt_state"], out["params"], mesh
    )
    return out
