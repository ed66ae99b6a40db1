"""LoRA: a low-rank update beside a frozen matrix (`jaxmllm/config/lora.py` configures it).

A `Dense` given an `Adapter` holds, beside its kernel W [in..., out...], `lora_a` [in..., r] and
`lora_b` [r, out...] (fp32 master weights, whatever the param dtype) and computes

    y = x W (+ b) + (alpha / r) * (dropout(x) A) B

as PEFT's LoRA does. A starts as PEFT's (uniform in +-1/sqrt(fan-in): kaiming_uniform with
a = sqrt(5)), B at zero, so a fresh adapter changes nothing. The adapters carry the kernel's
logical axes (the rank dim none): they are sharded like the matrix they adapt, and in a scanned
stack they stack on `layers` like it.

Dropout needs randomness only while training: the train step opens `dropout_key(key)` around
the loss; the scanned stacks fold each layer's index in (`salted`), so every layer and
microbatch draws its own mask. Without a key (evaluation, generation) there is no dropout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

LEAVES = ("lora_a", "lora_b")  # the adapters' parameter names, under their Dense
# Where each target sits in a block (transformer.Block) or a projector, by its name
BLOCK_PATHS = {
    "q": ("attn", "query"),
    "k": ("attn", "key"),
    "v": ("attn", "value"),
    "o": ("attn", "out"),
    "gate": ("mlp", "gate"),
    "up": ("mlp", "up"),
    "down": ("mlp", "down"),
    "fc1": ("mlp", "fc1"),
    "fc2": ("mlp", "fc2"),
    # a hybrid decoder's linear-attention layers (their `attn` is a deltanet.GatedDeltaNet)
    "in_qkv": ("attn", "qkv"),
    "in_z": ("attn", "z"),
    "in_b": ("attn", "b"),
    "in_a": ("attn", "a"),
    "out_proj": ("attn", "out"),
}
PROJECTOR_PATHS = {"fc1": ("fc1",), "fc2": ("fc2",), "fc": ("fc",)}
# Where each target sits in Gemma 4's audio conformer (conformer.ConformerBlock): its places
# (an MLP target: that matrix of both feed-forwards)
CONFORMER_PATHS = {
    "q": [("blocks", "attn", "query")],
    "k": [("blocks", "attn", "key")],
    "v": [("blocks", "attn", "value")],
    "o": [("blocks", "attn", "out")],
    "fc1": [("blocks", "ff1", "fc1"), ("blocks", "ff2", "fc1")],
    "fc2": [("blocks", "ff1", "fc2"), ("blocks", "ff2", "fc2")],
}
SALT = 0x4C6F5241  # folded into a kernel's init key for its adapter's A


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One matrix's adapter settings (static: they shape the program, not the parameters)."""

    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapters(lora, targets: Sequence[str]) -> tuple[tuple[str, Adapter], ...]:
    """(target, Adapter) of each target of a `config.lora.LoraConfig` (none without rank)."""
    if not lora.enabled:
        return ()
    one = Adapter(lora.rank, lora.alpha, lora.dropout)
    return tuple((t, one) for t in targets)


def is_adapter(path: Sequence[str]) -> bool:
    """Whether a parameter's path (its keys from the model's root) is an adapter's."""
    return bool(path) and path[-1] in LEAVES


# ----------------------------------------------------------------------------- parameters


def init_a(key: jax.Array, in_shape: tuple[int, ...], rank: int) -> jax.Array:
    """A [in..., rank], PEFT's init: uniform in +-1/sqrt(fan-in), float32."""
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    return jax.random.uniform(key, (*in_shape, rank), jnp.float32, -bound, bound)


def update(x: jax.Array, a: jax.Array, b: jax.Array, adapter: Adapter, dtype) -> jax.Array:
    """(alpha / r) * (dropout(x) A) B in `dtype`, contracting x's trailing dims with A's
    leading ones (as `Dense` contracts with its kernel)."""
    n_in = a.ndim - 1
    x = dropped(x, adapter.dropout).astype(dtype)
    contract_a = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    # (outputs in `dtype`, as the kernel's: a float32 output would make the backward's matmuls
    # float32 x float32 under bf16 compute)
    low = jnp.tensordot(x, a.astype(dtype), axes=contract_a, preferred_element_type=dtype)
    low = low * jnp.asarray(adapter.scale, dtype)  # [..., rank]: the scale on the small side
    return jnp.tensordot(low, b.astype(dtype), axes=((low.ndim - 1,), (0,)))


def merged(kernel: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + scale * A B of one layer's matrix (numpy, float32 sums), in the kernel's dtype."""
    n_in = a.ndim - 1
    a2 = np.asarray(a, np.float32).reshape(-1, a.shape[-1])
    b2 = np.asarray(b, np.float32).reshape(b.shape[0], -1)
    delta = (scale * (a2 @ b2)).reshape(*a.shape[:n_in], *b.shape[1:])
    return (np.asarray(kernel, np.float32) + delta).astype(kernel.dtype)


# ----------------------------------------------------------------------------- dropout


class _Scope:
    """The key dropout draws from here, and how many draws it has given (at trace time: each
    draw, and each scope opened inside, takes the next fold of the key)."""

    def __init__(self, key: jax.Array):
        self.key, self.count = key, 0

    def next(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("lora", default=None)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Adapters' dropout draws from `key` (a raw uint32 PRNG key) inside this block; None: no
    dropout."""
    token = _SCOPE.set(None if key is None else _Scope(key))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current_key() -> jax.Array | None:
    """A key of its own for a computation traced elsewhere (a pipeline's shard_map), None
    where no dropout key is open."""
    scope = _SCOPE.get()
    return None if scope is None else scope.next()


@contextlib.contextmanager
def salted(*salts) -> Iterator[None]:
    """A scope of its own inside the open one, its key folded with `salts` (a layer's index,
    a microbatch's: traced values too), so a scanned body draws other masks at every step;
    nothing changes without an open key."""
    scope = _SCOPE.get()
    if scope is None:
        yield
        return
    key = scope.next()
    for salt in salts:
        key = jax.random.fold_in(key, salt)
    with dropout_key(key):
        yield


def dropped(x: jax.Array, rate: float) -> jax.Array:
    """x with inverted dropout at `rate` under the open key, else x; each call its own mask."""
    scope = _SCOPE.get()
    if scope is None or rate == 0:
        return x
    keep = jax.random.bernoulli(scope.next(), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)
