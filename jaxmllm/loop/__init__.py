"""The training loop's parts: `checkpoint`, `guards` (stuck peer, non-finite steps,
preemption), `ledger`, `metrics`, `timings`, `evaluate` and its held-out `answers`.
`jaxmllm.train` puts them together; the process's set-up is `jaxmllm.process`."""
