"""The whole multimodal checkpoints jaxmllm reads and writes (`jaxmllm.hf.whole` is the contract).

- LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP tower, a two-layer projector
  (`multi_modal_projector.linear_1`, its activation, `linear_2`: jaxmllm's vision projector
  with one patch a token, `merge: 1`) and a Llama or Qwen2 LLM. The LLM reads the tower's
  hidden states after `vision_feature_layer` blocks, before its final norm: the model keeps
  those blocks (`model.vision.depth`, `final_norm: false`) and the others are left alone (and
  written back at export). `vision_feature_select_strategy: default` drops CLIP's class token
  after the blocks (jaxmllm's class tokens are never read by the LLM); a SigLIP tower has none
  (`full`). An image is `image_token_index` once per patch.
- Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
  `Qwen2_5_VLForConditionalGeneration`): the Qwen2 LLM with M-RoPE and the `visual.` tower
  whose patch merger is the projector (`jaxmllm.hf.qwen_vision`).
- Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): the Qwen2-Audio encoder (Whisper's, its
  rows pooled in pairs), one Linear as projector (`multi_modal_projector.linear`,
  `model.audio.projector: linear`) and a Qwen2 LLM. A clip of L frames is L / 4 audio tokens.

Videos (Qwen2-VL / 2.5-VL's temporal grid and Qwen2.5-VL's absolute-time M-RoPE) are not read
yet: a video modality adds its part here, beside `vision`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.data.text.tokenizer import config_tokenizer
from jaxmllm.hf.audio import Qwen2AudioEncoder
from jaxmllm.hf.decoders import Decoders
from jaxmllm.hf.family import Family, Link, mismatches, refuse_unless
from jaxmllm.hf.hybrid import HYBRIDS
from jaxmllm.hf.qwen_vision import Qwen2VLVision, Qwen25VLVision
from jaxmllm.hf.vision import Clip, Siglip, linear
from jaxmllm.hf.whole import Whole

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


class Llava(Whole):
    name = "llava"
    model_types = ("llava",)
    hf_class = "LlavaForConditionalGeneration"
    processor_class = "LlavaProcessor"
    parts = {
        "llm": ("text_config", "language_model."),
        "vision": ("vision_config", "vision_tower."),
    }
    token_keys = {"vision": ("image_token_index", "image_token_id")}
    runtime_prefix = {"vision": "model.vision_tower."}
    towers = {"clip_vision_model": Clip(), "siglip_vision_model": Siglip()}

    def inner(self, role: str, hf: dict) -> Family:
        sub = self.sub(role, hf)
        if role == "llm":
            return decoder(sub, "llava config.json")
        kind = sub.get("model_type", "clip_vision_model")
        tower = self.towers.get(kind)
        refuse_unless(
            tower is not None,
            "llava config.json",
            f"vision_config model_type {kind!r}: jaxmllm reads {', '.join(self.towers)}",
        )
        return tower

    def feature_depth(self, hf: dict) -> int:
        """The tower's blocks before the hidden layer the LLM reads (`vision_feature_layer`)."""
        where, layer = "llava config.json", hf.get("vision_feature_layer", -2)
        refuse_unless(
            isinstance(layer, int),
            where,
            f"vision_feature_layer {layer!r}: several "
            "feature layers are not supported (one integer)",
        )
        depth = int(self.sub("vision", hf).get("num_hidden_layers", 0))
        used = layer if layer >= 0 else depth + 1 + layer
        refuse_unless(
            1 <= used <= depth,
            where,
            f"vision_feature_layer {layer} is not one of the tower's {depth} blocks",
        )
        return used

    def section(self, role: str, hf: dict) -> dict:
        out = super().section(role, hf)
        if role != "vision":
            return out
        where, tower = "llava config.json", self.inner(role, hf)
        strategy = hf.get("vision_feature_select_strategy", "default")
        want = "default" if tower.name == "clip" else "full"
        message = f"vision_feature_select_strategy {strategy!r} with a {tower.name} tower"
        refuse_unless(
            strategy == want, where, f"{message} is not supported (jaxmllm reads {want!r})"
        )
        refuse_unless(
            hf.get("multimodal_projector_bias", True),
            where,
            "multimodal_projector_bias: false is not supported",
        )
        act = hf.get("projector_hidden_act", "gelu")
        refuse_unless(
            act in PROJECTOR_ACTS,
            where,
            f"projector_hidden_act {act!r} is not supported ({', '.join(PROJECTOR_ACTS)})",
        )
        out.update(
            depth=self.feature_depth(hf),
            final_norm=False,
            merge=1,
            projector_dim=0,
            projector_act=PROJECTOR_ACTS[act],
        )
        return out

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        if role != "vision":
            return []
        v, out = cfg.model.vision, cfg.model.llm.width
        hidden = v.projector_dim or out
        p = "multi_modal_projector."
        return [
            *linear(p + "linear_1", "vision_projector/fc1", (v.width, hidden)),
            *linear(p + "linear_2", "vision_projector/fc2", (hidden, out)),
        ]

    def owns(self, role: str, name: str) -> bool:
        return role == "vision" and name.startswith("multi_modal_projector.")

    def unused(self, role: str, name: str, hf: dict) -> bool:
        return role == "vision" and self.inner(role, hf).unused(name, self.feature_depth(hf))

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        v, llm = cfg.model.vision, cfg.model.llm
        tower = Clip() if v.class_token else Siglip()
        act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[v.projector_act]
        if source is None:
            return {
                "architectures": [self.hf_class],
                "model_type": "llava",
                "text_config": nested(decoder_of(cfg).to_hf_config(cfg, None)),
                "vision_config": nested(tower.to_hf_config(cfg, None)),
                "vision_feature_layer": -1,
                "vision_feature_select_strategy": "default" if v.class_token else "full",
                "image_token_index": tokenizer_ids(cfg).specials.media["vision"],
                "image_seq_length": v.position_grid**2,
                "projector_hidden_act": act,
                "multimodal_projector_bias": True,
                "tie_word_embeddings": llm.tie_embeddings,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.sub("llm", source)
            out["text_config"] = nested(
                self.inner("llm", source).to_hf_config(cfg, text), text.get("model_type")
            )
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(tower.to_hf_config(cfg, source))
            out["projector_hidden_act"] = act
        return out

    def mismatches(self, cfg: Any) -> list[str]:
        v, width = cfg.model.vision, cfg.model.llm.width
        tower = Clip() if v.class_token else Siglip()
        wants = {
            **decoder_of(cfg).wants(cfg),
            **tower.wants(cfg),
            "model.vision.final_norm": (False,),
            "model.vision.merge": (1,),
            "model.vision.projector_dim": ((lambda d: d in (0, width)), "the LLM's width"),
            "model.vision.projector_act": ("gelu", "gelu_tanh"),
        }
        return (
            enabled(cfg, "vision", True)
            + enabled(cfg, "audio", False)
            + mismatches(cfg, wants, "LLaVA")
        )

    def fillers(self, cfg: Any) -> dict[str, Any]:
        width = cfg.model.vision.width  # (the tower's final norm: LLaVA never applies it)
        return {
            "vision_tower.post_layernorm.weight": np.ones(width, np.float32),
            "vision_tower.post_layernorm.bias": np.zeros(width, np.float32),
        }

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        v = cfg.model.vision
        side = v.position_grid * v.patch_size
        image = {
            **pixels(cfg, "CLIPImageProcessor" if v.class_token else "SiglipImageProcessor"),
            "resample": 3,
            **(
                {
                    "size": {"shortest_edge": side},
                    "do_center_crop": True,
                    "crop_size": {"height": side, "width": side},
                }
                if v.class_token
                else {"size": {"height": side, "width": side}}
            ),
        }
        processor = {
            "processor_class": self.processor_class,
            "patch_size": v.patch_size,
            "vision_feature_select_strategy": "default" if v.class_token else "full",
            "num_additional_image_tokens": int(v.class_token),
            "image_token": placeholder(cfg, "vision"),
        }
        return {"preprocessor_config.json": image, "processor_config.json": processor}


class QwenVL(Whole):
    """Qwen2-VL and Qwen2.5-VL: a Qwen2 LLM with M-RoPE (at the top level of older files)."""

    parts = {"llm": ("text_config", ""), "vision": ("vision_config", "visual.")}
    token_keys = {"vision": ("image_token_id",)}
    runtime_prefix = {"vision": "model.visual."}

    def __init__(self, name: str, tower: Family, hf_class: str, processor_class: str):
        self.name, self.model_types, self.tower = name, (name,), tower
        self.hf_class, self.processor_class = hf_class, processor_class

    def sub(self, role: str, hf: dict) -> dict:
        if role == "llm" and not hf.get("text_config"):  # the hub's older, flat files
            return {k: v for k, v in hf.items() if k != "vision_config"}
        return super().sub(role, hf)

    def inner(self, role: str, hf: dict) -> Family:
        return DECODERS["qwen2"] if role == "llm" else self.tower

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        llm = cfg.model.llm
        if source is None:
            tk = tokenizer_ids(cfg)
            ids = {"image_token_id": tk.specials.media["vision"]}
            for key, token in (
                ("video_token_id", "<|video_pad|>"),
                ("vision_start_token_id", "<|vision_start|>"),
                ("vision_end_token_id", "<|vision_end|>"),
            ):
                found = getattr(tk, "token_id", lambda _: None)(token)
                if found is not None:
                    ids[key] = found
            text = DECODERS["qwen2"].to_hf_config(cfg, None)
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
                "text_config": nested(text, f"{self.name}_text"),
                "vision_config": nested(self.tower.to_hf_config(cfg, None)),
                "tie_word_embeddings": llm.tie_embeddings,
                **ids,
            }
        out = dict(source)
        if "llm" in roles:
            text = DECODERS["qwen2"].to_hf_config(cfg, self.sub("llm", source))
            if source.get("text_config"):
                kind = source["text_config"].get("model_type", f"{self.name}_text")
                out["text_config"] = nested(text, kind)
            else:  # flat: the text keys at the top level, as the source has them
                out.update(nested(text, self.name))
                out["architectures"] = [self.hf_class]
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(self.tower.to_hf_config(cfg, source))
        return out

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        v, d = cfg.model.vision, cfg.data
        image = {
            **pixels(cfg, "Qwen2VLImageProcessor"),
            "min_pixels": d.image_min_pixels,
            "max_pixels": d.image_max_pixels,
            "patch_size": v.patch_size,
            "merge_size": v.merge,
            "temporal_patch_size": v.temporal_patch,
        }
        return {
            "preprocessor_config.json": image,
            "processor_config.json": {"processor_class": self.processor_class},
        }

    def mismatches(self, cfg: Any) -> list[str]:
        wants = {
            **DECODERS["qwen2"].wants(cfg),
            **self.tower.wants(cfg),
            "model.llm.mrope_section": (any, "M-RoPE (time, row, column sections)"),
        }
        return (
            enabled(cfg, "vision", True)
            + enabled(cfg, "audio", False)
            + mismatches(cfg, wants, self.name)
        )


class Qwen2Audio(Whole):
    name = "qwen2_audio"
    model_types = ("qwen2_audio",)
    hf_class = "Qwen2AudioForConditionalGeneration"
    processor_class = "Qwen2AudioProcessor"
    parts = {"llm": ("text_config", "language_model."), "audio": ("audio_config", "audio_tower.")}
    token_keys = {"audio": ("audio_token_index", "audio_token_id")}
    runtime_prefix = {"audio": "model.audio_tower."}
    encoder = Qwen2AudioEncoder()

    def inner(self, role: str, hf: dict) -> Family:
        if role == "llm":
            return decoder(self.sub(role, hf), "qwen2_audio config.json", ("qwen2",))
        return self.encoder

    def section(self, role: str, hf: dict) -> dict:
        out = super().section(role, hf)
        if role == "audio":
            out["projector"] = "linear"
        return out

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        if role != "audio":
            return []
        shape = (cfg.model.audio.width, cfg.model.llm.width)
        return linear("multi_modal_projector.linear", "audio_projector/fc", shape)

    def owns(self, role: str, name: str) -> bool:
        return role == "audio" and name.startswith("multi_modal_projector.")

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        llm = cfg.model.llm
        if source is None:
            return {
                "architectures": [self.hf_class],
                "model_type": "qwen2_audio",
                "text_config": nested(DECODERS["qwen2"].to_hf_config(cfg, None)),
                "audio_config": nested(self.encoder.to_hf_config(cfg, None)),
                "audio_token_index": tokenizer_ids(cfg).specials.media["audio"],
                "tie_word_embeddings": llm.tie_embeddings,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.sub("llm", source)
            out["text_config"] = nested(DECODERS["qwen2"].to_hf_config(cfg, text), "qwen2")
        if "audio" in roles:
            out["audio_config"] = nested(self.encoder.to_hf_config(cfg, source))
        return out

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        a, rate = cfg.model.audio, cfg.data.audio_sample_rate
        seconds = a.max_positions * a.stride // 100  # (10 ms frames)
        features = {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": a.n_mels,
            "sampling_rate": rate,
            "hop_length": rate // 100,
            "chunk_length": seconds,
            "n_fft": 400,
            "n_samples": seconds * rate,
            "nb_max_frames": a.max_positions * a.stride,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
        }
        processor = {
            "processor_class": self.processor_class,
            "audio_token": placeholder(cfg, "audio"),
        }
        return {"preprocessor_config.json": features, "processor_config.json": processor}

    def mismatches(self, cfg: Any) -> list[str]:
        wants = {
            **DECODERS["qwen2"].wants(cfg),
            **self.encoder.wants(cfg),
            "model.audio.projector": ("linear",),
        }
        return (
            enabled(cfg, "audio", True)
            + enabled(cfg, "vision", False)
            + mismatches(cfg, wants, "Qwen2-Audio")
        )


WHOLES: tuple[Whole, ...] = (
    Llava(),
    QwenVL("qwen2_vl", Qwen2VLVision(), "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    QwenVL(
        "qwen2_5_vl", Qwen25VLVision(), "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"
    ),
    Qwen2Audio(),
)


def whole_for(hf: dict | None) -> Whole | None:
    """The whole-checkpoint family of a config.json, or None (a checkpoint of one part)."""
    kind = (hf or {}).get("model_type")
    return next((w for w in WHOLES if kind in w.model_types), None)
