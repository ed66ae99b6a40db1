"""Decoder families: Llama (3.x, with its rope scaling) and Qwen2 / Qwen2.5 (q/k/v biases); the
LLM of a whole checkpoint is one of them on its `text_config` (`jaxmllm.hf.wholes`: Qwen2-VL's
is Qwen2 with M-RoPE).

All are jaxmllm's own decoder (RMSNorm, rotate-half RoPE, GQA, SiLU-gated MLP) with options:
`norm_eps`, `head_dim`, `attn_bias` (Qwen2: qkv; Llama: qkvo with attention_bias), `mlp_bias`,
`rope_scaling`, `mrope_section` (Qwen2-VL), and tied embeddings without jaxmllm's
1/sqrt(width) logit scale.
"""

from __future__ import annotations

from typing import Any

from jaxmllm.hf.family import Family, FamilyError, Link, dense, read, refuse_unless, reshaped, same

ROPE_TYPES = {"default": "none", "mrope": "none", "linear": "linear", "llama3": "llama3"}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def rope_section(hf: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, our rope_scaling) from either config style: transformers 5's
    `rope_parameters`, or the hub's older `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        params = next(iter(params.values()))  # per layer type: the same for every layer here
    scaling = params or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    refuse_unless(
        kind in ROPE_TYPES,
        where,
        f"rope type {kind!r} is not supported (jaxmllm has {', '.join(ROPE_TYPES)})",
    )
    refuse_unless(
        float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) == 1.0,
        where,
        "partial_rotary_factor != 1 (rotary on part of each head) is not supported",
    )
    ours = {"type": ROPE_TYPES[kind]}
    if kind in ("linear", "llama3"):
        ours["factor"] = float(scaling["factor"])
    if kind == "llama3":
        ours["low_freq_factor"] = float(scaling["low_freq_factor"])
        ours["high_freq_factor"] = float(scaling["high_freq_factor"])
        ours["original_max_positions"] = int(scaling["original_max_position_embeddings"])
    return theta, ours


def rope_to_hf(llm: Any) -> dict:
    """transformers 5's `rope_parameters` of our decoder config."""
    s = llm.rope_scaling
    out = {"rope_theta": llm.rope_theta, "rope_type": {"none": "default"}.get(s.type, s.type)}
    if s.type in ("linear", "llama3"):
        out["factor"] = s.factor
    if s.type == "llama3":
        out.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_positions,
        )
    return out


class Decoders(Family):
    """Llama and Qwen2 causal LMs (`LlamaForCausalLM`, `Qwen2ForCausalLM`)."""

    role = "llm"

    def __init__(self, model_type: str):
        self.name = self.model_type = model_type
        self.model_types = (model_type,)
        self.hf_class = CLASSES[model_type]

    def section(self, hf: dict) -> dict:
        where = f"{self.name} config.json"
        act = read(hf, "hidden_act", where, "silu")
        refuse_unless(act == "silu", where, f"hidden_act {act!r}: the decoder's MLP is SiLU-gated")
        refuse_unless(
            int(hf.get("pretraining_tp", 1)) == 1, where, "pretraining_tp != 1 is not supported"
        )
        if self.model_type != "llama":
            kinds = set(hf.get("layer_types") or ["full_attention"])
            refuse_unless(
                not hf.get("use_sliding_window") and kinds == {"full_attention"},
                where,
                "sliding-window attention (use_sliding_window / layer_types) is not supported",
            )
        width, heads = (
            int(read(hf, "hidden_size", where)),
            int(read(hf, "num_attention_heads", where)),
        )
        head_dim = int(hf.get("head_dim") or width // heads)
        theta, scaling = rope_section(hf, where)
        if self.model_type != "llama":
            bias = "qkv"
        else:
            bias = "qkvo" if hf.get("attention_bias") else ""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        mrope = [int(x) for x in rope.get("mrope_section", [0, 0, 0])]
        return {
            "vocab_size": int(read(hf, "vocab_size", where)),
            "width": width,
            "depth": int(read(hf, "num_hidden_layers", where)),
            "heads": heads,
            "kv_heads": int(hf.get("num_key_value_heads") or heads),
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "head_dim": 0 if head_dim * heads == width else head_dim,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "tied_logits_scaled": False,
            "norm": "rms",
            "norm_eps": float(read(hf, "rms_norm_eps", where)),
            "mlp": "gated_silu",
            "attn_bias": bias,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "mrope_section": mrope,
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        llm = cfg.model.llm
        if self.model_type != "llama" and llm.attn_bias != "qkv":
            raise FamilyError(f"model.llm.attn_bias={llm.attn_bias!r}: Qwen2 has q/k/v biases")
        if self.model_type == "llama" and llm.attn_bias not in ("", "qkvo"):
            raise FamilyError(f"model.llm.attn_bias={llm.attn_bias!r}: Llama has none or all")
        out = {k: v for k, v in (source or {}).items() if k not in ("rope_theta", "rope_scaling")}
        out.update(
            architectures=[self.hf_class],
            model_type=self.model_type,
            vocab_size=llm.vocab_size,
            hidden_size=llm.width,
            num_hidden_layers=llm.depth,
            num_attention_heads=llm.heads,
            num_key_value_heads=llm.kv_heads,
            intermediate_size=llm.mlp_dim,
            head_dim=llm.head_width,
            hidden_act="silu",
            rms_norm_eps=llm.norm_eps,
            rope_parameters=rope_to_hf(llm),
            tie_word_embeddings=llm.tie_embeddings,
        )
        if self.model_type == "llama":
            out.update(attention_bias=llm.attn_bias == "qkvo", mlp_bias=llm.mlp_bias)
        if any(llm.mrope_section):
            out["rope_parameters"]["mrope_section"] = list(llm.mrope_section)
        return out

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options this architecture has a counterpart for (a decoder from scratch)."""
        llm = cfg.model.llm
        return {
            "model.llm.norm": ("rms",),
            "model.llm.mlp": ("gated_silu",),
            "model.llm.attn_bias": ("", "qkvo") if self.model_type == "llama" else ("qkv",),
            "model.llm.mlp_bias": (False, True) if self.model_type == "llama" else (False,),
            "model.llm.tied_logits_scaled": (
                lambda scaled: not (scaled and llm.tie_embeddings),
                "tied logits x . E^T, unscaled",
            ),
            "model.llm.mrope_section": ((lambda m: not any(m)), "1D rotary positions"),
        }

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        llm = cfg.model.llm
        w, h, k, e, f, n = (
            llm.width,
            llm.heads,
            llm.kv_heads,
            llm.head_width,
            llm.mlp_dim,
            llm.depth,
        )
        p, ours = "model.layers.{i}.", "llm/transformer/blocks/"
        links = [
            same("model.embed_tokens.weight", "llm/embed/embedding"),
            same(p + "input_layernorm.weight", ours + "attn_norm/scale", n),
            dense(p + "self_attn.q_proj.weight", ours + "attn/query/kernel", (w, h, e), 1, n),
            dense(p + "self_attn.k_proj.weight", ours + "attn/key/kernel", (w, k, e), 1, n),
            dense(p + "self_attn.v_proj.weight", ours + "attn/value/kernel", (w, k, e), 1, n),
            dense(p + "self_attn.o_proj.weight", ours + "attn/out/kernel", (h, e, w), 2, n),
            same(p + "post_attention_layernorm.weight", ours + "mlp_norm/scale", n),
            dense(p + "mlp.gate_proj.weight", ours + "mlp/gate/kernel", (w, f), 1, n),
            dense(p + "mlp.up_proj.weight", ours + "mlp/up/kernel", (w, f), 1, n),
            dense(p + "mlp.down_proj.weight", ours + "mlp/down/kernel", (f, w), 1, n),
            same("model.norm.weight", "llm/transformer/final_norm/scale"),
        ]
        heads = {"q": ("query", h), "k": ("key", k), "v": ("value", k)}
        for letter, (name, count) in heads.items():
            if letter in llm.attn_bias:
                hf_name = p + f"self_attn.{letter}_proj.bias"
                links.append(reshaped(hf_name, ours + f"attn/{name}/bias", (count, e), n))
        if "o" in llm.attn_bias:
            links.append(same(p + "self_attn.o_proj.bias", ours + "attn/out/bias", n))
        if llm.mlp_bias:
            for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                links.append(same(p + f"mlp.{proj}.bias", ours + f"mlp/{name}/bias", n))
        if not llm.tie_embeddings:
            # (-1: the checkpoint's vocabulary; the loader grows it to ours if tokens were added)
            links.append(dense("lm_head.weight", "llm/lm_head/kernel", (w, -1)))
        return links

    def skipped(self, name: str) -> bool:
        # Rotary caches some older exports stored (recomputed from the config).
        return name.endswith("rotary_emb.inv_freq")
