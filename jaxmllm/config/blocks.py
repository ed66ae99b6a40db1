"""What every transformer block of a tower is made of (`BlockOptions`), shared by the encoders'
and the decoder's sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxmllm.config.checks import check
from jaxmllm.config.lora import LoraConfig, block_targets
from jaxmllm.config.remat import REMAT_POLICIES

NORMS = ("rms", "rms_offset", "layer")  # jaxmllm.models.layers.NORMS implements each
# jaxmllm.models.layers.make_mlp
MLPS = ("gated_silu", "gated_gelu_tanh", "gelu_tanh", "gelu", "quick_gelu", "silu")
GATED_MLPS = ("gated_silu", "gated_gelu_tanh")  # three matrices (gate, up, down), not two
ACTIVATIONS = ("gelu_tanh", "gelu")  # projector activations (jaxmllm.models.layers.ACTIVATIONS)


@dataclass(frozen=True)
class BlockOptions:
    """What each transformer block of a tower is made of; the defaults are jaxmllm's own blocks.

    HuggingFace families set them (`python -m jaxmllm.hf import` writes them from config.json):
    Llama / Qwen2 / Qwen3 decoders rms + gated_silu (Qwen2: attn_bias qkv; Qwen3: qk_norm),
    SigLIP layer + gelu_tanh + biases, CLIP layer + quick_gelu + biases, the Qwen2-VL vision
    tower layer + quick_gelu + biases, Qwen2.5-VL's rms + gated_silu + biases, Whisper layer +
    gelu + qvo.
    """

    # rms (RMSNorm) | rms_offset (RMSNorm scaling by 1 + its weight, stored zero-centred:
    # Qwen3.5's, QK-norm's too) | layer (LayerNorm with a bias), before attention and MLP
    norm: str = "rms"
    norm_eps: float = 1e-6  # the norms' epsilon (Llama 1e-5, Qwen2 1e-6, Whisper 1e-5)
    # MLP: gated_silu = down(silu(gate x) * up x) | gated_gelu_tanh = the same with the tanh
    # GELU (Gemma's GeGLU) | gelu_tanh, gelu (exact), quick_gelu (x * sigmoid(1.702 x)) =
    # fc2(act(fc1 x)); silu the same with SiLU (the conformer's feed-forwards)
    mlp: str = "gated_silu"
    attn_bias: str = ""  # attention projections with a bias: any of q, k, v, o, e.g. "qkv"
    mlp_bias: bool = False  # biases on the MLP's projections
    # RMSNorm over each head's queries and keys before the rotary positions (Qwen3's QK-norm,
    # a learned scale of head_dim each, norm_eps)
    qk_norm: bool = False
    # This tower's remat policy (one of config.remat.REMAT_POLICIES); "" = model.remat's
    remat: str = ""
    # LoRA adapters on the blocks' matrices (jaxmllm/config/lora.py): rank > 0 freezes the
    # tower's base weights and trains the adapters, e.g. {rank: 64, alpha: 128, targets: all}
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The frozen base's storage dtype (a frozen tower or one with adapters): float32 |
    # bfloat16 (half the memory; it is computed in model.compute_dtype anyway) | "" =
    # model.param_dtype
    base_dtype: str = ""

    @property
    def adapter_targets(self) -> tuple[str, ...]:
        """The block matrices with adapters (none without `lora.rank`)."""
        return self.lora.resolve(self.block_matrices()) if self.lora.enabled else ()

    def block_matrices(self) -> tuple[str, ...]:
        """The matrices of the blocks, as LoRA targets name them."""
        return block_targets(self.mlp)

    def __post_init__(self):
        self.lora.resolve(self.block_matrices(), "lora.targets", f"{self.mlp} blocks")
        check(
            self.base_dtype in ("", "float32", "bfloat16"),
            "must be float32, bfloat16 or empty (model.param_dtype)",
            "base_dtype",
        )
        check(self.norm in NORMS, f"must be one of {', '.join(NORMS)}", "norm")
        check(
            self.remat in ("", *REMAT_POLICIES),
            f"must be one of {', '.join(REMAT_POLICIES)} (or empty: model.remat's)",
            "remat",
        )
        check(self.mlp in MLPS, f"must be one of {', '.join(MLPS)}", "mlp")
        check(self.norm_eps > 0, "must be > 0", "norm_eps")
        check(
            set(self.attn_bias) <= set("qkvo") and len(set(self.attn_bias)) == len(self.attn_bias),
            f"{self.attn_bias!r}: must be letters of 'qkvo' (each at most once), e.g. 'qkv'",
            "attn_bias",
        )
