"""FLOPs of one item of each phase from the model config: the forward FLOPs per unit of a
tower's layers and projector (`jaxmllm.cost.model.CostModel.from_model` prices items with them,
times the training multipliers).

Per transformer layer and token (hidden d, key/value width d_kv, gated-MLP width f):
2 * (2 d d_q + 2 d d_kv + 3 d f). A mixture-of-experts layer's MLP is its router, the top_k
experts a token visits and its shared expert: the active parameters (`decoder_linear`). A
decoder's attention layers are of three kinds, each with the same projections: full attention
(a hybrid's q projection twice as wide with an output gate), quadratic in a document's tokens
(`full_layer_count`); sliding-window attention (Gemma 3's local layers), quadratic up to the
window and linear beyond it (`sliding_layer_count`, priced by `cost.model.window_sq`); and
Gated DeltaNet linear attention (`linear_attention`), linear in tokens, its whole cost in the
linear term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxmllm.config.blocks import GATED_MLPS
from jaxmllm.cost import training

if TYPE_CHECKING:
    from jaxmllm.config import LLMConfig
    from jaxmllm.config.model import AudioConfig, VisionConfig


def _vision_flops(v: VisionConfig, llm_width: int) -> tuple[float, float, float]:
    """Per patch: (encoder linear, encoder quadratic, projector) forward FLOPs of a ViT over
    patches and its merge-area MLP projector; DeepStack (`deepstack`: K tapped blocks) adds K
    more projectors and the K additions of their rows to the LLM's hidden states."""
    area, levels = v.merge**2, len(v.deepstack)
    hid = v.projector_dim or llm_width
    proj = 2 * (area * v.width * hid + hid * llm_width) / area
    if v.projector == "pool":  # (one Linear from the pooled row)
        proj = 2 * v.width * llm_width / area
    proj = proj * (1 + levels) + levels * llm_width / area
    lin = v.depth * layer_linear(v.width, v.width, v.mlp_dim, mlp=v.mlp)
    return lin, v.depth * 4.0 * v.width, proj


def conformer_flops(a: AudioConfig) -> float:
    """Per log-mel frame: the forward FLOPs of Gemma 4's conformer (`jaxmllm.models.conformer`),
    all linear in frames. Its stem: the first 3x3 convolution (one input channel) on every
    second frame and mel bin, the second on every fourth frame and second bin of the first's,
    the Linear from the bins left to the width. A block on rows of 4 frames: two feed-forwards
    (d -> f -> d), q, k, v and the output (4 d x d), the light convolution's Linears (d -> 2d,
    d -> d) and its kernel, and the attention as it is computed: each query's scores and
    weighted values over its chunk's context of C rows (4 C d) and its relative term over the
    P distances of the table (2 P d). Then the output projection."""
    c, d, f = a.conformer, a.width, a.mlp_dim
    c0, c1 = c.channels
    m0 = (a.n_mels + 1) // 2  # mel bins after the first convolution, then the second
    m1 = (m0 + 1) // 2
    stem = 2 * 9 * (m0 * c0 / 2 + m1 * c0 * c1 / 4) + 2 * m1 * c1 * d / 4
    attention = 4 * c.context * d + 2 * c.relative_positions * d
    block = 2 * (2 * d * f) * 2 + 2 * 4 * d * d + 2 * 3 * d * d + 2 * c.conv_kernel * d
    return stem + (a.depth * (block + attention) + 2 * d * c.out_dim) / a.stride


def _audio_flops(a: AudioConfig, llm_width: int) -> tuple[float, float, float]:
    """Per log-mel frame: (encoder linear, encoder quadratic, projector) forward FLOPs of the
    audio encoder (its stem's convolutions, then a transformer on rows of `r` frames, or the
    conformer's blocks: `conformer_flops`, no quadratic term) and its projector (`subsample /
    r` rows per LLM token)."""
    s, r = a.subsample, a.stride  # frames per LLM token, per encoder row
    hid = a.projector_dim or llm_width
    proj = 2 * (s // r * a.out_width * hid + hid * llm_width) / s
    if a.projector == "embed":  # (one Linear from each row)
        proj = 2 * a.out_width * llm_width / s
    if a.is_conformer:  # (local attention: each query's keys are bounded, not the clip's)
        return conformer_flops(a), 0.0, proj
    if a.stem == "whisper":  # 3-tap convs, stride 1 then 2: per frame
        conv = 2 * 3 * a.width * (a.n_mels + a.width / 2)
    else:  # (two 3-tap stride-2 convs, as first modelled: within a few % of the two pairs)
        conv = 2 * 9 * a.width * (a.n_mels + a.width) / s
    lin = a.depth * layer_linear(a.width, a.width, a.mlp_dim, mlp=a.mlp) / r + conv
    return lin, a.depth * 4.0 * a.width / (r * r), proj


# Per encoder phase of the table: its forward FLOPs per unit from its config section
ENCODER_FLOPS = {"vision": _vision_flops, "audio": _audio_flops}


def _vision_adapters(v: VisionConfig, llm_width: int, how: dict) -> float:
    """Per patch: the forward FLOPs of the tower's and its projector's LoRA adapters."""
    area, hid = v.merge**2, v.projector_dim or llm_width
    tower = v.depth * training.adapter_flops(
        how["vision"], training.block_shapes(v.width, v.width, v.mlp_dim)
    )
    shapes = {"fc1": (area * v.width, hid), "fc2": (hid, llm_width), "fc": (v.width, llm_width)}
    levels = 1 + len(v.deepstack)  # (DeepStack's projectors' adapters too)
    return tower + levels * training.adapter_flops(how["vision_projector"], shapes) / area


def _audio_adapters(a: AudioConfig, llm_width: int, how: dict) -> float:
    """Per log-mel frame: the forward FLOPs of the encoder's and its projector's adapters."""
    s, r, out = a.subsample, a.stride, a.out_width
    hid = a.projector_dim or llm_width
    tower = a.depth * training.adapter_flops(
        how["audio"], training.block_shapes(a.width, a.width, a.mlp_dim)
    )
    shapes = {"fc1": (s // r * out, hid), "fc2": (hid, llm_width), "fc": (out, llm_width)}
    return tower / r + training.adapter_flops(how["audio_projector"], shapes) / s


ENCODER_ADAPTERS = {"vision": _vision_adapters, "audio": _audio_adapters}


def moe_decoder(lm: LLMConfig) -> bool:
    """Whether a decoder has mixture-of-experts layers."""
    return lm.moe.enabled


def moe_layer_count(lm: LLMConfig) -> int:
    """The decoder's MoE layers (`config.decoder.MoEConfig.is_moe`)."""
    return len(lm.moe_layers)


def linear_layer_count(lm: LLMConfig) -> int:
    """The decoder's Gated DeltaNet layers (`config.decoder.LinearConfig.is_linear`)."""
    return len(lm.linear_layers)


def sliding_layer_count(lm: LLMConfig) -> int:
    """The decoder's sliding-window layers (`config.decoder.WindowConfig.is_sliding`)."""
    return sum(lm.layer_kind(i).sliding for i in range(lm.depth))


def sliding_window(lm: LLMConfig) -> int:
    """The tokens a sliding-window layer's query sees, 0 when no layer slides."""
    return lm.window.size if sliding_layer_count(lm) else 0


def full_layer_count(lm: LLMConfig) -> int:
    """The decoder's full-attention layers (neither linear nor sliding): the ones whose cost
    is quadratic in a whole document."""
    return lm.depth - linear_layer_count(lm) - sliding_layer_count(lm)


def linear_attention(lm: LLMConfig) -> float:
    """Forward FLOPs per token of a Gated DeltaNet layer (`jaxmllm.models.deltanet`): its
    projections (q, k, v together, the output gate z, beta's and the decay's logits, the
    output), its convolution, and the chunked delta rule over chunks of C: per key head its
    chunk's k k^T and q k^T, per value head the UT transform's triangular solve (C^2 / 3 a
    token), u and w, the chunk's attention and the three state matmuls (d_k x d_v)."""
    s, d = lm.linear, lm.width
    kh, vh, dk, dv, c = s.key_heads, s.value_heads, s.key_dim, s.value_dim, s.chunk
    channels = 2 * kh * dk + vh * dv
    projections = 2.0 * d * (channels + vh * dv + 2 * vh) + 2.0 * vh * dv * d
    conv = 2.0 * s.conv_width * channels
    rule = 4.0 * c * dk * kh + 2.0 * vh * (c * c / 3 + c * (2 * dv + dk) + 3 * dk * dv)
    return projections + conv + rule


def decoder_linear(lm: LLMConfig) -> float:
    """Forward FLOPs per token of the decoder's layers' linear terms, every layer: attention's
    projections (a sliding layer's, a full-attention layer's at its own head shapes and
    without a value projection where its values are its keys', without keys and values where
    it reuses another layer's: Gemma 4's) or a Gated DeltaNet layer's whole cost, and a dense
    layer's MLP (twice as wide in a shared layer with `kv_shared_wide_mlp`), or an MoE layer's
    router, the top_k experts a token visits and its shared expert (and gate); the per-layer
    inputs' projection and each layer's gate and projection: what a step computes, the active
    parameters."""
    kinds = [lm.layer_kind(i) for i in range(lm.depth)]
    mixers = sum(
        linear_attention(lm) if k.linear else attention_linear(lm, not k.sliding, k.kv_shared)
        for k in kinds
    )
    d, p = lm.width, lm.per_layer_dim
    mixers += 2.0 * d * p * lm.depth * 3  # (the inputs' projection, each layer's gate and out)
    wide = lambda k: 2 if k.kv_shared and lm.kv_shared_wide_mlp else 1
    dense = lambda k: wide(k) * (3 if lm.mlp in GATED_MLPS else 2) * 2.0 * d * lm.mlp_dim
    if not moe_decoder(lm):
        return mixers + sum(dense(k) for k in kinds)
    m, n_moe = lm.moe, moe_layer_count(lm)
    routed = 2.0 * (d * m.experts + m.top_k * 3 * d * m.mlp_dim + 3 * d * m.shared_mlp_dim)
    routed += 2.0 * d * bool(m.shared_mlp_dim and m.shared_gate)
    return mixers + sum(dense(k) for k in kinds if not k.moe) + n_moe * routed


def query_width(lm: LLMConfig, full: bool) -> int:
    """The query (and output) width of a full-attention layer (`full`: at its own head width
    beside windowed layers, `model.llm.full_head_dim`) or a sliding one."""
    own = full and lm.window.enabled and lm.full_head_dim
    return (own or lm.head_width) * lm.heads


def attention_linear(lm: LLMConfig, full: bool, shared: bool = False) -> float:
    """Forward FLOPs per token of an attention layer's projections: q and o, k and v (a full
    layer's at its own head width and kv heads, no v where its values are its keys', neither
    where it reuses another layer's: `shared`), the output gate's half of a q twice as wide
    (Qwen3.5)."""
    beside = full and lm.window.enabled  # (Gemma 4's full layers, their own shapes)
    head = (beside and lm.full_head_dim) or lm.head_width
    kv = 0 if shared else head * ((beside and lm.full_kv_heads) or lm.kv_heads)
    q, d = query_width(lm, full), lm.width
    values = 0 if beside and lm.full_k_eq_v else kv
    return 2.0 * (2 * d * q + d * (kv + values)) + 2.0 * d * q * lm.attn_gate


def decoder_adapters(lm: LLMConfig, module: training.Module) -> float:
    """Forward FLOPs per token of the decoder's LoRA adapters (`module`: the LLM's
    `training.Module`): attention's in full-attention layers (each layer's own shapes, without
    k and v where it reuses another's keys, without v where its values are its keys), the
    linear layers' own in Gated DeltaNet ones, the MLPs' (an MoE layer's on its shared expert;
    without one, on its routed experts: merged into their weights once a step, not per token,
    and none on a dense layer's MLP among them, as `models.moe.MoE` places them)."""
    d = lm.width
    mlp_of = lambda f: {"gate": (d, f), "up": (d, f), "down": (f, d)}
    linear = set(lm.linear_layers)
    flops = sum(
        training.adapter_flops(module, attention_matrices(lm, i))
        for i in range(lm.depth)
        if i not in linear
    )
    n_linear = len(linear)
    if not moe_decoder(lm):
        wide = lambda i: 2 if lm.kv_shared_wide_mlp and lm.layer_kind(i).kv_shared else 1
        flops += sum(
            training.adapter_flops(module, mlp_of(wide(i) * lm.mlp_dim)) for i in range(lm.depth)
        )
    elif lm.moe.shared_mlp_dim:
        n_moe = moe_layer_count(lm)
        flops += n_moe * training.adapter_flops(module, mlp_of(lm.moe.shared_mlp_dim))
        flops += (lm.depth - n_moe) * training.adapter_flops(module, mlp_of(lm.mlp_dim))
    if n_linear:
        s = lm.linear
        own = {
            "in_qkv": (d, 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim),
            "in_z": (d, s.value_heads * s.value_dim),
            "in_b": (d, s.value_heads),
            "in_a": (d, s.value_heads),
            "out_proj": (s.value_heads * s.value_dim, d),
        }
        flops += n_linear * training.adapter_flops(module, own)
    return flops


def attention_matrices(lm: LLMConfig, layer: int) -> dict[str, tuple[int, int]]:
    """An attention layer's projections {target: (in, out)}: at the full layers' own head
    width and key-value heads beside windows (Gemma 4's), none for keys and values where the
    layer reuses another's, none for values where the full layers' are their keys'."""
    kind = lm.layer_kind(layer)
    own = lm.window.enabled and not kind.sliding
    head = (lm.full_head_dim or lm.head_width) if own else lm.head_width
    kv_heads = (lm.full_kv_heads or lm.kv_heads) if own else lm.kv_heads
    q, kv, d = head * lm.heads, head * kv_heads, lm.width
    gate = 2 if lm.attn_gate else 1
    out = {"q": (d, gate * q), "k": (d, kv), "v": (d, kv), "o": (q, d)}
    if kind.kv_shared:
        del out["k"], out["v"]
    elif own and lm.full_k_eq_v:
        del out["v"]
    return out


def layer_linear(d: int, d_kv: int, f: int, d_q: int = 0, mlp: str = "gated_silu") -> float:
    """Forward FLOPs per token of a layer's projections: q and o (d x d_q), k and v (d x d_kv),
    the MLP (3 matrices gated, 2 otherwise)."""
    d_q = d_q or d
    return 2.0 * (2 * d * d_q + 2 * d * d_kv + (3 if mlp in GATED_MLPS else 2) * d * f)


# ----------------------------------------------------------------------------- timings
