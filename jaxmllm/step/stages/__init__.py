"""Pipeline parallelism on the devices (`mesh.stage` > 1), over `jaxmllm.pipeline`' plan.

Rooms, bottom to top: `layout` (the train state's [stage, slots, ...] form and the checkpoint's
[depth, ...] one), `loop` (the shard_map tick loop: stages, ppermute, the head's loss), `program`
(the pipelined `Program`).
"""
