"""The decoder's section: a Llama-style LLM (`LLMConfig`), its rotary scaling, its
mixture-of-experts MLPs (`MoEConfig`), its linear-attention layers (`LinearConfig`) and its
sliding-window layers (`WindowConfig`); and the kinds its layers come in (`LayerKind`: how a
layer mixes tokens, which MLP it has)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxmllm.config.blocks import GATED_MLPS, BlockOptions
from jaxmllm.config.checks import check, lr_scale_valid, positive
from jaxmllm.config.lora import LINEAR_TARGETS


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling for contexts longer than pretraining (HF's rope_scaling)."""

    # none | linear (frequencies / factor) | llama3 (Llama 3.1+'s bands) | proportional
    # (Gemma 4's full layers: the first `fraction` of the head's frequencies, the others zero)
    type: str = "none"
    factor: float = 1.0  # linear, llama3, proportional: how much longer the context is
    low_freq_factor: float = 1.0  # llama3: wavelengths over original / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths under original / this are kept
    original_max_positions: int = 8192  # llama3: the pretraining context
    # proportional: the share of the head's rotary frequencies that turn, each at the base's
    # power over the whole head (HF's partial_rotary_factor there); the rest stay still
    fraction: float = 1.0

    def __post_init__(self):
        check(self.type in ROPE_SCALINGS, f"must be one of {', '.join(ROPE_SCALINGS)}", "type")
        check(self.factor > 0, "must be > 0", "factor")
        check(
            self.type != "llama3" or self.high_freq_factor > self.low_freq_factor > 0,
            "llama3 needs high_freq_factor > low_freq_factor > 0",
            "high_freq_factor",
        )
        positive(self, "original_max_positions")
        check(0 < self.fraction <= 1, "must be in (0, 1]", "fraction")


ROPE_SCALINGS = ("none", "linear", "llama3", "proportional")


class Mixer(enum.Enum):
    """How a decoder layer mixes tokens; the value names its layers' stack (`LayerKind.name`)
    and is the word a config or checkpoint says it with."""

    FULL = "full"  # causal attention over the whole document: quadratic in its tokens
    LINEAR = "linear"  # Gated DeltaNet linear attention (`LinearConfig`): linear in tokens
    # causal attention over the last `WindowConfig.size` tokens of the document (Gemma's local
    # layers): linear in tokens for documents longer than the window
    SLIDING = "sliding"


class Mlp(enum.Enum):
    """A decoder layer's MLP: one gated MLP, or the routed experts (`MoEConfig`)."""

    DENSE = "dense"
    MOE = "moe"


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer is, where its layers differ: its mixer in a hybrid decoder, its
    MLP in a mixture of experts (None: every layer's is the same, and the name leaves it out).
    Layers of one kind share a stack of parameters, named by `name`."""

    mixer: Mixer | None = None
    mlp: Mlp | None = None
    # The layer computes no keys and values: it attends over those of an earlier layer of its
    # mixer (`LLMConfig.kv_shared_layers`: Gemma 4's last layers)
    kv_shared: bool = False

    @property
    def name(self) -> str:
        """The kind's name, its stack's (`linear_moe`, `full`, `dense`, `sliding_shared`; ""
        for a decoder whose layers are all alike): the mixer's word, then the MLP's, then
        `shared` for a layer that reuses keys and values."""
        parts = [part.value for part in (self.mixer, self.mlp) if part is not None]
        return "_".join(parts + ["shared"] * self.kv_shared)

    @property
    def linear(self) -> bool:
        """Whether the layer mixes tokens by linear attention (Gated DeltaNet)."""
        return self.mixer is Mixer.LINEAR

    @property
    def moe(self) -> bool:
        """Whether the layer's MLP is the routed experts."""
        return self.mlp is Mlp.MOE

    @property
    def sliding(self) -> bool:
        """Whether the layer attends within a sliding window (`WindowConfig`)."""
        return self.mixer is Mixer.SLIDING


EXCHANGES = ("dense", "ragged")  # how tokens travel to their experts' devices (MoEConfig)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs in the decoder (Qwen3-MoE, Qwen2-MoE, Gemma 4's block beside its
    MLP): in an MoE layer a router
    sends each token to `top_k` of `experts` gated MLPs, stacked, and sums their outputs
    weighted by its probabilities; an optional shared expert sees every token. Dropless: every
    token reaches its experts (tokens grouped by expert, a grouped matmul computing only the
    active ones, `jaxmllm/models/moe.py`). `mesh.expert` shards the experts over devices that
    also hold data-parallel buckets; tokens travel to their experts' devices and back."""

    experts: int = 0  # routed experts of an MoE layer (num_experts); 0: no MoE, every MLP dense
    top_k: int = 2  # experts each token is sent to (num_experts_per_tok)
    mlp_dim: int = 0  # a routed expert's gated-MLP width (moe_intermediate_size)
    norm_topk_prob: bool = True  # the top_k probabilities renormalised to sum to 1
    # A shared expert every token of an MoE layer passes through (Qwen2-MoE,
    # Qwen3.5-MoE: shared_expert_intermediate_size), this wide; 0: none
    shared_mlp_dim: int = 0
    shared_gate: bool = True  # its output scaled by sigmoid(x . w) (shared_expert_gate)
    # Which layers are MoE (the others a dense MLP of model.llm.mlp_dim): layer i (0-based) is
    # when (i + 1) % every == 0 and i is not in dense_layers (decoder_sparse_step,
    # mlp_only_layers)
    every: int = 1
    dense_layers: tuple[int, ...] = ()
    # The load-balancing loss (router_aux_loss_coef): coef x experts x sum over experts of
    # (share of assignments) x (mean router probability), over every MoE layer's tokens of a
    # microbatch on all devices (padding left out), averaged over the step's microbatches
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0  # the router z-loss: coef x mean over tokens of logsumexp(logits)^2
    # Rows a device receives for its experts: 0 = dropless (buffers for the worst case, every
    # token reaches its experts); c > 0 bounds them at c x the mean (less memory): what does
    # not fit is dropped, counted (moe_dropped in the metrics) and logged, never silently
    capacity_factor: float = 0.0
    # The token all-to-alls under mesh.expert > 1: dense (lax.all_to_all, every backend, moves
    # the worst case's buffers) | ragged (lax.ragged_all_to_all: only the routed rows; GPU)
    exchange: str = "dense"
    # Rows per tile of the grouped matmul (a tile holds one expert's rows); 0: from the token
    # count and experts (padding at most ~1/8 of the rows)
    tile: int = 0
    # Gemma 4's router: it reads the layer's residual stream (not the MLP's normed input)
    # through an RMSNorm without a weight, times a learned scale per channel and width^-0.5
    # (router.norm, router.scale)
    router_norm: bool = False
    # Each expert's routing weight times a learned scale of its own, after the top-k
    # renormalisation (Gemma 4's router.per_expert_scale)
    expert_scale: bool = False
    # The shared expert and the routed experts normed apart before and after (Gemma 4's dense
    # MLP on pre_feedforward_layernorm, its experts on pre_feedforward_layernorm_2, their
    # outputs by post_feedforward_layernorm_1 and _2), their sum by the MLP's post-norm; needs
    # model.llm.post_norms and a shared expert
    branch_norms: bool = False

    @property
    def enabled(self) -> bool:
        return self.experts > 0

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has the routed experts."""
        return self.enabled and (layer + 1) % self.every == 0 and layer not in self.dense_layers

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        check(self.experts >= 0, "must be >= 0 (0: no mixture of experts)", "experts")
        positive(self, "every")
        check(self.tile >= 0, "must be >= 0 (0: from the token count)", "tile")
        check(self.shared_mlp_dim >= 0, "must be >= 0 (0: no shared expert)", "shared_mlp_dim")
        check(self.exchange in EXCHANGES, f"must be one of {', '.join(EXCHANGES)}", "exchange")
        for key in ("aux_loss_coef", "z_loss_coef", "capacity_factor"):
            check(getattr(self, key) >= 0, "must be >= 0 (0: off)", key)
        check(
            all(isinstance(i, int) and i >= 0 for i in self.dense_layers),
            f"{list(self.dense_layers)}: must be layer indices >= 0",
            "dense_layers",
        )
        if not self.enabled:
            return
        positive(self, "top_k", "mlp_dim")
        check(
            self.top_k <= self.experts,
            f"must be at most experts={self.experts} (a token's distinct experts)",
            "top_k",
        )
        check(
            self.capacity_factor == 0 or self.capacity_factor >= 1,
            "must be 0 (dropless) or >= 1 (x the mean rows a device receives)",
            "capacity_factor",
        )


def in_layer_choice(layer: int, layers: tuple[int, ...], every: int) -> bool:
    """Whether decoder layer `layer` (0-based) is of the kind a (layers, every) choice names
    (`LinearConfig`, `WindowConfig`): listed in `layers`, or, given `every`, not a layer i
    with (i + 1) % every == 0 (those attend to the whole document)."""
    if every:
        return (layer + 1) % every != 0
    return layer in layers


def check_layer_choice(layers: tuple[int, ...], every: int) -> None:
    """Refuses a (layers, every) choice of layers that is not one: negative layer indices, a
    negative `every`, or both given."""
    check(every >= 0, "must be >= 0 (0: the layers list says)", "every")
    check(
        all(isinstance(i, int) and i >= 0 for i in layers),
        f"{list(layers)}: must be layer indices >= 0",
        "layers",
    )
    check(
        not (layers and every),
        f"layers {list(layers)} and every {every}: give one of them",
        "every",
    )


@dataclass(frozen=True)
class LinearConfig:
    """Gated DeltaNet linear attention in some decoder layers (Qwen3.5's `linear_attention`
    layer_types; `jaxmllm/models/deltanet.py`): a causal depthwise convolution and a gated
    delta-rule state per value head instead of attention, restarted at each document of a
    packed row. Its cost is linear in tokens: only the other (full-attention) layers add
    attention tiles and quadratic cost to the planner's model."""

    # The linear-attention layers (0-based); the others are full attention. Either list them,
    # or say every: layer i is full attention when (i + 1) % every == 0 and linear otherwise
    # (HF's full_attention_interval); neither: no linear layers
    layers: tuple[int, ...] = ()
    every: int = 0
    key_heads: int = 16  # query/key heads (linear_num_key_heads)
    value_heads: int = 32  # value heads, a multiple of key_heads (linear_num_value_heads)
    key_dim: int = 128  # each query/key head's width (linear_key_head_dim)
    value_dim: int = 128  # each value head's width (linear_value_head_dim)
    conv_width: int = 4  # the causal convolution's taps (linear_conv_kernel_dim)
    # Tokens a chunk of the chunked delta rule, a power of two: C x C matmuls and a triangular
    # inverse within a chunk, a scan over T / C chunks (64: transformers' and FLA's)
    chunk: int = 64

    @property
    def enabled(self) -> bool:
        return bool(self.layers) or self.every > 0

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) is linear attention."""
        return in_layer_choice(layer, self.layers, self.every)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        check_layer_choice(self.layers, self.every)
        positive(self, "key_heads", "value_heads", "key_dim", "value_dim", "conv_width", "chunk")
        check(
            self.chunk & (self.chunk - 1) == 0,
            f"{self.chunk}: must be a power of two (the chunk's triangular inverse doubles "
            "its blocks), e.g. 64",
            "chunk",
        )
        check(
            self.value_heads % self.key_heads == 0,
            f"must be a multiple of key_heads={self.key_heads} (a key head serves "
            "value_heads / key_heads value heads)",
            "value_heads",
        )


@dataclass(frozen=True)
class WindowConfig:
    """Sliding-window attention in some decoder layers (Gemma 3's `sliding_attention`
    layer_types): a query attends to itself and the `size` - 1 tokens before it in its own
    document (transformers' `sliding_window`: key index > query index - size), so in a packed
    row a window never reaches into the document before. The other layers attend to the whole
    document. The windowed layers turn their rotary positions at a base of their own
    (`rope_theta`: Gemma's local base, transformers' rope_parameters.sliding_attention)."""

    size: int = 0  # tokens a query sees, itself included (sliding_window); 0: no windows
    # The windowed layers (0-based); or every: layer i attends to the whole document when
    # (i + 1) % every == 0 and within the window otherwise (Gemma's sliding_window_pattern)
    layers: tuple[int, ...] = ()
    every: int = 0
    rope_theta: float = 10000.0  # the windowed layers' rotary base (unscaled)

    @property
    def enabled(self) -> bool:
        """Whether some layer attends within a window (a size, and layers named)."""
        return self.size > 0 and (bool(self.layers) or self.every > 0)

    def is_sliding(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) attends within the window."""
        return self.enabled and in_layer_choice(layer, self.layers, self.every)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        check(self.size >= 0, "must be >= 0 (0: no sliding windows)", "size")
        check_layer_choice(self.layers, self.every)
        check(
            self.size > 0 or not (self.layers or self.every),
            "windowed layers are named (layers or every): give the window's size in tokens",
            "size",
        )
        check(self.rope_theta > 0, "must be > 0", "rope_theta")


@dataclass(frozen=True)
class LLMConfig(BlockOptions):
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, gated MLP."""

    vocab_size: int = 32000  # tokenizer vocabulary incl. special tokens
    width: int = 2048  # hidden size
    depth: int = 16  # decoder layers
    heads: int = 16  # query heads
    kv_heads: int = 4  # key/value heads (GQA); must divide heads
    mlp_dim: int = 5632  # gated-MLP inner width
    head_dim: int = 0  # width of each attention head; 0 = width / heads
    rope_theta: float = 10000.0  # rotary base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Multimodal rotary (Qwen2-VL's M-RoPE): the head's rotary frequencies in three sections
    # turned by (time, row, column) positions: an image's tokens take their place in its grid,
    # text the same position in all three. (0, 0, 0): 1D rotary; else they sum to head_dim / 2
    mrope_section: tuple[int, int, int] = (0, 0, 0)
    # The share of each head's width that rotates (HF's partial_rotary_factor: Qwen3.5's 0.25);
    # the rest of the head carries no position
    rotary_fraction: float = 1.0
    # Attention's output gated per channel by sigmoid(x W_gate), W_gate beside each head's
    # queries (Qwen3.5's full-attention layers: q_proj twice as wide)
    attn_gate: bool = False
    # M-RoPE's frequencies interleaved (Qwen3-VL: time, row, column, time, ... while rows and
    # columns have theirs, then time) instead of in sections; the sections' sizes as above
    mrope_interleaved: bool = False
    tie_embeddings: bool = False  # share input embedding and output projection
    # Tied output: logits = x . E^T / sqrt(width), unit-scale logits from jaxmllm's unit-scale
    # embedding rows; false for HF checkpoints (x . E^T)
    tied_logits_scaled: bool = True
    # Mixture-of-experts MLPs (experts > 0): which layers, how many experts, the router's losses
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Gated DeltaNet linear attention in some layers (layers or every): a hybrid decoder
    linear: LinearConfig = field(default_factory=LinearConfig)
    # Sliding-window attention in some layers (size, and layers or every): Gemma 3's local ones
    window: WindowConfig = field(default_factory=WindowConfig)
    # Encoder phases (vision, audio) whose items' tokens attend to each other both ways in the
    # decoder, each item's within itself, the rest causal (Gemma 3's images: transformers'
    # token_type_ids); the batch marks them (`llm_spans`)
    bidirectional: tuple[str, ...] = ()
    # With bidirectional spans, the full-attention layers read them both ways too (Gemma 3);
    # false: only the sliding-window layers do and the full ones stay causal over them (Gemma
    # 4's use_bidirectional_attention: vision)
    bidirectional_full: bool = True
    # A norm after attention and after the MLP too, each output normed before its residual add
    # (Gemma's four norms a layer: x + norm(attn(norm(x))), then the same for the MLP)
    post_norms: bool = False
    # Token embeddings times sqrt(width), the factor rounded to the compute dtype first as
    # transformers rounds it to the embedding's (Gemma); encoder rows replacing placeholders
    # are not scaled
    embed_scale: bool = False
    # Attention scores scale by 1 / sqrt(attn_scalar) (Gemma's query_pre_attn_scalar);
    # 0: 1 / sqrt(head width)
    attn_scalar: float = 0.0
    # An RMSNorm without a scale over each head's values (Gemma 4's v_norm)
    v_norm: bool = False
    # Each layer's output times a learned scalar of its own (Gemma 4's layer_scalar)
    layer_scalar: bool = False
    # Logits soft-capped to cap x tanh(logits / cap) (final_logit_softcapping); 0: none
    logit_softcap: float = 0.0
    # With windows, the full-attention layers' own head width and key-value heads (Gemma 4's
    # global_head_dim, num_global_key_value_heads); 0: the windowed layers' (head_dim, kv_heads)
    full_head_dim: int = 0
    full_kv_heads: int = 0
    # With windows, the full-attention layers' values are their keys' projection, before its
    # norm and rotary (no value projection: Gemma 4's attention_k_eq_v)
    full_k_eq_v: bool = False
    # Per-layer inputs (Gemma 4's per-layer embeddings, hidden_size_per_layer_input): each
    # layer adds, after its MLP, norm(W_out (act(W_gate x) * p)) for an input p of its own this
    # wide: a table row of the token's id (times sqrt(per_layer_dim)) and a projection of the
    # decoder's input embeddings (over sqrt(width), normed), summed over sqrt(2); 0: none
    per_layer_dim: int = 0
    # The per-layer table's vocabulary (vocab_size_per_layer_input); 0: vocab_size
    per_layer_vocab: int = 0
    # The id whose per-layer row an encoder row's slot (an image's or a clip's token) reads, as
    # transformers' Gemma4Model reads them (its pad_token_id)
    per_layer_pad_id: int = 0
    # The last kv_shared_layers layers compute no keys and values: each attends over those of
    # the last layer before them of its own kind, sliding or full (num_kv_shared_layers)
    kv_shared_layers: int = 0
    # Those layers' MLPs 2 x mlp_dim wide (Gemma 4's use_double_wide_mlp)
    kv_shared_wide_mlp: bool = False
    # Tokens per slice of the output projection and cross entropy: a step never holds more than
    # [rows, logits_chunk, vocab] fp32 logits (a 152k vocabulary at 1024: 0.6 GB a row)
    logits_chunk: int = 1024
    # Embedding lookups and the loss's logits split by vocabulary rows over fsdp x tensor
    # (models/vocab.py): no device holds the whole table; false: XLA gathers it per device
    vocab_parallel: bool = True
    freeze: bool = False  # no gradient and no optimizer state for the decoder
    lr_scale: float = 1.0  # the decoder's learning rate as a multiple of optim.lr

    @property
    def head_width(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.width // self.heads

    def block_matrices(self) -> tuple[str, ...]:
        """The blocks' matrices as LoRA targets name them: a hybrid's linear-attention ones
        too."""
        own = super().block_matrices()
        return own + LINEAR_TARGETS if self.linear.enabled else own

    @property
    def rotary_dim(self) -> int:
        """The rotating part of each head's width (an even number)."""
        return int(self.head_width * self.rotary_fraction) // 2 * 2

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "bidirectional", tuple(self.bidirectional))
        lr_scale_valid(self)
        positive(self, "vocab_size", "width", "depth", "heads", "kv_heads", "mlp_dim")
        positive(self, "logits_chunk")
        check(self.head_dim >= 0, "must be >= 0 (0: width / heads)", "head_dim")
        check(
            self.head_dim > 0 or self.width % self.heads == 0,
            "width must be divisible by heads (or set head_dim)",
            "width",
        )
        check(self.head_width % 2 == 0, "head dim must be even (RoPE)", "heads")
        check(
            0 < self.rotary_fraction <= 1 and self.rotary_dim > 0,
            f"must be in (0, 1] and leave an even number of rotating dims of the head's "
            f"{self.head_width}",
            "rotary_fraction",
        )
        half = self.rotary_dim // 2
        check(
            not any(self.mrope_section) or sum(self.mrope_section) == half,
            f"{list(self.mrope_section)} must sum to the rotary dims / 2 = {half} "
            "(or be [0, 0, 0]: 1D rotary)",
            "mrope_section",
        )
        check(self.heads % self.kv_heads == 0, "kv_heads must divide heads", "kv_heads")
        m, lin, win = self.moe, self.linear, self.window
        for key, layers in (
            ("moe.dense_layers", m.dense_layers),
            ("linear.layers", lin.layers),
            ("window.layers", win.layers),
        ):
            check(
                all(i < self.depth for i in layers),
                f"{list(layers)}: a layer past depth={self.depth}",
                key,
            )
        check(
            not m.enabled or any(m.is_moe(i) for i in range(self.depth)),
            f"no layer of the {self.depth} is MoE (moe.every={m.every}, moe.dense_layers="
            f"{list(m.dense_layers)}): set moe.experts: 0 for a dense decoder",
            "moe.experts",
        )
        check(
            not (win.enabled and lin.enabled),
            "sliding windows and linear-attention layers in one decoder are not built: set "
            "window.size: 0 or linear.layers: []",
            "window.size",
        )
        check(self.attn_scalar >= 0, "must be >= 0 (0: the head width)", "attn_scalar")
        check(self.logit_softcap >= 0, "must be >= 0 (0: no soft-capping)", "logit_softcap")
        self._check_full_layers()
        self._check_per_layer_inputs()
        self._check_kv_sharing()

        self._check_moe_block()
        if m.enabled and not m.shared_mlp_dim and self.lora.enabled:
            self._check_expert_adapters()  # (with a shared expert they adapt its Linears)

    def _check_moe_block(self) -> None:
        """The experts are gated MLPs of the decoder's activation; Gemma 4's branch norms need
        Gemma's post-norms and the shared expert they norm apart from the routed ones."""
        m = self.moe
        if not m.enabled:
            return
        check(
            self.mlp in GATED_MLPS,
            f"{self.mlp!r}: the routed experts are gated MLPs of the decoder's activation (one "
            f"of {', '.join(GATED_MLPS)})",
            "mlp",
        )
        check(
            not m.branch_norms or (self.post_norms and m.shared_mlp_dim > 0),
            "branch norms norm a shared expert apart from the routed experts, after the "
            "MLP's post-norm: set post_norms: true and moe.shared_mlp_dim > 0, or "
            "moe.branch_norms: false",
            "moe.branch_norms",
        )

    def _check_full_layers(self) -> None:
        """The full-attention layers' own head width, key-value heads and values from keys
        need windowed layers beside them (else every layer is a full one: set head_dim)."""
        check(self.full_head_dim >= 0, "must be >= 0 (0: head_dim)", "full_head_dim")
        check(self.full_head_dim % 2 == 0, "must be even (RoPE)", "full_head_dim")
        check(self.full_kv_heads >= 0, "must be >= 0 (0: kv_heads)", "full_kv_heads")
        check(
            self.heads % (self.full_kv_heads or self.kv_heads) == 0,
            "must divide heads",
            "full_kv_heads",
        )
        for key in ("full_head_dim", "full_kv_heads", "full_k_eq_v"):
            check(
                not getattr(self, key) or self.window.enabled,
                "the full-attention layers differ from the windowed ones only with windows "
                "(window.size and layers): set it 0 / false, or head_dim / kv_heads",
                key,
            )

    def _check_per_layer_inputs(self) -> None:
        """The per-layer inputs' widths, and a pad id inside their table."""
        check(self.per_layer_dim >= 0, "must be >= 0 (0: no per-layer inputs)", "per_layer_dim")
        check(self.per_layer_vocab >= 0, "must be >= 0 (0: vocab_size)", "per_layer_vocab")
        if not self.per_layer_dim:
            return
        check(
            0 <= self.per_layer_pad_id < self.per_layer_vocab_size,
            f"must be an id of the per-layer table (0 .. {self.per_layer_vocab_size - 1})",
            "per_layer_pad_id",
        )

    def _check_kv_sharing(self) -> None:
        """The layers reusing keys and values: fewer than the decoder's, each with an earlier
        layer of its own kind to read, beside attention layers only, their adapters without
        dropout (the keys they read are computed once more, outside the layer that owns them:
        a second dropout draw would make them others than that layer's)."""
        n = self.kv_shared_layers
        check(
            0 <= n < self.depth,
            f"must be in [0, depth={self.depth}): the layers before them compute the keys and "
            "values they reuse",
            "kv_shared_layers",
        )
        check(
            n or not self.kv_shared_wide_mlp,
            "widens the MLPs of the layers that reuse keys and values: set kv_shared_layers",
            "kv_shared_wide_mlp",
        )
        if not n:
            return
        check(
            not self.linear.enabled,
            "layers reusing keys and values beside linear-attention ones are not built: set "
            "kv_shared_layers: 0 or linear.layers: []",
            "kv_shared_layers",
        )
        first = self.depth - n
        for layer in range(first, self.depth):
            check(
                self.kv_source(layer) is not None,
                f"layer {layer} (a {self.layer_kind(layer).name.split('_')[0]} one) reuses keys "
                f"and values, and none of layers 0 .. {first - 1} is of its kind to give them",
                "kv_shared_layers",
            )
        check(
            self.lora.dropout == 0 or not {"k", "v"} & set(self.adapter_targets),
            f"{self.lora.dropout}: the layers reusing keys and values read them computed again "
            "from the input of the layer that owns them, where a second dropout draw would "
            "differ from that layer's: set lora.dropout: 0, or adapt q, o and the MLPs only",
            "lora.dropout",
        )

    @property
    def per_layer_vocab_size(self) -> int:
        """The per-layer table's rows (`per_layer_vocab`, or the vocabulary's)."""
        return self.per_layer_vocab or self.vocab_size

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer `layer` (0-based) attends over: itself, or for
        one of the last `kv_shared_layers` the last layer before them of its own mixer
        (sliding or full; transformers' kv_sharing_modes, store and reuse); None where no such
        layer exists."""
        first = self.depth - self.kv_shared_layers
        if layer < first:
            return layer
        mixer = self.layer_kind(layer).mixer
        own = [i for i in range(first) if self.layer_kind(i).mixer == mixer]
        return own[-1] if own else None

    def _check_expert_adapters(self) -> None:
        """A mixture of experts' MLP targets adapt its routed experts, as PEFT adapts
        transformers' stacked ones: gate and up are one fused matrix there, and no dropout."""
        mlp = {"gate", "up", "down"} & set(self.adapter_targets)
        check(
            len({"gate", "up"} & mlp) != 1,
            "gate and up adapt each expert's fused gate_up matrix (transformers' "
            "mlp.experts.gate_up_proj, one PEFT adapter): name both or neither",
            "lora.targets",
        )
        check(
            not mlp or self.lora.dropout == 0,
            f"{self.lora.dropout}: adapters on the routed experts ({', '.join(sorted(mlp))}) are "
            "merged into their weights, where no dropout of the inputs reaches (PEFT refuses "
            "it too): set lora.dropout: 0, or adapt q, k, v, o only",
            "lora.dropout",
        )

    def layer_kind(self, layer: int) -> LayerKind:
        """Layer `layer`'s kind (0-based): its mixer where the decoder is a hybrid (linear
        attention in some layers) or has windowed layers, its MLP where it has experts."""
        mixer = mlp = None
        if self.linear.enabled:
            mixer = Mixer.LINEAR if self.linear.is_linear(layer) else Mixer.FULL
        elif self.window.enabled:
            mixer = Mixer.SLIDING if self.window.is_sliding(layer) else Mixer.FULL
        if self.moe.enabled:
            mlp = Mlp.MOE if self.moe.is_moe(layer) else Mlp.DENSE
        return LayerKind(mixer, mlp, layer >= self.depth - self.kv_shared_layers)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The decoder layers (0-based) with linear attention."""
        return tuple(i for i in range(self.depth) if self.linear.is_linear(i))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layers (0-based) with routed experts."""
        return tuple(i for i in range(self.depth) if self.moe.is_moe(i))
