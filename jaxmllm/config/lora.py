"""LoRA adapters by config: `model.<tower>.lora` (llm, vision, audio) and `model.projector_lora`.

A tower with adapters (`rank` > 0) keeps its base weights frozen (no gradient, no optimizer
state; stored in `model.<tower>.base_dtype` if set) and trains, beside each targeted matrix W,
two small ones A [in, rank] and B [rank, out] (fp32 master weights): the matrix then computes
`x W + (alpha / rank) * dropout(x) A B`, PEFT's LoRA. B starts at zero, so a fresh adapter
changes nothing.

Targets are named as the blocks name their matrices: the attention's q, k, v, o; a gated MLP's
gate, up, down, another MLP's fc1, fc2 (`model.<tower>.mlp`); a hybrid decoder's
linear-attention in_qkv, in_z, in_b, in_a, out_proj (`model.llm.linear`); a projector's fc1, fc2
(fc: the linear audio projector). `all` is every matrix of the blocks (or projectors).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmllm.config.checks import check

ATTENTION = ("q", "k", "v", "o")
# A hybrid decoder's linear-attention layers (Gated DeltaNet): transformers' in_proj_qkv,
# in_proj_z, in_proj_b, in_proj_a and out_proj
LINEAR_TARGETS = ("in_qkv", "in_z", "in_b", "in_a", "out_proj")
# A block's matrices by its MLP kind (config.blocks.MLPS): the gated ones', else fc1 / fc2
GATED = (*ATTENTION, "gate", "up", "down")
BLOCK_TARGETS = {"gated_silu": GATED, "gated_gelu_tanh": GATED}
OTHER_MLP = (*ATTENTION, "fc1", "fc2")
# A projector's matrices by its kind (config.model.PROJECTORS)
PROJECTOR_TARGETS = {"mlp": ("fc1", "fc2"), "linear": ("fc",), "pool": ("fc",), "embed": ("fc",)}
ALL = "all"


def block_targets(mlp: str) -> tuple[str, ...]:
    """The matrices of a block whose MLP is `mlp`, as targets name them."""
    return BLOCK_TARGETS.get(mlp, OTHER_MLP)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a tower's matrices (see the module docstring)."""

    rank: int = 0  # the adapters' rank r; 0: none (the tower trains or freezes by `freeze`)
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on each adapter's input while training (PEFT's lora_dropout)
    # The matrices that get adapters, by their names in the blocks: q, k, v, o and gate, up,
    # down (gated MLP) or fc1, fc2; a projector's fc1, fc2 (fc); all: every one of them
    targets: tuple[str, ...] = (ALL,)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        check(self.rank >= 0, "must be >= 0 (0: no adapters)", "rank")
        check(self.alpha > 0, "must be > 0 (the update is scaled by alpha / rank)", "alpha")
        check(0 <= self.dropout < 1, "must be in [0, 1)", "dropout")
        check(
            len(self.targets) > 0 and all(isinstance(t, str) and t for t in self.targets),
            "must name at least one matrix (q, k, v, o, gate, up, down, fc1, fc2) or all",
            "targets",
        )
        check(len(set(self.targets)) == len(self.targets), "names a matrix twice", "targets")

    def resolve(
        self, valid: tuple[str, ...], key: str = "targets", where: str = "the blocks"
    ) -> tuple[str, ...]:
        """The targets among `valid` (in its order): `all` is every one; an unknown name is a
        ConfigError naming the valid ones (`where`: whose matrices they are)."""
        if ALL in self.targets:
            return valid
        unknown = [t for t in self.targets if t not in valid]
        check(
            not unknown,
            f"{', '.join(map(repr, unknown))}: {where} have no such matrix; valid: "
            f"{', '.join(valid)} (or all)",
            key,
        )
        return tuple(t for t in valid if t in self.targets)
