"""`python -m jaxmllm.hf export RUN_DIR --out DIR`: a run's parameters as HF directories.

For each module a family covers (the LLM, the vision tower, the audio encoder) it writes
`DIR/<role>/` with config.json and safetensors shards (and their index) that transformers
loads: the tensors come from our parameters through the family's links, in the dtype the
imported checkpoint stored them in (float32 for a module trained from scratch). What the family
knowingly left alone at import (a SigLIP pooling head; Whisper's whole decoder, which makes the
export a complete Whisper model) is copied from the imported checkpoint unchanged, as are its
tokenizer, chat template, generation and preprocessor files. Importing the export gives back
the same parameters bit for bit.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
from flax import nnx

from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.hf.family import Family
from jaxmllm.hf.registry import FAMILIES, ROLES, family_for, read_hf_config
from jaxmllm.hf.safetensors import DTYPES, Checkpoint, write_checkpoint
from jaxmllm.loop.checkpoint import restore_params
from jaxmllm.step.program import model_parts
from sharding.rules import keyed_leaves

log = logging.getLogger("jaxmllm")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)  # fmt: skip
# Copied from the imported checkpoint's directory when present.
FILES = ("generation_config.json", "preprocessor_config.json", *TOKENIZER_FILES)
# Families exported as the whole imported model, our module replaced: Whisper's decoder, a
# Qwen2-VL's vision tower (replaced too when the run's vision is that tower)
WHOLE = {("audio", "whisper"), ("llm", "qwen2_vl")}


def export_run(run_dir: str, out: str, step: int | None = None, max_shard: int = 4 << 30):
    """Writes `out/<role>/` for each module of the run; returns {role: directory}.

    Raises:
      ConfigError: no run config or checkpoint there.
    """
    run = Path(run_dir)
    try:
        raw = json.loads((run / "config.json").read_text())
    except OSError:
        raise ConfigError(f"{run}: no config.json (is it a run's train.output_dir?)") from None
    cfg = from_dict(Config, raw, source=str(run / "config.json"))
    parts, _ = model_parts(cfg)
    pure = nnx.to_pure_dict(parts.template)
    abstract = {
        "params": {k: v for k, v in pure.items() if k not in parts.frozen_keys},
        "frozen": {k: v for k, v in pure.items() if k in parts.frozen_keys},
    }
    step, restored = restore_params(run, abstract, step)
    flat = keyed_leaves({**restored["params"], **restored["frozen"]})
    written = {}
    for role in ROLES:
        if role != "llm" and not getattr(cfg.model, role).enabled:
            continue
        directory = Path(out) / role
        export_role(cfg, role, flat, directory, max_shard)
        written[role] = directory
    log.info("exported step %d of %s to %s", step, run, out)
    return written


def export_role(cfg: Config, role: str, flat: dict, directory: Path, max_shard: int) -> None:
    """One module's HF directory (see the module docstring)."""
    source_dir = getattr(cfg.model.init_from, role)
    has_source = bool(source_dir) and (Path(source_dir) / "config.json").is_file()
    source = read_hf_config(source_dir) if has_source else None
    family = family_for(role, source, source_dir) if source else family_of(cfg, role)
    ck = Checkpoint(source_dir) if has_source else None
    prefix = family.prefix(ck.names()) if ck else ""
    whole = (role, family.name) in WHOLE
    if whole and ck is None:
        prefix = "model.encoder." if role == "audio" else ""
        log.warning("%s: no imported checkpoint to take the rest of the model from: the export "
                    "holds this module only", role)  # fmt: skip
    tensors = hf_tensors(family, cfg, source, flat)
    stored = lambda name: DTYPES[ck.dtype(name)] if ck and name in ck else np.dtype(np.float32)
    out = {(prefix + n if whole else n): v.astype(stored(prefix + n)) for n, v in tensors.items()}
    for name in ck.names() if ck else []:  # what the family left alone, unchanged
        mine = name.startswith(prefix) and name[len(prefix) :] in tensors
        if not mine and (
            whole or (name.startswith(prefix) and family.skipped(name[len(prefix) :]))
        ):
            out[name if whole else name[len(prefix) :]] = np.asarray(ck.get(name))
    if whole and role == "llm" and cfg.model.vision.enabled and ck is not None:
        tower = family_for("vision", source, source_dir)  # the run's own Qwen2-VL tower
        if cfg.model.init_from.vision == source_dir:
            at = tower.prefix(ck.names())
            for n, v in hf_tensors(tower, cfg, source, flat).items():
                out[at + n] = v.astype(stored(at + n))
    write_checkpoint(directory, sorted(out.items()), max_shard)
    hf_config = family.to_hf_config(cfg, source)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in FILES if has_source else ():
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, directory / name)
    if role == "llm":
        _copy_tokenizer(cfg, directory)


def hf_tensors(family: Family, cfg: Config, source: dict | None, flat: dict) -> dict:
    """A module's HF tensors (the family's names, no checkpoint prefix) from our parameters."""
    tensors: dict[str, np.ndarray] = {}
    for link in family.links(cfg, source):
        ours = [np.asarray(flat[p]) for p in link.ours]
        for layer in range(link.layers) if link.layers else [None]:
            args = ours if layer is None else [o[layer] for o in ours]
            tensors.update(zip(link.hf_names(layer), link.to_hf(*args), strict=True))
    return tensors


def family_of(cfg: Config, role: str) -> Family:
    """A module's family from our config alone (a module trained from scratch, or whose
    imported directory is gone): what its options say it is."""
    m = cfg.model
    name = {
        "llm": "qwen2" if m.llm.attn_bias == "qkv" else "llama",
        "vision": "siglip" if m.vision.positions == "learned" else "qwen2_vl",
        "audio": "whisper",
    }[role]
    return next(f for f in FAMILIES if f.role == role and f.name == name)


def _copy_tokenizer(cfg: Config, directory: Path) -> None:
    """The training tokenizer's files when it is a HF tokenizer directory."""
    tok = Path(cfg.data.tokenizer)
    if cfg.data.tokenizer != "byte" and tok.is_dir():
        for name in TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copy2(tok / name, directory / name)
