"""`model.attention: auto` resolved for the devices a run trains on, and the checks that a
resolved kernel (and a mixture of experts' exchange) runs on them."""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxmllm.config import Config, ConfigError

log = logging.getLogger("jaxmllm")


def resolve_attention(cfg: Config, devices: list | None = None) -> Config:
    """`model.attention: auto` resolved for the devices the run trains on (`auto_attention`),
    logged; any other setting as it is. The trainer resolves it once at start-up, before the
    batch sizes that depend on the kernel (tiles, documents); config.json and checkpoints keep
    the resolved kernel, and models refuse `auto`."""
    if cfg.model.attention != "auto":
        return cfg
    kind, why = auto_attention(cfg, jax.devices() if devices is None else devices)
    log.info("model.attention: auto -> %s (%s)", kind, why)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=kind))


def auto_attention(cfg: Config, devices: list) -> tuple[str, str]:
    """(kernel, why) for `model.attention: auto`: cuDNN's packed attention on NVIDIA GPUs of
    compute capability 9.0 (Hopper) or newer, which it needs; block-sparse elsewhere, and
    wherever context parallelism splits rows (it deals block-sparse tiles to the ranks), and
    for a vision tower with windows or class tokens (Qwen2.5-VL's, CLIP's), whose documents
    are not one run of a row each, as cuDNN's packed layout holds them, and for a decoder
    with sliding windows or bidirectional spans (Gemma's), which `cudnn.attend` does not pass
    on."""
    if cfg.mesh.context > 1:
        return "block_sparse", f"mesh.context={cfg.mesh.context} splits block-sparse tiles"
    v = cfg.model.vision
    if v.enabled and (v.window or v.class_token):
        what = "windows" if v.window else "class tokens"
        return "block_sparse", f"the vision tower's {what}: cuDNN's packed layout cannot hold them"
    if cfg.model.llm.window.enabled:
        return "block_sparse", "the decoder's sliding windows: cuDNN's attention here has none"
    if cfg.model.llm.bidirectional:
        return "block_sparse", "the decoder's bidirectional spans: cuDNN's attention here has none"
    first = devices[0]
    if first.platform != "gpu":
        return "block_sparse", f"{first.platform} devices"
    cc = hopper_or_newer(first)
    if cc is not True:
        return "block_sparse", f"{first.device_kind}, compute capability {cc}: cuDNN needs 9.0"
    return "cudnn", f"{first.device_kind}, compute capability {first.compute_capability}"


def hopper_or_newer(device) -> bool | str:
    """True for an NVIDIA GPU of compute capability 9.0 or newer, else the capability it has
    (a name for a GPU that reports none in that form, e.g. ROCm's gfx names)."""
    cc = str(getattr(device, "compute_capability", "none"))
    try:
        return tuple(int(x) for x in cc.split(".")[:2]) >= (9, 0) or cc
    except ValueError:
        return cc


def check_attention(cfg: Config, devices: list | None = None) -> None:
    """Refuses a resolved `model.attention` the devices cannot run, naming the key and what to
    set instead: cudnn off NVIDIA GPUs of compute capability 9.0 or newer; and a mixture of
    experts' ragged token exchange off GPUs."""
    first = (jax.devices() if devices is None else devices)[0]
    moe = cfg.model.llm.moe
    if moe.enabled and moe.exchange == "ragged" and cfg.mesh.expert > 1:
        if first.platform != "gpu":
            raise ConfigError(
                "model.llm.moe.exchange=ragged: lax.ragged_all_to_all runs on GPUs, this "
                f"backend is {first.platform} (XLA:{first.platform.upper()} does not implement "
                "it); set model.llm.moe.exchange: dense"
            )
    if cfg.model.attention != "cudnn":
        return
    if first.platform != "gpu":
        raise ConfigError(
            f"model.attention=cudnn: cuDNN's fused attention needs a GPU, this backend is "
            f"{first.platform}; use model.attention: block_sparse (every backend) or auto"
        )
    cc = hopper_or_newer(first)
    if cc is not True:
        raise ConfigError(
            f"model.attention=cudnn: cuDNN's packed-documents layout needs a Hopper GPU "
            f"(compute capability 9.0) or newer, this one is {cc}; use model.attention: "
            "block_sparse or auto"
        )
