"""`preference.reference: precomputed`: the reference policy's log-probs of every pair, computed
in one pass before training (TRL's `precompute_ref_log_probs`), so that training holds and runs
no reference model.

The pass is the training feed over the pairs not yet done (`Feed`: the run's planner at its
bucket shapes, this host's parts loaded, bucketized), each step forward only with the starting
weights; the sums come back whole on every process and fill a table [samples, 2] (chosen,
rejected) by sample index. Process 0 writes it under `<output_dir>/reference_logps/` with which
samples are done, every `SAVE_EVERY` steps and at the end, so a pass killed half way resumes
where it stopped; a finished table is read, never recomputed (a run resumed from a checkpoint
reads it too). The training feed then writes each pair's two sums on its documents' first
tokens (`llm_reference`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from jaxmllm.batch.bucketize import host_buckets, text_segments
from jaxmllm.batch.pairs import pair_slots
from jaxmllm.config import ConfigError
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.feed.iterator import Feed
from jaxmllm.plan.ragged import gather_items
from jaxmllm.resolve.run import Run
from jaxmllm.step.preference import pair_sums

log = logging.getLogger("jaxmllm")

SAVE_EVERY = 50  # steps of the pass between two writes of the table
MAX_PASSES = 4  # a pass needing more steps than this many times its share is stuck


def reference_table(
    run: Run,
    prog,
    weights: dict,
    out: Path,
    name: str = "train",
    source=None,
    index: LengthsIndex | None = None,
) -> np.ndarray:
    """The reference sums [samples, 2] of every pair of `index` (default the run's), by the
    starting `weights` ({"params", "frozen"}); read from `<out>/reference_logps/<name>.npy`
    where a pass finished, else computed (resuming a pass stopped half way)."""
    source = run.source if source is None else source
    index = run.index if index is None else index
    folder = Path(out) / "reference_logps"
    table, done = _read(folder, name, len(index))
    if done.all():
        return table
    left = np.flatnonzero(~done)
    log.info(
        "preference.reference: precomputed: the reference log-probs of %d of %d pairs (%s)",
        len(left),
        len(index),
        folder / f"{name}.npy",
    )
    step = jax.jit(_sums_step(prog), out_shardings=sharding.replicated(run.mesh))
    # (its batches bring no reference log-probs: those are what it computes)
    pref = dataclasses.replace(run.cfg.preference, reference="base")
    computing = dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, preference=pref))
    feed = Feed(computing, _Subset(source, left), subset(index, left), workers=0)
    steps, start = 0, time.perf_counter()
    most = MAX_PASSES * max(1, -(-len(left) // max(1, run.caps.devices * run.caps.microbatches)))
    try:
        while not done[left].all():
            if steps > most + 8:
                raise ConfigError(f"preference.reference: {int((~done).sum())} pairs never planned")
            plan = feed.plan()
            samples = feed.load(plan, feed.local_parts(plan))
            batch = feed.bucketize(plan, samples)
            batch["pair_sample"] = _slot_samples(run, plan, samples, batch, left)
            got = jax.device_get(step(weights, sharding.make_global_batch(batch, run.mesh)))
            _fill(table, done, *got)
            done[left[plan.samples]] = True  # (a sample that failed to load: done, zeros)
            steps += 1
            if steps % SAVE_EVERY == 0:
                _write(folder, name, table, done)
    finally:
        feed.close()
        _write(folder, name, table, done)
    log.info("reference log-probs of %d pairs in %.0f s", len(left), time.perf_counter() - start)
    return table


def _sums_step(prog):
    """(weights, batch) -> (each slot's (chosen, rejected) sums [M, D, K, 2], its sample)."""
    parts = prog.parts

    def step(weights, batch):
        """The reference's (chosen, rejected) sums of every slot of every microbatch, and the
        batch's pair sample ids beside them (popped from the batch: the model does not take
        them)."""
        batch = dict(batch)
        ids = batch.pop("pair_sample")

        def micro(mb):
            """One microbatch's (chosen, rejected) completion log-prob sums per pair slot [D, K,
            2]."""
            logps, _ = parts.merge(weights["params"], weights["frozen"]).token_logps_and_router(mb)
            s = pair_sums(logps, mb["llm_sequence"], mb["llm_loss_mask"])
            return jnp.stack([s.chosen, s.rejected], -1)

        return jax.lax.map(micro, batch), ids

    return step


def _slot_samples(run: Run, plan, samples, batch, left: np.ndarray) -> np.ndarray:
    """[M, D_local, K]: the sample index (into the whole data set) of each pair slot this host
    wrote (`pair_slots`: plan order within a bucket, as bucketize numbers them), -1 elsewhere."""
    m_n, d_n, r_n, l_n = batch["llm_tokens"].shape
    out = np.full((m_n, d_n, max(r_n * l_n // 2, 1)), -1, np.int32)
    _, home = host_buckets(run.caps, run.positions)
    ks, bucket, _ = text_segments(plan, samples, home, False, d_n, r_n)
    if len(ks):
        micro = plan.micro[ks]
        slot = pair_slots(micro * d_n + bucket[ks])
        out[micro, bucket[ks], slot] = left[plan.samples[ks]]
    return out


def _fill(table: np.ndarray, done: np.ndarray, sums: np.ndarray, ids: np.ndarray) -> None:
    """Writes the (chosen, rejected) sums of each slot holding a pair into `table` at its sample
    id (slots without one, id -1, left out)."""
    ids, sums = np.asarray(ids).reshape(-1), np.asarray(sums).reshape(-1, 2)
    table[ids[ids >= 0]] = sums[ids >= 0]


def subset(index: LengthsIndex, ids: np.ndarray) -> LengthsIndex:
    """The index's rows `ids`, in that order."""
    items = {}
    for name, it in index.items.items():
        owner, _, flat = gather_items(it.ptr, ids)
        counts = np.bincount(owner, minlength=len(ids))
        items[name] = Items(
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), it.sizes[flat]
        )
    return LengthsIndex(index.text[ids], items, split=index.split_rows(ids))


class _Subset:
    """A source's samples `ids` as a source of their own (what the feed loads)."""

    def __init__(self, source, ids: np.ndarray):
        """The subset of `source` at these sample ids, in this order."""
        self.source, self.ids = source, np.asarray(ids, np.int64)

    def __len__(self) -> int:
        """The samples in the subset."""
        return len(self.ids)

    def __getitem__(self, i: int):
        """The subset's sample `i`: the source's sample `ids[i]`."""
        return self.source[int(self.ids[int(i)])]

    def load(self, i: int, keep=None):
        """The subset's sample `i` as the loader takes it (`keep`: the items this host encodes)."""
        return self.source.load(int(self.ids[int(i)]), keep)

    def record_id(self, i: int):
        """The record id of the subset's sample `i`, for reject messages."""
        return self.source.record_id(int(self.ids[int(i)]))

    def __getattr__(self, name: str):  # (specials, rejects: the source's own)
        if name in ("source", "ids"):
            raise AttributeError(name)
        return getattr(self.source, name)


def _read(folder: Path, name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The saved table of `name` ([n, 2] sums and which are done) from an earlier, interrupted
    pass, or a fresh one when there is none or it does not match the data's n pairs."""
    path, flags = folder / f"{name}.npy", folder / f"{name}.done.npy"
    if path.is_file() and flags.is_file():
        table, done = np.load(path), np.load(flags)
        if table.shape == (n, 2) and done.shape == (n,):
            return table.astype(np.float32), done.astype(bool)
        log.warning("%s holds %d pairs, the data %d: computed again", path, len(table), n)
    return np.zeros((n, 2), np.float32), np.zeros(n, bool)


def _write(folder: Path, name: str, table: np.ndarray, done: np.ndarray) -> None:
    """The table and its done flags, each written whole then renamed (process 0 only)."""
    if jax.process_index() != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for suffix, array in ((".npy", table), (".done.npy", done)):
        tmp = folder / f"{name}.tmp{suffix}"
        np.save(tmp, array)
        tmp.replace(folder / f"{name}{suffix}")
    meta = {"pairs": int(len(done)), "done": int(done.sum())}
    (folder / f"{name}.json").write_text(json.dumps(meta) + "\n")
