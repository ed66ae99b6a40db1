"""What trains in a model, as the cost model prices it: per module (an encoder, its projector,
the LLM) whether its base weights train, its LoRA adapters, and the training multiplier of its
forward cost.

Training multiplies a module's forward by 3 when its weights train (the forward, the gradient
of its activations, the gradient of its weights), by 2 when they are frozen but gradients still
pass through it (to something trainable below it, closer to the input, or to its own LoRA
adapters: activation gradients, no weight gradients of the base), by 1 when frozen with nothing
trainable below or inside (forward only). A LoRA adapter of rank r beside a d_in x d_out matrix
adds its own forward, 2 r (d_in + d_out) FLOPs a token, trained: times 3.

Reads a `ModelConfig` (a run's config.json read back as one: `calibrate._model_config`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxmllm.config.lora import ALL, LINEAR_TARGETS, PROJECTOR_TARGETS, block_targets
from jaxmllm.config.phases import ENCODERS, LLM

if TYPE_CHECKING:
    from jaxmllm.config import ModelConfig
    from jaxmllm.config.lora import LoraConfig


def multiplier(frozen: bool, trainable_below: bool, adapted: bool = False) -> int:
    """Training cost over forward cost: 3 trainable, 2 frozen that still passes gradients to
    something trainable below it or to its own adapters, 1 frozen with nothing trainable
    below or inside (forward only)."""
    if not frozen:
        return 3
    return 2 if trainable_below or adapted else 1


@dataclasses.dataclass(frozen=True)
class Module:
    """How one module trains."""

    frozen: bool  # its base weights get no gradient (frozen, or under adapters)
    rank: int  # its adapters' rank (0: none)
    targets: tuple[str, ...]  # the matrices with adapters
    multiplier: int  # its base's training cost over its forward's (`multiplier`)

    @property
    def trains(self) -> bool:
        """Whether anything in it gets a gradient."""
        return not self.frozen or self.rank > 0


def _lora(lora: LoraConfig) -> tuple[int, tuple[str, ...]]:
    """(rank, the targets named) of a tower's adapters; (0, ()) without adapters."""
    return lora.rank, lora.targets if lora.rank else ()


def _resolved(targets: tuple[str, ...], valid: tuple[str, ...]) -> tuple[str, ...]:
    """The matrices of `valid` (a tower's, by target name) that `targets` adapt (`all`: each)."""
    return valid if ALL in targets else tuple(t for t in valid if t in targets)


def modules(model: ModelConfig) -> dict[str, Module]:
    """Per module of the model (`vision`, `vision_projector`, ..., `llm`; enabled encoders
    only), how it trains."""
    out: dict[str, Module] = {}
    encoder_trains = False
    for p in ENCODERS:
        if not p.enabled(model):
            continue
        enc = p.encoder(model)
        rank, targets = _lora(enc.lora)
        frozen = enc.freeze or rank > 0
        targets = _resolved(targets, block_targets(enc.mlp))
        out[p.name] = Module(frozen, rank, targets, multiplier(frozen, False, rank > 0))
        encoder_trains |= out[p.name].trains
        rank, targets = _lora(model.projector_lora)
        kind = enc.projector
        targets = _resolved(targets, PROJECTOR_TARGETS[kind])
        frozen = model.projector_freeze or rank > 0
        below = out[p.name].trains
        m = multiplier(frozen, below, rank > 0)
        out[f"{p.name}_projector"] = Module(frozen, rank, targets, m)
    below = any(m.trains for m in out.values())
    rank, targets = _lora(model.llm.lora)
    frozen = model.llm.freeze or rank > 0
    valid = block_targets(model.llm.mlp)
    if model.llm.linear.enabled:  # (a hybrid's linear layers: matrices of their own)
        valid += LINEAR_TARGETS
    targets = _resolved(targets, valid)
    out[LLM] = Module(frozen, rank, targets, multiplier(frozen, below, rank > 0))
    return out


def adapter_flops(module: Module, shapes: dict[str, tuple[int, int]]) -> float:
    """Forward FLOPs a token of a module's adapters: 2 r (d_in + d_out) per adapted matrix
    (`shapes`: each matrix's (d_in, d_out) by its target name)."""
    return sum(2.0 * module.rank * sum(shapes[t]) for t in module.targets if t in shapes)


def block_shapes(d: int, d_kv: int, f: int, d_q: int = 0) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each matrix of a block, by target name."""
    d_q = d_q or d
    attention = {"q": (d, d_q), "k": (d, d_kv), "v": (d, d_kv), "o": (d_q, d)}
    return {**attention, "gate": (d, f), "up": (d, f), "down": (f, d), "fc1": (d, f), "fc2": (f, d)}
