"""Online RL's feed (`train.objective: grpo`): rollouts sampled from the policy being trained,
scored, and packed into the step's fixed-shape buckets by the planner like any sample.

    prompts (the data set, split at their answers) -> generate G each (the policy now)
        -> rewards -> group advantages -> samples -> planner -> bucketize -> the GRPO step

`RolloutIterator` stands where the training feed stands in the loop (`next()` -> {"batch",
"info"}), so the loop's checkpoints, guards, metrics and preemption serve RL unchanged. At a
rollout's start it takes `rl.prompts_per_step` prompts (a sample's tokens before its first
learned one, its media with them; the learned ones are its answer, what `exact_answer` and the
other rewards compare with), generates `rl.group_size` completions of each with the state's
current weights (`jaxmllm.step.generate.Generator`: prefill and a KV-cache decode step at
shapes rounded up, so a few programs serve every rollout), scores them
(`jaxmllm.data.rewards`), and turns each prompt's group into one sample of G documents
(`group_samples`): the prompt and each completion a document, the completions learned, each
one's advantage on its tokens, the prompt's media listed once (the step encodes them once and
their rows fill every document's slots). The feed's own stages then plan them (the run's
planner, over an index of the rollout alone), load them from memory, bucketize and count them:
every group is packed into a row, balanced over devices and microbatches, and brought exactly
once (a set smaller than a step may be planned twice: the
second copy's loss mask is zeroed, as evaluation does). A rollout the step's buckets cannot hold
at once trains over as many steps as the planner needs, and `rl.updates_per_rollout` times
over; where that makes more than one step, the sampling policy's log-probs of every batch are
computed before the first (`llm_old_logps`), so each step's ratio is against the policy that
sampled.

Resuming is exact: prompts come in an order drawn per epoch from `data.seed`, and sampling's
key from the seed and the rollout's number, so a rollout is a function of the weights that
sampled it; checkpoints are taken at rollout boundaries only (`at_boundary`: the loop defers a
periodic save, and a preemption, to the rollout's end), where the state is the rollout number
and the prompt cursor. Every process generates the whole rollout (one SPMD program over the
mesh, the same keys: the same completions on every process), scores it and plans it, then
bucketizes only its own positions' rows, as the training feed does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import grain
import jax
import numpy as np

import sharding
from jaxmllm.batch.prompts import PromptShapes, split_answer
from jaxmllm.config import ConfigError
from jaxmllm.config.phases import ENCODERS, LLM
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.rewards import Rewards, group_advantages
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.template import make_template
from jaxmllm.feed.iterator import StepIterator
from jaxmllm.loop.evaluate import count_once
from jaxmllm.plan.contract import bucket_tile_caps, span_extras
from jaxmllm.plan.state import PlanStateError
from jaxmllm.plan.tiles import packed_tiles
from jaxmllm.resolve.run import Run
from jaxmllm.step.generate import Generator, beyond_memory
from jaxmllm.step.grpo import make_logps_program

log = logging.getLogger("jaxmllm")

MAX_PROMPT_SCAN = 8  # epochs of the data scanned for prompts before a rollout gives up
# Most steps a rollout's completion waits in the balancer (`Balancer.max_age`; 4 on the endless
# training stream): a rollout is a finite set, and a completion deferred takes a step with it
ROLLOUT_MAX_AGE = 2


def drain(planner) -> None:
    """Sets a planner to plan a finite set: the balancer reads no sample past the set's end
    (the endless stream's next epoch filled a step's room with repeats, leaving a straggler
    to a step of its own) and its samples wait at most ROLLOUT_MAX_AGE steps; a planner
    without deferral is left as it is (bench.rollouts: ai2d's 1,024 completions at 8 devices
    took 4 steps at goodput 0.48 before, 2 at 0.95 now, as grain's packer's 2 at 0.94)."""
    if hasattr(planner, "max_age"):
        planner.max_age = min(planner.max_age, ROLLOUT_MAX_AGE)
    if hasattr(planner, "finite"):
        planner.finite = True


class RolloutSource:
    """A rollout's samples as a random-access source (`source[i]`), held in memory."""

    def __init__(self, samples: list[Sample], specials):
        """`specials`: the tokenizer's ids (bucketize pads with them, finds slots by them)."""
        self.samples, self.specials = samples, specials

    def __len__(self) -> int:
        """The rollout's completions."""
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        """Completion i's sample (a copy: a loader may drop items of it in place)."""
        s = self.samples[int(i)]
        return dataclasses.replace(s, media={p: list(v) for p, v in s.media.items()})


def group_samples(
    prompt: Sample,
    completions: list[np.ndarray],
    advantages,
    fits: Callable[[list[int]], bool],
    first_id: int = 0,
) -> list[Sample]:
    """A prompt's group of completions as samples: one sample of a document per completion
    (the prompt, then the completion, learned), its media listed once and its advantages one
    a document, so the step encodes the prompt's images once for the whole group and their
    rows fill each document's slots (`models.mllm.fill_slots`). A sample is one row of one
    bucket: where the group's documents (their tokens: `fits`, `RolloutIterator.room`) overrun
    it, the completions in order make as few samples as it holds (each encoding the media
    once); ids count from `first_id`, one a completion."""
    out, chunk = [], []
    n = len(prompt.tokens)
    for k, ids in enumerate(completions):
        if chunk and not fits([n + len(x) for _, x in chunk] + [n + len(ids)]):
            out.append(_group_sample(prompt, chunk, advantages, first_id))
            chunk = []
        chunk.append((k, ids))
    if chunk:
        out.append(_group_sample(prompt, chunk, advantages, first_id))
    return out


def fits_bucket(sizes: list[int], caps, spans: int = 0) -> bool:
    """Whether documents of `sizes` LLM tokens fit one sample of `caps`: one row, and, with
    attention tiles, laid out from the row's start (their tiles back to back, `spans` more
    each: a document's bidirectional spans'), the base step's LLM tiles of a bucket."""
    n = np.asarray(sizes, np.int64)
    cap = bucket_tile_caps(caps, 0)[LLM]
    if n.sum() > caps.group_row_len:
        return False
    if not (cap and caps.attention_block):
        return True
    tiles = packed_tiles(np.cumsum(n) - n, n, caps.attention_block, True).sum()
    return int(tiles) + spans * len(n) <= cap


def _group_sample(prompt: Sample, chunk: list, advantages, first_id: int) -> Sample:
    """One sample of the completions `chunk` [(k, ids)] of `prompt`, a document each."""
    n = len(prompt.tokens)
    tokens = np.concatenate([t for _, ids in chunk for t in (prompt.tokens, ids)])
    loss = np.concatenate(
        [t for _, ids in chunk for t in (np.zeros(n, bool), np.ones(len(ids), bool))]
    )
    documents = tuple(n + len(ids) for _, ids in chunk) if len(chunk) > 1 else ()
    advantage = tuple(float(advantages[k]) for k, _ in chunk)
    return dataclasses.replace(
        prompt,
        id=first_id + chunk[0][0],
        tokens=tokens.astype(np.int32),
        loss=loss,
        documents=documents,
        advantage=advantage if len(chunk) > 1 else advantage[0],
    )


def rollout_index(samples: list[Sample], specials) -> LengthsIndex:
    """The planner's lengths of a rollout's samples: text tokens (placeholders left out, one
    copy of them: a group's media are encoded once, `LengthsIndex.split`), each encoder item's
    units, and a group's documents."""
    media = {p.name: np.asarray(specials.phase_ids(p.name)) for p in ENCODERS}
    records = []
    for s in samples:
        held = sum(int(np.isin(s.tokens, ids).sum()) for ids in media.values())
        copies = max(len(s.documents), 1)
        record = {"text": len(s.tokens) - held // copies}
        record.update({p.items: [len(m[0]) for m in s.media[p.name]] for p in ENCODERS})
        if s.documents:
            record["documents"] = list(s.documents)
        records.append(record)
    return LengthsIndex.from_records(records)


def spill(index: LengthsIndex, caps, steps: int, rollout: int) -> str:
    """Why rollout `rollout` took `steps` steps (`index`: its samples' lengths), and the rows
    that would hold one like it in one step: said once a run (a rollout's later steps train
    off-policy, the ratio correcting them, and each costs a whole step)."""
    buckets = caps.devices * caps.microbatches
    tokens = int(index.llm_tokens(caps.per_token).sum())
    holds = caps.llm_rows * caps.llm_row_len * buckets
    what = [
        f"{tokens} LLM tokens in all, where a step holds {holds} (batch.llm_rows="
        f"{caps.llm_rows} x batch.llm_row_len={caps.llm_row_len} x {buckets} buckets of the "
        f"devices and microbatches)"
    ]
    for name, units in index.units().items():  # (an encoder's bucket may be what overflowed)
        need, room = int(units.sum()), caps.units.get(name, 0) * buckets
        if need and need > room // 2:
            what.append(f"{need} {name} units, where a step's {name} buckets hold {room}")
    # (packing leaves a row's tail empty: a quarter more rows than the tokens fill; and the
    # step's other bounds, its attention tiles and encoder buckets, may defer before the rows
    # are full: at least one row more than now)
    rows = max(-(-tokens * 5 // (4 * caps.llm_row_len * buckets)), caps.llm_rows + 1)
    return (
        f"rollout {rollout} took {steps} training steps: its prompts and completions are "
        f"{'; '.join(what)}; what a step could not take (its rows, attention tiles or encoder "
        f"buckets full) went on to the next. A rollout's later steps train off-policy (the "
        f"ratio corrects them) and each costs a whole step: to train each rollout in one step "
        f"raise batch.llm_rows to {rows} or more, or lower rl.prompts_per_step or "
        f"rl.group_size (said once)"
    )


@dataclasses.dataclass
class Prompt:
    """One prompt of the data set: its sample cut before the answer, and what rewards read."""

    index: int  # the data set's sample
    sample: Sample
    record: dict  # {"id", "prompt", "answer"}: a reward function's view of the record


class RolloutIterator(grain.DatasetIterator):
    """The loop's feed under `train.objective: grpo` (the module's docstring); a grain
    iterator, so its state is checkpointed as the training feed's is."""

    def __init__(self, run: Run, prog, policy: Callable[[], dict]):
        """`policy()`: the train state's current weights ({"params", "frozen"}), read at each
        rollout's start."""
        super().__init__()
        self.run, self.cfg, self.policy = run, run.cfg, policy
        self.rl = run.cfg.rl
        self.template = make_template(run.cfg)
        self.specials = self.template.specials
        self.rewards = Rewards(self.rl.rewards)
        self.generators: dict[tuple, Generator] = {}
        self.logps = jax.jit(make_logps_program(run.cfg, prog.parts))
        self.rollout, self.cursor = 0, 0  # the next rollout's number, the prompts' cursor
        self.pending: list[dict] = []  # the rollout's steps not trained yet
        self.skipped_prompts = 0
        self.spill_said = False  # (a rollout over several steps: said once a run, `spill`)
        self.order: tuple[int, np.ndarray | None] = (-1, None)  # (epoch, its prompt order)
        self.started = self.position()  # the state at the current rollout's start
        # What the last `next` spent sampling, scoring and planning a rollout (0 inside one):
        # the devices generated meanwhile, so the loop does not count it as waiting on data
        self.sampling_s = 0.0
        self.check_fits()

    # ------------------------------------------------------------------ the loop's interface

    @property
    def at_boundary(self) -> bool:
        """Whether the last rollout's steps are all trained (a checkpoint may be taken)."""
        return not self.pending

    def __iter__(self):
        """Itself (an iterator)."""
        return self

    def __next__(self) -> dict:
        """The next step of the current rollout ({"batch": device arrays, "info"}), a new
        rollout sampled first when the last one's steps are all taken."""
        self.sampling_s = 0.0
        if not self.pending:
            start = time.perf_counter()
            self.pending = self.roll()
            self.sampling_s = time.perf_counter() - start
        return self.pending.pop(0)

    def position(self) -> dict:
        """The next rollout's number, the prompts' cursor and the prompts skipped so far."""
        return {"rollout": self.rollout, "cursor": self.cursor, "skipped": self.skipped_prompts}

    def get_state(self) -> dict:
        """What a checkpoint keeps: at a boundary, the next rollout's position; inside a
        rollout (the run's last step, or a non-finite stop: the loop saves periodically only at
        boundaries), the current one's start, which a resumed run samples again."""
        return self.started if self.pending else self.position()

    def set_state(self, state: dict) -> None:
        """Restores a checkpoint's state (the next rollout is the one it names)."""
        try:
            self.rollout, self.cursor = int(state["rollout"]), int(state["cursor"])
        except (KeyError, TypeError, ValueError):
            raise PlanStateError(
                f"the checkpoint's data state is not a rollout's (train.objective: grpo): "
                f"{state!r:.80}"
            ) from None
        self.skipped_prompts = int(state.get("skipped", 0))
        self.pending, self.started = [], self.position()

    # ------------------------------------------------------------------ a rollout

    def check_fits(self) -> None:
        """A completion is its prompt and up to `rl.max_new_tokens` more in one row: the
        data's longest sample (a prompt is shorter) and that many must fit a row."""
        row = self.run.spec.group_row_len
        longest = int(self.run.index.llm_tokens(self.run.caps.per_token).max(initial=0))
        if longest + self.rl.max_new_tokens > row:
            raise ConfigError(
                f"rl.max_new_tokens={self.rl.max_new_tokens}: a prompt of the data (up to "
                f"{longest} tokens) and its completion must fit one row of "
                f"batch.llm_row_len={row} tokens; raise batch.llm_row_len to at least "
                f"{longest + self.rl.max_new_tokens}, or lower rl.max_new_tokens"
            )

    def prompts(self) -> list[Prompt]:
        """The next `rl.prompts_per_step` prompts from the cursor, in the epoch's order (a
        sample without a prompt or an answer, or one that fails to load, is skipped, counted)."""
        source, n = self.run.source, len(self.run.source)
        out: list[Prompt] = []
        scanned = 0
        while len(out) < self.rl.prompts_per_step:
            if scanned > MAX_PROMPT_SCAN * n:
                raise ConfigError(
                    "train.objective: grpo: no sample of the data splits into a prompt and an "
                    "answer (a prompt: tokens before the first learned one); give records with "
                    "a user turn and an answer"
                )
            epoch, k = divmod(self.cursor, n)
            if self.order[0] != epoch:  # (drawn once an epoch)
                self.order = (
                    epoch,
                    np.random.default_rng([self.cfg.data.seed, epoch, 7]).permutation(n),
                )
            i = int(self.order[1][k])
            self.cursor, scanned = self.cursor + 1, scanned + 1
            try:
                split = split_answer(source[i], self.specials)
            except RecordError as e:
                log.warning("rollout prompt %d skipped: %s", i, e)
                split = None
            if split is None:
                self.skipped_prompts += 1
                continue
            prompt, answer = split
            rid = source.record_id(i) if hasattr(source, "record_id") else i
            # (the answer's text as the record gives it: not the template's newline after its
            # end-of-turn token, which the answer's learned tokens hold)
            answer_text = self.text(answer).strip()
            record = {"id": rid, "prompt": self.text(prompt.tokens), "answer": answer_text}
            out.append(Prompt(i, prompt, record))
        return out

    def text(self, ids: np.ndarray) -> str:
        """What a reward reads of a prompt's or an answer's ids: their text without BOS,
        padding and the media placeholders (a prompt's image is hundreds of them)."""
        sp = self.specials
        hidden = [i for i in (sp.bos, sp.pad, *sp.media.values()) if i is not None]
        return self.template.decode(np.asarray(ids)[~np.isin(ids, hidden)])

    def generator(self, prompts: list[Sample]) -> Generator:
        """The generator of these prompts' shapes (rounded up: a few serve every rollout),
        answering each `rl.group_size` times from one prefill (a prompt's media encoded once)."""
        shapes = PromptShapes.fit(prompts, self.cfg, self.rl.max_new_tokens)
        key = (shapes.rows, shapes.prompt_len, shapes.total_len, tuple(shapes.units.items()))
        if key not in self.generators:
            decoded = dataclasses.replace(shapes, rows=shapes.rows * self.rl.group_size)
            if short := beyond_memory(self.cfg, decoded):  # (refused before allocating any)
                need, have = short
                raise ConfigError(
                    f"a rollout's KV cache ({decoded.rows} rows of {shapes.total_len} "
                    f"positions: prompts and rl.max_new_tokens={self.rl.max_new_tokens}) needs "
                    f"{need / 1e9:.1f} GB, more than the devices' {have / 1e9:.1f} GB; lower "
                    "rl.prompts_per_step, rl.group_size or rl.max_new_tokens"
                )
            g = self.rl.group_size
            self.generators[key] = Generator(self.cfg, shapes, self.specials, repeat=g)
        return self.generators[key]

    def room(self, prompt: Sample) -> Callable[[list[int]], bool]:
        """Whether documents of these LLM tokens, each `prompt` and a completion, fit one
        sample: one row of `batch.llm_row_len` tokens, and, with attention tiles, within a
        bucket's LLM tile capacity laid out from the row's start (their tiles back to back,
        and each document's bidirectional spans'), so the planner can always place it."""
        caps = self.run.caps
        extra = span_extras(rollout_index([prompt], self.specials), np.zeros(1, np.int64), caps)
        spans = 0 if extra is None else int(extra[0])
        return lambda sizes: fits_bucket(sizes, caps, spans)

    def roll(self) -> list[dict]:
        """Samples, scores and plans the next rollout; its steps, each repeated
        `rl.updates_per_rollout` times, with the rollout's metrics on each step's info."""
        rl, start = self.rl, time.perf_counter()
        self.started = self.position()
        prompts = self.prompts()
        group = [p for p in prompts for _ in range(rl.group_size)]
        # The policy's weights are the last step's, whose update was dispatched and may still
        # run: it ends here, not inside sampling's first program, so its time stays training's
        # (counted there it made sampling 2.6 s of the tiny recipe's 2.9 s steps; it is 1.5 s)
        waited = time.perf_counter()
        weights = jax.block_until_ready(self.policy())
        waited = time.perf_counter() - waited
        answers = self.generator([p.sample for p in prompts]).generate(
            weights["params"],
            weights["frozen"],
            [p.sample for p in prompts],  # (G answers each: `group`'s order)
            max_new_tokens=rl.max_new_tokens,
            stop_ids=frozenset(self.specials.stop),
            temperature=rl.temperature,
            top_p=rl.top_p,
            seed=(self.cfg.data.seed * 1_000_003 + self.rollout) % 2**31,
        )
        sampled = time.perf_counter()
        texts = [self.template.decode(a.ids) for a in answers]
        scores = self.rewards([p.record for p in group], texts)
        advantages, equal = group_advantages(scores.total, rl.group_size, rl.advantage)
        scored = time.perf_counter()
        keep = np.ones(len(prompts), bool)
        if rl.skip_equal_groups and not equal.all():  # (all equal: trained on, all zero)
            keep = ~equal
        samples = []
        for g, p in enumerate(prompts):
            if not keep[g]:
                continue
            at = np.arange(g * rl.group_size, (g + 1) * rl.group_size)
            ids = [np.asarray(answers[k].ids, np.int32) for k in at]
            fits = self.room(p.sample)
            samples += group_samples(p.sample, ids, advantages[at], fits, first_id=int(at[0]))
        steps = self.plan(samples, weights)
        lengths = np.array([len(a.ids) for a in answers])
        metrics = {
            "rl/reward": float(scores.total.mean()),
            "rl/reward_std": float(scores.total.std()),
            **{f"rl/reward/{k}": float(v.mean()) for k, v in scores.by_name.items()},
            "rl/completion_len_mean": float(lengths.mean()),
            "rl/completion_len_max": float(lengths.max()),
            "rl/truncated": float(np.mean([not a.stopped for a in answers])),
            "rl/equal_groups": float(equal.mean()),
            "rl/skipped_groups": float((~keep).sum()),
            "rl/skipped_prompts": float(self.skipped_prompts),
            "rl/steps_per_rollout": float(len(steps)),
            "rl/rollout": float(self.rollout),
            "time/rollout_s": sampled - start - waited,
            "time/score_s": scored - sampled,
            "rl/rollout_tokens_per_s": float(lengths.sum()) / max(sampled - start - waited, 1e-9),
        }
        self.rollout += 1
        for element in steps:
            element["info"].extra.update(metrics)
        return [dict(e) for _ in range(rl.updates_per_rollout) for e in steps]

    def plan(self, samples: list[Sample], weights: dict) -> list[dict]:
        """The rollout's steps: the feed's stages over its samples until each is planned
        once, each batch on the devices; with more than one step, or more than one update, the
        sampling policy's log-probs of each batch beside it."""
        cfg = dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data, workers=0))
        source = RolloutSource(samples, self.specials)
        run = dataclasses.replace(
            self.run, cfg=cfg, source=source, index=rollout_index(samples, self.specials)
        )
        feed = StepIterator(run)
        drain(feed.planner)
        seen = np.zeros(len(samples), bool)
        feed.marks = lambda plan, loaded, batch: count_once(
            plan, loaded, run.caps, run.positions, batch, seen
        )
        steps = []
        try:
            while not seen.all():
                if len(steps) > 4 * len(samples) + 8:
                    raise ConfigError(f"{int((~seen).sum())} completions were never planned")
                steps.append(next(feed))
        finally:
            feed.close()
        if len(steps) > 1 and not self.spill_said:
            self.spill_said = True
            log.warning(spill(run.index, run.caps, len(steps), self.rollout))
        kept = len(steps) > 1 or self.rl.updates_per_rollout > 1
        for element in steps:
            batch = element["batch"]
            batch["llm_old_given"][:] = int(kept)
            element["batch"] = sharding.make_global_batch(batch, self.run.mesh)
            if kept:  # (the sampling policy's, before any update)
                old = self.logps(weights["params"], weights["frozen"], element["batch"])
                element["batch"]["llm_old_logps"] = old
        return steps
