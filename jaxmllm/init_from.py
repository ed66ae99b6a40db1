"""Where a fresh run's parameters come from (`model.init_from`): `jaxmllm.hf.start` reads them
into a program's shardings. A resumed run restores its own checkpoint instead, and the frozen
base of a run with LoRA adapters, which its checkpoints do not hold (`start_base`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxmllm.config import Config, ConfigError, InitFrom, keep_origin, to_dict
from jaxmllm.config.checks import UserError
from jaxmllm.hf.start import initial_params as _initial
from jaxmllm.hf.start import run_params
from jaxmllm.loop.base import base_identity
from jaxmllm.loop.evaluate import eval_source
from jaxmllm.loop.reference_pass import reference_table
from jaxmllm.resolve.run import Run
from jaxmllm.step.preference import reference_given
from jaxmllm.step.program import Program, join

__all__ = ["initial_params", "precomputed_reference", "run_params", "start_base", "start_reference"]


def initial_params(cfg: Config, prog: Program) -> dict:
    """The parameters `model.init_from` gives, in the program's shardings (a nested dict of a
    subset of the parameters; `Program.init` fills in the rest at random)."""
    return _initial(cfg, prog.abstract_params())


def start_base(cfg: Config, prog: Program, stamp: dict) -> tuple[dict | None, dict | None]:
    """A run with LoRA adapters: (its fresh state, its frozen base in checkpoint form), the
    base read as `model.init_from` names it and its identity put in `stamp` (a resume on
    another base is refused by it); (None, None) for a run whose checkpoints hold the base."""
    if prog.saves_base:
        return None, None
    given = initial_params(cfg, prog)
    loaded = prog.parts.split(given)[1]  # (before init, which may donate them)
    fresh = prog.init(given)
    base = prog.weights(fresh)["frozen"]
    stamp["base"] = base_identity(cfg, base, loaded)
    return fresh, base


def start_reference(cfg: Config, prog: Program, state: dict) -> dict:
    """`state` with a preference run's reference policy (`preference.reference`): `base`, the
    starting weights `model.init_from` gives (random ones from train.seed where it gives
    none), read again at every start, a resumed run's too; or a checkpoint directory, an HF
    one (config.json) or a run's train.output_dir (its latest checkpoint), which must hold
    every parameter of the policy's architecture. A run without a reference: `state`."""
    if prog.reference_keeps is None:
        return state
    ref = cfg.preference.reference
    if ref == "base":
        return prog.with_reference(state, prog.initial_weights(initial_params(cfg, prog)))
    ref_cfg = _reference_config(cfg, ref)
    if ref_cfg.model.init_from.llm:  # (an HF directory: its config.json said first)
        _check_architecture(cfg, ref)
    try:
        given = initial_params(ref_cfg, prog)
    except UserError as e:  # (its load's words name model.init_from: say which it is)
        raise ConfigError(f"preference.reference={ref}: {e}") from None
    need = prog.reference_of(join(*(prog.abstract_sharded()[k] for k in ("params", "frozen"))))
    missing = _paths(need) - _paths(given)
    if missing:
        raise ConfigError(
            f"preference.reference={ref} has no {', '.join(sorted(missing)[:4])}"
            f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of the policy's parameters): "
            "a reference must be a checkpoint of the policy's architecture (model.*) and "
            "vocabulary"
        )
    return prog.with_reference(state, prog.initial_weights(given))


def _reference_config(cfg: Config, ref: str) -> Config:
    """`cfg` whose model.init_from names the reference checkpoint alone: an HF directory as
    every tower's, a run directory as `run`."""
    path = Path(ref)
    if (path / "config.json").is_file():
        towers = {"llm": ref}
        towers.update({t: ref for t in ("vision", "audio") if getattr(cfg.model, t).enabled})
        init = InitFrom(**towers)
    elif path.is_dir():
        init = InitFrom(run=ref)
    else:
        raise ConfigError(
            f"preference.reference={ref}: not a directory; set base (the policy's starting "
            "weights), an HF checkpoint directory (config.json) or a run's train.output_dir"
        )
    model = dataclasses.replace(cfg.model, init_from=init)
    return keep_origin(dataclasses.replace(cfg, model=model), cfg)


def _check_architecture(cfg: Config, ref: str) -> None:
    """Refuses an HF reference directory whose config.json is not the policy's architecture
    and vocabulary (what `hf import` would write for it against the policy's model.*, in one
    line naming each key that differs): the reference runs in the policy's model, so one of
    other sizes would not load, and one of other options (QK-norm, M-RoPE sections, rotary
    base) would load into the wrong model. A vocabulary the import grew for placeholder
    tokens (`hf.importer.vocab_size`) is the policy's checkpoint's."""
    from jaxmllm.hf.importer import model_section

    on = {t: ref if getattr(cfg.model, t).enabled else "" for t in ("vision", "audio")}
    try:
        theirs = model_section(ref, on["vision"], on["audio"])
    except UserError as e:
        raise ConfigError(f"preference.reference={ref}: {e}") from None
    ours = to_dict(cfg.model)
    own_vocab = ours["llm"]["vocab_size"]
    if cfg.model.init_from.llm:  # (the vocabulary before the import grew it)
        own_vocab = model_section(cfg.model.init_from.llm)["llm"]["vocab_size"]
    differ = []
    for role in ("llm", "vision", "audio"):
        if role != "llm" and not getattr(cfg.model, role).enabled:
            continue
        for key, value in _leaves(json.loads(json.dumps(theirs[role]))).items():
            mine = _leaves(ours[role]).get(key)
            if key == "vocab_size" and role == "llm":
                if value not in (own_vocab, mine):
                    differ.append(f"model.llm.vocab_size {value} (the policy's {own_vocab})")
            elif mine != value:
                differ.append(
                    f"model.{role}.{key} {json.dumps(value)} (the policy's {json.dumps(mine)})"
                )
    if differ:
        shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
        raise ConfigError(
            f"preference.reference={ref} is not the policy's architecture: {shown}; a "
            "reference must be a checkpoint of the policy's architecture (model.*) and "
            "vocabulary"
        )


def _leaves(tree: dict, prefix: str = "") -> dict:
    """A nested dict's values by dotted key."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(_leaves(value, name) if isinstance(value, dict) else {name: value})
    return out


def _paths(tree: dict, prefix: str = "") -> set[str]:
    """The '/'-joined paths of every leaf of a nested dict ('llm/embed/embedding'), to compare
    two parameter trees' keys."""
    out: set[str] = set()
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        out |= _paths(value, name) if isinstance(value, dict) else {name}
    return out


def precomputed_reference(run: Run, prog: Program, out: Path) -> Run:
    """`run` with its pairs' reference log-probs (`preference.reference: precomputed`): read
    from `out`, or computed by the starting weights in one pass before training; `run` itself
    for any other run."""
    if not reference_given(run.cfg):
        return run
    weights = prog.initial_weights(initial_params(run.cfg, prog))
    tables = {"train": reference_table(run, prog, weights, out)}
    if run.cfg.data.eval.source != "none":  # (the held-out pairs' too)
        source, index = eval_source(run.cfg)
        tables["eval"] = reference_table(run, prog, weights, out, "eval", source, index)
    return dataclasses.replace(run, reference_logps=tables)
