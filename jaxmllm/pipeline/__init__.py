"""Pipeline parallelism over the `stage` mesh axis (`mesh.stage` > 1).

Rooms, bottom to top: `schedule` (the tick tables, pure Python), `costs` (what each layer and
each stack's ends cost per microbatch, pure Python), `partition` (the frozen-aware partitioner,
pure Python), then the device side on jax.
"""
