"""Which family reads a HF checkpoint directory, by its config.json's model_type and the role
(llm, vision, audio) it is imported for: a checkpoint of one part (`FAMILIES`), or one part of a
whole multimodal checkpoint (`jaxmllm.hf.wholes.WHOLES`, read through `Part`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jaxmllm.hf.config_json import check_values
from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.hf.whole import Part
from jaxmllm.hf.whole_config import TOWERS
from jaxmllm.hf.wholes import DECODERS, WHOLES, whole_for

# Every family of one part: a decoder per row of the table's decoders, a tower per tower row
FAMILIES: tuple[Family, ...] = (*DECODERS.values(), *TOWERS)
ROLES = ("llm", "vision", "audio")


def read_hf_config(directory: str | Path) -> dict:
    """A checkpoint directory's config.json, its values checked (`jaxmllm.hf.config_json`).

    Raises:
      FamilyError: naming the directory when there is no readable config.json, or the file
        and the key of a value of the wrong kind or out of its range.
    """
    path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError:
        raise FamilyError(
            f"{directory}: no config.json (not a HuggingFace model directory)"
        ) from None
    except (ValueError, RecursionError) as e:
        raise FamilyError(f"{path}: not valid JSON ({e})"[:500]) from None
    if not isinstance(hf, dict):
        raise FamilyError(f"{path}: not a JSON object")
    check_values(hf, path)
    return hf


def section_of(role: str, hf: dict, where: str) -> dict:
    """Our config keys for `role` from a checked config.json (`read_hf_config`): the family's
    `section`, with any value it cannot read (a string for a number) a FamilyError."""
    family = family_for(role, hf, where)
    try:
        section = family.section(hf)
        if role == "llm":
            _heads_agree(section, where)
        return section
    except FamilyError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
        raise FamilyError(
            f"{where}: config.json has a value {family.name} cannot read ({type(e).__name__}: {e})"[
                :500
            ]
        ) from None


def _heads_agree(llm: dict, where: str) -> None:
    """Refuses a decoder's config.json whose head counts or rotary sections disagree, naming
    its keys (the model config's own check would name ours, and advise what would change the
    model: a checkpoint's values are the model's, or damaged)."""
    heads, kv = llm["heads"], llm["kv_heads"]
    if heads % kv:
        raise FamilyError(
            f"{where}: config.json's num_attention_heads {heads} is not a multiple of its "
            f"num_key_value_heads {kv}: no attention groups its heads so (the config.json is "
            "damaged or not this checkpoint's)"
        )
    head = llm.get("head_dim") or llm["width"] // heads
    rotary = int(head * llm.get("rotary_fraction", 1.0))
    sections = llm.get("mrope_section") or ()
    if any(sections) and sum(sections) * 2 != rotary:
        raise FamilyError(
            f"{where}: config.json's mrope_section {list(sections)} sums to {sum(sections)}, "
            f"and must to half the {rotary} rotary channels of each head ({rotary // 2}): the "
            "config.json is damaged or not this checkpoint's"
        )


def family_for(role: str, hf: dict, where: str = "", names: Sequence[str] = ()) -> Family:
    """The family that reads `hf` (a config.json) for `role`; for a whole checkpoint, the
    `Part` of it that role reads (`names`: its tensor names, which say how the part nests and
    how its tensors are laid out: `Family.for_checkpoint`).

    Raises:
      FamilyError: naming the model_type and what jaxmllm reads for that role, or a tensor
        of a layout the family refuses.
    """
    model_type = hf.get("model_type", "")
    whole = whole_for(hf)
    if whole is not None:
        if role in whole.held(hf):
            return Part(whole, role, hf, names, where)
        raise FamilyError(
            f"{where or 'checkpoint'}: a {whole.name} checkpoint has no {role} part (it holds "
            f"{', '.join(whole.held(hf))})"
        )
    for family in FAMILIES:
        if family.role == role and model_type in family.model_types:
            return family.for_checkpoint(names, where)
    supported = sorted(t for f in FAMILIES if f.role == role for t in f.model_types)
    supported += sorted(t for w in WHOLES if role in w.parts for t in w.model_types)
    other = [f.role for f in FAMILIES if model_type in f.model_types]
    hint = f" (it is a {other[0]} model: pass it as --{other[0]})" if other else ""
    raise FamilyError(
        f"{where or 'checkpoint'}: model_type {model_type!r} is not a supported {role} "
        f"architecture{hint}; jaxmllm reads {', '.join(supported)} for the {role}"
    )


def roles_of(hf: dict) -> tuple[str, ...]:
    """The roles a checkpoint fills: a whole checkpoint's parts, or its family's role."""
    whole = whole_for(hf)
    if whole is not None:
        return tuple(r for r in ROLES if r in whole.held(hf))
    return tuple(f.role for f in FAMILIES if hf.get("model_type") in f.model_types)[:1]
