"""`python -m jaxmllm.hf import`: a training config whose model matches HF checkpoints.

The model section comes from each checkpoint's config.json (through its family), so the model
jaxmllm builds has exactly the checkpoint's shapes and options; `model.init_from` names the
directories the trainer then loads (a whole checkpoint, `--model DIR`, is every part's
directory: its LLM, its encoders and its projectors). The rest of the config is a fine-tuning
starting point on the built-in data (swap in your own manifest), the checkpoint's own tokenizer
and processor settings included.
"""

from __future__ import annotations

import copy
import glob
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import yaml

from jaxmllm.config import Config, ConfigError, DataConfig, from_dict
from jaxmllm.config.outputs import new_file, write_text
from jaxmllm.config.phases import ENCODERS
from jaxmllm.config.sections import BatchConfig
from jaxmllm.config.yamlfile import read_yaml
from jaxmllm.data.text.tokenizer import make_tokenizer
from jaxmllm.hf.adapter_load import shapes_of
from jaxmllm.hf.family import FamilyError, refuse_unless
from jaxmllm.hf.load import checkpoint_tensors, fits, link_names
from jaxmllm.hf.registry import FAMILIES, ROLES, family_for, read_hf_config, roles_of, section_of
from jaxmllm.hf.wholes import WHOLES, whole_for

TEMPLATE = """\
# python -m jaxmllm.train --config {config}
#
# Written by: {command}
# The model section is the checkpoints' own (model.init_from names them); what is not in a
# checkpoint (the projectors) starts fresh. Size batch.* to your devices; `--set` overrides any
# key. {data}
#   python -m jaxmllm.data.index --config {config}
"""
NO_DATA = """It names no data yet, and training refuses to start without: set data.path (a
# file, a folder of shards or a glob, in any data.format; docs/data.md), then index it once:"""
DATA = "Index its data once before the first run:"
BUILT_IN = """It trains on the built-in data (data.source: synthetic); for your own, set
# data.path and data.source: files, then index it once:"""


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
        merger = getattr(getattr(family, "inner", family), "merger_out", lambda _: None)(hf)
        if merger and merger != model["llm"]["width"]:
            print(
                f"note: the Qwen2-VL merger of {directory} was trained for a {merger}-wide LLM; "
                f"this LLM is {model['llm']['width']} wide, so the projector starts fresh",
                file=sys.stderr,
            )
    return model


def model_dirs(model: str) -> tuple[str, str, str]:
    """(llm, vision, audio) directories of a whole checkpoint: itself for each part it holds.
    A causal LM alone (Llama, Qwen2, Qwen3, Qwen3-MoE, ...) is a whole text-only model: its
    LLM, no encoder.

    Raises:
      FamilyError: a directory that is neither, naming what jaxmllm reads whole.
    """
    hf = read_hf_config(model)
    whole = whole_for(hf)
    if whole is None:
        if roles_of(hf) == ("llm",):
            return model, "", ""
        kind = hf.get("model_type")
        wholes = sorted(t for w in WHOLES for t in w.model_types)
        decoders = sorted(t for f in FAMILIES if f.role == "llm" for t in f.model_types)
        parts = roles_of(hf)
        article = "an" if parts and parts[0][0] in "aeiou" else "a"
        hint = (
            f"; it is {article} {parts[0]} part: pass it as --{parts[0]} beside --llm"
            if parts
            else ""
        )
        raise FamilyError(
            f"--model {model}: model_type {kind!r} is not a model jaxmllm reads whole{hint}. "
            f"Whole multimodal models: {', '.join(wholes)}; causal LMs (a text-only model): "
            f"{', '.join(decoders)}; encoders are parts (--vision, --audio)"
        )
    held = whole.held(hf)
    return tuple(model if role in held else "" for role in ROLES)  # type: ignore


def data_section(llm: str, vision: str = "", audio: str = "", tokenizer: str = "") -> dict:
    """Our `data` keys from the checkpoints' processors: the tokenizer (a directory: the LLM's
    by default; its chat template and placeholder tokens come with it), pixel normalisation and
    budgets (preprocessor_config.json), Whisper's mel and sample rate."""
    data: dict = {"tokenizer": str(Path(tokenizer or llm).resolve())}
    proc = _processor(vision)
    where = _processor_file(vision)
    if "image_mean" in proc and "image_std" in proc:
        for key in ("image_mean", "image_std"):
            values = proc[key] if isinstance(proc[key], list) else [proc[key]]
            data[key] = [_number(x, where, key, 1e6, whole=False) for x in values]
    size = proc.get("size") if isinstance(proc.get("size"), dict) else {}
    low = proc.get("min_pixels", size.get("shortest_edge"))
    high = proc.get("max_pixels", size.get("longest_edge"))
    if low and high:  # Qwen2-VL's pixel budget (SigLIP's fixed size: jaxmllm keeps native)
        low_key = "min_pixels" if "min_pixels" in proc else "size.shortest_edge"
        high_key = "max_pixels" if "max_pixels" in proc else "size.longest_edge"
        data["image_min_pixels"] = _number(low, where, low_key, MAX_PIXELS)
        data["image_max_pixels"] = _number(high, where, high_key, MAX_PIXELS)
    whole = whole_for(read_hf_config(vision)) if vision else None
    if whole is not None and whole.video_timestamps:  # (Qwen3-VL: times between frames)
        data["video_timestamps"] = True
    if whole is not None and whole.fixed_size:
        refuse_unless(
            not proc.get("do_pan_and_scan"),
            where,
            "do_pan_and_scan: true: Gemma 3's pan and scan (crops of a large image beside it) "
            "is not built in jaxmllm's data pipeline (set it to false)",
        )
        # LLaVA saw square crops of one size, Gemma 3 images resized to one: as many pixels,
        # at each image's aspect ratio
        crop = proc.get("crop_size") if isinstance(proc.get("crop_size"), dict) else size
        if crop.get("height") and crop.get("width"):
            side = 1 << 13  # (a side of the largest stored image, data.max_image_pixels)
            h = _number(crop["height"], where, "crop_size.height", side)
            w = _number(crop["width"], where, "crop_size.width", side)
            data["image_min_pixels"] = data["image_max_pixels"] = h * w
    if whole is not None:
        data.update(whole.data_keys(proc, where, read_hf_config(vision)))
    if vision:
        _check_sizes(vision, proc)
    if audio:  # (the feature extractor's log-mel: Whisper's, Gemma 4's)
        family = tower_of_audio(audio)
        features = _processor(audio, "feature_extractor")
        family.check_features(features, _processor_file(audio))
        data["mel"] = family.mel
        rate = features.get("sampling_rate")
        if rate:
            data["audio_sample_rate"] = _number(
                rate, _processor_file(audio), "sampling_rate", 10**6
            )
    return data


def tower_of_audio(directory: str):
    """The audio encoder family of a checkpoint directory (a whole's: its part's)."""
    family = family_for("audio", read_hf_config(directory), directory)
    return getattr(family, "inner", family)


MAX_PIXELS = DataConfig().max_image_pixels  # a pixel budget past it: no stored image is read


def _number(value: object, where: str, key: str, most: float, whole: bool = True) -> float:
    """`value` of the processor file's `key` as a number (a whole one by default), refused
    unless it is one in (0, most] (mean and std: [-most, most]) naming the file and the key."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and whole:
        ok = 1 <= value <= most and float(value).is_integer()
    elif ok:
        ok = -most <= value <= most
    if not ok:
        what = f"a whole number from 1 to {int(most)}" if whole else f"a number within +-{most:g}"
        raise FamilyError(
            f"{where}: {key} is {value!r:.40} but must be {what} (a damaged processor "
            "file: fix the value, or delete the file to keep jaxmllm's defaults)"
        )
    return int(value) if whole else float(value)


def _processor_file(directory: str) -> str:
    """The processor file `_processor` reads in `directory` (for messages)."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        if directory and (Path(directory) / name).is_file():
            return str(Path(directory) / name)
    return f"{directory}/preprocessor_config.json"


def _check_sizes(vision: str, proc: dict) -> None:
    """The processor's patch and merge sizes are the model's (else its images would be cut
    into patches the tower was not trained on)."""
    hf = read_hf_config(vision)
    tower = hf.get("vision_config", hf)
    for theirs, ours in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size")):
        if theirs in proc and ours in tower and proc[theirs] != tower[ours]:
            raise FamilyError(
                f"{vision}: preprocessor_config.json's {theirs} is {proc[theirs]} but "
                f"config.json's {ours} is {tower[ours]}: they must agree"
            )


def check_placeholders(directory: str, tokenizer: str) -> None:
    """A whole checkpoint's placeholder ids (config.json) are its tokenizer's: else its
    images and clips would fill slots of other tokens.

    Raises:
      FamilyError: naming both when they differ.
    """
    hf = read_hf_config(directory)
    whole = whole_for(hf)
    if whole is None or not (Path(tokenizer) / "tokenizer.json").is_file():
        return
    held = whole.held(hf)
    specials = make_tokenizer(tokenizer, phases=held).specials
    for p in ENCODERS:
        want = whole.token_id(p.name, hf) if p.name in held else None
        have = specials.media.get(p.name)
        if want is not None and want != have:
            raise FamilyError(
                f"{directory}: config.json's {whole.token_keys[p.name][0]} is {want} but the "
                f"tokenizer in {tokenizer} makes each {p.item} token id {have}; the tokenizer "
                f"must be the checkpoint's own (its tokenizer_config.json's {p.item}_token, or "
                "its processor_config.json's, names the placeholder)"
            )


def _processor(directory: str, kind: str = "image_processor") -> dict:
    """A checkpoint's image processor or feature extractor (`kind`) settings:
    preprocessor_config.json, or (transformers 5 writes one file) processor_config.json's
    `kind` (Gemma4Processor's holds both, and its video processor's)."""
    if not directory:
        return {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(directory) / name
        if not path.is_file():
            continue
        try:
            found = json.loads(path.read_text())
        except ValueError as e:
            raise FamilyError(f"{path}: not valid JSON ({e})") from None
        if name == "preprocessor_config.json":
            return found
        return found.get(kind) or {}
    return {}


DEFAULTS = {  # the sections of a config without --base: a fine-tuning starting point
    "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
    "batch": {"microbatches": 1, "llm_rows": 1, "llm_row_len": 4096, "capacity": "auto"},
    "optim": {"lr": 1e-5, "warmup_steps": 50, "weight_decay": 0.0},
}


def whole_tokens(batch: dict, model: dict) -> dict:
    """`batch` with its vision patch capacity (the default's, or the base's) cut to whole LLM
    tokens of the tower's merge x merge patches (and a multiple of 4, as every bucket), where
    they do not divide it (Gemma 4's 3 x 3 pooling under the default 4096: 4068)."""
    vision = model.get("vision", {})
    unit = math.lcm(4, vision.get("merge", 2) ** 2)
    have = batch.get("vision_patches", BatchConfig.vision_patches)
    if vision.get("enabled", True) and have % unit:
        return {**batch, "vision_patches": have // unit * unit}
    return batch


def encoder_phases(model: dict) -> tuple[str, ...]:
    """The encoder phases a `model` section (a dict, before it is a config) has."""
    return tuple(p.name for p in ENCODERS if model.get(p.name, {}).get("enabled", True))


def vocab_size(checkpoint: int, tokenizer: str, phases: tuple[str, ...]) -> int:
    """The checkpoint's vocabulary, grown when the tokenizer adds tokens past it (placeholders
    for images or audio that the checkpoint had no token for, of the encoder `phases` the model
    has: their rows start at the mean row) to a multiple of 128, which the vocabulary's shards
    divide."""
    root = Path(tokenizer)
    if not ((root / "tokenizer.json").is_file() and (root / "tokenizer_config.json").is_file()):
        print(
            f"note: {tokenizer} has no tokenizer.json and tokenizer_config.json; set "
            "data.tokenizer to the checkpoint's tokenizer directory before training",
            file=sys.stderr,
        )
        return checkpoint
    need = make_tokenizer(tokenizer, phases=phases).vocab_size
    return checkpoint if need <= checkpoint else -(-need // 128) * 128


def write_config(
    out: str | Path,
    llm: str = "",
    vision: str = "",
    audio: str = "",
    base: str | Path = "",
    tokenizer: str = "",
    model: str = "",
    adapter: str = "",
    command: str = "",
) -> Config:
    """Writes the config YAML at `out` and returns it, checked as the trainer will load it.

    `model`: a whole multimodal checkpoint (every part it holds; instead of `llm`, `vision`,
    `audio`). `base`: a config YAML (a recipe: configs/recipes/) whose keys are kept where the
    import does not set them: the import sets the modules' architecture, `model.init_from` and
    the processors' data keys; the base keeps freezing, batch, optimizer, data source and the
    rest. `tokenizer`: the tokenizer directory when it is not the LLM's. `adapter`: a PEFT
    LoRA adapter of these checkpoints the run starts from (`adapter_sections`: it sets
    model.*.lora and what else trains). `command`: the command line that asked for it, for
    the file's header (default: one made of these arguments). Every tensor the model will
    read is checked of its parameter's size (config.json's sizes against the tensors') and
    finite (a NaN or Inf in a checkpoint is refused naming the tensor).
    """
    reads = (llm, vision, audio, tokenizer, model, adapter)
    out = new_file("--out", out, reads, ours=written_by_import)
    command = command or import_command(out, llm, vision, audio, base, tokenizer, model, adapter)
    if model:
        llm, vision, audio = model_dirs(model)
    if not llm:
        raise FamilyError("name the checkpoint: --model DIR (a whole model) or --llm DIR")
    raw = _read_base(base) if base else {**DEFAULTS, "train": {"output_dir": f"runs/{out.stem}"}}
    section = raw.setdefault("model", {})
    for key, value in model_section(llm, vision, audio).items():
        section[key] = {**section.get(key, {}), **value}
    raw["data"] = {**raw.get("data", {}), **data_section(llm, vision, audio, tokenizer)}
    check_placeholders(llm, raw["data"]["tokenizer"])
    llm_keys = section["llm"]
    llm_keys["vocab_size"] = vocab_size(
        llm_keys["vocab_size"], raw["data"]["tokenizer"], encoder_phases(section)
    )
    if section["audio"].get("positions") == "sinusoidal":  # Whisper: clips up to its table
        raw["data"]["audio_max_frames"] = section["audio"]["max_positions"] * 2
    if adapter:
        adapter_sections(raw, adapter, str(out))
    raw["batch"] = whole_tokens(raw.get("batch", {}), section)
    cfg = from_dict(Config, raw, source=str(out))  # the checks the trainer will run
    found = []  # every tensor the model will ask for is there (headers alone) ...
    for role in ROLES:
        directory = getattr(cfg.model.init_from, role)
        if directory:
            key = f"model.init_from.{role}"
            found.append((role, key, *checkpoint_tensors(cfg, role, directory, key)))
    # ... then of its size (the model's abstract shapes: built only once the layer counts are
    # known to be the tensors', nothing allocated), and finite (but a bound that may be ±inf:
    # Gemma 4's clipped linears', `Link.infinite`, NaN-free)
    shapes = shapes_of(cfg) if found else {}
    for role, key, ck, _, prefix, links, names in found:
        fits(role, links, ck, prefix, shapes, key)
        unbounded = {prefix + n for link in links if link.infinite for n in link_names(link)}
        for name in sorted(names):
            array = ck.get(name)
            if name not in unbounded or np.isnan(array).any():
                ck.check_finite(name, array)
    out.parent.mkdir(parents=True, exist_ok=True)
    named = raw["data"].get("path") or raw["data"].get("sources")
    data = BUILT_IN if cfg.data.source == "synthetic" else DATA if named else NO_DATA
    text = TEMPLATE.format(config=out, command=command, data=data)
    unset = keys_to_set(raw, from_base=bool(base))
    if unset:
        text += "# Still to set (the --base recipe's placeholders, paths naming nothing here):\n"
        text += "".join(f"#   {line}\n" for line in unset)
    write_text(
        out, text + yaml.safe_dump(raw, sort_keys=False, default_flow_style=False, width=100)
    )
    return cfg


def written_by_import(path: Path) -> bool:
    """Whether the file at `path` is a config an `hf import` wrote (TEMPLATE's header), which a
    rerun may write again."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return head.startswith("# python -m jaxmllm.train --config ") and (
        "\n# Written by: python -m jaxmllm.hf import " in head
    )


def keys_to_set(raw: dict, from_base: bool) -> list[str]:
    """The written config's keys that still need a value of this site: data paths that name
    nothing here (data.path, data.media_root), an absolute train.output_dir whose top folder
    does not exist here (a recipe's /shared/...), and, `from_base`, data.workers (a recipe's
    worker count a process, sized for its own nodes' cores)."""
    data, unset = raw.get("data", {}), []
    for key in ("path", "media_root"):
        value = str(data.get(key) or "")
        if value and not (Path(value).exists() or glob.glob(value)):
            unset.append(f"data.{key}: {value} (nothing there yet)")
    out = Path(str(raw.get("train", {}).get("output_dir") or ""))
    if out.is_absolute() and len(out.parts) > 1 and not Path(*out.parts[:2]).exists():
        unset.append(f"train.output_dir: {out} ({Path(*out.parts[:2])} does not exist here)")
    workers = data.get("workers")
    if from_base and workers:
        unset.append(
            f"data.workers: {workers} (the recipe's, per process: what python -m "
            "jaxmllm.bench.host says a step needs, within a process's cores)"
        )
    return unset


def adapter_sections(raw: dict, adapter: str, where: str) -> None:
    """`raw`'s model with the LoRA sections a PEFT adapter implies (its ranks, scales and
    targets: `adapter_load.lora_sections`) and `init_from.adapter`: a module it has adapters on
    trains them, one it saves whole (`modules_to_save`) trains whole, the others freeze.

    Raises:
      FamilyError: an adapter the model cannot take (naming the tensors or target_modules).
    """
    from jaxmllm.hf.adapter_load import lora_sections

    model = raw["model"]
    everything = copy.deepcopy(raw)  # (adapters on every matrix: which ones it has)
    for tower in ("vision", "audio", "llm"):
        everything["model"][tower].update(freeze=False, lora={"rank": 1, "targets": ["all"]})
    everything["model"].update(projector_freeze=False, projector_lora={"rank": 1})
    sections, saved = lora_sections(from_dict(Config, everything, source=where), adapter)
    projectors = [sections.pop(p) for p in ("vision_projector", "audio_projector") if p in sections]
    if len(projectors) > 1 and projectors[0] != projectors[1]:
        raise FamilyError(
            f"{adapter}: its two projectors' adapters differ in rank or scale; "
            "model.projector_lora is one for both"
        )
    for tower in ("vision", "audio", "llm"):
        if tower in sections:
            model[tower].update(freeze=False, lora=sections[tower])
        elif model[tower].get("enabled", True):
            model[tower].update(freeze=tower not in saved, lora={"rank": 0})
    if projectors:
        model.update(projector_freeze=False, projector_lora=projectors[0])
    else:
        trained = bool(saved & {"vision_projector", "audio_projector"})
        model.update(projector_freeze=not trained, projector_lora={"rank": 0})
    model["init_from"]["adapter"] = str(Path(adapter).resolve())


def import_command(
    out: Path, llm="", vision="", audio="", base="", tokenizer="", model="", adapter=""
) -> str:
    """The `hf import` command line that writes `out` from these arguments."""
    args = ["--model", model] if model else ["--llm", llm]
    for role, directory in (("vision", vision), ("audio", audio)):
        args += [f"--{role}", directory] if directory and not model else []
    args += ["--tokenizer", tokenizer] if tokenizer else []
    args += ["--base", str(base)] if base else []
    args += ["--adapter", str(adapter)] if adapter else []
    return shlex.join(["python", "-m", "jaxmllm.hf", "import", *args, "--out", str(out)])


def _read_base(base: str | Path) -> dict:
    try:
        raw = read_yaml(Path(base).read_text(), f"--base {base}") or {}
    except OSError as e:
        raise FamilyError(f"--base {base}: cannot read it ({e.strerror})") from None
    except ConfigError as e:
        raise FamilyError(str(e)) from None
    if not isinstance(raw, dict):
        raise FamilyError(f"--base {base}: the top level must be a mapping of sections")
    return raw
