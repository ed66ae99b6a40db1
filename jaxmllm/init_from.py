"""Where a fresh run's parameters come from (`model.init_from`): `jaxmllm.hf.start` reads them
into a program's shardings. A resumed run restores its own checkpoint instead, and the frozen
base of a run with LoRA adapters, which its checkpoints do not hold (`start_base`)."""

from __future__ import annotations

from jaxmllm.config import Config
from jaxmllm.hf.start import initial_params as _initial
from jaxmllm.hf.start import run_params
from jaxmllm.loop.base import base_identity
from jaxmllm.step.program import Program

__all__ = ["initial_params", "run_params", "start_base"]


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
