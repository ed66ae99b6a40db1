"""Audio families: the Whisper encoder (of a `WhisperModel` / `WhisperForConditionalGeneration`)
and Qwen2-Audio's (`Qwen2AudioEncoder`, `audio_tower.` of a Qwen2-Audio).

Whisper's encoder is jaxmllm's audio encoder with `stem: whisper` (kernel-3 convolutions with
strides 1 and 2, exact GELU), `positions: sinusoidal` (its fixed `embed_positions` table, never
trained), LayerNorm blocks with exact-GELU MLPs, and biases on q, v and the output projection
(its key projection has none). The decoder is left alone; export writes it back unchanged.
Qwen2-Audio's encoder is Whisper's with its rows averaged in pairs after the blocks and before
the final LayerNorm (`pool: 2`): one row per 4 frames, each an LLM token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.hf.family import Family, Link, read, refuse_unless, same
from jaxmllm.hf.table import QWEN2_AUDIO_ENCODER, WHISPER
from jaxmllm.hf.vision import _prefix, layer_norm, linear


def conv1d(hf: str, ours: str, c_in: int, c_out: int) -> Link:
    """A torch Conv1d weight [out, in, 3] <-> our kernel [(tap, in), out] (windows of the
    previous, own and next step, in that order: torch's taps 0, 1, 2)."""
    return Link(
        (hf,),
        (ours,),
        lambda x: (np.asarray(x).transpose(2, 1, 0).reshape(3 * c_in, c_out),),
        lambda k: (np.asarray(k).reshape(3, c_in, c_out).transpose(2, 1, 0),),
    )


class WhisperEncoder(Family):
    """Whisper's encoder (the module docstring)."""

    row = WHISPER
    exports_whole = True  # (its decoder, unchanged)

    def section(self, hf: dict) -> dict:
        """Our `model.audio` keys from the encoder's config.json (a whole model's
        `audio_config`)."""
        hf = hf.get("audio_config", hf)  # a whole Qwen2-Audio: its encoder
        where = f"{self.name} config.json"
        act = read(hf, "activation_function", where, "gelu")
        refuse_unless(act == "gelu", where, f"activation_function {act!r}: expected gelu")
        return {
            "n_mels": int(read(hf, "num_mel_bins", where)),
            "subsample": 4,
            "stem": "whisper",
            "width": int(read(hf, "d_model", where)),
            "depth": int(read(hf, "encoder_layers", where)),
            "heads": int(read(hf, "encoder_attention_heads", where)),
            "mlp_dim": int(read(hf, "encoder_ffn_dim", where)),
            "positions": "sinusoidal",
            "max_positions": int(read(hf, "max_source_positions", where)),
            "norm": "layer",
            "norm_eps": 1e-5,
            "mlp": "gelu",
            "attn_bias": "qvo",
            "mlp_bias": True,
            "pool": self.pool,
        }

    pool = 1  # rows averaged after the blocks

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options this architecture has a counterpart for (an encoder from scratch)."""
        return {
            "model.audio.stem": ("whisper",),
            "model.audio.positions": ("sinusoidal",),
            "model.audio.norm": ("layer",),
            "model.audio.norm_eps": (1e-5,),
            "model.audio.mlp": ("gelu",),
            "model.audio.attn_bias": ("qvo",),
            "model.audio.mlp_bias": (True,),
            "model.audio.pool": (self.pool,),
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The model's config.json with our `model.audio` as its encoder."""
        a = cfg.model.audio
        out = dict(source or {})
        out.update(
            architectures=out.get("architectures") or [self.hf_class],
            model_type=self.model_types[0],
            d_model=a.width,
            encoder_layers=a.depth,
            encoder_attention_heads=a.heads,
            encoder_ffn_dim=a.mlp_dim,
            num_mel_bins=a.n_mels,
            max_source_positions=a.max_positions,
            activation_function="gelu",
        )
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The convolution stem, the positions, the encoder layers and the final norm."""
        a = cfg.model.audio
        w, h, f, n = a.width, a.heads, a.mlp_dim, a.depth
        e = w // h
        layer, ours = "layers.{i}.", "audio/transformer/blocks/"
        links = [
            conv1d("conv1.weight", "audio/conv1/kernel", a.n_mels, w),
            same("conv1.bias", "audio/conv1/bias"),
            conv1d("conv2.weight", "audio/conv2/kernel", w, w),
            same("conv2.bias", "audio/conv2/bias"),
            same("embed_positions.weight", "audio/positions"),
            *layer_norm("layer_norm", "audio/transformer/final_norm"),
            *layer_norm(layer + "self_attn_layer_norm", ours + "attn_norm", n),
            *layer_norm(layer + "final_layer_norm", ours + "mlp_norm", n),
            *linear(layer + "self_attn.q_proj", ours + "attn/query", (w, h, e), 1, n),
            *linear(layer + "self_attn.v_proj", ours + "attn/value", (w, h, e), 1, n),
            *linear(layer + "self_attn.out_proj", ours + "attn/out", (h, e, w), 2, n),
            *linear(layer + "fc1", ours + "mlp/fc1", (w, f), 1, n),
            *linear(layer + "fc2", ours + "mlp/fc2", (f, w), 1, n),
        ]
        links += linear(layer + "self_attn.k_proj", ours + "attn/key", (w, h, e), 1, n)[:1]
        return links

    def prefix(self, names: list[str]) -> str:
        """What the checkpoint puts before the encoder's names (`model.encoder.`)."""
        return _prefix(names, "conv1.weight")


class Qwen2AudioEncoder(WhisperEncoder):
    """Qwen2-Audio's encoder: Whisper's with its rows pooled in pairs."""

    row = QWEN2_AUDIO_ENCODER
    exports_whole = False
    pool = 2

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The encoder's own config.json (a whole Qwen2-Audio's `audio_config`)."""
        out = super().to_hf_config(cfg, (source or {}).get("audio_config", source))
        out.update(architectures=[self.hf_class], model_type=self.model_types[0])
        return out
