"""The feed: the grain iterator that plans a step, loads its samples, bucketizes them and puts
them on the devices, ahead of the trainer (`iterator`)."""
