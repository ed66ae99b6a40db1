"""What every whole checkpoint's family (`jaxmllm.hf.wholes`, `jaxmllm.hf.qwen_vl`) writes and
reads alike: its LLM's decoder family, a part's config nested in the whole's config.json, the
run's placeholder tokens and an image processor's normalisation."""

from __future__ import annotations

from typing import Any

from jaxmllm.data.text.tokenizer import config_tokenizer
from jaxmllm.hf.decoders import Decoders
from jaxmllm.hf.family import refuse_unless
from jaxmllm.hf.hybrid import HYBRIDS

DECODERS = {kind: Decoders(kind) for kind in ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")}
DECODERS.update(HYBRIDS)  # Qwen3.5's text decoders (jaxmllm.hf.hybrid)
PROJECTOR_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def decoder(hf: dict, where: str, allowed=("llama", "qwen2", "qwen3")) -> Decoders:
    kind = hf.get("model_type", "llama")
    refuse_unless(
        kind in allowed,
        where,
        f"text_config model_type {kind!r} is not supported "
        f"(jaxmllm reads {', '.join(allowed)} here)",
    )
    return DECODERS[kind]


def decoder_of(cfg: Any) -> Decoders:
    """The decoder family our LLM's options say it is."""
    llm = cfg.model.llm
    if llm.linear.enabled:
        return DECODERS["qwen3_5_moe_text" if llm.moe.enabled else "qwen3_5_text"]
    if llm.moe.enabled:
        return DECODERS["qwen3_moe" if llm.qk_norm else "qwen2_moe"]
    if llm.qk_norm:
        return DECODERS["qwen3"]
    return DECODERS["qwen2" if llm.attn_bias == "qkv" else "llama"]


def nested(config: dict, model_type: str | None = None) -> dict:
    """A part's config as a whole's config.json nests it (no architectures of its own)."""
    out = {k: v for k, v in config.items() if k != "architectures"}
    if model_type:
        out["model_type"] = model_type
    return out


def enabled(cfg: Any, name: str, want: bool) -> list[str]:
    have = getattr(cfg.model, name).enabled
    return (
        []
        if have == want
        else [f"model.{name}.enabled={have} ({'needs' if want else 'has no'} {name} encoder)"]
    )


def tokenizer_ids(cfg: Any) -> Any:
    """The run's tokenizer (what a new config.json's placeholder ids are)."""
    return config_tokenizer(cfg.data)


def placeholder(cfg: Any, phase: str) -> str:
    """The text of the run's tokenizer's placeholder token of an encoder phase."""
    tk = tokenizer_ids(cfg)
    return tk.decode([tk.specials.media[phase]])


def pixels(cfg: Any, processor: str) -> dict:
    """An image processor's normalisation (rescaled to [0, 1], then mean / std per channel)."""
    d = cfg.data
    return {
        "image_processor_type": processor,
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(d.image_mean),
        "image_std": list(d.image_std),
    }
