"""Model sections: the encoders, the decoder, and how they compute."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxmllm.config.checks import check, positive


@dataclass(frozen=True)
class VisionConfig:
    """ViT over packed native-resolution patches (no fixed image size)."""

    enabled: bool = True  # build the vision encoder and feed images
    patch_size: int = 14  # patch side in pixels
    channels: int = 3  # image channels (RGB)
    width: int = 1024  # hidden size
    depth: int = 24  # transformer layers
    heads: int = 16  # attention heads
    mlp_dim: int = 4096  # gated-MLP inner width
    merge: int = 2  # projector merges merge x merge neighbouring patches into one LLM token
    rope_theta: float = 10000.0  # 2D rotary base
    freeze: bool = False  # no gradient and no optimizer state for the encoder

    def __post_init__(self):
        positive(self, "patch_size", "channels", "width", "depth", "heads", "mlp_dim", "merge")
        check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        check(
            (self.width // self.heads) % 4 == 0,
            "head dim must be divisible by 4 (2D RoPE)",
            "heads",
        )


@dataclass(frozen=True)
class AudioConfig:
    """Audio encoder: strided conv subsampling of packed log-mel frames, then a transformer."""

    enabled: bool = True  # build the audio encoder and feed audio clips
    n_mels: int = 80  # mel bins per frame
    subsample: int = 4  # frames per encoder output row (two stride-2 convs = 4)
    width: int = 768  # hidden size
    depth: int = 12  # transformer layers
    heads: int = 12  # attention heads
    mlp_dim: int = 3072  # gated-MLP inner width
    rope_theta: float = 10000.0  # rotary base
    freeze: bool = False  # no gradient and no optimizer state for the encoder

    def __post_init__(self):
        positive(self, "n_mels", "width", "depth", "heads", "mlp_dim")
        check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        check((self.width // self.heads) % 2 == 0, "head dim must be even (RoPE)", "heads")
        check(
            self.subsample == 4, "only subsample=4 (two stride-2 convs) is implemented", "subsample"
        )


@dataclass(frozen=True)
class LLMConfig:
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, gated MLP."""

    vocab_size: int = 32000  # tokenizer vocabulary incl. special tokens
    width: int = 2048  # hidden size
    depth: int = 16  # decoder layers
    heads: int = 16  # query heads
    kv_heads: int = 4  # key/value heads (GQA); must divide heads
    mlp_dim: int = 5632  # gated-MLP inner width
    rope_theta: float = 10000.0  # rotary base
    tie_embeddings: bool = False  # share input embedding and output projection
    freeze: bool = False  # no gradient and no optimizer state for the decoder

    def __post_init__(self):
        positive(self, "vocab_size", "width", "depth", "heads", "kv_heads", "mlp_dim")
        check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        check((self.width // self.heads) % 2 == 0, "head dim must be even (RoPE)", "heads")
        check(self.heads % self.kv_heads == 0, "kv_heads must divide heads", "kv_heads")
        check(self.vocab_size >= 264, "the byte tokenizer needs at least 264 ids", "vocab_size")


@dataclass(frozen=True)
class ModelConfig:
    """Encoders + projectors + LLM; each module replaceable and freezable."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    projector_freeze: bool = False  # freeze both projectors
    compute_dtype: str = "float32"  # activations/matmuls: float32 or bfloat16 (params stay fp32)
    param_dtype: str = "float32"  # master weights
    remat: bool = False  # rematerialise each transformer block in the backward pass
    # With remat, what each block keeps for the backward pass: nothing (only its input: least
    # memory, the forward runs twice) | dots (also its weight matmuls' outputs q, k, v, out,
    # gate, up, down: up to 4 * width + 2 * mlp_dim more values per token and layer, and only
    # attention and elementwise ops are recomputed)
    remat_policy: str = "nothing"
    # How attention reads packed rows: block_sparse computes only the (query block, key block)
    # tiles the documents span, listed by the planner (batch.*_tiles, batch.attention_block) |
    # dense: every pair of a row, masked (the reference; memory and time grow with row_len^2) |
    # cudnn: cuDNN's fused attention over the packed documents (GPU only)
    attention: str = "block_sparse"

    def __post_init__(self):
        check(self.attention in ATTENTIONS, f"must be one of {', '.join(ATTENTIONS)}", "attention")
        for key in ("compute_dtype", "param_dtype"):
            check(getattr(self, key) in ("float32", "bfloat16"), "must be float32 or bfloat16", key)
        check(
            self.remat_policy in REMAT_POLICIES,
            f"must be one of {', '.join(REMAT_POLICIES)}",
            "remat_policy",
        )


REMAT_POLICIES = ("nothing", "dots")  # jaxmllm.models.transformer.REMAT_POLICIES implements each
ATTENTIONS = ("block_sparse", "dense", "cudnn")
