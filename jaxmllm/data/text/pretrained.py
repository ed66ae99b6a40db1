"""A HuggingFace checkpoint's tokenizer directory: its own ids, special tokens and chat template.

`data.tokenizer: path/to/checkpoint` (a directory) reads what transformers' `AutoTokenizer`
reads there: `tokenizer.json` (the tokenizer itself, ids unchanged), `tokenizer_config.json`
(named special tokens, the chat template), `special_tokens_map.json` (older checkpoints' named
tokens, used when the config has no `added_tokens_decoder`, as transformers does) and
`chat_template.jinja` (which takes priority over the config's template); a processor's
`chat_template.json` is used when the tokenizer has no template. Nothing is downloaded.

Sequences are what the checkpoint saw in training:
- chat records (`messages`) are rendered by the chat template
  (`jaxmllm.data.text.chat_template`) and tokenized once without added specials, exactly HF's
  `apply_chat_template` ids; loss on each assistant turn's tokens and its end-of-turn token,
  nowhere else (on the last one's alone where the record says `learn_last`: a preference
  pair's document learns its completion, not a multi-turn prompt's assistant turns);
- text records are HF's `tokenizer(text)` (the tokenizer.json's post-processor: Llama 3's
  `<|begin_of_text|>`, nothing for Qwen) followed by `eos_token`, loss on all of it.

Images, videos and clips take the checkpoint's own placeholder token where it has one
(`image_token` / `video_token` / `audio_token` in tokenizer_config.json, else in its processor's
processor_config.json, or Qwen2-VL's `<|image_pad|>` and `<|video_pad|>`, Qwen2-Audio's
`<|AUDIO|>`, Gemma 3's `<image_soft_token>`, ...), wrapped as its template or processor wraps it
(`<|vision_start|><|image_pad|><|vision_end|>`; Gemma 3's between blank lines, `<start_of_image>`
and `<end_of_image>`; else the `boi_token` and `eoi_token`, for a clip `boa_token` and
`eoa_token`, tokenizer_config.json names: Gemma 4);
where it has none, a new special token is appended after the vocabulary (`added_tokens`: the model
needs those embedding rows), but for videos, which then take the image placeholder (as LLaVA-style
checkpoints place video frames): the vision phase's rows fill either. Each placeholder is then laid
out as one token per encoder output row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError
from jaxmllm.config.phases import KIND, KINDS, Kind
from jaxmllm.data.records.record import KIND_OF_PLACEHOLDER, PLACEHOLDER, Record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.text.chat_template import ChatTemplate, TemplateError, TemplateInconsistent
from jaxmllm.data.text.specials import Specials

FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "processor_config.json",
)
# The tokenizer_config.json keys naming the tokens before and after a kind's item where no known
# wrap applies (Gemma4Processor's `boi_token`, `eoi_token`; `boa_token`, `eoa_token`)
NAMED_WRAPS = {"vision": ("boi_token", "eoi_token"), "audio": ("boa_token", "eoa_token")}
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Checkpoints' own media placeholders per kind of media: (token, opening, closing); the wrap is
# used when the vocabulary has both of its tokens (the text around them, Gemma 3's blank
# lines, comes with them). Searched after tokenizer_config's `<item>_token` (image_token,
# video_token, audio_token).
KNOWN_TOKENS = {
    "vision": (
        ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),  # Qwen2-VL, Qwen2.5(-VL), Qwen3
        ("<|IMAGE|>", "<|vision_bos|>", "<|vision_eos|>"),  # Qwen2.5-Omni
        # Gemma 3 (its processor's `full_image_sequence`)
        ("<image_soft_token>", "\n\n<start_of_image>", "<end_of_image>\n\n"),
        ("<|image|>", "", ""),  # Llama 3.2 Vision
        ("<image>", "", ""),  # LLaVA
    ),
    "audio": (
        ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"),  # Qwen2-Audio, Qwen2.5-Omni
        ("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>"),  # Qwen3-Omni
        ("<audio>", "", ""),
    ),
    "video": (
        ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),  # Qwen2-VL, Qwen2.5(-VL), Qwen3
        ("<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>"),  # Qwen2.5-Omni
        ("<video>", "", ""),
    ),
}
DEFAULT_DATE = "2024-07-26"  # what strftime_now renders (data.template_date's default)


def frame_time(seconds: float) -> str:
    """A video frame's time as Qwen3-VL's processor writes it before the frame."""
    return f"<{seconds:.1f} seconds>"


def is_tokenizer_dir(spec: str) -> bool:
    return Path(spec).is_dir()


def directory_sha256(directory: str, template_date: str) -> str:
    """One hash over the files that decide the token ids and the template's date: a change to
    any of them changes every count, so the lengths index records it."""
    h = hashlib.sha256(f"template_date={template_date}".encode())
    root = Path(directory)
    extra = sorted((root / "additional_chat_templates").glob("*.jinja"))
    for path in [root / name for name in FILES] + extra:
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


MAX_TOKENIZER_BYTES = 48 << 20  # a tokenizer.json's size (Gemma 3's, among the largest: 33 MB)


class PretrainedTokenizer:
    """The tokenizer of a HuggingFace checkpoint directory (see the module docstring).

    Attributes:
      specials: pad (`pad_token`, else `eos_token`: padding is never a target nor attended to),
        bos (`bos_token` or None), eos (`eos_token`), stop (eos and generation_config.json's
        `eos_token_id`s: where generation stops), media (the placeholder ids per kind).
      base_size: the checkpoint tokenizer's size (largest id + 1).
      added_tokens: tokens appended after it ({content: id}); their embedding rows are new.
      vocab_size: base_size + len(added_tokens), the least `model.llm.vocab_size`.
      template: the ChatTemplate (None when the directory has none: text records only).
    """

    def __init__(
        self,
        directory: str | Path,
        template_date: str = DEFAULT_DATE,
        max_bytes: int = MAX_TOKENIZER_BYTES,
        phases: Iterable[str] | None = None,
    ):
        """`phases`: the encoder phases the model has (None: every phase). A kind of media of
        another phase keeps the checkpoint's own placeholder where it has one, and gets none
        appended where it has not: the model has no tower for it, so no embedding row."""
        from tokenizers import Tokenizer

        self.path, self.template_date = str(directory), template_date
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise ConfigError(
                f"data.tokenizer: {root} has no tokenizer.json; a HuggingFace tokenizer directory "
                "needs tokenizer.json and tokenizer_config.json (nothing is downloaded)"
            )
        config = _read_json(root / "tokenizer_config.json", required=True)
        size = (root / "tokenizer.json").stat().st_size
        if size > max_bytes:  # (each process holds it parsed: about 20x the file)
            raise ConfigError(
                f"data.tokenizer: {root / 'tokenizer.json'} is {size} bytes, over "
                f"data.max_tokenizer_bytes={max_bytes} (the largest released tokenizers are "
                "tens of MB; loaded, about 20 times the file in every worker): point "
                "data.tokenizer at the model's own, or raise the key for a larger one you trust"
            )
        try:
            self._tk = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:
            raise ConfigError(
                f"data.tokenizer: {root / 'tokenizer.json'} does not load: {e}"
            ) from None
        self.base_size = max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        named = _named_tokens(config, root)
        self.added_tokens: dict[str, int] = {}
        # per kind: (its placeholder token, the text an item becomes, its content part type);
        # the tokenizer's own `<item>_token` first, then the processor's (processor_config.json)
        media = {**_processor_tokens(root), **named}
        self._media: dict[str, tuple[str, str, str]] = {}
        self._wraps: dict[str, tuple[str, str]] = {}  # per kind: its placeholder's wrap
        self.phases = tuple(dict.fromkeys(k.phase for k in KINDS) if phases is None else phases)
        for kind in KINDS:  # (a phase's own kind first: a video may fall back to the image's)
            found = self._media_placeholder(kind, media, append=kind.phase in self.phases)
            if found is not None:
                self._media[kind.name] = found
        self.vocab_size = max([self.base_size - 1, *self.added_tokens.values()]) + 1
        self.specials = self._specials(named, root)
        self.template = _load_template(root, config, named, template_date)
        self._stops = [self._tk.id_to_token(i) for i in self.specials.stop]

    # ------------------------------------------------------------------ ids

    def _id(self, token: str, what: str) -> int:
        i = self._tk.token_to_id(token)
        if i is None:
            raise ConfigError(
                f"data.tokenizer: {what} {token!r} is not in {self.path}/tokenizer.json"
            )
        return i

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (`<|im_start|>`), or None."""
        return self._tk.token_to_id(token)

    def _media_placeholder(
        self, kind: Kind, named: dict[str, str], append: bool
    ) -> tuple[str, str, str] | None:
        """(the placeholder token, the text a media item becomes: it in its wrap, the content
        part type a template renders it from); None where the tokenizer has none and `append`
        is false (a kind of a phase the model has no tower for)."""
        from tokenizers import AddedToken

        known = KNOWN_TOKENS.get(kind.name, ())
        token, before, after = self._own_placeholder(named.get(f"{kind.item}_token"), known)
        if token is not None and not (before or after):
            before, after = self._named_wrap(kind, named)
        if token is None and kind.name != kind.phase:  # (a video: its phase's own kind's)
            if kind.phase not in self._media:
                return None
            self._wraps[kind.name] = self._wraps[kind.phase]
            return self._media[kind.phase]
        if token is None and not append:
            return None
        self._wraps[kind.name] = (before, after)
        if token is None:  # a new token after the vocabulary: the model needs its row
            token = f"<|jaxmllm_{kind.item}|>"
            self._tk.add_special_tokens([AddedToken(token, special=True, normalized=False)])
            self.added_tokens[token] = self._tk.token_to_id(token)
        return token, before + token + after, kind.item

    def _named_wrap(self, kind: Kind, named: dict[str, str]) -> tuple[str, str]:
        """The wrap the tokenizer names for a kind (`NAMED_WRAPS`: Gemma 4's tokenizer_config
        boi_token and eoi_token, boa_token and eoa_token, its processor writing an image or a
        clip as them around its soft tokens, nothing between), where both are in the
        vocabulary; else none."""
        keys = NAMED_WRAPS.get(kind.name, ())
        tokens = [named.get(k) for k in keys]
        if keys and all(t and self._tk.token_to_id(t) is not None for t in tokens):
            return tokens[0], tokens[1]
        return "", ""

    def _own_placeholder(self, configured: str | None, known) -> tuple[str | None, str, str]:
        have = lambda t: bool(t) and self._tk.token_to_id(t) is not None
        for token, before, after in known:
            if (configured is None or token == configured) and have(token):
                wrap = have(before.strip()) and have(after.strip())
                return token, before if wrap else "", after if wrap else ""
        return (configured, "", "") if have(configured) else (None, "", "")

    def _specials(self, named: dict[str, str], root: Path) -> Specials:
        if "eos_token" not in named:
            raise ConfigError(f"data.tokenizer: {root}/tokenizer_config.json names no eos_token")
        eos = self._id(named["eos_token"], "eos_token")
        pad = self._id(named["pad_token"], "pad_token") if "pad_token" in named else eos
        bos = self._id(named["bos_token"], "bos_token") if "bos_token" in named else None
        generation = _read_json(root / "generation_config.json", required=False)
        more = generation.get("eos_token_id", [])
        more = [more] if isinstance(more, int) else [i for i in more if isinstance(i, int)]
        stop = tuple(dict.fromkeys([eos, *more]))
        media = {k: self._tk.token_to_id(token) for k, (token, _, _) in self._media.items()}
        try:
            return Specials(pad=pad, bos=bos, eos=eos, stop=stop, media=media)
        except ValueError as e:
            raise ConfigError(f"data.tokenizer: {root}: {e}") from None

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no BOS/EOS; special tokens in it are matched, as HF does)."""
        return np.asarray(self._tk.encode(text, add_special_tokens=False).ids, np.int32)

    def frame_text(self, kind: str, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """The ids before and after a video's temporal patch `seconds` in, where its time is
        written (`data.video_timestamps`): Qwen3-VL's processor writes `<1.5 seconds>` and the
        frame's placeholders in its wrap (`<|vision_start|>` ... `<|vision_end|>`), the
        template's own wrap around them all."""
        before, after = self._wraps[kind]
        return self.encode(frame_time(seconds) + before), self.encode(after)

    def decode(self, ids) -> str:
        """Text of ids, special tokens included."""
        return self._tk.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    # ------------------------------------------------------------------ sequences

    def messages(self, record: Record) -> list[dict]:
        """A chat record's turns as HF messages: `<image>` / `<video>` / `<audio>` become
        content parts ({"type": "image"}) where the template renders that placeholder itself
        (Qwen2-VL's), else the wrapped placeholder text."""
        own = {
            k
            for k, (token, _, _) in self._media.items()
            if self.template and token in self.template.source
        }
        out = []
        for role, text in record.turns:
            parts = [p for p in PLACEHOLDER.split(text) if p]
            if not own & {KIND_OF_PLACEHOLDER.get(p) for p in parts}:
                out.append({"role": role, "content": self._substitute(text)})
                continue
            content = []
            for p in parts:
                kind = KIND_OF_PLACEHOLDER.get(p)
                if kind in own:
                    content.append({"type": self._media[kind][2]})
                else:
                    text = self._media[kind][1] if kind else p
                    content.append({"type": "text", "text": text})
            out.append({"role": role, "content": content})
        return out

    def pieces(self, record: Record, generation: bool = False) -> list[tuple]:
        """Token runs ("text", ids, loss) and media markers (kind of media, item number) of
        `record`, in order; `generation`: a prompt ending in the assistant's generation
        prompt, nothing learned. Raises RecordError for a template that fails on the record,
        or for items of a kind this tokenizer has no placeholder for (the model has no tower)."""
        for kind in KINDS:
            if record.media[kind.name] and kind.name not in self._media:
                raise RecordError(
                    "no_encoder",
                    f"{len(record.media[kind.name])} {kind.item} item(s), but the model has no "
                    f"{kind.phase} encoder (model.{kind.phase}.enabled: false) and {self.path} "
                    f"no {kind.item} placeholder: enable it, or leave such records out",
                    record.id,
                )
        if record.turns[0][0] == "text":
            enc = self._tk.encode(self._substitute(record.turns[0][1]), add_special_tokens=True)
            ids = list(enc.ids)
            if not generation and (not ids or ids[-1] != self.specials.eos):
                ids.append(self.specials.eos)
            loss = np.full(len(ids), not generation)
        else:
            ids, loss = self._render(record, generation)
        return self._split_media(np.asarray(ids, np.int32), loss, record)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> np.ndarray:
        """Ids of HF `messages` followed by the assistant's generation prompt (what generation
        continues): `apply_chat_template(messages, add_generation_prompt=True)`. Media stay one
        placeholder id each; `Preprocessor` lays them out as rows."""
        if self.template is None:
            raise ConfigError(f"data.tokenizer: {self.path} has no chat template")
        text = self.template.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
        return self.encode(text)

    def _substitute(self, text: str) -> str:
        return PLACEHOLDER.sub(lambda m: self._media[KIND_OF_PLACEHOLDER[m.group(0)]][1], text)

    def _render(self, record: Record, generation: bool) -> tuple[list[int], np.ndarray]:
        if self.template is None:
            raise RecordError(
                "template_error",
                f"{self.path} has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja): only text records can be tokenized",
                record.id,
            )
        messages = self.messages(record)
        try:
            if generation:
                text, spans = self.template.render(messages, add_generation_prompt=True), []
            else:
                text, spans = self.template.assistant_spans(messages, self._stops)
                spans = spans[-1:] if record.learn_last else spans  # (a pair's completion)
        except TemplateError as e:
            reason = "template_inconsistent" if isinstance(e, TemplateInconsistent) else None
            raise RecordError(reason or "template_error", str(e), record.id) from None
        enc = self._tk.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        start, end = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
        loss = np.zeros(len(enc.ids), bool)
        for a, b in spans:  # a token is learned when it overlaps an assistant span
            loss |= (start < b) & (end > a)
        return list(enc.ids), loss

    def _split_media(self, ids: np.ndarray, loss: np.ndarray, record: Record) -> list[tuple]:
        """The rendered ids cut at their placeholders: the k-th is the record's k-th item
        (kinds may share a token: a video placed by the image token)."""
        s = self.specials
        marks = np.flatnonzero(np.isin(ids, list(s.media.values()))).tolist()
        kinds = [KIND_OF_PLACEHOLDER[m] for _, t in record.turns for m in PLACEHOLDER.findall(t)]
        placed = [int(ids[m]) for m in marks]
        if placed != [s.media[k] for k in kinds]:
            wrong = []
            for token in dict.fromkeys(s.media.values()):
                want = sum(s.media[k] == token for k in kinds)
                found = int((ids == token).sum())
                if found != want:
                    items = "/".join(KIND[k].item for k, i in s.media.items() if i == token)
                    name = self._tk.id_to_token(token)
                    wrong.append(f"{found} {name} placeholder(s) for {want} {items} item(s)")
            raise RecordError(
                "placeholder_mismatch",
                f"the sequence has {'; '.join(wrong) or 'its placeholders out of the order'} "
                "of the record's items (the text holds a placeholder token itself?)",
                record.id,
            )
        out, at, count = [], 0, dict.fromkeys(s.media, 0)
        for m, kind in zip(marks + [len(ids)], kinds + [None], strict=True):
            if m > at:
                out.append(("text", ids[at:m], loss[at:m]))
            if kind is not None:
                out.append((kind, count[kind]))
                count[kind] += 1
            at = m + 1
        return out

    def __getstate__(self):  # workers reload the directory instead of pickling Rust objects
        return {"path": self.path, "template_date": self.template_date}

    def __setstate__(self, state):
        self.__init__(state["path"], state["template_date"])


# ----------------------------------------------------------------------------- files


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ConfigError(
                f"data.tokenizer: {path.parent} has no {path.name}; a HuggingFace tokenizer "
                "directory needs tokenizer.json and tokenizer_config.json (for a bare "
                "tokenizer.json trained from scratch, give the file's path instead)"
            )
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"data.tokenizer: {path} is not a JSON object")
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value if isinstance(value, str) else None


def _named_tokens(config: dict, root: Path) -> dict[str, str]:
    """The named special tokens transformers exposes to templates: the standard ones and every
    other `*_token` key (Qwen's `image_token`), with special_tokens_map.json's values where the
    config has no added_tokens_decoder (older checkpoints), as transformers does."""
    values = dict(config)
    if isinstance(values.get("extra_special_tokens"), dict):
        values.update(values["extra_special_tokens"])
    if "added_tokens_decoder" not in config:
        values.update(_read_json(root / "special_tokens_map.json", required=False))
    names = [k for k in values if k in NAMED or k.endswith("_token")]
    named = {k: _token_text(values[k]) for k in names}
    return {k: v for k, v in named.items() if v is not None}


def _processor_tokens(root: Path) -> dict[str, str]:
    """The placeholders a whole checkpoint's processor names (processor_config.json's
    image_token, video_token, audio_token: LlavaProcessor's, Qwen2AudioProcessor's)."""
    processor = _read_json(root / "processor_config.json", required=False)
    keys = [f"{k.item}_token" for k in KINDS]
    return {k: processor[k] for k in keys if isinstance(processor.get(k), str)}


def _load_template(root: Path, config: dict, named: dict, date: str) -> ChatTemplate | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's (a string,
    or a list of named templates), else a processor's chat_template.json."""
    origin, source = root / "chat_template.jinja", None
    if origin.is_file():
        source = origin.read_text(encoding="utf-8")
    else:
        origin, source = root / "tokenizer_config.json", config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = source.get("default")
        if source is None:
            origin = root / "chat_template.json"
            source = _read_json(origin, required=False).get("chat_template")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ConfigError(f"data.tokenizer: the chat template in {origin} is not a string")
    try:
        now = datetime.strptime(date, "%Y-%m-%d")
    except ValueError:
        raise ConfigError(f"data.template_date: {date!r} is not a date (YYYY-MM-DD)") from None
    try:
        return ChatTemplate(source, str(origin), named, now)
    except TemplateError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
