"""Each encoder phase's modules (`jaxmllm.config.phases`): the encoder over its packed bucket and
the projector from its rows to the LLM's embeddings. A new modality adds its entry here (a test
holds the names equal to the phase table's)."""

from __future__ import annotations

from flax import nnx

from jaxmllm.config import AudioConfig
from jaxmllm.models.audio import AudioEncoder
from jaxmllm.models.conformer import ConformerEncoder
from jaxmllm.models.projectors import audio_projector, vision_projector
from jaxmllm.models.vision import VisionEncoder


def audio_encoder(cfg: AudioConfig, **kw) -> nnx.Module:
    """The audio encoder `cfg.stem` names: Gemma 4's conformer, or the transformer encoder."""
    return (ConformerEncoder if cfg.is_conformer else AudioEncoder)(cfg, **kw)


# phase name -> (encoder factory (config section, ..., documents=, rngs=), projector factory
# (ModelConfig, ...))
ENCODER_MODULES = {
    "vision": (VisionEncoder, vision_projector),
    "audio": (audio_encoder, audio_projector),
}
