"""PEFT adapters on a mixture of experts' stacked experts, in and out.

PEFT puts LoRA on a parameter (`target_parameters`, PEFT >= 0.17), and on transformers 5's MoE
models it moves `gate_proj`, `up_proj` and `down_proj` targets onto the stacked experts:
`mlp.experts.gate_up_proj` [E, 2f, width] (gate's rows, then up's: one adapter, whose rank and
alpha a rank_pattern / alpha_pattern makes twice the others') and `mlp.experts.down_proj`
[E, width, f]. Its tensors are lora_A [E x r, in] (expert-major rows) and lora_B [out, r x E]
(rank-major columns), the update scale * B_e A_e of each expert's [out, in] matrix; where both
matrices are adapted they nest on one module, gate_up_proj's inside (`experts.base_layer`),
down_proj's outside (`experts`). Ours (`models.moe.Experts`) are lora_a [E, in, r] and lora_b
[E, r, out] per layer, the same update transposed. The dense layers' and the shared expert's
MLPs take no adapters there (PEFT's conversion moves their targets away too), nor here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.models.llm import kind_stacks
from jaxmllm.models.mllm import expert_adapters

PARAMS = {"gate_up": "gate_up_proj", "down": "down_proj"}  # ours -> transformers' parameter
PATTERN = {"gate_up": r".*\.gate_up_proj"}  # the rank_pattern key of a doubled rank


@dataclasses.dataclass(frozen=True)
class ExpertsParam:
    """One adapted stacked matrix of one stack of our MoE layers."""

    path: str  # our Experts module ("llm/transformer/blocks/mlp/experts")
    matrix: str  # gate_up | down
    runtime: str  # transformers' module holding its adapter, `{i}` its layer
    layers: tuple[int, ...]  # the checkpoint's layers of our rows


def params_of(cfg: Any, family: Family, prefix: str = "") -> list[ExpertsParam]:
    """The adapted expert matrices of `cfg`'s decoder, named as `family` (a decoder, or the
    LLM part of a whole checkpoint) builds the model (`prefix`: the checkpoint's before)."""
    adapted = expert_adapters(cfg.model)
    out = []
    for stack, kind, ids in kind_stacks(cfg.model.llm):
        path = f"llm/transformer/{stack}/mlp/experts"
        if not kind.moe or path not in adapted:
            continue
        module = experts_module(family, prefix)
        for matrix in adapted[path]:
            inner = matrix == "gate_up" and len(adapted[path]) == 2  # (nested inside down's)
            runtime = module + (".base_layer" if inner else "")
            out.append(ExpertsParam(path, matrix, runtime, ids))
    return out


def experts_module(family: Family, prefix: str = "") -> str:
    """transformers' module of a layer's stacked experts (`{i}` the layer), as `family` (a
    decoder, or a whole checkpoint's LLM part: its placement) builds the model."""
    return family.runtime(prefix + family.placed("model.layers.{i}.mlp.experts"))


def to_peft(a_eir: np.ndarray, b_ero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (lora_A [E x r, in], lora_B [out, r x E]) from ours."""
    e, n_in, r = a_eir.shape
    lora_a = np.asarray(a_eir, np.float32).transpose(0, 2, 1).reshape(e * r, n_in)
    lora_b = np.asarray(b_ero, np.float32).transpose(2, 1, 0).reshape(b_ero.shape[2], r * e)
    return lora_a, lora_b


def from_peft(lora_a: np.ndarray, lora_b: np.ndarray, experts: int, where: str) -> tuple:
    """Ours (a [E, in, r], b [E, r, out]) from one layer's PEFT tensors."""
    rows, n_in = lora_a.shape
    if rows % experts or lora_b.shape[1] != rows:
        raise FamilyError(
            f"{where}: lora_A {list(lora_a.shape)} and lora_B {list(lora_b.shape)} are not "
            f"adapters of {experts} experts (lora_A [experts x rank, in], lora_B [out, rank x "
            "experts])"
        )
    r = rows // experts
    a = lora_a.reshape(experts, r, n_in).transpose(0, 2, 1)
    b = lora_b.reshape(lora_b.shape[0], r, experts).transpose(2, 1, 0)
    return a, b


def tensors(params: list[ExpertsParam], flat: dict) -> dict[str, np.ndarray]:
    """The PEFT tensors (keys without PEFT's prefix) of every adapted expert matrix."""
    out = {}
    for p in params:
        a = np.asarray(flat[f"{p.path}/{p.matrix}_adapter/lora_a"])
        b = np.asarray(flat[f"{p.path}/{p.matrix}_adapter/lora_b"])
        for row, layer in enumerate(p.layers):
            lora_a, lora_b = to_peft(a[row], b[row])
            name = p.runtime.format(i=layer)
            out[f"{name}.lora_A.weight"] = lora_a
            out[f"{name}.lora_B.weight"] = lora_b
    return out


def config_keys(params: list[ExpertsParam], rank: int, alpha: float) -> dict:
    """adapter_config.json's target_parameters and the patterns of the doubled gate_up rank
    (as PEFT writes them) for a tower of `rank` and `alpha`."""
    which = sorted({p.matrix for p in params})
    patterns = {PATTERN[m]: m for m in which if m in PATTERN}
    return {
        "target_parameters": [PARAMS[m] for m in which],
        "rank_pattern": {k: 2 * rank for k in patterns},
        "alpha_pattern": {k: 2 * alpha for k in patterns},
    }


def merged(flat: dict, params: list[ExpertsParam], scales: dict[str, float]) -> dict:
    """The experts' gate, up and down with their adapters' updates added (numpy, float32
    sums, in each weight's dtype); `scales`: alpha / rank of each matrix's adapter."""
    out = {}
    for path in dict.fromkeys(p.path for p in params):
        gate, up, down = (np.asarray(flat[f"{path}/{m}"]) for m in ("gate", "up", "down"))
        new = {"gate": gate.astype(np.float32), "up": up.astype(np.float32)}
        new["down"] = down.astype(np.float32)
        for p in (p for p in params if p.path == path):
            a = np.asarray(flat[f"{path}/{p.matrix}_adapter/lora_a"], np.float32)
            b = np.asarray(flat[f"{path}/{p.matrix}_adapter/lora_b"], np.float32)
            delta = scales[p.matrix] * np.einsum("leir,lero->leio", a, b)
            if p.matrix == "down":
                new["down"] += delta
            else:
                f = gate.shape[-1]
                new["gate"] += delta[..., :f]
                new["up"] += delta[..., f:]
        for m, w in (("gate", gate), ("up", up), ("down", down)):
            out[f"{path}/{m}"] = new[m].astype(w.dtype)
    return out


def present(adapter: Any, cfg: Any, family: Family, prefix: str = "") -> list[ExpertsParam]:
    """The expert matrices an adapter holds (its target_parameters), named as it nests them
    (`params_of` for a model adapting exactly those)."""
    targets = adapter.config.get("target_parameters") or []
    names = {PARAMS[m] for m in PARAMS}
    held = {t.rsplit(".", 1)[-1] for t in targets if isinstance(t, str)} & names
    unknown = sorted(
        t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in names
    )
    if unknown:
        raise FamilyError(
            f"{adapter.directory}: target_parameters {unknown} name no parameter jaxmllm adapts "
            f"(it reads adapters on a mixture of experts' {', '.join(sorted(names))})"
        )
    out = []
    for stack, kind, ids in kind_stacks(cfg.model.llm) if held else []:
        if not kind.moe:
            continue
        module = experts_module(family, prefix)
        for matrix in ("gate_up", "down"):
            if PARAMS[matrix] in held:
                inner = matrix == "gate_up" and len(held) == 2
                path = f"llm/transformer/{stack}/mlp/experts"
                runtime = module + (".base_layer" if inner else "")
                out.append(ExpertsParam(path, matrix, runtime, ids))
    if held and not out:
        raise FamilyError(
            f"{adapter.directory}: its target_parameters adapt routed experts, and this model's "
            "decoder has none (model.llm.moe.experts is 0)"
        )
    return out


def read(adapter: Any, params: list[ExpertsParam], experts: int) -> tuple[list, set[str]]:
    """Each adapted matrix's (a, b) per layer (ours), and the adapter's keys they used.

    Raises:
      FamilyError: a layer without its tensors, or tensors of another shape, naming them.
    """
    prefix = "base_model.model."
    keys, used, out = set(adapter.keys()), set(), []
    for p in params:
        per = []
        for layer in p.layers:
            name = prefix + p.runtime.format(i=layer)
            pair = [f"{name}.lora_A.weight", f"{name}.lora_B.weight"]
            if not set(pair) <= keys:
                raise FamilyError(
                    f"{adapter.directory}: no {pair[0]}: its target_parameters adapt the experts "
                    f"of every MoE layer, and layer {layer}'s {PARAMS[p.matrix]} has none"
                )
            used |= set(pair)
            per.append(from_peft(*(adapter.tensor(k) for k in pair), experts, name))
        out.append((p, per))
    return out, used


def scale_name(p: ExpertsParam, layer: int) -> str:
    """The name PEFT's rank_pattern / alpha_pattern keys match for a matrix's adapter."""
    return f"{p.runtime.removesuffix('.base_layer').format(i=layer)}.{PARAMS[p.matrix]}"
