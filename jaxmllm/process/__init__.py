"""The process, set up before JAX starts a backend: `distributed` (jax.distributed start-up,
the job's shape), `xla_flags` (XLA's GPU flag set), `cpu_pool` (XLA:CPU's thread pool against
the collective deadlock), `late_io` (orbax's abandoned reads and writes, counted)."""
