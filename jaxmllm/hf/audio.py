"""Audio families: the Whisper encoder (of a `WhisperModel` / `WhisperForConditionalGeneration`),
Qwen2-Audio's (`Qwen2AudioEncoder`, `audio_tower.` of a Qwen2-Audio) and Gemma 4's conformer
(`Gemma4AudioModel`, `Gemma4AudioEncoder` below).

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

from jaxmllm.data.media.audio import GEMMA4
from jaxmllm.hf.family import Family, Link, bounds, dense, read, refuse_unless, same
from jaxmllm.hf.table import GEMMA4_AUDIO, QWEN2_AUDIO_ENCODER, WHISPER
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
    mel = "whisper"  # data.mel: its feature extractor's log-mel

    def check_features(self, proc: dict, where: str) -> None:
        """Nothing to refuse: `data.mel: whisper` is its feature extractor's."""

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


# What Gemma4AudioFeatureExtractor's preprocessor_config.json may set that `data.mel: gemma4`
# computes only at its default (jaxmllm.data.media.audio.gemma4_log_mel)
MEL_DEFAULTS = {
    "frame_length_ms": 20.0,
    "hop_length_ms": 10.0,
    "min_frequency": 0.0,
    "max_frequency": 8000.0,
    "preemphasis": 0.0,
    "fft_overdrive": False,
    "dither": 0.0,
    "input_scale_factor": 1.0,
    "mel_floor": 1e-3,
    "per_bin_mean": None,
    "per_bin_stddev": None,
}
# transformers' attention_invalid_logits_value: the score of a masked key
INVALID_LOGITS = -1e9


def conv2d_3x3(hf: str, ours: str) -> Link:
    """A torch Conv2d weight [out, in, 3 (time), 3 (mel)] <-> our kernel [time, mel, in,
    out]."""
    return Link(
        (hf,),
        (ours,),
        lambda w: (np.asarray(w).transpose(2, 3, 1, 0),),
        lambda k: (np.asarray(k).transpose(3, 2, 0, 1),),
    )


def depthwise(hf: str, ours: str, layers: int) -> Link:
    """A torch depthwise Conv1d weight [width, 1, taps] <-> our kernel [taps, width]."""
    return Link(
        (hf,),
        (ours,),
        lambda w: (np.asarray(w)[:, 0, :].T,),
        lambda k: (np.asarray(k).T[:, None, :],),
        layers,
    )


class Gemma4AudioEncoder(Family):
    """Gemma 4's audio encoder (`Gemma4AudioModel`, `audio_tower.` of a whole Gemma 4): the
    conformer of `jaxmllm.models.conformer` (`model.audio.stem: conformer`). Its feed-forwards
    are 4x the width with SiLU; its frames have 4 x (subsampling_conv_channels[0] // 4) mel
    bins, what its output Linear's input implies (the feature extractor's feature_size)."""

    row = GEMMA4_AUDIO
    mel = GEMMA4

    def check_features(self, proc: dict, where: str) -> None:
        """Refuses a feature extractor (preprocessor_config.json `proc`) whose features
        `data.mel: gemma4` does not compute, naming the key."""
        for key, default in MEL_DEFAULTS.items():
            value = proc.get(key, default)
            refuse_unless(
                value == default,
                where,
                f"{key} {value!r}: jaxmllm's gemma4 log-mel computes {default!r} only",
            )

    def section(self, hf: dict) -> dict:
        """Our `model.audio` keys from the encoder's config.json (a whole's `audio_config`)."""
        hf = hf.get("audio_config", hf)
        where = f"{self.name} config.json"
        act = read(hf, "hidden_act", where, "silu")
        refuse_unless(act == "silu", where, f"hidden_act {act!r}: the conformer's is silu")
        invalid = float(read(hf, "attention_invalid_logits_value", where, INVALID_LOGITS))
        refuse_unless(
            invalid == INVALID_LOGITS,
            where,
            f"attention_invalid_logits_value {invalid}: jaxmllm masks scores with "
            f"{INVALID_LOGITS} (no key outside a query's window counts)",
        )
        channels = [int(c) for c in read(hf, "subsampling_conv_channels", where, [128, 32])]
        refuse_unless(
            len(channels) == 2,
            where,
            f"subsampling_conv_channels {channels}: the subsampling is two convolutions",
        )
        width = int(read(hf, "hidden_size", where))
        return {
            "n_mels": 4 * (channels[0] // 4),
            "subsample": 4,
            "stem": "conformer",
            "width": width,
            "depth": int(read(hf, "num_hidden_layers", where)),
            "heads": int(read(hf, "num_attention_heads", where)),
            "mlp_dim": 4 * width,
            "positions": "relative",
            "norm": "rms",
            "norm_eps": float(read(hf, "rms_norm_eps", where, 1e-6)),
            "mlp": "silu",
            "attn_bias": "",
            "mlp_bias": False,
            "pool": 1,
            "conformer": {
                "channels": channels,
                "chunk": int(read(hf, "attention_chunk_size", where, 12)),
                "context_left": int(read(hf, "attention_context_left", where, 13)),
                "context_right": int(read(hf, "attention_context_right", where, 0)),
                "logit_cap": float(read(hf, "attention_logit_cap", where, 50.0)),
                "conv_kernel": int(read(hf, "conv_kernel_size", where, 5)),
                "residual_weight": float(read(hf, "residual_weight", where, 0.5)),
                "clamp": float(read(hf, "gradient_clipping", where, 1e10)),
                "clipped_linears": bool(read(hf, "use_clipped_linears", where, True)),
                "out_dim": int(read(hf, "output_proj_dims", where, 1536)),
            },
        }

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options this architecture has a counterpart for (an encoder from scratch)."""
        a = cfg.model.audio
        c0 = a.conformer.channels[0]
        return {
            "model.audio.stem": ("conformer",),
            "model.audio.mlp_dim": (4 * a.width,),
            "model.audio.n_mels": tuple(range(4 * (c0 // 4) - 3, 4 * (c0 // 4) + 1)),
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The encoder's own config.json (a whole Gemma 4's `audio_config`)."""
        a, c = cfg.model.audio, cfg.model.audio.conformer
        out = dict((source or {}).get("audio_config", source) or {})
        out.update(
            architectures=[self.hf_class],
            model_type=self.model_types[0],
            hidden_size=a.width,
            num_hidden_layers=a.depth,
            num_attention_heads=a.heads,
            hidden_act="silu",
            subsampling_conv_channels=list(c.channels),
            conv_kernel_size=c.conv_kernel,
            residual_weight=c.residual_weight,
            attention_chunk_size=c.chunk,
            attention_context_left=c.context_left,
            attention_context_right=c.context_right,
            attention_logit_cap=c.logit_cap,
            attention_invalid_logits_value=INVALID_LOGITS,
            use_clipped_linears=c.clipped_linears,
            rms_norm_eps=a.norm_eps,
            gradient_clipping=c.clamp,
            output_proj_dims=c.out_dim,
        )
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The subsampling, the blocks (their clipped linears' bounds where it has them) and
        the output projection."""
        a = cfg.model.audio
        c = a.conformer
        w, h, f, n = a.width, a.heads, a.mlp_dim, a.depth
        e, mels = w // h, ((a.n_mels + 1) // 2 + 1) // 2
        sub, layer, ours = "subsample_conv_projection.", "layers.{i}.", "audio/blocks/"
        links = [
            conv2d_3x3(sub + "layer0.conv.weight", "audio/layer0/conv/kernel"),
            same(sub + "layer0.norm.weight", "audio/layer0/norm/scale"),
            conv2d_3x3(sub + "layer1.conv.weight", "audio/layer1/conv/kernel"),
            same(sub + "layer1.norm.weight", "audio/layer1/norm/scale"),
            dense(
                sub + "input_proj_linear.weight",
                "audio/input_proj/kernel",
                (mels, c.channels[1], w),
                2,
            ),
            *linear("output_proj", "audio/output_proj", (w, c.out_dim)),
            same(layer + "self_attn.per_dim_scale", ours + "attn/per_dim_scale", n),
            dense(
                layer + "self_attn.relative_k_proj.weight",
                ours + "attn/relative/kernel",
                (w, h, e),
                1,
                n,
            ),
            depthwise(layer + "lconv1d.depthwise_conv1d.weight", ours + "conv/kernel", n),
        ]
        norms = {
            "norm_pre_attn": "attn_norm",
            "norm_post_attn": "attn_post_norm",
            "norm_out": "out_norm",
            "lconv1d.pre_layer_norm": "conv/pre_norm",
            "lconv1d.conv_norm": "conv/conv_norm",
        }
        for k in (1, 2):
            norms[f"feed_forward{k}.pre_layer_norm"] = f"ff{k}/pre_norm"
            norms[f"feed_forward{k}.post_layer_norm"] = f"ff{k}/post_norm"
        links += [same(f"{layer}{t}.weight", f"{ours}{o}/scale", n) for t, o in norms.items()]
        clipped = {  # theirs -> (ours, our kernel's shape, its input dims)
            "self_attn.q_proj": ("attn/query", (w, h, e), 1),
            "self_attn.k_proj": ("attn/key", (w, h, e), 1),
            "self_attn.v_proj": ("attn/value", (w, h, e), 1),
            "self_attn.post": ("attn/out", (h, e, w), 2),
            "lconv1d.linear_start": ("conv/start", (w, 2 * w), 1),
            "lconv1d.linear_end": ("conv/end", (w, w), 1),
        }
        for k in (1, 2):
            clipped[f"feed_forward{k}.ffw_layer_1"] = (f"ff{k}/fc1", (w, f), 1)
            clipped[f"feed_forward{k}.ffw_layer_2"] = (f"ff{k}/fc2", (f, w), 1)
        for theirs, (o, shape, n_in) in clipped.items():
            links.append(
                dense(f"{layer}{theirs}.linear.weight", f"{ours}{o}/kernel", shape, n_in, n)
            )
            if c.clipped_linears:
                links.append(bounds(layer + theirs, ours + o, n))
        return links

    def prefix(self, names: list[str]) -> str:
        """What the checkpoint puts before the encoder's names (`model.audio_tower.`)."""
        return _prefix(names, "subsample_conv_projection.layer0.conv.weight")
