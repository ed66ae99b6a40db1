"""Each encoder phase's modules (`jaxmllm.config.phases`): the encoder over its packed bucket and
the projector from its rows to the LLM's embeddings. A new modality adds its entry here (a test
holds the names equal to the phase table's)."""

from __future__ import annotations

from jaxmllm.models.audio import AudioEncoder
from jaxmllm.models.projectors import audio_projector, vision_projector
from jaxmllm.models.vision import VisionEncoder

# phase name -> (encoder class (config section, ..., documents=, rngs=), projector factory
# (ModelConfig, ...))
ENCODER_MODULES = {
    "vision": (VisionEncoder, vision_projector),
    "audio": (AudioEncoder, audio_projector),
}
