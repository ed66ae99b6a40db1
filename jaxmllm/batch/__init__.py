"""A step's plan and loaded samples made into the fixed-shape batch contract.

Rooms, bottom to top: `context` (a context group's rows dealt to its devices), `bucketize` (the
batch contract's arrays, the routing tables), `counts` (what a batch holds: real tokens, FLOPs,
each bucket's work), `prompts` (generation's prompts laid out as a batch).
"""
