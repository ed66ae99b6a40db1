"""The SPMD layer: mesh, logical-axis rules, parameter/optimizer/batch shardings.

Usable on its own: nothing here imports jaxmllm. Typical start-up::

    mesh = make_mesh(cfg.mesh)
    validate(axes_tree)                      # fails fast on a bad rules table
    p_shard = param_shardings(axes_tree, abstract_params, mesh)
    print(describe(axes_tree, abstract_params, mesh))
    o_shard = opt_state_shardings(optimizer, abstract_opt_state, p_shard, mesh)
    batch = make_global_batch(host_batch, mesh)
"""

from .mesh import (
    AXES,
    CONTEXT_AXIS,
    DATA_AXES,
    EXPERT_AXIS,
    STAGE_AXIS,
    ShardingError,
    context_size,
    data_parallel_size,
    expert_size,
    make_mesh,
    resolve_axis_sizes,
    varying_as,
    varying_axes,
)
from .params import (
    batch_sharding,
    describe,
    local_dp_indices,
    make_global_batch,
    opt_state_shardings,
    param_shardings,
    replicated,
)
from .rules import (
    RULES,
    check_no_duplicate_axes,
    logical_to_spec,
    mesh_axes_of,
    resolve,
    validate,
)

__all__ = [
    "AXES",
    "CONTEXT_AXIS",
    "DATA_AXES",
    "EXPERT_AXIS",
    "RULES",
    "STAGE_AXIS",
    "ShardingError",
    "batch_sharding",
    "check_no_duplicate_axes",
    "context_size",
    "data_parallel_size",
    "expert_size",
    "describe",
    "local_dp_indices",
    "logical_to_spec",
    "make_global_batch",
    "make_mesh",
    "mesh_axes_of",
    "opt_state_shardings",
    "param_shardings",
    "replicated",
    "resolve",
    "resolve_axis_sizes",
    "validate",
    "varying_as",
    "varying_axes",
]
