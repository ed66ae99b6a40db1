"""Pipeline parallelism's plan (`mesh.stage` > 1): which layers and encoders run on which stage.

Rooms, bottom to top, pure Python and numpy: `schedule` (the tick tables), `costs` (what each
layer and each stack's ends cost per microbatch, from the cost model with the frozen
multipliers), `partition` (the frozen-aware partitioner), `choose` (per-step variants: the
cheapest program that holds a step's plan). The device side is `jaxmllm.step.stages`.
"""
