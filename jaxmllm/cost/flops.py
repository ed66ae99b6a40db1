"""FLOPs of one item of each phase from the model config: the forward FLOPs per unit of a
tower's layers and projector (`jaxmllm.cost.model.CostModel.from_model` prices items with them,
times the training multipliers).

Per transformer layer and token (hidden d, key/value width d_kv, gated-MLP width f):
2 * (2 d d_q + 2 d d_kv + 3 d f). A mixture-of-experts layer's MLP is its router, the top_k
experts a token visits and its shared expert: the active parameters (`decoder_linear`).
"""

from __future__ import annotations

from jaxmllm.cost import training


def _mlp(section) -> str:
    return getattr(section, "mlp", "gated_silu")


def _vision_flops(v, llm_width: int) -> tuple[float, float, float]:
    """Per patch: (encoder linear, encoder quadratic, projector) forward FLOPs of a ViT over
    patches and its merge-area MLP projector; DeepStack (`deepstack`: K tapped blocks) adds K
    more projectors and the K additions of their rows to the LLM's hidden states."""
    area, levels = v.merge**2, len(getattr(v, "deepstack", ()))
    hid = getattr(v, "projector_dim", 0) or llm_width
    proj = 2 * (area * v.width * hid + hid * llm_width) / area
    proj = proj * (1 + levels) + levels * llm_width / area
    lin = v.depth * layer_linear(v.width, v.width, v.mlp_dim, mlp=_mlp(v))
    return lin, v.depth * 4.0 * v.width, proj


def _audio_flops(a, llm_width: int) -> tuple[float, float, float]:
    """Per log-mel frame: (encoder linear, encoder quadratic, projector) forward FLOPs of the
    audio encoder (its stem's convolutions, then a transformer on rows of `r` frames) and its
    projector (`subsample / r` rows per LLM token)."""
    stem = getattr(a, "stem", "pairs")
    s, r = a.subsample, 2 if stem == "whisper" else 4  # frames per LLM token, per encoder row
    hid = getattr(a, "projector_dim", 0) or llm_width
    proj = 2 * (s // r * a.width * hid + hid * llm_width) / s
    if stem == "whisper":  # 3-tap convs, stride 1 then 2: per frame
        conv = 2 * 3 * a.width * (a.n_mels + a.width / 2)
    else:  # (two 3-tap stride-2 convs, as first modelled: within a few % of the two pairs)
        conv = 2 * 9 * a.width * (a.n_mels + a.width) / s
    lin = a.depth * layer_linear(a.width, a.width, a.mlp_dim, mlp=_mlp(a)) / r + conv
    return lin, a.depth * 4.0 * a.width / (r * r), proj


# Per encoder phase of the table: its forward FLOPs per unit from its config section
ENCODER_FLOPS = {"vision": _vision_flops, "audio": _audio_flops}


def _vision_adapters(v, llm_width: int, how: dict) -> float:
    """Per patch: the forward FLOPs of the tower's and its projector's LoRA adapters."""
    area, hid = v.merge**2, getattr(v, "projector_dim", 0) or llm_width
    tower = v.depth * training.adapter_flops(
        how["vision"], training.block_shapes(v.width, v.width, v.mlp_dim)
    )
    shapes = {"fc1": (area * v.width, hid), "fc2": (hid, llm_width)}
    levels = 1 + len(getattr(v, "deepstack", ()))  # (DeepStack's projectors' adapters too)
    return tower + levels * training.adapter_flops(how["vision_projector"], shapes) / area


def _audio_adapters(a, llm_width: int, how: dict) -> float:
    """Per log-mel frame: the forward FLOPs of the encoder's and its projector's adapters."""
    s, r = a.subsample, 2 if getattr(a, "stem", "pairs") == "whisper" else 4
    hid = getattr(a, "projector_dim", 0) or llm_width
    tower = a.depth * training.adapter_flops(
        how["audio"], training.block_shapes(a.width, a.width, a.mlp_dim)
    )
    shapes = {"fc1": (s // r * a.width, hid), "fc2": (hid, llm_width), "fc": (a.width, llm_width)}
    return tower / r + training.adapter_flops(how["audio_projector"], shapes) / s


ENCODER_ADAPTERS = {"vision": _vision_adapters, "audio": _audio_adapters}


def moe_decoder(lm) -> bool:
    """Whether a decoder config has mixture-of-experts layers (any object with its fields: a
    run's config.json read back is a namespace)."""
    return getattr(getattr(lm, "moe", None), "experts", 0) > 0


def moe_layer_count(lm) -> int:
    """The decoder's MoE layers (`config.decoder.MoEConfig.is_moe`)."""
    m = lm.moe
    dense = set(getattr(m, "dense_layers", ()))
    return sum((i + 1) % m.every == 0 and i not in dense for i in range(lm.depth))


def decoder_linear(lm) -> float:
    """Forward FLOPs per token of the decoder's layers' projections, every layer: attention,
    and a dense layer's MLP, or an MoE layer's router, the top_k experts a token visits and
    its shared expert (and gate): what a step computes, the active parameters."""
    head = getattr(lm, "head_dim", 0) or lm.width // lm.heads
    q, kv, d = head * lm.heads, head * lm.kv_heads, lm.width
    if not moe_decoder(lm):
        return lm.depth * layer_linear(d, kv, lm.mlp_dim, q, _mlp(lm))
    m, n_moe = lm.moe, moe_layer_count(lm)
    attention = layer_linear(d, kv, 0, q)
    dense = layer_linear(d, kv, lm.mlp_dim, q, _mlp(lm)) - attention
    routed = 2.0 * (d * m.experts + m.top_k * 3 * d * m.mlp_dim + 3 * d * m.shared_mlp_dim)
    routed += 2.0 * d * bool(m.shared_mlp_dim and m.shared_gate)
    return lm.depth * attention + (lm.depth - n_moe) * dense + n_moe * routed


def layer_linear(d: int, d_kv: int, f: int, d_q: int = 0, mlp: str = "gated_silu") -> float:
    """Forward FLOPs per token of a layer's projections: q and o (d x d_q), k and v (d x d_kv),
    the MLP (3 matrices gated, 2 otherwise)."""
    d_q = d_q or d
    return 2.0 * (2 * d * d_q + 2 * d * d_kv + (3 if mlp == "gated_silu" else 2) * d * f)


# ----------------------------------------------------------------------------- timings
