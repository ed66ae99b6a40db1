"""Step planning: which sample goes to which device, microbatch, row and offset, per phase.

Modules, bottom to top (none imports one listed after it): `cost` (the cost model),
`contract` (capacities, plans, the Planner protocol, checks), `stream` (the sample stream),
`ragged` (sort and ragged-array primitives), `capacity` (capacity suggestion), `baselines`
(first_fit, naive, grain), `bins`, `rounds`, `pack` (packing one phase), `route` (locality and
route capacity), `work`, `select` (window and selection), `assign` (assignment strategies),
`balancer` (balanced and orchestrated), `registry` (planners by name), `sizing` (a config's
auto sizes resolved; its capacities), `stages` (pipeline parallelism's plan). See README.md here.
"""
