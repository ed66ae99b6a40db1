"""How much of a generated caption of the built-in data (`jaxmllm.data.synthetic`) is right,
by what it names: the shapes' count, colours and kinds, a tone's pitch and contour, a moving
shape's direction. The evaluation's answer scores (`loop/answers.py`) come from here."""

from __future__ import annotations

from jaxmllm.data.synthetic import COLOURS, CONTOURS, DIRECTIONS, PITCHES, SHAPES

# What `score_answer` checks of each kind of answer, and a uniform guess's chance of it
SCORED = {
    "shapes": {"count": 1 / 2, "colour": 1 / len(COLOURS), "shape": 1 / len(SHAPES)},
    "tone": {"pitch": 1 / len(PITCHES), "contour": 1 / len(CONTOURS)},
    "motion": {
        "direction": 1 / len(DIRECTIONS),
        "colour": 1 / len(COLOURS),
        "shape": 1 / len(SHAPES),
    },
}


def score_answer(answer: str, truth: str) -> dict[str, float]:
    """How much of a generated caption is right, by what it names.

    Shapes ("a red circle and a blue square"): `count` (as many shapes named as shown),
    `colour` and `shape` (the share of the shown shapes, in order, named right); a tone ("a
    rising high tone"): `pitch`, `contour`; a moving shape ("a red circle moving left"):
    `direction`, `colour`, `shape`; all: `exact` (the whole answer).
    """
    scores = {"exact": float(answer.strip() == truth.strip())}
    want, got = _named(truth), _named(answer)
    got += [("", "", "")] * len(want)  # (an answer naming fewer things misses the rest)
    if truth.strip().split()[-1] in DIRECTIONS:  # (colour, shape, "moving") + the direction
        scores["direction"] = float(answer.strip().split()[-1:] == truth.strip().split()[-1:])
        scores["colour"] = float(got[0][0] == want[0][0])
        scores["shape"] = float(got[0][1] == want[0][1])
    elif truth.strip().endswith(" tone"):  # (contour, pitch, "tone")
        scores["contour"] = float(got[0][0] == want[0][0])
        scores["pitch"] = float(got[0][1] == want[0][1])
    elif want:  # shapes: (colour, shape) each
        scores["count"] = float(len(got) - len(want) == len(want))
        pairs = list(zip(want, got, strict=False))
        scores["colour"] = sum(w[0] == g[0] for w, g in pairs) / len(want)
        scores["shape"] = sum(w[1] == g[1] for w, g in pairs) / len(want)
    return scores


def _named(caption: str) -> list[tuple[str, str, str]]:
    """The first three words after each "a " of a caption's " and "-joined parts ("" where a
    part has fewer)."""
    parts = [p.strip().removeprefix("a ").split() for p in caption.strip().split(" and ")]
    return [tuple((p + ["", "", ""])[:3]) for p in parts if p]


def caption_reward(record: dict, completion: str) -> float:
    """An RL reward for the built-in data's questions (`rl.rewards: [{name:
    jaxmllm.data.scoring:caption_reward}]`): the mean of what `score_answer` finds right of the
    completion against the record's answer (the count, each colour and shape, a tone's pitch
    and contour, the whole answer), so a completion that names the right colour of the wrong
    shape earns part of the reward exactness would deny it. configs/tiny_grpo.yaml says what it
    teaches the tiny model against `exact_answer`."""
    scores = score_answer(completion, record["answer"])
    return sum(scores.values()) / len(scores)
