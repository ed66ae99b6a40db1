"""Model sections: the encoders, the decoder, and how they compute."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jaxmllm.config.blocks import ACTIVATIONS, BlockOptions
from jaxmllm.config.checks import check, lr_scale_valid, positive
from jaxmllm.config.decoder import LLMConfig
from jaxmllm.config.lora import PROJECTOR_TARGETS, LoraConfig
from jaxmllm.config.remat import REMAT_POLICIES, upgrade_legacy

RESIZES = ("bicubic", "bilinear")  # how a learned position table meets an image's grid


@dataclass(frozen=True)
class VisionConfig(BlockOptions):
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
    # Where patches learn their place: rope (2D rotary by row and column in every attention) |
    # learned (SigLIP: a table of position_grid x position_grid rows added to the patch
    # embeddings, resized to each image's grid)
    positions: str = "rope"
    # Side of a learned table of positions added to the patch embeddings (0: none): positions:
    # learned needs one (SigLIP-384/14: 27); with rope it is added too (Qwen3-VL: 48)
    position_grid: int = 0
    # How the table is resized to each image's grid: bicubic (torch's, align_corners false:
    # SigLIP, CLIP) | bilinear (align_corners true: Qwen3-VL)
    position_resize: str = "bicubic"
    # Rows of each of two learned tables of positions added to the patch embeddings, a patch
    # reading its column's row of the first and its row's row of the second, no resize (Gemma
    # 4's position_embedding_table, its position_embedding_size); 0: none
    position_axes: int = 0
    # The axis each half of a head turns by under positions: rope (2D rotary): rows_first (the
    # first half by row, the second by column: Qwen2-VL) | cols_first (Gemma 4's axial rotary)
    rope_axes: str = "rows_first"
    patch_bias: bool = True  # a bias on the patch embedding (Qwen2-VL's has none)
    # Frames per patch of a video-capable patch embedding (Qwen2-VL: 2): a video's temporal
    # patch is this many frames of a patch side by side; an image repeats its one frame
    temporal_patch: int = 1
    # Take videos too (records' `videos`, `<video>`): each vision item's patch is then
    # temporal_patch frames wide in the batch (an image's frame repeated on the host, as
    # Qwen2-VL's processor does); false: images only, a patch one frame wide, and data with
    # videos is refused at start-up naming this key. The parameters do not depend on it.
    video: bool = False
    # How a video's temporal patches are placed in time by M-RoPE: 0 = one time step per
    # temporal patch (Qwen2-VL); > 0 = absolute time, this many steps a second (Qwen2.5-VL's
    # vision_config.tokens_per_second: a temporal patch of frames sampled at f fps advances
    # floor(k x tokens_per_second x temporal_patch / f))
    tokens_per_second: float = 0.0
    # The projector: mlp (fc2(act(fc1 x)) over the merge x merge patches of one LLM token, side by
    # side) | pool (their mean, an RMSNorm scaling by 1 + w, one Linear without a bias: Gemma
    # 3's average-pooled soft tokens; projector_dim and projector_act are not read)
    projector: str = "mlp"
    # pool, Gemma 4's form: the mean times sqrt(width), standardised where `standardize` says,
    # an RMSNorm without a scale, the Linear (its pooler and embed_vision)
    pool_embed: bool = False
    # pool_embed: the pooled rows minus a learned bias, times a learned scale, per channel
    # (Gemma 4's standardize: its std_bias and std_scale)
    standardize: bool = False
    projector_dim: int = 0  # the projector's hidden width; 0 = the LLM's width
    projector_act: str = "gelu_tanh"  # the projector's activation: gelu_tanh | gelu (exact)
    freeze: bool = False  # no gradient and no optimizer state for the encoder
    # The encoder's learning rate as a multiple of optim.lr, all along its schedule (ms-swift's
    # vit_lr / lr; model.projector_lr_scale and model.llm.lr_scale scale the others')
    lr_scale: float = 1.0
    # How the tower starts and ends. LLaVA reads a hidden layer of its tower, before any final
    # norm (`hf import` keeps the blocks up to it as `depth`; the others are copied back at
    # export); CLIP normalises the embedded patches first (its pre_layrnorm)
    final_norm: bool = True  # a norm after the last block
    pre_norm: bool = False  # a norm on the embedded patches (and class tokens) before the blocks
    # A learned class token per image (CLIP): an extra row of the image's document in every
    # block, after the row's patches (batch.vision_documents of them, resolved from the data),
    # dropped at the end as LLaVA's "default" feature selection drops it; positions: learned
    class_token: bool = False
    # Window attention (Qwen2.5-VL): blocks attend within windows of window x window patches of
    # their image (a window is a document: the patches are put in window order for the blocks
    # and back after), except the blocks in full_blocks, which attend over the whole image.
    # 0: every block over the whole image. A multiple of merge
    window: int = 0
    full_blocks: tuple[int, ...] = ()  # with window: the blocks (0-based) over the whole image
    # DeepStack (Qwen3-VL): the blocks (0-based) whose outputs, merged as the projector merges
    # (merge x merge patches a token) by projectors of their own (a LayerNorm over the merged
    # width, then fc1, GELU, fc2), are added to the LLM's hidden states at the image's and
    # video's tokens after its first len(deepstack) layers, the k-th after layer k
    deepstack: tuple[int, ...] = ()
    # Gemma 4's block (as the decoder's keys): each branch's output normed before its residual
    # add, an RMSNorm without a scale over each head's values, scores scaled by
    # 1 / sqrt(attn_scalar) (0: the head width)
    post_norms: bool = False
    v_norm: bool = False
    attn_scalar: float = 0.0
    # Bounds on the inputs and outputs of the blocks' attention and MLP matrices, read from the
    # checkpoint (Gemma 4's use_clipped_linears; never trained); false: none
    clipped_linears: bool = False

    @property
    def stages_ok(self) -> bool:
        """Whether its blocks run as pipeline stages (`pipeline.vision: stages`): not with class
        tokens, windows or no final norm, which only the whole tower's call lays out."""
        return not (self.class_token or self.window or not self.final_norm or self.deepstack)

    # What the phase table (jaxmllm.config.phases) reads of an encoder: its units (patches),
    # how many make an LLM token and an encoder row, and one unit's input and position.
    @property
    def units_per_token(self) -> int:
        """Patches per LLM token: the projector merges merge x merge neighbours."""
        return self.merge**2

    units_per_row = 1  # attention sees every patch
    position_dims = 2  # a patch's (row, column)

    @property
    def input_width(self) -> int:
        """Values per patch: patch x patch pixels of `channels`, of temporal_patch frames where
        the encoder takes videos."""
        frames = self.temporal_patch if self.video else 1
        return frames * self.patch_size**2 * self.channels

    def __post_init__(self):
        super().__post_init__()
        lr_scale_valid(self)
        positive(self, "patch_size", "channels", "width", "depth", "heads", "mlp_dim", "merge")
        positive(self, "temporal_patch")
        check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        check(self.positions in ("rope", "learned"), "must be rope or learned", "positions")
        check(
            self.positions != "rope" or (self.width // self.heads) % 4 == 0,
            "head dim must be divisible by 4 (2D RoPE)",
            "heads",
        )
        check(
            self.positions != "learned" or self.position_grid >= 1,
            "positions: learned needs the table's side (e.g. 27 for SigLIP at 384 px / 14)",
            "position_grid",
        )
        check(self.position_grid >= 0, "must be >= 0 (0: no learned table)", "position_grid")
        check(self.position_axes >= 0, "must be >= 0 (0: no axial tables)", "position_axes")
        check(self.rope_axes in ROPE_AXES, f"must be one of {', '.join(ROPE_AXES)}", "rope_axes")
        check(self.attn_scalar >= 0, "must be >= 0 (0: the head width)", "attn_scalar")
        check(
            not self.pool_embed or self.projector == "pool",
            "is the pooling projector's form: needs projector: pool",
            "pool_embed",
        )
        check(
            not self.standardize or self.pool_embed,
            "standardises pool_embed's pooled rows: needs pool_embed: true",
            "standardize",
        )
        check(
            self.position_resize in RESIZES,
            f"must be one of {', '.join(RESIZES)}",
            "position_resize",
        )
        deep = tuple(self.deepstack)
        object.__setattr__(self, "deepstack", deep)
        check(
            all(isinstance(i, int) and 0 <= i < self.depth for i in deep)
            and len(set(deep)) == len(deep),
            f"{list(deep)}: must be distinct block indices in [0, depth={self.depth})",
            "deepstack",
        )
        check(self.projector_dim >= 0, "must be >= 0 (0: the LLM's width)", "projector_dim")
        check(
            math.isfinite(self.tokens_per_second) and self.tokens_per_second >= 0,
            "must be >= 0 (0: one M-RoPE time step per temporal patch, Qwen2-VL's rule)",
            "tokens_per_second",
        )
        check(self.projector_act in ACTIVATIONS, f"must be one of {ACTIVATIONS}", "projector_act")
        check(
            self.projector in VISION_PROJECTORS,
            f"must be one of {', '.join(VISION_PROJECTORS)}",
            "projector",
        )
        check(
            not (deep and self.projector != "mlp"),
            "DeepStack's levels are MLP projectors: needs projector: mlp",
            "projector",
        )
        check(
            not self.class_token or self.positions == "learned",
            "a class token takes its place from the learned table (positions: learned)",
            "class_token",
        )
        check(
            self.window >= 0 and self.window % self.merge == 0,
            f"must be 0 (none) or a multiple of merge={self.merge} (windows hold whole merge "
            "blocks)",
            "window",
        )
        full = tuple(self.full_blocks)
        object.__setattr__(self, "full_blocks", full)
        check(
            all(isinstance(i, int) and 0 <= i < self.depth for i in full)
            and len(set(full)) == len(full),
            f"{list(full)}: must be distinct block indices in [0, depth={self.depth})",
            "full_blocks",
        )
        check(
            not full or self.window > 0,
            "needs window > 0 (the other blocks' windows)",
            "full_blocks",
        )
        check(
            not (deep and self.window),
            "DeepStack and windows together are not supported (no tower has both)",
            "deepstack",
        )
        check(
            not (self.class_token and self.window),
            "class tokens and windows together are not supported (no tower has both)",
            "window",
        )


PROJECTORS = ("mlp", "linear", "embed")  # jaxmllm.models.projectors implements each
STEMS = ("pairs", "whisper", "conformer")  # model.audio.stem (jaxmllm.models.audio, conformer)
VISION_PROJECTORS = ("mlp", "pool")  # (the vision tower's)
ROPE_AXES = {"rows_first": "2d", "cols_first": "2d_cols_first"}  # -> models.layers.ROPE


@dataclass(frozen=True)
class ConformerConfig:
    """Gemma 4's audio conformer (`model.audio.stem: conformer`; transformers'
    Gemma4AudioConfig): its subsampling convolutions, its chunked local attention, its light
    convolution and output projection. The blocks' width, depth and heads are model.audio's."""

    # The two 3x3 stride-2 convolutions' output channels over (frames, mel bins)
    # (subsampling_conv_channels)
    channels: tuple[int, int] = (128, 32)
    chunk: int = 12  # rows a block of queries (attention_chunk_size): a unit of computing
    # Each query attends to itself and the context_left - 2 rows before it, and the
    # context_right - 1 rows after it (attention_context_left, attention_context_right); the
    # relative positions span chunk + context_left - 1 + context_right rows
    context_left: int = 13
    context_right: int = 0
    logit_cap: float = 50.0  # scores soft-capped: cap * tanh(s / cap) (attention_logit_cap)
    conv_kernel: int = 5  # the light convolution's causal depthwise kernel (conv_kernel_size)
    residual_weight: float = 0.5  # what each feed-forward's output is scaled by (macaron)
    # Activations clamped to [-clamp, clamp] around the norms (gradient_clipping)
    clamp: float = 1e10
    # Bounds on the inputs and outputs of the blocks' linears, read from the checkpoint
    # (use_clipped_linears; never trained); false: none
    clipped_linears: bool = True
    out_dim: int = 1536  # the output projection's width (output_proj_dims)

    @property
    def context(self) -> int:
        """Rows a block of queries reads: chunk + context_left - 1 + context_right."""
        return self.chunk + self.context_left - 1 + self.context_right

    @property
    def relative_positions(self) -> int:
        """Rows of the relative position table: context // 2 + 1."""
        return self.context // 2 + 1

    def __post_init__(self):
        object.__setattr__(self, "channels", tuple(self.channels))
        check(
            len(self.channels) == 2 and all(isinstance(c, int) and c >= 1 for c in self.channels),
            f"{list(self.channels)}: must be two channel counts >= 1 (two convolutions)",
            "channels",
        )
        positive(self, "chunk", "conv_kernel", "out_dim")
        check(self.context_left >= 2, "must be >= 2 (a query sees itself)", "context_left")
        check(self.context_right >= 0, "must be >= 0", "context_right")
        check(self.logit_cap > 0, "must be > 0", "logit_cap")
        check(self.clamp > 0, "must be > 0", "clamp")


@dataclass(frozen=True)
class AudioConfig(BlockOptions):
    """Audio encoder: strided conv subsampling of packed log-mel frames, then a transformer."""

    enabled: bool = True  # build the audio encoder and feed audio clips
    n_mels: int = 80  # mel bins per frame
    subsample: int = 4  # frames per LLM token (the encoder's stride x the projector's merge)
    # The convolutions before the transformer: pairs (two kernel-2 stride-2 convolutions: one
    # encoder row per 4 frames) | whisper (kernel 3, strides 1 and 2, within each clip: one row
    # per 2 frames; the projector then merges 2 rows into an LLM token) | conformer (Gemma 4's
    # encoder, `model.audio.conformer`: two 3x3 stride-2 convolutions over frames and mel bins,
    # one row per 4 frames, then conformer blocks instead of transformer ones; needs
    # positions: relative, norm: rms, mlp: silu)
    stem: str = "pairs"
    width: int = 768  # hidden size
    depth: int = 12  # transformer layers
    heads: int = 12  # attention heads
    mlp_dim: int = 3072  # gated-MLP inner width
    rope_theta: float = 10000.0  # rotary base
    # rope (1D rotary in every attention) | sinusoidal (Whisper: a fixed table of max_positions
    # rows added after the convolutions; it is never trained) | relative (the conformer's:
    # scores biased by each key's distance to its query)
    positions: str = "rope"
    max_positions: int = 1500  # rows of the sinusoidal table: the longest clip in encoder rows
    projector_dim: int = 0  # the projector's hidden width; 0 = the LLM's width
    projector_act: str = "gelu_tanh"  # the projector's activation: gelu_tanh | gelu (exact)
    # The projector: mlp (fc2(act(fc1 x)) over the rows of one LLM token) | linear (one Linear
    # from one pooled row: Qwen2-Audio's) | embed (an RMSNorm without a scale, of epsilon
    # norm_eps, then one Linear without a bias, from one row: Gemma 4's embed_audio)
    projector: str = "mlp"
    # Encoder rows averaged in runs of this many after the blocks, before the final norm
    # (Qwen2-Audio's pooling: 2); stride x pool divides subsample
    pool: int = 1
    freeze: bool = False  # no gradient and no optimizer state for the encoder
    # The encoder's learning rate as a multiple of optim.lr, all along its schedule (ms-swift's
    # vit_lr / lr; model.projector_lr_scale and model.llm.lr_scale scale the others')
    lr_scale: float = 1.0
    # Gemma 4's conformer (stem: conformer): its own options (`ConformerConfig`)
    conformer: ConformerConfig = field(default_factory=ConformerConfig)

    @property
    def stride(self) -> int:
        """Frames per encoder row."""
        return 2 if self.stem == "whisper" else 4

    @property
    def is_conformer(self) -> bool:
        """Whether the encoder is Gemma 4's conformer (`stem: conformer`)."""
        return self.stem == "conformer"

    @property
    def out_width(self) -> int:
        """The width of the encoder's output rows: the conformer's output projection's, else
        the blocks'."""
        return self.conformer.out_dim if self.is_conformer else self.width

    @property
    def stages_ok(self) -> bool:
        """Whether its blocks run as pipeline stages: not with pooling after them, nor the
        conformer's blocks."""
        return self.pool == 1 and not self.is_conformer

    @property
    def rows_per_token(self) -> int:
        """Encoder output rows (after pooling) the projector merges into one LLM token."""
        return self.subsample // (self.stride * self.pool)

    # What the phase table (jaxmllm.config.phases) reads of an encoder (see VisionConfig).
    @property
    def units_per_token(self) -> int:
        """Frames per LLM token."""
        return self.subsample

    @property
    def units_per_row(self) -> int:
        """Frames per encoder row: attention sees rows of `stride` frames."""
        return self.stride

    position_dims = 0  # a frame's index in its clip

    @property
    def input_width(self) -> int:
        """Values per frame: its mel bins."""
        return self.n_mels

    def __post_init__(self):
        super().__post_init__()
        lr_scale_valid(self)
        positive(self, "n_mels", "width", "depth", "heads", "mlp_dim", "max_positions")
        check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        check(self.stem in STEMS, f"must be one of {', '.join(STEMS)}", "stem")
        check(
            self.positions in ("rope", "sinusoidal", "relative"),
            "must be rope, sinusoidal or relative",
            "positions",
        )
        check(
            (self.positions == "relative") == self.is_conformer,
            "relative positions are the conformer's own (stem: conformer), and it has no other",
            "positions",
        )
        if self.is_conformer:
            self._check_conformer()
        check(
            self.positions != "rope" or (self.width // self.heads) % 2 == 0,
            "head dim must be even (RoPE)",
            "heads",
        )
        check(
            self.subsample == 4,
            "only subsample=4 is implemented (pairs: two stride-2 convs; whisper: stride 2, "
            "then the projector merges 2 rows)",
            "subsample",
        )
        check(self.projector_dim >= 0, "must be >= 0 (0: the LLM's width)", "projector_dim")
        check(self.projector_act in ACTIVATIONS, f"must be one of {ACTIVATIONS}", "projector_act")
        check(self.projector in PROJECTORS, f"must be one of {', '.join(PROJECTORS)}", "projector")
        check(
            self.pool >= 1 and self.subsample % (self.stride * self.pool) == 0,
            f"must be >= 1 with stride x pool dividing subsample={self.subsample} (the {self.stem} "
            f"stem's stride is {self.stride})",
            "pool",
        )
        check(
            self.projector == "mlp" or self.rows_per_token == 1,
            f"{self.projector} projects one pooled row per LLM token: needs stride x pool = "
            "subsample",
            "projector",
        )

    def _check_conformer(self) -> None:
        """The options the conformer's blocks are built with; the others are refused."""
        why = "the conformer's blocks (stem: conformer)"
        check(self.norm == "rms", f"{why} have RMSNorms: set rms", "norm")
        check(self.mlp == "silu", f"{why} have feed-forwards fc2(silu(fc1 x)): set silu", "mlp")
        check(not self.attn_bias, f"{why} have no attention biases: set ''", "attn_bias")
        check(not self.mlp_bias, f"{why} have no feed-forward biases: set false", "mlp_bias")
        check(not self.qk_norm, f"{why} have no QK-norm: set false", "qk_norm")
        check(self.pool == 1, f"{why} pool nothing: set 1", "pool")


@dataclass(frozen=True)
class InitFrom:
    """Pretrained HuggingFace checkpoint directories the modules start from (a fresh run only:
    a resumed run restores its own checkpoint). `python -m jaxmllm.hf import` writes these."""

    # A whole checkpoint (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen2-Audio) is each part's directory:
    # `hf import --model` writes it as every part it holds, projectors included
    llm: str = ""  # a Llama / Qwen2 causal LM directory (config.json + safetensors)
    vision: str = ""  # a SigLIP, CLIP or Qwen2(.5)-VL (vision tower) directory
    audio: str = ""  # a Whisper or Qwen2-Audio (its encoder) directory
    # An earlier run's train.output_dir: its latest checkpoint's parameters (not its optimizer
    # state or data position) for every module both models have, over the directories above
    run: str = ""
    # A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) the
    # adapters start from: `hf import --adapter` writes it with the model.*.lora it implies
    adapter: str = ""


@dataclass(frozen=True)
class ModelConfig:
    """Encoders + projectors + LLM; each module replaceable and freezable."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    init_from: InitFrom = field(default_factory=InitFrom)  # else every module starts random
    projector_freeze: bool = False  # freeze both projectors
    projector_lr_scale: float = 1.0  # the projectors' learning rate as a multiple of optim.lr
    # LoRA adapters on the projectors' matrices (fc1, fc2; fc: a linear projector): rank > 0
    # freezes their base weights and trains the adapters (jaxmllm/config/lora.py)
    projector_lora: LoraConfig = field(default_factory=LoraConfig)
    compute_dtype: str = "float32"  # activations/matmuls: float32 or bfloat16 (params stay fp32)
    param_dtype: str = "float32"  # master weights
    # What each transformer block keeps for the backward pass, every tower's unless it sets
    # its own (model.vision.remat, ...): none (everything: the most memory) | full (only its
    # input: the least; the forward runs again) | save_dots (its weight matmuls' outputs: only
    # the attention is recomputed) | save_dots_except_mlp (the MLP recomputed too) | save_qkv
    # | offload_dots (save_dots' in host memory); see jaxmllm/config/remat.py. The old
    # remat: true / false (+ remat_policy: nothing | dots) reads as full / none (save_dots)
    remat: str = "none"
    # How attention reads packed rows: block_sparse computes only the (query block, key block)
    # tiles the documents span, listed by the planner (batch.*_tiles, batch.attention_block) |
    # dense: every pair of a row, masked (the reference; memory and time grow with row_len^2) |
    # cudnn: cuDNN's fused attention over the packed documents (GPU only) | auto: cudnn on
    # Hopper or newer NVIDIA GPUs, block_sparse elsewhere, resolved at start-up
    # (jaxmllm.resolve.attention.resolve_attention) and printed; models never see auto
    attention: str = "block_sparse"

    def __post_init__(self):
        lr_scale_valid(self, "projector_lr_scale")
        check(self.attention in ATTENTIONS, f"must be one of {', '.join(ATTENTIONS)}", "attention")
        v = self.vision
        check(
            self.attention != "cudnn" or not (v.enabled and (v.class_token or v.window)),
            "cudnn's packed layout holds each document as one run of a row: a vision tower with "
            "class tokens or windows (model.vision.class_token, window) needs block_sparse or "
            "dense",
            "attention",
        )
        check(
            self.attention != "cudnn" or not self.llm.window.enabled,
            f"the decoder's sliding windows (model.llm.window.size={self.llm.window.size}) are "
            "not built into cuDNN's packed attention here: set model.attention: block_sparse "
            "or dense (auto picks block_sparse for them)",
            "attention",
        )
        for name in self.llm.bidirectional:
            check(
                name in ("vision", "audio") and getattr(self, name).enabled,
                f"{name!r}: each must be an encoder phase the model has (vision, audio), whose "
                "items' tokens then attend to each other both ways",
                "llm.bidirectional",
            )
        check(
            self.attention != "cudnn" or not self.llm.bidirectional,
            f"the decoder's bidirectional spans (model.llm.bidirectional="
            f"{list(self.llm.bidirectional)}) are not built into cuDNN's packed attention here: "
            "set model.attention: block_sparse or dense (auto picks block_sparse for them)",
            "attention",
        )
        check(
            not (v.enabled and len(v.deepstack) > self.llm.depth),
            f"{list(v.deepstack)}: DeepStack adds each of these blocks' features after one of "
            f"the LLM's first layers, and it has {self.llm.depth}",
            "vision.deepstack",
        )
        for key in ("compute_dtype", "param_dtype"):
            check(getattr(self, key) in ("float32", "bfloat16"), "must be float32 or bfloat16", key)
        check(self.remat in REMAT_POLICIES, f"must be one of {', '.join(REMAT_POLICIES)}", "remat")
        self._check_adapters()

    def _check_adapters(self) -> None:
        """Adapters train on a frozen base: not on a tower frozen outright; a base dtype only
        where there is a frozen base; projector targets that some projector has."""
        for name in ("vision", "audio", "llm"):
            tower = getattr(self, name)
            check(
                not (tower.freeze and tower.lora.enabled),
                "true freezes the whole tower, its adapters too: set it to false to train the "
                f"adapters of model.{name}.lora (their base stays frozen), or lora.rank: 0",
                f"{name}.freeze",
            )
            check(
                not tower.base_dtype or tower.freeze or tower.lora.enabled,
                f"{tower.base_dtype!r}: the tower trains all its weights (set model.{name}."
                "freeze: true or lora.rank > 0 for a frozen base, or leave base_dtype empty)",
                f"{name}.base_dtype",
            )
        check(
            not (self.projector_freeze and self.projector_lora.enabled),
            "true freezes the projectors, their adapters too: set it to false to train the "
            "adapters of model.projector_lora, or projector_lora.rank: 0",
            "projector_freeze",
        )
        kinds = [self.projector_kind(n) for n in ("vision", "audio") if getattr(self, n).enabled]
        valid = tuple(dict.fromkeys(t for k in kinds for t in PROJECTOR_TARGETS[k]))
        key = "projector_lora.targets"
        self.projector_lora.resolve(valid or PROJECTOR_TARGETS["mlp"], key, "the projectors")

    def projector_kind(self, tower: str) -> str:
        """The kind of a tower's projector (config.model.PROJECTORS)."""
        return getattr(self, tower).projector

    def adapted(self, module: str) -> tuple[str, ...]:
        """The matrices of a top-level module (vision, vision_projector, audio,
        audio_projector, llm) that get adapters: none without its lora.rank."""
        if not module.endswith("_projector"):
            return getattr(self, module).adapter_targets
        if not self.projector_lora.enabled:
            return ()
        valid = PROJECTOR_TARGETS[self.projector_kind(module.removesuffix("_projector"))]
        if "all" in self.projector_lora.targets:
            return valid
        return tuple(t for t in valid if t in self.projector_lora.targets)

    def lora_of(self, module: str) -> LoraConfig:
        """The adapters' settings of a top-level module (`adapted`)."""
        if module.endswith("_projector"):
            return self.projector_lora
        return getattr(self, module).lora

    def remat_of(self, tower: str) -> str:
        """The remat policy of `tower` (vision, audio, llm): its own, else model.remat."""
        return getattr(self, tower).remat or self.remat

    @staticmethod
    def upgrade(raw: dict, source: str) -> dict:
        """The raw section with keys of an older format read as they are meant now."""
        return upgrade_legacy(raw, source)


ATTENTIONS = ("block_sparse", "dense", "cudnn", "auto")
