"""Model code: encoders, projectors, the decoder and their composition."""

from jaxmllm.models.mllm import MultimodalLM, param_axes, token_losses

__all__ = ["MultimodalLM", "param_axes", "token_losses"]
