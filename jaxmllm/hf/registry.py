"""Which family reads a HF checkpoint directory, by its config.json's model_type and the role
(llm, vision, audio) it is imported for."""

from __future__ import annotations

import json
from pathlib import Path

from jaxmllm.hf.audio import WhisperEncoder
from jaxmllm.hf.decoders import Decoders
from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.hf.vision import Qwen2VLVision, Siglip

FAMILIES: tuple[Family, ...] = (
    Decoders("llama"),
    Decoders("qwen2"),
    Decoders("qwen2_vl"),
    Siglip(),
    Qwen2VLVision(),
    WhisperEncoder(),
)
ROLES = ("llm", "vision", "audio")


def read_hf_config(directory: str | Path) -> dict:
    """A checkpoint directory's config.json.

    Raises:
      FamilyError: naming the directory when there is no readable config.json.
    """
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise FamilyError(
            f"{directory}: no config.json (not a HuggingFace model directory)"
        ) from None
    except ValueError as e:
        raise FamilyError(f"{path}: not valid JSON ({e})") from None


def family_for(role: str, hf: dict, where: str = "") -> Family:
    """The family that reads `hf` (a config.json) for `role`.

    Raises:
      FamilyError: naming the model_type and what jaxmllm reads for that role.
    """
    model_type = hf.get("model_type", "")
    for family in FAMILIES:
        if family.role == role and model_type in family.model_types:
            return family
    supported = sorted(t for f in FAMILIES if f.role == role for t in f.model_types)
    other = [f.role for f in FAMILIES if model_type in f.model_types]
    hint = f" (it is a {other[0]} model: pass it as --{other[0]})" if other else ""
    raise FamilyError(
        f"{where or 'checkpoint'}: model_type {model_type!r} is not a supported {role} "
        f"architecture{hint}; jaxmllm reads {', '.join(supported)} for the {role}"
    )
