"""Tokenizers and the special tokens the batch contract needs.

Token ids: bytes (or a tokenizer.json's ids below 256) as is, 256..263 the reserved specials (pad,
BOS, EOS, image, audio, user, assistant), and a tokenizer.json's ids k >= 256 shifted to k + 8.
So any tokenizer.json works without added special tokens, and model.llm.vocab_size must be at
least the tokenizer's size + 8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError

PAD, BOS, EOS, IMAGE, AUDIO, USER, ASSISTANT = 256, 257, 258, 259, 260, 261, 262
NUM_SPECIAL = 8  # ids 256..263 are reserved; byte vocab needs vocab_size >= 264


def make_tokenizer(spec: str):
    """`byte` or the path of a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer: no tokenizer.json at {spec!r}; give the path of a HuggingFace "
            "tokenizer.json (nothing is downloaded), or 'byte'"
        )
    try:
        return HFTokenizer(path)
    except Exception as e:
        raise ConfigError(f"data.tokenizer: {spec} is not a tokenizer.json: {e}") from None


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; specials follow. Needs no files, so tiny runs need nothing."""

    vocab_size = 256 + NUM_SPECIAL

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no BOS/EOS)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        """Text of byte ids; specials are shown as <name>."""
        names = {
            PAD: "<pad>",
            BOS: "<s>",
            EOS: "</s>",
            IMAGE: "<image>",
            AUDIO: "<audio>",
            USER: "<user>",
            ASSISTANT: "<assistant>",
        }
        out, run = [], []
        for i in np.asarray(ids).tolist():
            if i < 256:
                run.append(i)
                continue
            out.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            out.append(names.get(i, f"<{i}>"))
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A HuggingFace `tokenizers` tokenizer.json, ids shifted past the reserved specials."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = str(path)
        self._tk = Tokenizer.from_file(self.path)
        largest = max(self._tk.get_vocab(with_added_tokens=True).values(), default=0)
        self.vocab_size = max(ByteTokenizer.vocab_size, largest + 1 + NUM_SPECIAL)

    def encode(self, text: str) -> np.ndarray:
        ids = np.asarray(self._tk.encode(text, add_special_tokens=False).ids, np.int64)
        return np.where(ids >= 256, ids + NUM_SPECIAL, ids).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        text = ids[(ids < 256) | (ids >= 256 + NUM_SPECIAL)]
        return self._tk.decode(np.where(text >= 256, text - NUM_SPECIAL, text).tolist())

    def __getstate__(self):  # workers reload the file instead of pickling the Rust object
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])
