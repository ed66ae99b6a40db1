"""The contract of a whole multimodal checkpoint: one directory holding an LLM, encoders and the
projectors between them (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen2-Audio: `jaxmllm.hf.wholes`).

A `Whole` says where each part sits: its sub-config in config.json (`text_config`,
`vision_config`, `audio_config`) and the prefix of its tensors (`language_model.`,
`vision_tower.`, ...); which part family reads it (`inner`: Llama or Qwen2, SigLIP, CLIP, a
Qwen VL tower, a Whisper-like encoder); the links of the projectors it holds beside the parts;
and the whole config.json back (`to_hf_config`).

`Part` is one role's view of a whole checkpoint as a `Family`, so the loader, the importer and
export read it as they read a checkpoint of one part: its links carry the whole's tensor names
(the part's prefix, or the projector's), and it leaves the other parts' tensors alone.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from jaxmllm.hf.family import Family, FamilyError, Link, renamed


class Whole:
    """One whole-checkpoint architecture (see the module docstring)."""

    name: str = ""  # what the CLI and errors call it
    model_types: tuple[str, ...] = ()  # config.json model_type values it reads
    hf_class: str = ""  # the transformers class export writes and check compares against
    processor_class: str = ""  # the transformers processor of its directory
    # role -> (the key of its config inside config.json, the prefix of its tensors)
    parts: dict[str, tuple[str, str]] = {}
    # The parts a checkpoint of it may leave out, its config null (Gemma 4 without audio)
    optional: tuple[str, ...] = ()
    # role -> config.json keys naming its placeholder token id (the first present is read)
    token_keys: dict[str, tuple[str, ...]] = {}
    # encoder role -> where transformers (5) puts that part in the model it builds (the LLM's
    # decoder is `model.language_model.`, its head `lm_head`; a projector `model.<name>`)
    runtime_prefix: dict[str, str] = {}
    # The checkpoint names its tensors as transformers 5 names the modules (Qwen3-VL's
    # `model.language_model.`, `model.visual.`): PEFT's names are its names
    runtime_names = False
    # Its processor writes each video frame's time before it (Qwen3-VL): data.video_timestamps
    video_timestamps = False
    # Its processor resizes every image to its tower's size (LLaVA's crop, Gemma 3's resize):
    # `hf import` sets as many pixels (`data.image_min_pixels` = `image_max_pixels`), `hf check`
    # draws images of that size
    fixed_size = False
    row: Any = None  # its row of the family table (`jaxmllm.hf.table.WholeRow`)

    def __init__(self, row: Any = None):
        """`row`: the whole's row of the table (default: the class's), whose name, model
        types, transformers class and processor are the whole's."""
        row = self.row if row is None else row
        if row is not None:
            self.row, self.name, self.model_types = row, row.name, row.model_types
            self.hf_class, self.processor_class = row.hf_class, row.processor_class

    def held(self, hf: dict) -> tuple[str, ...]:
        """The parts a checkpoint (its config.json `hf`) holds: every part but an optional one
        whose config it leaves null."""
        return tuple(r for r in self.parts if r not in self.optional or hf.get(self.parts[r][0]))

    def sub(self, role: str, hf: dict) -> dict:
        """A part's own config (the whole's top-level tie_word_embeddings goes to the LLM's),
        with its architecture's defaults where it leaves keys out (`with_defaults`)."""
        key = self.parts[role][0]
        sub = dict(hf.get(key) or {})
        if role == "llm" and "tie_word_embeddings" in hf:
            sub["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return with_defaults(sub, f"config.json's {key}")

    def inner(self, role: str, hf: dict) -> Family:
        """The family that reads a part's own config and tensors."""
        raise NotImplementedError

    def section(self, role: str, hf: dict) -> dict:
        """Our config section of a part (the inner family's, and what the whole adds)."""
        return self.inner(role, hf).section(self.sub(role, hf))

    def place(self, role: str, name: str, at: str) -> str:
        """A part's tensor in the whole checkpoint: its family's `name` under `at` (the part's
        prefix and nesting); a whole that nests its LLM's decoder otherwise renames it."""
        return at + name

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        """Links of tensors a role holds outside its part's prefix (a projector), full names."""
        return []

    def owns(self, role: str, name: str) -> bool:
        """Whether a tensor outside every part's prefix is this role's (its projector's)."""
        return False

    def part_of(self, name: str) -> str | None:
        """The role a tensor belongs to: a projector's, else the part whose prefix it has (the
        one with no prefix, Qwen VL's LLM, takes the rest)."""
        for role in self.parts:
            if self.owns(role, name):
                return role
        bases = sorted(((b, r) for r, (_, b) in self.parts.items()), key=lambda x: -len(x[0]))
        return next((r for b, r in bases if name.startswith(b)), None)

    def unused(self, role: str, name: str, hf: dict) -> bool:
        """Whether a tensor of a part (name under its prefix) is one the model leaves alone."""
        return False

    def nesting(self, role: str) -> str:
        """A part's prefix under its own prefix when a checkpoint has no tensors to tell."""
        return ""

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole config.json: `source` with the parts `roles` made ours, or (None) a new
        one for a run trained from scratch."""
        raise NotImplementedError

    def mismatches(self, cfg: Any) -> list[str]:
        """Our options this architecture has no counterpart for (a run from scratch)."""
        raise NotImplementedError

    def fillers(self, cfg: Any) -> dict[str, Any]:
        """Tensors the transformers class has that the model leaves out, for a checkpoint from
        scratch (a norm it never applies): name -> array."""
        return {}

    def data_keys(self, proc: dict, where: str, hf: dict) -> dict:
        """Our `data` keys its image processor's file (`proc`, at `where`; `hf`: the whole's
        config.json) sets beyond the pixel normalisation and budgets `hf import` reads alike
        for every family (Gemma 4's resize rule)."""
        return {}

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """The processor's files (name -> JSON) for a checkpoint from scratch, from the data
        section: what `AutoProcessor` reads beside the tokenizer."""
        return {}

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        """transformers' keyword arguments (numpy) for one of our samples alone: what `hf
        check` runs its class on (`jaxmllm.hf.oracle`)."""
        raise NotImplementedError

    def token_id(self, role: str, hf: dict) -> int | None:
        """The placeholder token id config.json names for a role's media."""
        for key in self.token_keys.get(role, ()):
            if hf.get(key) is not None:
                return int(hf[key])
        return None


def with_defaults(config: dict, where: str = "config.json") -> dict:
    """A part's config with every key its transformers config class fills by default (as
    transformers reads it): LLaVA-1.5's text_config names little beyond its model_type, the
    rest are LlamaConfig's defaults. Without transformers installed, the config as it is (a
    key it lacks is then refused naming it).

    Raises:
      FamilyError: a value transformers' config class refuses (a name where a number
        belongs), naming `where` and the key.
    """
    return copy.deepcopy(_with_defaults(json.dumps(config, sort_keys=True), where))


@functools.lru_cache(maxsize=64)
def _with_defaults(text: str, where: str) -> dict:  # (once per tensor a load leaves alone)
    config = json.loads(text)
    try:
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig
    except ImportError:
        return config
    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        full = AutoConfig.for_model(config.get("model_type"), **rest).to_dict()
    except StrictDataclassError as e:  # (transformers 5 checks each value's type)
        why = " ".join(str(e.__cause__ or e).split())
        raise FamilyError(
            f"{where}: {why} (transformers refuses it: the checkpoint's config.json is "
            "damaged or not a model's)"
        ) from None
    except (ValueError, KeyError, TypeError):  # (a model_type transformers does not know)
        return config
    return {**full, **config}


class Part(Family):
    """One role of a whole checkpoint, read as a part's family (see the module docstring).

    `names`: the checkpoint's tensor names, which say how the part nests under its prefix
    (`vision_tower.` or `vision_tower.vision_model.`) and how its tensors are laid out (the
    inner family's `for_checkpoint`; `where` names the checkpoint in its refusals); none: the
    nesting and layout transformers writes.
    """

    def __init__(self, whole: Whole, role: str, hf: dict, names=(), where: str = ""):
        """A whole checkpoint's part for `role` (see the class docstring)."""
        self.whole, self.role, self.hf = whole, role, hf
        self.name, self.model_types, self.hf_class = whole.name, whole.model_types, whole.hf_class
        self.base = whole.parts[role][1]
        under = [n[len(self.base) :] for n in names if n.startswith(self.base)]
        self.inner = whole.inner(role, hf).for_checkpoint(under, where)
        self.at = self.base + (self.inner.prefix(under) if under else whole.nesting(role))

    def section(self, hf: dict) -> dict:
        """The whole's section for this part."""
        return self.whole.section(self.role, hf)

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The inner family's links under the whole's names, and the projectors the whole holds."""
        hf = hf or self.hf
        sub = self.whole.sub(self.role, hf)
        place = lambda n: self.whole.place(self.role, n, self.at)
        links = [renamed(link, place) for link in self.inner.links(cfg, sub)]
        return links + self.whole.own_links(self.role, cfg, hf)

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The whole's config.json with this part ours."""
        return self.whole.to_hf_config(cfg, source, (self.role,))

    def placed(self, name: str) -> str:
        """A name of the inner family's under the whole's names."""
        return self.whole.place(self.role, name, self.at)

    def runtime(self, name: str) -> str:
        """The name transformers (5) gives a checkpoint tensor's module in the whole model it
        builds."""
        if self.whole.runtime_names:
            return name
        if not name.startswith(self.at):  # (a projector the whole holds beside the parts)
            return f"model.{name}"
        rest = name[len(self.at) :]
        if self.role != "llm":
            return self.whole.runtime_prefix[self.role] + rest
        if rest.startswith("model."):  # the decoder; its head (lm_head) sits at the top
            return "model.language_model." + rest.removeprefix("model.")
        return rest

    def checkpoint_name(self, runtime: str) -> str:
        """The inverse of `runtime`: a module's name in the checkpoint."""
        if self.whole.runtime_names:
            return runtime
        prefix = self.whole.runtime_prefix.get(self.role)
        if prefix and runtime.startswith(prefix):
            return self.at + runtime.removeprefix(prefix)
        if self.role == "llm" and runtime.startswith("model.language_model."):
            return self.at + "model." + runtime.removeprefix("model.language_model.")
        if self.role == "llm" and not runtime.startswith("model."):
            return self.at + runtime  # (its head)
        return runtime.removeprefix("model.")  # (a projector the whole holds)

    def part_of(self, name: str) -> str | None:
        """The role of the part a tensor of the whole belongs to."""
        return self.whole.part_of(name)

    def skipped(self, name: str) -> bool:
        """Another part's tensors, and those the inner family or the whole leaves alone."""
        if self.whole.part_of(name) != self.role:
            return True  # another part's
        if self.whole.owns(self.role, name) or not name.startswith(self.at):
            return False
        rest = name[len(self.at) :]
        return self.inner.skipped(rest) or self.whole.unused(self.role, rest, self.hf)
