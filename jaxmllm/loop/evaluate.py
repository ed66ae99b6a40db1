"""Evaluation during training: a fixed held-out set, planned and shaped like training steps.

`data.eval` names the set: a held-out share of the built-in synthetic source (its samples
`num_samples`, `num_samples + 1`, ...: generated like the training samples, from indices the
training index never holds), or a manifest / ArrayRecord file with its own lengths index. At
start-up the set goes through the training feed (`jaxmllm.feed.iterator.Feed`: the run's own
planner at the run's own bucket shapes, this host's parts loaded, bucketized) into step batches,
until every sample has been planned (a sample the planner brings
again in a later step of the pass counts once); so the eval step takes the train step's batch
shapes and compiles once, and every evaluation sees exactly the same batches.

Every `train.eval_every` steps and at the last step the `Evaluator` runs the set forward with the
current parameters and writes, into metrics.jsonl and TensorBoard:

- `eval/loss`, `eval/accuracy`: mean token cross entropy and the share of loss tokens whose most
  likely token is the target, over the whole set (token-weighted, as the training loss);
- `eval/loss/<mix>`, `eval/accuracy/<mix>`: the same per modality mix of the samples (`text`,
  `image`, `audio`, `image_audio`; only mixes the set has);
- greedy answers to the set's first `data.eval.questions` prompts (`jaxmllm.loop.answers`): logged,
  scored (`eval/answers/*`), and printed as a table at the end of the run.

Evaluation reads the parameters and nothing else of the run: no data iterator, no RNG, no
optimizer state, so the training losses are the same with and without it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from jaxmllm.batch.bucketize import host_buckets, text_segments
from jaxmllm.config import Config, ConfigError, keep_origin
from jaxmllm.config.phases import ENCODERS
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.rejects import append_rejects
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.feed.iterator import Feed
from jaxmllm.loop.answers import Questions
from jaxmllm.plan.contract import OversizeError, StepPlan
from jaxmllm.resolve.run import Run
from jaxmllm.step.preference import eval_pair_metrics, make_preference_eval_step
from jaxmllm.step.program import ModelParts, Program

log = logging.getLogger("jaxmllm")

# A sample's modality mix: bit i set when it has items of encoder phase i ("text": none; else
# the items joined: image, audio, image_audio, ...)
MIXES = tuple(
    "_".join(p.item for i, p in enumerate(ENCODERS) if mask >> i & 1) or "text"
    for mask in range(1 << len(ENCODERS))
)
MAX_PASSES = 4  # a pass that needs more steps than this many times the set's share is stuck


# ----------------------------------------------------------------------------- the set


class HeldOut:
    """The synthetic samples after the training range: `held[i]` = synthetic sample
    `num_samples + i`, which no training step can draw."""

    def __init__(self, cfg: Config):
        """A synthetic source of num_samples + data.eval.samples samples, and the lengths index
        of those past num_samples: the held-out share."""
        syn, n = cfg.data.synthetic, cfg.data.synthetic.num_samples
        more = dataclasses.replace(syn, num_samples=n + cfg.data.eval.samples)
        self.source = SyntheticSource(
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, synthetic=more))
        )
        self.start, self.specials = n, self.source.specials
        every = self.source.lengths()
        self.index = LengthsIndex.from_records([every.record(i) for i in range(n, len(every))])

    def __len__(self) -> int:
        """The held-out samples (data.eval.samples)."""
        return len(self.index)

    def __getitem__(self, i: int):
        """Held-out sample `i`: synthetic sample num_samples + i."""
        return self.source[self.start + int(i)]

    def load(self, i: int, keep=None):
        """Held-out sample `i` as the loader takes it (`keep`: the items this host encodes)."""
        return self.source.load(self.start + int(i), keep)


def eval_source(cfg: Config):
    """The eval set's source (`source[i]` -> Sample) and its lengths index."""
    e = cfg.data.eval
    if e.source == "synthetic":
        held = HeldOut(cfg)
        return held, held.index
    from jaxmllm.data.source import open_source

    # (its media paths lead as data.eval's index read them: `jaxmllm.data.datasets.eval_set`)
    data = dataclasses.replace(
        cfg.data, source=e.source, path=e.path, format=e.format, index_dir=e.index_dir, sources=()
    )
    try:
        full = open_source(keep_origin(dataclasses.replace(cfg, data=data), cfg))
    except ConfigError as err:
        raise ConfigError(f"data.eval: {err}") from None
    n = len(full) if not e.samples else min(e.samples, len(full))
    source = full.head(n)
    return source, source.index


def sample_mixes(index: LengthsIndex) -> np.ndarray:
    """Each sample's modality mix, an index into MIXES."""
    mix = np.zeros(len(index), np.int32)
    for i, p in enumerate(ENCODERS):
        mix += (index.items[p.name].count() > 0).astype(np.int32) << i
    return mix


def plan_set(
    run: Run, source, index: LengthsIndex, reference=None
) -> tuple[list[dict], list[dict], list[int]]:
    """The set's step batches (this host's rows, with `eval_mix`: each token's sample's mix,
    -1 for tokens not counted): the training feed over the set (`Feed`: the run's planner at
    its shapes, this host's parts loaded, bucketized), until every sample has been planned;
    and the load-time rejects of this host's samples, as entries of a rejects log (written by
    the caller: `Evaluator.write_rejects`); and each batch's ladder variant (its model:
    `Program.parts_of`)."""
    try:  # (loaded in this process: the set is loaded once, at start-up)
        feed = Feed(run, source, index, workers=0, write_rejects=False, reference=reference)
    except OversizeError as e:
        raise ConfigError(f"data.eval: a sample does not fit the run's buckets: {e}") from None
    caps = run.caps
    mixes, seen, batches, variants = sample_mixes(index), np.zeros(len(index), bool), [], []
    steps_per_pass = max(1, -(-len(index) // max(1, caps.devices * caps.microbatches)))
    while not seen.all():
        if len(batches) > MAX_PASSES * steps_per_pass + 8:
            raise ConfigError(f"data.eval: {int((~seen).sum())} samples were never planned")
        plan = feed.plan()
        samples = feed.load(plan, feed.local_parts(plan))
        variants.append(plan.variant)
        if run.cfg.train.objective == "dpo":  # pairs: each counted once, by its own sums
            batch = feed.bucketize(plan, samples)
            count_once(plan, samples, caps.at(plan.variant), run.positions, batch, seen)
            batches.append(batch)
            continue
        batch = feed.bucketize(plan, samples)
        view = caps.at(plan.variant)  # (a context degree per step: the variant's groups)
        batch["eval_mix"] = _token_mixes(plan, samples, view, run.positions, batch, mixes, seen)
        batches.append(batch)
    feed.close()
    return batches, ([] if feed.loader is None else feed.loader.log.take_entries()), variants


def count_once(plan: StepPlan, samples, caps, positions, batch, seen) -> None:
    """Pairs: the loss mask of a sample the pass already brought (an earlier step, or earlier
    in this one) zeroed, so that it sums no token and counts as no pair; marks `seen`."""
    _, home = host_buckets(caps, positions)
    for k, s in enumerate(plan.samples.tolist()):
        again, seen[s] = bool(seen[s]), True
        bucket, sample = int(home[plan.device[k]]), samples.get(s)
        if again and bucket >= 0 and sample is not None:
            at = int(plan.offset[k])
            span = slice(at, at + len(sample.tokens))
            batch["llm_loss_mask"][plan.micro[k], bucket, plan.row[k], span] = 0


def _token_mixes(plan: StepPlan, samples, caps, positions, batch, mixes, seen) -> np.ndarray:
    """[M, D_local, R, L]: the mix of each token's sample, -1 for padding and for a sample the
    pass already brought (each sample counts once), read off the segment ids bucketize wrote
    (`text_segments`: a sample's id in its row, or in its context group's rows); marks the
    plan's samples `seen`."""
    first = np.zeros(len(plan.samples), bool)
    for k, s in enumerate(plan.samples.tolist()):  # (a small set may come twice in a step)
        first[k], seen[s] = not seen[s], True  # (every host walks the whole plan: they agree)
    segments = batch["llm_segment_ids"]
    m_n, d_n, r_n, _ = segments.shape
    grouped = caps.context > 1
    _, home = host_buckets(caps, positions)
    ks, bucket, seg = text_segments(plan, samples, home, grouped, d_n // caps.context, r_n)
    rows = np.zeros(len(ks), np.int64) if grouped else plan.row[ks]
    table = np.full((m_n, d_n // caps.context, 1 if grouped else r_n, seg.max(initial=0) + 1), -1)
    table[plan.micro[ks], bucket[ks], rows, seg] = np.where(first[ks], mixes[plan.samples[ks]], -1)
    m = np.arange(m_n)[:, None, None, None]
    b = (np.arange(d_n) // caps.context)[None, :, None, None]  # (a host holds whole groups)
    r = np.zeros((1, 1, r_n, 1), np.int64) if grouped else np.arange(r_n)[None, None, :, None]
    return np.where(segments > 0, table[m, b, r, segments], -1).astype(np.int32)


# ----------------------------------------------------------------------------- the eval step


def token_scores(decoder, h_dnw: jax.Array, targets_dn: jax.Array) -> tuple[jax.Array, ...]:
    """Per token: cross entropy and whether the most likely token is the target, [D, N] each;
    the logits are projected `decoder.logits_chunk` tokens at a time, as the training loss."""
    d, n, width = h_dnw.shape
    chunk = min(decoder.logits_chunk, n)
    pad = -n % chunk
    h_dnw = jnp.pad(h_dnw, ((0, 0), (0, pad), (0, 0)))
    targets_dn = jnp.pad(targets_dn, ((0, 0), (0, pad)))

    def one(xs):
        """One chunk of tokens: their logits in fp32, the cross entropy of each target and
        whether the argmax is the target."""
        h_dcw, targets_dc = xs
        logits = decoder.logits(h_dcw).astype(jnp.float32)  # [D, chunk, vocab]
        target = jnp.take_along_axis(logits, targets_dc[..., None], axis=-1)[..., 0]
        loss = jax.nn.logsumexp(logits, axis=-1) - target
        return loss, (jnp.argmax(logits, axis=-1) == targets_dc).astype(jnp.float32)

    slices = lambda x: jnp.moveaxis(x.reshape(d, -1, chunk, *x.shape[2:]), 1, 0)
    loss, correct = jax.lax.map(one, (slices(h_dnw), slices(targets_dn)))
    unslice = lambda x: jnp.moveaxis(x, 0, 1).reshape(d, -1)[:, :n]
    return unslice(loss), unslice(correct)


def make_eval_step(parts: ModelParts, mesh=None):
    """(params, frozen, step batch [M, D, ...] with `eval_mix`) -> [3, len(MIXES)]: per mix the
    summed loss, correct tokens and loss tokens, over all microbatches."""

    def eval_step(params, frozen, batch):
        """The [3, mixes] sums (loss, correct tokens, loss tokens per modality mix) over the
        batch's microbatches; `eval_mix` says each token's mix (-1: not counted)."""
        batch = dict(batch)
        mix = batch.pop("eval_mix")

        def microbatch(total, xs):
            """Adds one microbatch's per-mix sums of loss, correct tokens and loss tokens (its
            loss mask the weight) to the running total."""
            mb, mix_drl = xs
            model = parts.merge(params, frozen)
            h_drlw = model.hidden(mb)
            d, width = h_drlw.shape[0], h_drlw.shape[-1]
            targets = mb["llm_targets"].reshape(d, -1)
            loss, correct = token_scores(model.llm, h_drlw.reshape(d, -1, width), targets)
            weight = mb["llm_loss_mask"].reshape(d, -1).astype(jnp.float32)
            share_dnk = jax.nn.one_hot(mix_drl.reshape(d, -1), len(MIXES)) * weight[..., None]
            sums = jnp.stack(
                [
                    jnp.einsum("dn,dnk->k", loss, share_dnk),
                    jnp.einsum("dn,dnk->k", correct, share_dnk),
                    share_dnk.sum((0, 1)),
                ]
            )
            return total + sums, None

        zero = jnp.zeros((3, len(MIXES)), jnp.float32)
        total, _ = jax.lax.scan(microbatch, zero, (batch, mix))
        return total

    # (the sums come back whole on every process)
    return jax.jit(eval_step, out_shardings=None if mesh is None else sharding.replicated(mesh))


def eval_metrics(sums: np.ndarray) -> dict[str, float]:
    """The metrics row of the summed [3, mixes] (loss, correct, tokens)."""
    loss, correct, tokens = np.asarray(sums, np.float64)
    row = {
        "eval/loss": float(loss.sum() / max(tokens.sum(), 1.0)),
        "eval/accuracy": float(correct.sum() / max(tokens.sum(), 1.0)),
    }
    for k, mix in enumerate(MIXES):
        if tokens[k]:
            row[f"eval/loss/{mix}"] = float(loss[k] / tokens[k])
            row[f"eval/accuracy/{mix}"] = float(correct[k] / tokens[k])
    return row


# ----------------------------------------------------------------------------- the evaluator


class Evaluator:
    """The eval set on the run's mesh: its batches, the compiled eval step, the questions."""

    def __init__(self, run: Run, prog: Program, out: Path):
        """Plans the eval set into step batches at the run's shapes (its rejects kept for
        `write_rejects`), compiles nothing yet: the eval step (token scores, or pair metrics for
        preference runs) compiles on its first call; the questions' prompts when
        data.eval.questions asks."""
        cfg = run.cfg
        e = cfg.data.eval
        self.cfg, self.mesh = cfg, run.mesh
        self.every, self.last = cfg.train.eval_every, cfg.train.steps
        source, index = eval_source(cfg)
        rank = jax.process_index()
        name = "rejects.eval.jsonl" if rank == 0 else f"rejects.eval.process{rank}.jsonl"
        self.rejects_file = out / name
        # (preference.reference: precomputed: the held-out pairs' own, `init_from`)
        reference = (run.reference_logps or {}).get("eval")
        self.batches, self.rejects, self.variants = plan_set(run, source, index, reference)
        self.pairs = cfg.train.objective == "dpo"
        # (per model: a context degree per step gives the long variants' their own)
        models = {v: prog.parts_of(v) for v in set(self.variants)}
        if self.pairs:  # (the sums come back whole on every process)
            out = sharding.replicated(run.mesh)
            self.steps = {
                v: jax.jit(make_preference_eval_step(cfg, parts), out_shardings=out)
                for v, parts in models.items()
            }
        else:
            self.steps = {v: make_eval_step(parts, run.mesh) for v, parts in models.items()}
        self.questions = Questions(cfg, source, e.questions) if e.questions else None
        self.seconds = 0.0  # the last evaluation's time
        log.info(
            "eval set: %d samples of data.eval (%s) in %d steps; %d questions",
            len(index),
            e.source,
            len(self.batches),
            0 if self.questions is None else len(self.questions.prompts),
        )

    def write_rejects(self) -> None:
        """Writes the set's load-time rejects (this host's) to `rejects_file`, replacing the
        last start's: every start plans the same set, so appending listed each reject once a
        start. The trainer calls it once the resume checks passed and the state is restored,
        as it writes config.json: a run refused at start-up leaves its folder as it was."""
        self.rejects_file.unlink(missing_ok=True)
        append_rejects(self.rejects_file, self.rejects)

    def due(self, step: int) -> bool:
        """Whether step `step` (just done) is evaluated: every `eval_every`, and the last."""
        return step == self.last or (self.every > 0 and step % self.every == 0)

    def __call__(self, state: dict, step: int) -> dict[str, float]:
        """Evaluates the state after step `step`: the metrics row (and the answers, logged;
        at the last step printed with their accuracy). `seconds` is then the time it took,
        from when the step was done."""
        jax.block_until_ready(state["params"])
        start = time.perf_counter()
        total = 0.0
        for host_batch, variant in zip(self.batches, self.variants, strict=True):
            batch = sharding.make_global_batch(host_batch, self.mesh)
            weights = (state["params"], state["frozen"])
            if self.pairs:
                weights = (*weights, state.get("reference", {}))
            scores = self.steps[variant](*weights, batch)
            total = total + np.asarray(jax.device_get(scores), np.float64)
        row = eval_pair_metrics(total) if self.pairs else eval_metrics(total)
        if self.questions is not None:
            results = self.questions.ask(state["params"], state["frozen"], step)
            row.update(self.questions.metrics(results))
            if jax.process_index() == 0:
                self.questions.log(results, step)
                if step == self.last:
                    print(self.questions.report(results, step))
        self.seconds = time.perf_counter() - start
        return row


def open_evaluator(run: Run, prog: Program, out: Path):
    """The run's `Evaluator`, or None without data.eval.source."""
    cfg = run.cfg
    if cfg.data.eval.source == "none":
        if cfg.train.eval_every:
            log.warning(
                "train.eval_every=%d but data.eval.source is none: no evaluation",
                cfg.train.eval_every,
            )
        return None
    return Evaluator(run, prog, out)
