"""The training loop's parts: `distributed` (jax.distributed start-up), `checkpoint`, `guards`
(stuck peer, non-finite steps, preemption), `ledger`, `metrics`, `timings`, `evaluate` and its
held-out `answers`. `jaxmllm.train` puts them together."""
