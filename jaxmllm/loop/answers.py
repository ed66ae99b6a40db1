"""Questions a run answers while it trains: greedy answers to held-out prompts, scored.

The eval set's first `data.eval.questions` samples that have a prompt (tokens before their first
loss token: a question with its image or clip, a user turn) are cut there (`split_answer`); at
each evaluation the model answers them greedily with the KV-cache generator, and each answer is
compared with the sample's own: exactly, and for the built-in synthetic data by what it names
(`scoring.score_answer`: how many shapes, their colours and kinds, a tone's pitch and
contour). The answers go to the log; at the last step a table of them with the accuracy beside
chance is printed, so a first run shows that what it sees and hears reaches the LLM.

With `data.eval.sampled_answers` n, each question is also answered n times by sampling (at
`data.eval.temperature`, every sample its own row of one batch, the prompt prefilled once) and
each score gets two more figures: mean@n, how often a sample is right, and best@n (pass@n),
whether one of the n is. Online RL learns from the differences between a prompt's samples, so
they say beforehand what it can teach: a right answer the samples give often and the greedy
one misses is something to sharpen; samples right less often than the greedy answer, best@n
high only because the answers are few, are guesses (docs/rl.md).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxmllm.batch.prompts import PromptShapes, split_answer
from jaxmllm.config import Config, ConfigError
from jaxmllm.config.phases import ENCODERS, VISION
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.scoring import SCORED, score_answer
from jaxmllm.data.text.template import make_template
from jaxmllm.step.generate import Generator, beyond_memory

log = logging.getLogger("jaxmllm")

LOGGED = 4  # answers written to the log at each evaluation (the end-of-run table has all)


class Questions:
    """The held-out prompts, their true answers and the generator that answers them."""

    def __init__(self, cfg: Config, source, count: int):
        """The first `count` samples of the eval set that split into a prompt and a true answer
        (a sample that fails to load is skipped: the eval feed counts it; none: a warning, no
        questions), and the generator sized to them."""
        self.cfg, self.template = cfg, make_template(cfg)
        self.synthetic = cfg.data.eval.source == "synthetic"
        self.prompts, self.truths = [], []
        for i in range(len(source)):
            if len(self.prompts) == count:
                break
            try:
                split = split_answer(source[i], self.template.specials)
            except RecordError:  # (the eval set's loader counts and logs it)
                continue
            if split is not None:
                self.prompts.append(split[0])
                self.truths.append(self.template.decode(split[1]))
        if not self.prompts:
            log.warning("data.eval: no sample has a prompt to answer; no questions asked")
        max_new = cfg.data.eval.max_new_tokens
        shapes = PromptShapes.fit(self.prompts, cfg, max_new) if self.prompts else None
        self.generator = Generator(cfg, shapes, self.template.specials) if self.prompts else None
        n = cfg.data.eval.sampled_answers
        self.sampler = None  # (n answers each from one prefill: GRPO's rollouts' generator)
        if self.prompts and n:
            decoded = dataclasses.replace(shapes, rows=shapes.rows * n)
            if short := beyond_memory(cfg, decoded):  # (refused before a step is taken)
                need, have = short
                raise ConfigError(
                    f"data.eval.sampled_answers={n}: the KV cache of {decoded.rows} rows "
                    f"({len(self.prompts)} questions x {n}) of {shapes.total_len} positions "
                    f"needs {need / 1e9:.1f} GB, more than the devices' {have / 1e9:.1f} GB; "
                    "lower data.eval.sampled_answers, data.eval.questions or "
                    "data.eval.max_new_tokens"
                )
            self.sampler = Generator(cfg, shapes, self.template.specials, repeat=n)

    def ask(self, params: dict, frozen: dict, step: int = 0) -> list[dict]:
        """Each question's prompt, answer, true answer and scores; with sampled answers, their
        scores too ("sampled": one dict a sample), drawn with a key of data.seed and `step`
        (an evaluation repeated at a step, as after a resume, draws the same)."""
        if self.generator is None:
            return []
        e, stop = self.cfg.data.eval, frozenset(self.template.specials.stop)
        answers = self.generator.generate(
            params, frozen, self.prompts, max_new_tokens=e.max_new_tokens, stop_ids=stop
        )
        n, sampled = e.sampled_answers, []
        if self.sampler is not None:  # (question q's samples: q x n .. (q + 1) x n - 1)
            sampled = self.sampler.generate(
                params,
                frozen,
                self.prompts,
                max_new_tokens=e.max_new_tokens,
                stop_ids=stop,
                temperature=e.temperature,
                seed=(self.cfg.data.seed * 1_000_003 + step) % 2**31,
            )
        results = []
        for q, (prompt, truth, answer) in enumerate(
            zip(self.prompts, self.truths, answers, strict=True)
        ):
            text = self.template.decode(answer.ids)
            result = {
                "media": _media(prompt),
                "prompt": self.show(prompt.tokens),
                "answer": text,
                "truth": truth,
                "scores": self.score(text, truth),
            }
            if sampled:
                texts = [self.template.decode(a.ids) for a in sampled[q * n : (q + 1) * n]]
                result["samples"] = texts
                result["sampled"] = [self.score(t, truth) for t in texts]
            results.append(result)
        return results

    def score(self, text: str, truth: str) -> dict[str, float]:
        """An answer's scores: `exact`, and for the built-in data what it names right."""
        scores = score_answer(text, truth) if self.synthetic else {}
        scores["exact"] = float(text.strip() == truth.strip())
        return scores

    def show(self, ids: np.ndarray) -> str:
        """A prompt's text without its BOS and placeholder runs (`_media` names those)."""
        sp = self.template.specials
        hidden = [i for i in (sp.bos, *sp.media.values()) if i is not None]
        kept = np.asarray(ids)[~np.isin(ids, hidden)]
        return self.template.decode(kept)

    @staticmethod
    def metrics(results: list[dict]) -> dict[str, float]:
        """`eval/answers/<score>`: the mean of each score over the questions that have it; with
        n sampled answers, `<score>/mean@n` (over the samples too) and `<score>/best@n` (each
        question's best sample)."""
        keys = sorted({k for r in results for k in r["scores"]})
        mean = lambda k: float(np.mean([r["scores"][k] for r in results if k in r["scores"]]))
        row = {f"eval/answers/{k}": mean(k) for k in keys}
        if results and "sampled" in results[0]:
            n = len(results[0]["sampled"])
            for k in keys:
                _, samples, best = _rates(results, k)
                row[f"eval/answers/{k}/mean@{n}"] = samples
                row[f"eval/answers/{k}/best@{n}"] = best
        return row

    @staticmethod
    def log(results: list[dict], step: int) -> None:
        """The first few answers and how many were right, into the log."""
        for r in results[:LOGGED]:
            mark = "right" if r["scores"]["exact"] else f"wrong, truth {r['truth']!r}"
            log.info(
                "step %d: [%s] %r -> %r (%s)", step, r["media"], r["prompt"], r["answer"], mark
            )
        right = sum(r["scores"]["exact"] for r in results)
        log.info("step %d: %d of %d held-out answers exactly right", step, right, len(results))
        if results and "sampled" in results[0]:
            log.info("step %d: sampled answers: %s", step, _sampled_rates(results, "exact"))

    def report(self, results: list[dict], step: int) -> str:
        """The end-of-run table: every question, its answer, and the accuracy beside chance."""
        lines = [f"\nHeld-out questions after step {step} (samples it never trained on; greedy):"]
        width = max((len(r["prompt"]) for r in results), default=0)
        for r in results:
            mark = "right" if r["scores"]["exact"] else f"wrong (truth: {r['truth']})"
            lines.append(f"  {r['media']:<9} {r['prompt']:<{width}} -> {r['answer']:<40} {mark}")
        right = sum(r["scores"]["exact"] for r in results)
        lines.append(f"accuracy: {right:.0f} of {len(results)} answers exactly right")
        for kind, chances in SCORED.items():
            scored = [r["scores"] for r in results if next(iter(chances)) in r["scores"]]
            if scored:
                rates = ", ".join(
                    f"{k} {np.mean([x[k] for x in scored]):.0%} (chance {c:.0%})"
                    for k, c in chances.items()
                )
                lines.append(f"  {kind} ({len(scored)} answers): {rates}")
        if results and "sampled" in results[0]:
            e = self.cfg.data.eval
            lines.append(
                f"sampled answers ({e.sampled_answers} a question at temperature "
                f"{e.temperature:g}), right: greedy / of the samples / best of "
                f"{e.sampled_answers}"
            )
            lines.append(f"  exact {_sampled_rates(results, 'exact', short=True)}")
            for kind, chances in SCORED.items():
                scored = [r for r in results if next(iter(chances)) in r["scores"]]
                if scored:
                    rates = ", ".join(
                        f"{k} {_sampled_rates(scored, k, short=True)}" for k in chances
                    )
                    lines.append(f"  {kind} ({len(scored)} answers): {rates}")
        return "\n".join(lines)


def _rates(results: list[dict], key: str) -> tuple[float, float, float]:
    """A score's rate over the questions that have it: answered greedily, over their sampled
    answers, and of each question's best sample."""
    have = [r for r in results if key in r["scores"]]
    greedy = np.mean([r["scores"][key] for r in have])
    samples = np.mean([[s[key] for s in r["sampled"]] for r in have])
    best = np.mean([max(s[key] for s in r["sampled"]) for r in have])
    return float(greedy), float(samples), float(best)


def _sampled_rates(results: list[dict], key: str, short: bool = False) -> str:
    """A score's `_rates` as words: "40% greedy, 31% of samples, 82% best of 8" (`short`:
    "40% / 31% / 82%")."""
    greedy, samples, best = _rates(results, key)
    if short:
        return f"{greedy:.0%} / {samples:.0%} / {best:.0%}"
    n = len(results[0]["sampled"])
    return f"{greedy:.0%} greedy, {samples:.0%} of samples, {best:.0%} best of {n}"


def _media(prompt) -> str:
    """What a prompt shows the model besides text: "2 images", "image, audio", "video",
    "text" (its vision items by their grids: a video's several temporal patches are one)."""
    frames = [g[0] if len(g) >= 3 else 1 for g in prompt.grids]
    named = [(sum(t == 1 for t in frames), "image"), (sum(t > 1 for t in frames), "video")]
    named += [(len(prompt.media[p.name]), p.item) for p in ENCODERS if p.name != VISION.name]
    named = [(n, what) for n, what in named if n]
    return ", ".join(what if n == 1 else f"{n} {what}s" for n, what in named) or "text"
