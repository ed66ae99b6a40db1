"""Gemma 4's whole model: `Gemma4ForConditionalGeneration` (`gemma4`, the table's `GEMMA4` row),
its text decoder, its vision tower and, where its config.json has an `audio_config`, its audio
conformer.

- Its LLM is Gemma 4's text decoder (`jaxmllm.hf.gemma4`: `model.language_model.`, the
  causal LM's `model.` renamed, as transformers 5 names the modules), its tower Gemma 4's
  (`model.vision_tower.`, `jaxmllm.hf.gemma4_vision`), its projector `model.embed_vision.`
  (an RMSNorm without a scale, then `embedding_projection` [text width, vision width]):
  jaxmllm's `projector: pool`, `pool_embed`, the tower's pooling and standardisation before it.
- An image is `image_token_id` once per soft token, right after `boi_token_id` and before
  `eoi_token_id` (the row's `wrap`; Gemma4Processor writes nothing else around it). Its tokens
  attend to each other both ways where text_config's `use_bidirectional_attention` is
  `vision`, and then in the sliding-window layers only: the full-attention layers stay causal
  (transformers' `create_masks_for_vision_model`: `model.llm.bidirectional: [vision]`,
  `bidirectional_full: false`).
- Its processor resizes each image at its aspect ratio to at most `max_soft_tokens` x k x k
  patches (k: `pooling_kernel_size`), each side floored to whole k x k windows, small images
  scaled up: `data.image_resize: floor` within `data.image_max_pixels` (`hf import` sets them),
  so an image has exactly the processor's soft tokens, patch x patch x k x k pixels each.
- Its audio encoder is the conformer (`model.audio_tower.`, `jaxmllm.hf.audio.
  Gemma4AudioEncoder`), its projector `model.embed_audio.` (`model.audio.projector: embed`:
  an RMSNorm without a scale, of the audio config's rms_norm_eps, then `embedding_projection`
  [text width, output_proj_dims]). A clip is `audio_token_id` once per soft token (one per 4
  frames, rounded up) after `boa_token_id` and before `eoa_token_index`, read causally.
  A checkpoint whose `audio_config` is null holds no audio part (`Whole.optional`).

Refused, naming the key: what the decoder and the towers refuse.
"""

from __future__ import annotations

from typing import Any

from jaxmllm.hf import oracle, table
from jaxmllm.hf.audio import MEL_DEFAULTS
from jaxmllm.hf.family import Family, Link, dense, mismatches, refuse_unless
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.whole_config import (
    DECODERS,
    decoder,
    enabled,
    nested,
    placeholder,
    tokenizer_ids,
    tower_of,
)

PROJECTOR = "model.embed_vision."
AUDIO_PROJECTOR = "model.embed_audio."
# The soft tokens an image may have in Gemma4ImageProcessor (its max_soft_tokens)
SOFT_TOKENS = (70, 140, 280, 560, 1120)
# Gemma4Processor's tokens around an image and a clip (the row's `wraps` name their keys)
WRAP_TOKENS = {"vision": ("<|image>", "<image|>"), "audio": ("<|audio>", "<audio|>")}


class Gemma4Whole(Whole):
    """Gemma 4's whole model (the module docstring)."""

    row = table.GEMMA4
    parts = {
        "llm": ("text_config", "model.language_model."),
        "vision": ("vision_config", "model.vision_tower."),
        "audio": ("audio_config", "model.audio_tower."),
    }
    optional = ("audio",)
    token_keys = {"vision": ("image_token_id",), "audio": ("audio_token_id",)}
    runtime_names = True

    def __init__(self):
        """Its decoder (the row's) and its towers (Gemma 4's vision tower and conformer)."""
        super().__init__()
        self.decoder = DECODERS[self.row.llm[0].name]
        self.tower, self.audio = (tower_of(row) for row in self.row.towers)

    def inner(self, role: str, hf: dict) -> Family:
        """The LLM's decoder, the vision tower or the audio encoder.

        Raises:
          FamilyError: another text, vision or audio model type, naming it.
        """
        where = f"{self.name} config.json"
        sub = self.sub(role, hf)
        if role == "llm":
            return decoder(sub, where, self.row.llm)
        tower = self.tower if role == "vision" else self.audio
        kind = sub.get("model_type", tower.model_types[0])
        refuse_unless(
            kind in tower.model_types,
            where,
            f"{self.parts[role][0]} model_type {kind!r}: jaxmllm reads {tower.model_types[0]} here",
        )
        return tower

    def section(self, role: str, hf: dict) -> dict:
        """A part's section; the LLM's with its images read both ways in its sliding layers
        where text_config's use_bidirectional_attention is vision; the audio projector
        embed_audio's."""
        out = super().section(role, hf)
        if role == "audio":
            out["projector"] = "embed"
        if role == "llm" and self.sub(role, hf).get("use_bidirectional_attention") == "vision":
            out["bidirectional"] = list(self.row.bidirectional)
            out["bidirectional_full"] = False
        return out

    def place(self, role: str, name: str, at: str) -> str:
        """A part's tensor under the whole's names (the decoder's `model.` is
        `model.language_model.`; its head stays `lm_head`)."""
        if role == "llm":
            return at + name.removeprefix("model.") if name.startswith("model.") else name
        return at + name

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        """A projector's matrix (embed_vision's, embed_audio's; their norms have no weight)."""
        width = cfg.model.llm.width
        if role == "vision":
            shape, at = (cfg.model.vision.width, width), PROJECTOR
        elif role == "audio":
            shape, at = (cfg.model.audio.out_width, width), AUDIO_PROJECTOR
        else:
            return []
        kernel = f"{role}_projector/fc/kernel"
        return [dense(at + "embedding_projection.weight", kernel, shape)]

    def owns(self, role: str, name: str) -> bool:
        """A projector's tensors, its part's; the LM head, the LLM's."""
        if role == "vision":
            return name.startswith(PROJECTOR)
        if role == "audio":
            return name.startswith(AUDIO_PROJECTOR)
        return role == "llm" and name.startswith("lm_head.")

    def data_keys(self, proc: dict, where: str, hf: dict) -> dict:
        """Our `data` keys of its image processor (the module docstring): the floor rule
        within max_soft_tokens x k x k patches (280 where the file names none), pixels to
        [-1, 1] as its patch embedder maps them.

        Raises:
          FamilyError: a processor that normalises before the model does, or whose patch or
            pooling size is not the tower's.
        """
        refuse_unless(
            not proc.get("do_normalize"),
            where,
            "do_normalize: true: Gemma 4's patch embedder maps [0, 1] pixels to [-1, 1] "
            "itself; a processor that normalises first is not read (set it to false)",
        )
        tower = self.sub("vision", hf)
        p, k = int(tower.get("patch_size", 16)), int(tower.get("pooling_kernel_size", 3))
        theirs = (proc.get("patch_size", p), proc.get("pooling_kernel_size", k))
        refuse_unless(
            theirs == (p, k),
            where,
            f"patch_size {theirs[0]} and pooling_kernel_size {theirs[1]}: config.json's "
            f"vision_config has {p} and {k}; they must agree",
        )
        budget = int(proc.get("max_soft_tokens", 280)) * (k * p) ** 2
        return {
            "image_resize": "floor",
            "image_min_pixels": budget,
            "image_max_pixels": budget,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
        }

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole's config.json: from scratch, or `source`'s with `roles`' parts ours."""
        llm = cfg.model.llm
        both = "vision" if llm.bidirectional else None
        if source is None:
            text = nested(self.decoder.to_hf_config(cfg, None), self.decoder.name)
            audio = "audio" in roles
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
                "text_config": {**text, "use_bidirectional_attention": both},
                "vision_config": nested(self.tower.to_hf_config(cfg, None)),
                "audio_config": nested(self.audio.to_hf_config(cfg, None)) if audio else None,
                "tie_word_embeddings": llm.tie_embeddings,
                **self.token_ids(cfg, ("vision", "audio") if audio else ("vision",)),
            }
        out = dict(source)
        if "llm" in roles:
            text = nested(
                self.decoder.to_hf_config(cfg, self.sub("llm", source)), self.decoder.name
            )
            out["text_config"] = {**text, "use_bidirectional_attention": both}
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(self.tower.to_hf_config(cfg, source))
        if "audio" in roles:
            out["audio_config"] = nested(self.audio.to_hf_config(cfg, source))
        return out

    def token_ids(self, cfg: Any, phases: tuple[str, ...]) -> dict[str, int]:
        """A new config.json's ids of the run's tokenizer: each phase's placeholder and the
        tokens of its wrap (`WRAP_TOKENS`) where the vocabulary has them."""
        tk = tokenizer_ids(cfg)
        ids = {}
        for phase in phases:
            ids[self.token_keys[phase][0]] = tk.specials.media[phase]
            for key, token in zip(self.row.wraps[phase], WRAP_TOKENS[phase], strict=True):
                found = getattr(tk, "token_id", lambda _: None)(token)
                if found is not None:
                    ids[key] = found
        return ids

    def mismatches(self, cfg: Any) -> list[str]:
        """Our options Gemma 4 has no counterpart for (its decoder's, its towers', images read
        both ways in every layer, its processor's resize and pixels, an audio projector other
        than embed_audio's)."""
        spans = cfg.model.llm.bidirectional
        audio = {}
        if cfg.model.audio.enabled:
            audio = {
                **self.audio.wants(cfg),
                "model.audio.projector": ("embed",),
                "data.mel": (self.audio.mel,),  # (its feature extractor's frames)
            }
        wants = {
            **self.decoder.wants(cfg),
            **self.tower.wants(cfg),
            **audio,
            "model.llm.bidirectional": (
                (lambda b: tuple(b) in ((), ("vision",))),
                "[vision] or []",
            ),
            "model.llm.bidirectional_full": ((lambda f: not (spans and f)), "false (sliding only)"),
            "data.image_resize": ("floor",),
            "data.image_mean": ((lambda m: tuple(m) == (0.5,) * 3), "0.5 a channel"),
            "data.image_std": ((lambda m: tuple(m) == (0.5,) * 3), "0.5 a channel"),
            "data.image_max_pixels": (
                (lambda n: n in self.budgets(cfg)),
                "max_soft_tokens x (patch x merge)^2 pixels, max_soft_tokens one of "
                f"{', '.join(map(str, SOFT_TOKENS))}",
            ),
        }
        return enabled(cfg, "vision", True) + mismatches(cfg, wants, "Gemma 4")

    def budgets(self, cfg: Any) -> tuple[int, ...]:
        """The pixel budgets Gemma4ImageProcessor has at our patch and merge sizes."""
        v = cfg.model.vision
        return tuple(t * (v.patch_size * v.merge) ** 2 for t in SOFT_TOKENS)

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        """transformers' inputs of a sample (`oracle.gemma4`)."""
        return oracle.gemma4(sample, cfg, specials)

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """Gemma4Processor's one file, as its save_pretrained writes it (transformers 5: each
        sub-processor's settings nested): Gemma4ImageProcessor's (its resize at our budget,
        [0, 1] pixels) and its video processor's alike; Gemma4AudioFeatureExtractor's, with
        audio at `data.mel: gemma4`'s frames, our rate and mel bins, and a clip's most soft
        tokens, `data.audio_max_frames` over the conformer's subsampling (without, its
        defaults: the processor has one either way)."""
        v, d = cfg.model.vision, cfg.data
        tokens = d.image_max_pixels // (v.patch_size * v.merge) ** 2
        pixels = {
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": False,
            "image_mean": [0.0] * 3,
            "image_std": [1.0] * 3,
            "patch_size": v.patch_size,
            "pooling_kernel_size": v.merge,
        }
        processor = {
            "processor_class": self.processor_class,
            "image_seq_length": tokens,
            "image_token": placeholder(cfg, "vision"),
            "image_processor": {
                "image_processor_type": "Gemma4ImageProcessor",
                **pixels,
                "max_soft_tokens": tokens,
            },
            "video_processor": {"video_processor_type": "Gemma4VideoProcessor", **pixels},
        }
        # (Gemma4Processor has a feature extractor whether or not the model has audio)
        processor["feature_extractor"] = {"feature_extractor_type": "Gemma4AudioFeatureExtractor"}
        if cfg.model.audio.enabled:
            a = cfg.model.audio
            processor.update(
                audio_seq_length=d.audio_max_frames // a.subsample,
                audio_ms_per_token=10 * a.subsample,  # (10 ms frames)
                audio_token=placeholder(cfg, "audio"),
            )
            processor["feature_extractor"].update(
                feature_size=a.n_mels,
                sampling_rate=d.audio_sample_rate,
                padding_value=0.0,
                return_attention_mask=True,
                **MEL_DEFAULTS,
            )
        return {"processor_config.json": processor}
