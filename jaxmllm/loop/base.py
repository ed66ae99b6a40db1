"""The frozen base of a run with LoRA adapters: what identifies it, so adapters are never resumed
on another base than they were trained on.

Such a run's checkpoints hold no base (`jaxmllm.loop.checkpoint`): it is read again from
`model.init_from` at every start (drawn again from `train.seed` where nothing is named). Its
identity goes into every checkpoint's stamp: the sources, and a content hash of the base as
loaded, computed on the devices where it lives (`content_hash`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.config import Config, ConfigError
from sharding.rules import keyed_leaves


def check_base(where: str, saved: dict | None, now: dict | None) -> None:
    """Refuses to put a checkpoint's adapters (`where`: which checkpoint) on another base than
    they were trained on, naming the base each was read from (`model.init_from.*`, the seed)
    and their hashes."""
    if saved == now:
        return
    if saved is None or now is None:
        has = "holds" if now is None else "does not hold"
        raise ConfigError(
            f"{where} {has} a frozen base of its own, this config "
            f"{'has' if now is None else 'has no'} LoRA adapters (model.*.lora): resume it "
            "with the config it was trained with (its config.json), or use a new "
            "train.output_dir"
        )
    raise ConfigError(
        f"{where} holds LoRA adapters trained on the base {describe_base(saved)}, but the base "
        f"read now is {describe_base(now)}: adapters are only meaningful on their own base. "
        "Point model.init_from at the base they were trained on (restore its files if they "
        "changed), or use a new train.output_dir to train adapters on this one"
    )


def describe_base(identity: dict) -> str:
    """A base identity as a sentence: where it was read from, and its content hash."""
    named = [f"model.init_from.{k}={v}" for k, v in identity.get("init_from", {}).items() if v]
    rest = (
        ""
        if identity.get("complete")
        else f", the rest drawn from train.seed={identity.get('seed')}"
    )
    sources = (
        (", ".join(named) + rest) if named else f"drawn from train.seed={identity.get('seed')}"
    )
    return f"({sources}; content hash {identity.get('hash')})"


def base_identity(cfg: Config, base: Any, loaded: Any) -> dict:
    """What identifies a run's frozen base: the sources `model.init_from` names, the seed of
    what none of them fills, and `content_hash` of the base itself (`base`: the frozen
    parameters in their checkpoint form; `loaded`: the subset read from the sources)."""
    init = cfg.model.init_from
    sources = {k: getattr(init, k) for k in ("llm", "vision", "audio", "run")}
    complete = len(jax.tree.leaves(loaded)) == len(jax.tree.leaves(base))
    identity = {"init_from": sources, "complete": complete, "hash": content_hash(base)}
    if not complete:  # (a seed only identifies what it draws)
        identity["seed"] = cfg.train.seed
    return identity


def content_hash(tree: Any) -> str:
    """A hash of every parameter's bytes, shape, dtype and path, computed where the arrays
    live (a sharded base is never gathered): per leaf, the wrapping sums of its elements'
    bits mixed with their positions (two 32-bit lanes), then sha256 over them on the host.
    Integer sums do not depend on the order of summation, so neither on the sharding."""
    leaves = keyed_leaves(tree)
    sums = np.asarray(jax.device_get(_lane_sums(list(leaves.values()))))
    digest = hashlib.sha256()
    for (path, leaf), lanes in zip(leaves.items(), sums, strict=True):
        digest.update(f"{path}:{tuple(leaf.shape)}:{leaf.dtype}:{lanes.tolist()};".encode())
    return digest.hexdigest()[:32]


@jax.jit
def _lane_sums(leaves: list) -> jax.Array:
    """Every leaf's two 32-bit lane sums (`_mixed_sums`), stacked [leaves, 2], in one jitted
    program where the arrays live."""
    return jnp.stack([_mixed_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2))


def _mixed_sums(x: jax.Array) -> jax.Array:
    """One array's two lanes: each element's bits (8-byte ones as two 32-bit halves) mixed with
    its flat position by murmur3's finaliser under two seeds, summed with wrap-around;
    order-free, so any sharding gives the same sums."""
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if width is None:  # (8-byte values: their two halves)
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(*x.shape, 2)
    else:
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    index = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 0)
    for dim in range(1, bits.ndim):  # the flat position, wrapping
        index = index * jnp.uint32(bits.shape[dim]) + jax.lax.broadcasted_iota(
            jnp.uint32, bits.shape, dim
        )
    lanes = [_fmix(bits ^ _fmix(index * jnp.uint32(2) + jnp.uint32(s))) for s in (1, 2)]
    return jnp.stack([jnp.sum(lane, dtype=jnp.uint32) for lane in lanes])


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's finaliser: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)
