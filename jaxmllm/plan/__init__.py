"""Step planning: which sample goes to which device, microbatch, row and offset, per phase.

Modules, bottom to top (each imports only those above it in this list):

- `contract`: capacities, the step plan, the Planner protocol, start-up and plan checks
- `stream`: the epoch-shuffled sample stream
- `ragged`: stable sorts and ragged-array primitives
- `capacity`: bucket capacities suggested from the data, on a ladder of shapes
- `baselines`: first_fit, naive, grain
- `balancer`: the balanced and orchestrated planners
- `registry`: the planners by name (`batch.planner`)
"""
