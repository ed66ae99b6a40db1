"""What training costs: `training` (each module's multiplier: trainable, frozen with gradients
through it, frozen with none), `flops` (a layer's analytic FLOPs), `model` (the per-phase cost
model, from the model config or a calibrated file), `calibrate` (its fit on a run's measured
step times: `python -m jaxmllm.cost.calibrate RUN_DIR`)."""
