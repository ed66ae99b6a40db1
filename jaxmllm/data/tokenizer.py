"""Byte-level tokenizer with the special tokens the batch contract needs."""

from __future__ import annotations

import numpy as np

PAD, BOS, EOS, IMAGE, AUDIO, USER, ASSISTANT = 256, 257, 258, 259, 260, 261, 262
NUM_SPECIAL = 8  # ids 256..263 are reserved; byte vocab needs vocab_size >= 264


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
