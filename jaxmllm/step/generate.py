"""Generation's compiled programs: prefill (prompts with their images and clips, encoded as in
training) and a decode step (one token per row against the KV cache, `jaxmllm.models.decode`),
at fixed shapes (`jaxmllm.batch.prompts.PromptShapes`), and the host loop that samples from them
(greedy at temperature 0, else temperature and nucleus sampling) until each row stops.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.batch.prompts import PromptShapes, prompt_batch, prompt_config
from jaxmllm.config import Config, ConfigError
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import RESERVED, Specials
from jaxmllm.models import decode
from jaxmllm.models.attention import packing
from jaxmllm.plan.tiles import from_segments, window_capacity, window_reach
from jaxmllm.resolve.attention import auto_attention
from jaxmllm.step.program import model_parts


@dataclasses.dataclass
class Answer:
    """One prompt's generated tokens."""

    ids: list[int]  # the new ids, the stop id that ended them included
    stopped: bool  # ended at a stop id (else at max_new_tokens)
    logits: list[np.ndarray] | None = None  # per new id, the logits it was picked from [vocab]


class Generator:
    """The compiled prefill and decode-step programs of a model config at fixed shapes.

    With `repeat` G > 1 each prompt is answered G times (online RL's group): prefill runs the
    prompts once (their images and clips encoded once, `shapes.rows` rows), then the cache and
    the next-token logits are repeated G times, row by row, inside the same program, and the
    decode step runs `shapes.rows` x G rows, each sampled with its own key."""

    def __init__(
        self, cfg: Config, shapes: PromptShapes, specials: Specials = RESERVED, repeat: int = 1
    ):
        """`specials`: the tokenizer's ids (padding, the image and audio placeholders);
        `repeat`: the answers each prompt gets."""
        self.cfg, self.shapes, self.specials, self.repeat = cfg, shapes, specials, repeat
        parts, _ = model_parts(prompt_config(cfg, shapes))  # (dense attention, local rows)
        # Prefill scores the prompts among themselves as training scores a row (the run's
        # attention kind): block-sparse over the tiles of each prompt's causal blocks (host
        # made, at most a whole row's; the sliding-window layers' over those their window
        # reaches), cuDNN over its one document, else a dense mask.
        kind, block = prefill_kind(cfg), cfg.batch.attention_block
        self.tiles, self.window_tiles = 0, 0
        if kind == "block_sparse":
            if shapes.prompt_len % block:
                raise ValueError(
                    f"block-sparse prefill needs a prompt length ({shapes.prompt_len}) that "
                    f"batch.attention_block={block} divides (PromptShapes.fit rounds to it)"
                )
            n = shapes.prompt_len // block
            # (bidirectional spans: up to every tile of the square, above the diagonal too)
            self.tiles = n * n if cfg.model.llm.bidirectional else n * (n + 1) // 2
            window = cfg.model.llm.window
            if window.enabled:
                reach = window_reach(window.size, block)
                self.window_tiles = window_capacity(self.tiles, 1, n, reach, n - 1)

        # Sampling's settings come as host scalars (seed, the step's number, temperature,
        # top_p): traced, so they never recompile, and the same on every process of a job.
        def pick(logits, sampling):
            """The next token of each row (sampled with this step's key, folded from the seed and
            step number: the same on every process) and the logits it was drawn from, both whole
            on every device."""
            seed, i, temperature, top_p = sampling
            key = jax.random.fold_in(jax.random.key(seed), i)
            return _whole(decode.pick(logits, key, temperature, top_p)), _whole(logits)

        def prefill(params, frozen, mb, tiles, sampling):  # (tiles: the lists, or None)
            """Runs the prompts through the model once: the first new token of each row, its
            logits, and the KV cache filled to the prompts' lengths (sized for
            `shapes.total_len`)."""
            seg = mb["llm_segment_ids"][:, 0]
            spans = mb["llm_spans"][:, 0] if "llm_spans" in mb else None
            causal, windowed = tiles or (None, None)
            pack = packing(
                seg,
                causal=True,
                kind=kind,
                tiles_bk2=causal,
                block=block,
                documents=1,
                window_tiles_bk2=windowed,
                spans_bt=spans,
            )
            model = parts.merge(params, frozen)
            logits, cache = decode.prefill(model, mb, shapes.total_len, pack)
            if repeat > 1:  # (every leaf [layers, rows, ...]; the logits [rows, vocab])
                cache = jax.tree.map(lambda x: jnp.repeat(x, repeat, axis=1), cache)
                logits = jnp.repeat(logits, repeat, axis=0)
            return *pick(logits, sampling), cache

        def step(params, frozen, cache, tokens, index, positions, sampling):
            """One decode step: each row's last token at `index` (its positions for M-RoPE)
            against the cache; the next token, its logits and the cache with this token's keys
            and values."""
            model = parts.merge(params, frozen)
            logits, cache = decode.step(model, tokens, index, cache, positions)
            return *pick(logits, sampling), cache

        self.prefill = jax.jit(prefill)
        self.step = jax.jit(step, donate_argnums=2)  # the cache is updated in place

    def generate(
        self,
        params: dict,
        frozen: dict,
        prompts: Sequence[Sample],
        *,
        max_new_tokens: int,
        stop_ids: frozenset[int] = frozenset(),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        keep_logits: bool = False,
    ) -> list[Answer]:
        """Answers to `prompts` (at most `shapes.rows`, each within `shapes.prompt_len`):
        `repeat` of each, prompt p's at p x repeat .. (p + 1) x repeat - 1.

        Args:
          params, frozen: the model's parameters as pure dicts (a train state's, or
            `load_run`'s); jax arrays in any sharding, or host arrays.
          max_new_tokens: at most this many new ids per prompt (the shapes' total length must
            hold each prompt and them).
          stop_ids: a row ends at the first of these.
          temperature, top_p, seed: sampling (temperature 0: greedy; see `decode.pick`).
          keep_logits: also return the logits of every step (tests).
        """
        check_prompt_ids(prompts, self.cfg.model.llm.vocab_size)
        g = self.repeat
        lengths = np.array([len(p.tokens) for p in prompts])
        if (lengths + max_new_tokens > self.shapes.total_len).any():
            raise ValueError(
                f"a prompt of {lengths.max()} tokens and {max_new_tokens} new ones do not fit "
                f"{self.shapes.total_len}"
            )
        mb = prompt_batch(prompts, self.shapes, self.cfg, self.specials)
        index = np.ones(self.shapes.rows, np.int32)  # (spare rows hold one token)
        index[: len(prompts)] = lengths
        # A new token's rotary position: one past the row's last (with M-RoPE, past the
        # largest of its three), then counting on with the index.
        last = mb["llm_positions"][:, 0].reshape(self.shapes.rows, self.shapes.prompt_len, -1)
        delta = np.array([last[b, :n].max() + 1 - n for b, n in enumerate(index)], np.int32)
        index, delta = np.repeat(index, g), np.repeat(delta, g)  # (each prompt's G rows)
        sampling = lambda i: (
            np.int32(seed),
            np.int32(i),
            np.float32(temperature),
            np.float32(top_p),
        )
        tiles = None
        if self.tiles:  # (each prompt row one causal document: its blocks' tiles)
            block, seg = self.cfg.batch.attention_block, mb["llm_segment_ids"]
            spans = mb.get("llm_spans")
            tiles = (from_segments(seg, block, True, self.tiles, spans=spans), None)
            if self.window_tiles:  # (and the sliding-window layers' own)
                reach = window_reach(self.cfg.model.llm.window.size, block)
                windowed = from_segments(seg, block, True, self.window_tiles, reach, spans)
                tiles = (tiles[0], windowed)
        token, logits, cache = self.prefill(params, frozen, mb, tiles, sampling(0))
        answers = [Answer([], False, [] if keep_logits else None) for _ in range(len(prompts) * g)]
        for i in range(max_new_tokens):
            picked, scores = np.asarray(token), (np.asarray(logits) if keep_logits else None)
            for b, answer in enumerate(answers):
                if answer.stopped:
                    continue
                answer.ids.append(int(picked[b]))
                answer.stopped = int(picked[b]) in stop_ids
                if keep_logits:
                    answer.logits.append(scores[b])
            if i + 1 == max_new_tokens or all(a.stopped for a in answers):
                break
            at = index + i
            token, logits, cache = self.step(
                params, frozen, cache, token, at, at + delta, sampling(i + 1)
            )
        return answers


def prefill_kind(cfg: Config) -> str:
    """The attention prefill scores prompts with: the run's kernel, resolved for these devices
    where it says `auto`; cuDNN's only where it runs (a Hopper GPU or newer), else block-sparse,
    the same attention (a run trained on GPUs generating on a CPU)."""
    kind = cfg.model.attention
    if kind in ("auto", "cudnn"):
        here, _ = auto_attention(cfg, jax.devices())
        kind = "block_sparse" if kind == "cudnn" and here != "cudnn" else here
    return kind


def check_prompt_ids(prompts: Sequence[Sample], vocab_size: int) -> None:
    """Refuses a prompt holding an id the model has no embedding row for (negative, or past
    the vocabulary: the lookup would read another row, or garbage, and answer anyway)."""
    for k, prompt in enumerate(prompts):
        tokens = np.asarray(prompt.tokens)
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        if bad.size:
            raise ConfigError(
                f"prompt {k + 1}: token id {int(bad[0])} is outside the model's vocabulary "
                f"(model.llm.vocab_size={vocab_size}: ids 0 to {vocab_size - 1}); give ids in "
                "that range"
            )


def held_bytes(cfg: Config, shapes: PromptShapes) -> int:
    """Bytes generation's programs hold at least, over all devices: prefill's attention
    scores where they are dense (fp32 [rows, heads, prompt, prompt]; block-sparse and cuDNN
    hold a tile's at a time) and the KV cache of every full-attention layer with keys of its
    own ([rows, kv heads, total length, head width] keys and values)."""
    llm = cfg.model.llm
    scores = shapes.rows * llm.heads * shapes.prompt_len**2 * 4
    scores = scores if prefill_kind(cfg) == "dense" else 0
    layers = llm.depth - llm.kv_shared_layers  # (those reuse another layer's cache)
    if llm.linear.enabled:  # (linear-attention layers carry a state, not a cache)
        layers = sum(not llm.linear.is_linear(i) for i in range(llm.depth))
    width = jnp.dtype(cfg.model.compute_dtype).itemsize * llm.head_width
    return scores + layers * 2 * shapes.rows * llm.kv_heads * shapes.total_len * width


def beyond_memory(cfg: Config, shapes: PromptShapes) -> tuple[int, int] | None:
    """(bytes needed, bytes there are) where generation at `shapes` holds more than the
    devices' memory (`held_bytes` against `memory_bytes`), else None: the generate command,
    the evaluation's sampled answers and the rollouts each refuse it naming their own
    settings, before allocating any of it."""
    need, have = held_bytes(cfg, shapes), memory_bytes()
    return (need, have) if have is not None and need > have else None


def memory_bytes() -> int | None:
    """The memory of all devices: each accelerator's limit; on CPU the host's memory (the
    devices share it). None where neither is known."""
    devices = jax.devices()  # (another process's hold no stats here: a local one's)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] * len(devices)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _whole(x: jax.Array) -> jax.Array:
    """`x` replicated under a mesh (the host reads it; on several processes a sharded array
    is not whole on any), as it is without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return x if mesh.empty else jax.lax.with_sharding_constraint(x, jax.P())
