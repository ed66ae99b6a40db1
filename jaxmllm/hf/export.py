"""`python -m jaxmllm.hf export RUN_DIR --out DIR`: a run's parameters as HF checkpoints.

What is written follows where the run's modules came from (`model.init_from`):

- every module from one whole checkpoint (`hf import --model`): `DIR` is that checkpoint again
  (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen2-Audio, or a causal LM alone: Qwen3, Qwen3-MoE, ...), the
  run's LLM, encoders and projectors in it, with the imported directory's processor,
  tokenizer, chat template and generation files;
- modules from parts: `DIR/llm/`, `DIR/vision/`, `DIR/audio/`, each the family it was imported
  from (a part of a whole checkpoint is written back into that whole, under `DIR/<name>/`), and
  `DIR/projectors.safetensors` with the projectors no exported checkpoint holds (our names);
- a run from scratch: the whole family its architecture matches (an LLM alone: Llama or Qwen2),
  with processor files made from the data section when its tokenizer is a HF directory; or a
  refusal naming, per family, the option it has no counterpart for.

A run with LoRA adapters writes, in each of these places, a PEFT adapter for the checkpoint
it started from instead (`jaxmllm.hf.peft_export`), or with `merged` the checkpoints with the
adapters merged into their matrices.

Tensors come from our parameters through the families' links, in the dtype and the layout the
imported checkpoint stored them in (a mixture of experts' experts one Linear each or fused:
`Family.for_checkpoint`; from scratch float32, one Linear each as transformers saves them);
what the families knowingly left alone at import (a SigLIP pooling head, Whisper's decoder, the
tower blocks after LLaVA's feature layer) is copied from the imported checkpoint unchanged, so
importing the export gives back the same parameters bit for bit. Everything is written into a
temporary directory beside `DIR` and renamed to `DIR` when complete: a failed export leaves
nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.config.outputs import new_folder
from jaxmllm.hf.family import Family, FamilyError, mismatches
from jaxmllm.hf.peft_export import check_adapter_pieces, merge_adapters, write_adapter_piece
from jaxmllm.hf.registry import FAMILIES, ROLES, family_for, read_hf_config
from jaxmllm.hf.safetensors import DTYPES, Checkpoint, write_checkpoint, write_file
from jaxmllm.hf.start import run_parameters
from jaxmllm.hf.whole import Part, Whole
from jaxmllm.hf.wholes import WHOLES, decoder_of, whole_for
from jaxmllm.models.mllm import kernel_paths
from jaxmllm.step.program import join
from sharding.rules import keyed_leaves

log = logging.getLogger("jaxmllm")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Copied from the imported checkpoint's directory when present.
FILES = (
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    *TOKENIZER_FILES,
)
PROJECTORS = ("vision_projector", "audio_projector")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One checkpoint directory of an export."""

    where: str  # under --out ("": --out itself)
    roles: tuple[str, ...]  # the run's modules it holds (their projectors with them)
    source: str  # the imported directory ("": from scratch)
    whole: Whole | None = None  # a whole checkpoint's family, or
    family: Family | None = None  # a checkpoint of one part's


def export_run(
    run_dir: str, out: str, step: int | None = None, max_shard: int = 4 << 30, merged=False
):
    """Writes the run's checkpoint `step` (None: the latest) under `out` (see the module
    docstring); returns {what: directory} (what: "model", a role, a whole's name, or
    "projectors"). A run with LoRA adapters writes PEFT adapters (`jaxmllm.hf.peft_export`),
    or with `merged` its checkpoints with the adapters merged into their matrices.

    Raises:
      ConfigError: no run config or checkpoint there, or `out` a file or a non-empty directory.
      FamilyError: a module trained from scratch that no HF family has a counterpart for.
    """
    out = new_folder("--out", out)
    run = Path(run_dir)
    try:
        raw = json.loads((run / "config.json").read_text())
    except OSError:
        raise ConfigError(f"{run}: no config.json (is it a run's train.output_dir?)") from None
    cfg = from_dict(Config, raw, source=str(run / "config.json"))
    pieces = plan_export(cfg)  # (refusals before anything is read or written)
    adapters = bool(kernel_paths(cfg.model)) and not merged
    if adapters:
        check_adapter_pieces(cfg, pieces)
    step, flat = _restore(cfg, run, step)
    if merged:
        flat = merge_adapters(cfg, flat)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        written, held = {}, set()
        for piece in pieces:
            if adapters:
                held |= write_adapter_piece(cfg, piece, flat, partial / piece.where)
            else:
                held |= write_piece(cfg, piece, flat, partial / piece.where, max_shard)
            written[piece.where or "model"] = out / piece.where
        rest = {k: v for k, v in flat.items() if k.split("/")[0] in set(PROJECTORS) - held}
        if rest:  # projectors no exported checkpoint has a place for
            partial.mkdir(parents=True, exist_ok=True)
            write_file(partial / "projectors.safetensors", sorted(rest.items()))
            written["projectors"] = out / "projectors.safetensors"
        if out.is_dir():
            out.rmdir()
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("exported step %d of %s to %s", step, run, out)
    return written


def _restore(cfg: Config, run: Path, step: int | None) -> tuple[int, dict]:
    """The run's parameters ("/"-joined path -> host array); a run with adapters reads its
    base again (`run_parameters`)."""
    step, params, frozen = run_parameters(cfg, run, step)
    return step, keyed_leaves(jax.device_get(join(params, frozen)))


def plan_export(cfg: Config) -> list[Piece]:
    """The checkpoints an export of `cfg`'s run writes (see the module docstring).

    Raises:
      FamilyError: a module from scratch that no HF family has a counterpart for.
    """
    roles = tuple(r for r in ROLES if r == "llm" or getattr(cfg.model, r).enabled)
    dirs = {r: getattr(cfg.model.init_from, r) for r in roles}
    if not any(dirs.values()):
        return [scratch(cfg, roles)]
    wholes = {d: whole_for(read_hf_config(d)) for d in set(dirs.values()) if d}
    if len(set(dirs.values())) == 1 and wholes.get(dirs["llm"]) is not None:
        return [Piece("", roles, dirs["llm"], whole=wholes[dirs["llm"]])]
    if roles == ("llm",):  # a causal LM alone (`hf import --model` of one): DIR is it again
        family = family_for("llm", read_hf_config(dirs["llm"]), dirs["llm"])
        return [Piece("", roles, dirs["llm"], family=family)]
    pieces, done = [], set()
    for role in roles:
        d = dirs[role]
        if wholes.get(d) is not None and d not in done:  # its parts of the run, written back
            done.add(d)
            mine = tuple(r for r in roles if dirs[r] == d)
            pieces.append(Piece(wholes[d].name, mine, d, whole=wholes[d]))
        elif d and wholes.get(d) is None:
            pieces.append(Piece(role, (role,), d, family=family_for(role, read_hf_config(d), d)))
        elif not d:
            pieces.append(Piece(role, (role,), "", family=standalone(cfg, role)))
    return pieces


def scratch(cfg: Config, roles: tuple[str, ...]) -> Piece:
    """The whole family a run from scratch matches (an LLM alone: its decoder family)."""
    if roles == ("llm",):
        return Piece("", roles, "", family=standalone(cfg, "llm"))
    fits = lambda w: set(w.parts) - set(w.optional) <= set(roles) <= set(w.parts)
    candidates = [w for w in WHOLES if fits(w)]
    if not candidates:
        raise FamilyError(
            f"no HuggingFace architecture jaxmllm writes holds {' and '.join(roles)} together "
            "(model.vision.enabled and model.audio.enabled are both true): it cannot be exported "
            "from scratch"
        )
    found = {w.name: w.mismatches(cfg) for w in candidates}
    for w in candidates:
        if not found[w.name]:
            return Piece("", roles, "", whole=w)
    raise FamilyError(_refusal(found))


def standalone(cfg: Config, role: str) -> Family:
    """The family of one part that a module from scratch matches."""
    families = [f for f in FAMILIES if f.role == role]
    if role == "llm":
        families = [decoder_of(cfg)]
    found = {f.name: mismatches(cfg, f.wants(cfg), f.name) for f in families}
    for f in families:
        if not found[f.name]:
            return f
    raise FamilyError(_refusal(found))


def _refusal(found: dict[str, list[str]], most: int = 3) -> str:
    per = "; ".join(
        f"as {name}: {', '.join(m[:most])}{', ...' if len(m) > most else ''}"
        for name, m in found.items()
    )
    return f"the run's model has no HuggingFace counterpart, option by option ({per})"


def write_piece(cfg: Config, piece: Piece, flat: dict, directory: Path, max_shard: int) -> set:
    """One checkpoint directory; returns the top-level modules it holds."""
    source = read_hf_config(piece.source) if piece.source else None
    ck = Checkpoint(piece.source) if piece.source else None
    names = ck.names() if ck else ()
    if piece.whole is not None:
        hf = source or piece.whole.to_hf_config(cfg, None, piece.roles)
        families = [Part(piece.whole, r, hf, names) for r in piece.roles]
        prefix, keep_all = "", True
    else:
        hf, families = source, [piece.family.for_checkpoint(names)]  # (the source's layout)
        prefix = piece.family.prefix(names) if ck else ""
        keep_all = piece.family.exports_whole
        if keep_all and ck is None:
            prefix = "model.encoder."
            log.warning(
                "%s: no imported checkpoint to take the rest of the model from: the "
                "export holds this module only",
                piece.roles[0],
            )
    tensors: dict[str, np.ndarray] = {}
    for family in families:
        tensors.update(hf_tensors(family, cfg, hf if piece.whole else source, flat))
    stored = lambda n: DTYPES[ck.dtype(n)] if ck and n in ck else np.dtype(np.float32)
    out = {(prefix + n if keep_all else n): v for n, v in tensors.items()}
    out = {n: v.astype(stored(prefix + n if not keep_all else n)) for n, v in out.items()}
    for name in names:  # what the families left alone, unchanged
        rest = name[len(prefix) :] if name.startswith(prefix) else None
        if keep_all and name not in out:
            out[name] = np.asarray(ck.get(name))
        elif not keep_all and rest is not None and rest not in out and families[0].skipped(rest):
            out[rest] = np.asarray(ck.get(name))
    if piece.whole is not None and ck is None:
        out.update(piece.whole.fillers(cfg))
    write_checkpoint(directory, sorted(out.items()), max_shard)
    config = (
        piece.whole.to_hf_config(cfg, source, piece.roles)
        if piece.whole
        else (piece.family.to_hf_config(cfg, source))
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _processor_files(cfg, piece, directory)
    return {p.split("/")[0] for f in families for link in f.links(cfg, hf) for p in link.ours}


def _processor_files(cfg: Config, piece: Piece, directory: Path) -> None:
    """The imported directory's processor, tokenizer and generation files; from scratch, the
    processor's made from the data section. The run's tokenizer goes with its LLM."""
    for name in FILES if piece.source else ():
        if (Path(piece.source) / name).is_file():
            shutil.copy2(Path(piece.source) / name, directory / name)
    if "llm" in piece.roles:
        _copy_tokenizer(cfg, directory)
    tokenizer = Path(cfg.data.tokenizer)
    if piece.whole is not None and not piece.source and tokenizer.is_dir():
        for name, content in piece.whole.processor_files(cfg).items():
            (directory / name).write_text(json.dumps(content, indent=2) + "\n")
        _processor_template(directory)


def _processor_template(directory: Path) -> None:
    """The tokenizer's chat template as chat_template.jinja, where only its
    tokenizer_config.json holds it: a processor (transformers 5) reads its template from that
    file alone, so `apply_chat_template` of the processor AutoProcessor builds would have none."""
    if any((directory / n).is_file() for n in ("chat_template.jinja", "chat_template.json")):
        return
    config = directory / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, str):
        (directory / "chat_template.jinja").write_text(template)


def hf_tensors(family: Family, cfg: Config, source: dict | None, flat: dict) -> dict:
    """A module's HF tensors (the family's names, no checkpoint prefix) from our parameters."""
    tensors: dict[str, np.ndarray] = {}
    for link in family.links(cfg, source):
        ours = [np.asarray(flat[p]) for p in link.ours]
        for layer in range(link.layers) if link.layers else [None]:
            args = ours if layer is None else [o[layer] for o in ours]
            tensors.update(zip(link.hf_names(layer), link.to_hf(*args), strict=True))
    return tensors


def export_role(cfg: Config, role: str, flat: dict, directory: Path, max_shard: int) -> None:
    """One module's checkpoint directory, as a run built from parts exports it."""
    source = getattr(cfg.model.init_from, role)
    whole = whole_for(read_hf_config(source)) if source else None
    if whole is not None:
        piece = Piece("", (role,), source, whole=whole)
    elif source:
        piece = Piece("", (role,), source, family=family_for(role, read_hf_config(source), source))
    else:
        piece = Piece("", (role,), "", family=standalone(cfg, role))
    write_piece(cfg, piece, flat, directory, max_shard)


def _copy_tokenizer(cfg: Config, directory: Path) -> None:
    """The training tokenizer's files when it is a HF tokenizer directory."""
    tok = Path(cfg.data.tokenizer)
    if cfg.data.tokenizer != "byte" and tok.is_dir():
        for name in TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copy2(tok / name, directory / name)
