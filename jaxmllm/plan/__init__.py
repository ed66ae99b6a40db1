"""Step planning: which sample goes to which device, microbatch, row and offset, per phase.

Modules, bottom to top (none imports one listed after it): `contract` (capacities, plans, the
Planner protocol, checks), `stream` (the sample stream), `ragged` (sort and ragged-array
primitives), `baselines` (first_fit, naive, grain), `bins`, `rounds`, `pack` (packing one
phase), `route` (locality and route capacity), `work`, `select` (window and selection),
`assign` (assignment strategies), `balancer` (balanced and orchestrated), `registry` (planners
by name). The cost model is `jaxmllm.cost`; a config's sizes resolved by dry runs of these
planners, `jaxmllm.resolve`; pipeline parallelism's plan, `jaxmllm.pipeline`. See README.md
here.
"""
