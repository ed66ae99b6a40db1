"""The feed: the grain iterator that plans a step, loads its samples, bucketizes them and puts
them on the devices, ahead of the trainer (`iterator`); `info` (what a step carries beside its
arrays, `StepInfo`), `times` (each step's time per stage)."""
