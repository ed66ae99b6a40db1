"""Questions a run answers while it trains: greedy answers to held-out prompts, scored.

The eval set's first `data.eval.questions` samples that have a prompt (tokens before their first
loss token: a question with its image or clip, a user turn) are cut there (`split_answer`); at
each evaluation the model answers them greedily with the KV-cache generator, and each answer is
compared with the sample's own: exactly, and for the built-in synthetic data by what it names
(`scoring.score_answer`: how many shapes, their colours and kinds, a tone's pitch and
contour). The answers go to the log; at the last step a table of them with the accuracy beside
chance is printed, so a first run shows that what it sees and hears reaches the LLM.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxmllm.batch.prompts import PromptShapes, split_answer
from jaxmllm.config import Config
from jaxmllm.config.phases import ENCODERS, VISION
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.scoring import SCORED, score_answer
from jaxmllm.data.text.template import make_template
from jaxmllm.step.generate import Generator

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

    def ask(self, params: dict, frozen: dict) -> list[dict]:
        """Each question's prompt, answer, true answer and scores."""
        if self.generator is None:
            return []
        answers = self.generator.generate(
            params,
            frozen,
            self.prompts,
            max_new_tokens=self.cfg.data.eval.max_new_tokens,
            stop_ids=frozenset(self.template.specials.stop),
        )
        results = []
        for prompt, truth, answer in zip(self.prompts, self.truths, answers, strict=True):
            text = self.template.decode(answer.ids)
            scores = score_answer(text, truth) if self.synthetic else {}
            scores["exact"] = float(text.strip() == truth.strip())
            results.append(
                {
                    "media": _media(prompt),
                    "prompt": self.show(prompt.tokens),
                    "answer": text,
                    "truth": truth,
                    "scores": scores,
                }
            )
        return results

    def show(self, ids: np.ndarray) -> str:
        """A prompt's text without its BOS and placeholder runs (`_media` names those)."""
        sp = self.template.specials
        hidden = [i for i in (sp.bos, *sp.media.values()) if i is not None]
        kept = np.asarray(ids)[~np.isin(ids, hidden)]
        return self.template.decode(kept)

    @staticmethod
    def metrics(results: list[dict]) -> dict[str, float]:
        """`eval/answers/<score>`: the mean of each score over the questions that have it."""
        keys = sorted({k for r in results for k in r["scores"]})
        mean = lambda k: float(np.mean([r["scores"][k] for r in results if k in r["scores"]]))
        return {f"eval/answers/{k}": mean(k) for k in keys}

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
        return "\n".join(lines)


def _media(prompt) -> str:
    """What a prompt shows the model besides text: "2 images", "image, audio", "video",
    "text" (its vision items by their grids: a video's several temporal patches are one)."""
    frames = [g[0] if len(g) >= 3 else 1 for g in prompt.grids]
    named = [(sum(t == 1 for t in frames), "image"), (sum(t > 1 for t in frames), "video")]
    named += [(len(prompt.media[p.name]), p.item) for p in ENCODERS if p.name != VISION.name]
    named = [(n, what) for n, what in named if n]
    return ", ".join(what if n == 1 else f"{n} {what}s" for n, what in named) or "text"
