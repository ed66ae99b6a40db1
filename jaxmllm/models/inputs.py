"""An encoder phase's inputs as its first layer takes them (`jaxmllm.config.spec.Inputs`).

Pixels travel to the devices as uint8, a quarter of float32's bytes, and become the values the
host used to compute here: each through its channel's table of the 256 normalised values
(`Inputs.table`, float32, computed on the host with the arithmetic the host normalised with,
so the values are bit for bit the host's), padding (segment 0) zero as the host wrote it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.config.spec import Inputs


def decode(x: jax.Array, segment_ids: jax.Array, inputs: Inputs | None) -> jax.Array:
    """`x` [..., K * C] as the encoder's first layer takes it: uint8 pixels (C channels last)
    normalised by `inputs` (float32; 0 where `segment_ids` [...] is 0); anything else as it is."""
    if inputs is None or x.dtype != jnp.uint8:
        return x
    table = inputs.table()  # [C, 256]
    channels = np.arange(x.shape[-1]) % table.shape[0]
    index = x.astype(jnp.int32) + jnp.asarray(channels * 256, jnp.int32)
    values = jnp.take(jnp.asarray(table.reshape(-1)), index, mode="clip")
    return jnp.where((segment_ids > 0)[..., None], values, jnp.float32(0))
