"""Step planning: which sample goes to which device, microbatch, row and offset, per phase.

Modules, bottom to top (each imports only modules listed before it, and jaxmllm.data.samples):

- `contract`: capacities, the step plan, the Planner protocol, start-up and plan checks
- `stream`: the epoch-shuffled sample stream
- `ragged`: stable sorts and ragged-array primitives
- `capacity`: bucket capacities suggested from the data, on a ladder of shapes
- `baselines`: first_fit, naive, grain
- `rounds`: packing rounds (the sequential greedy, many items at a time)
- `pack`: one phase's items to bins, equal fill and attention cost
- `route`: encoder items brought home, the route capacity
- `work`: per-sample work per phase, one microbatch's buckets
- `select`: the step's window and each microbatch's selection
- `assign`: assignment strategies (joint for `balanced`, routed for `orchestrated`)
- `balancer`: the balanced planners' step (select, assign, defer, emit)
- `registry`: the planners by name (`batch.planner`)
"""
