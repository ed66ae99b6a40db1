"""`python -m jaxmllm.hf import`: a training config whose model matches HF checkpoints.

The model section comes from each checkpoint's config.json (through its family), so the model
jaxmllm builds has exactly the checkpoint's shapes and options; `model.init_from` names the
directories the trainer then loads. The rest of the config is a fine-tuning starting point on
the built-in data (swap in your own manifest), the checkpoint's own tokenizer included.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from jaxmllm.config import Config, from_dict
from jaxmllm.data.text.tokenizer import make_tokenizer
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.registry import family_for, read_hf_config, section_of

TEMPLATE = """\
# python -m jaxmllm.train --config {config}
#
# Written by: python -m jaxmllm.hf import {args}
# The model section is the checkpoints' own (model.init_from names them); what is not in a
# checkpoint (the projectors) starts fresh. Point data at your own manifest (README, "Your own
# data") and size batch.* to your devices; `--set` overrides any key.
"""


def model_section(llm: str, vision: str = "", audio: str = "") -> dict:
    """Our `model` keys for these checkpoint directories (vision / audio: "" = no encoder).

    Raises:
      FamilyError: a directory without config.json, or an architecture jaxmllm does not read.
    """
    model: dict = {"init_from": {}}
    for role, directory in (("llm", llm), ("vision", vision), ("audio", audio)):
        if not directory:
            model[role] = {"enabled": False}
            continue
        hf = read_hf_config(directory)
        family = family_for(role, hf, f"--{role} {directory}")
        model[role] = section_of(role, hf, f"--{role} {directory}")
        model["init_from"][role] = str(Path(directory).resolve())
        merger = getattr(family, "merger_out", lambda _: None)(hf)
        if merger and merger != model["llm"]["width"]:
            print(
                f"note: the Qwen2-VL merger of {directory} was trained for a {merger}-wide LLM; "
                f"this LLM is {model['llm']['width']} wide, so the projector starts fresh"
            )
    return model


def data_section(llm: str, vision: str = "", audio: str = "", tokenizer: str = "") -> dict:
    """Our `data` keys from the checkpoints' processors: the tokenizer (a directory: the LLM's
    by default), pixel normalisation and budgets (preprocessor_config.json), Whisper's mel."""
    data: dict = {"tokenizer": str(Path(tokenizer or llm).resolve())}
    proc = _processor(vision)
    if "image_mean" in proc and "image_std" in proc:
        data["image_mean"] = [float(x) for x in proc["image_mean"]]
        data["image_std"] = [float(x) for x in proc["image_std"]]
    size = proc.get("size") if isinstance(proc.get("size"), dict) else {}
    low = proc.get("min_pixels", size.get("shortest_edge"))
    high = proc.get("max_pixels", size.get("longest_edge"))
    if low and high:  # Qwen2-VL's pixel budget (SigLIP's fixed size: jaxmllm keeps native)
        data["image_min_pixels"], data["image_max_pixels"] = int(low), int(high)
    if audio:
        data["mel"] = "whisper"
        rate = _processor(audio).get("sampling_rate")
        if rate:
            data["audio_sample_rate"] = int(rate)
    return data


def _processor(directory: str) -> dict:
    path = Path(directory) / "preprocessor_config.json" if directory else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise FamilyError(f"{path}: not valid JSON ({e})") from None


DEFAULTS = {  # the sections of a config without --base: a fine-tuning starting point
    "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
    "batch": {"microbatches": 1, "llm_rows": 1, "llm_row_len": 4096, "capacity": "auto"},
    "optim": {"lr": 1e-5, "warmup_steps": 50, "weight_decay": 0.0},
}


def vocab_size(checkpoint: int, tokenizer: str) -> int:
    """The checkpoint's vocabulary, grown when the tokenizer adds tokens past it (placeholders
    for images or audio that the checkpoint had no token for: their rows start at the mean row)
    to a multiple of 128, which the vocabulary's shards divide."""
    root = Path(tokenizer)
    if not ((root / "tokenizer.json").is_file() and (root / "tokenizer_config.json").is_file()):
        print(f"note: {tokenizer} has no tokenizer.json and tokenizer_config.json; set "
              "data.tokenizer to the checkpoint's tokenizer directory before training")  # fmt: skip
        return checkpoint
    need = make_tokenizer(tokenizer).vocab_size
    return checkpoint if need <= checkpoint else -(-need // 128) * 128


def write_config(
    out: str | Path,
    llm: str,
    vision: str = "",
    audio: str = "",
    base: str | Path = "",
    tokenizer: str = "",
) -> Config:
    """Writes the config YAML at `out` and returns it, checked as the trainer will load it.

    `base`: a config YAML (a recipe: configs/recipes/) whose keys are kept where the import
    does not set them: the import sets the modules' architecture, `model.init_from` and the
    processors' data keys; the base keeps freezing, batch, optimizer, data source and the rest.
    `tokenizer`: the tokenizer directory when it is not the LLM's.
    """
    out = Path(out)
    raw = _read_base(base) if base else {**DEFAULTS, "train": {"output_dir": f"runs/{out.stem}"}}
    model = raw.setdefault("model", {})
    for key, value in model_section(llm, vision, audio).items():
        model[key] = {**model.get(key, {}), **value}
    raw["data"] = {**raw.get("data", {}), **data_section(llm, vision, audio, tokenizer)}
    model["llm"]["vocab_size"] = vocab_size(model["llm"]["vocab_size"], raw["data"]["tokenizer"])
    if model["audio"].get("positions") == "sinusoidal":  # Whisper: clips up to its table
        raw["data"]["audio_max_frames"] = model["audio"]["max_positions"] * 2
    cfg = from_dict(Config, raw, source=str(out))  # the checks the trainer will run
    dirs = (("llm", llm), ("vision", vision), ("audio", audio))
    args = " ".join(f"--{role} {d}" for role, d in dirs if d)
    args += f" --base {base}" if base else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = TEMPLATE.format(config=out, args=f"{args} --out {out}")
    out.write_text(text + yaml.safe_dump(raw, sort_keys=False, default_flow_style=False, width=100))
    return cfg


def _read_base(base: str | Path) -> dict:
    try:
        raw = yaml.safe_load(Path(base).read_text()) or {}
    except OSError as e:
        raise FamilyError(f"--base {base}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise FamilyError(f"--base {base}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise FamilyError(f"--base {base}: the top level must be a mapping of sections")
    return raw
