"""Where a fresh run's parameters come from (`model.init_from`): an earlier run's checkpoint
(`run`: LLaVA's stage 2 starting from stage 1's projectors), HuggingFace checkpoints (`llm`,
`vision`, `audio`: `jaxmllm.hf.load`), or, for whatever neither names, the random init.

A resumed run restores its own checkpoint instead and reads none of these.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flax import nnx

from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.hf.load import pretrained
from jaxmllm.loop.checkpoint import restore_params
from jaxmllm.step.program import Program, model_parts
from sharding.rules import keyed_leaves

log = logging.getLogger("jaxmllm")


def initial_params(cfg: Config, prog: Program) -> dict:
    """The parameters `model.init_from` gives, in the program's shardings (a nested dict of a
    subset of the parameters; `Program.init` fills in the rest at random)."""
    abstract = prog.abstract_params()
    given = run_params(cfg.model.init_from.run, abstract) if cfg.model.init_from.run else {}
    return {**pretrained(cfg, abstract, skip=set(given)), **given}


def run_params(run_dir: str, abstract: dict) -> dict:
    """The parameters of an earlier run's latest checkpoint that this model also has (whole
    top-level modules: a module the run did not have keeps its other source).

    Raises:
      ConfigError: no run or checkpoint there, or a shared module of another shape.
    """
    key = f"model.init_from.run={run_dir}"
    try:
        raw = json.loads((Path(run_dir) / "config.json").read_text())
    except OSError:
        raise ConfigError(f"{key}: no config.json (is it a run's train.output_dir?)") from None
    theirs, _ = model_parts(from_dict(Config, raw, source=f"{run_dir}/config.json"))
    their_shapes = keyed_leaves(nnx.to_pure_dict(theirs.template))
    mine = keyed_leaves(abstract)
    shared = sorted({p.split("/")[0] for p in mine} & {p.split("/")[0] for p in their_shapes})
    for path, leaf in mine.items():
        if path.split("/")[0] in shared and (
            path not in their_shapes or their_shapes[path].shape != leaf.shape
        ):
            have = their_shapes[path].shape if path in their_shapes else "no such parameter"
            raise ConfigError(
                f"{key}: parameter {path} is {tuple(leaf.shape)} here and {have} in that run; "
                "init_from.run needs the same modules (change model.* or the run)"
            )
    split = {
        "params": {k: abstract[k] for k in shared if k not in theirs.frozen_keys},
        "frozen": {k: abstract[k] for k in shared if k in theirs.frozen_keys},
    }
    step, restored = restore_params(Path(run_dir), split, None)
    log.info("%s: step %d's %s", key, step, ", ".join(shared))
    return {**restored["params"], **restored["frozen"]}
