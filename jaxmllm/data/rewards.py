"""Online RL's rewards (`rl.rewards`, `jaxmllm.config.rl`): each completion's score, and each
group's advantages, computed on the host.

The GRPO rollout loop (`jaxmllm.loop.rollouts`) calls a `Rewards` on the rollout's records and
decoded completions, and `group_advantages` on their weighted sum, before packing the
completions into samples. A reward is a built-in (`exact_answer`, `regex`, `choice`, `format`,
`math`; `RewardConfig`'s docstring) or the user's `module:function`, called as
function(record, completion) with record {"id", "prompt", "answer"}. A user's reward that
raises or returns something other than a finite number stops the run (`RewardError`): training
on a silently wrong reward wastes the run.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxmllm.config.checks import ConfigError, UserError
from jaxmllm.config.rl import ADVANTAGES, RewardConfig

# Stripped from both ends of an answer before comparing: a sentence's end, quotes, code ticks
_END_PUNCTUATION = " .,;:!?\"'`"
# A multiple-choice letter: a capital standing alone ("B", "(B)", "B.", "**B**"), not "I'm"
_LETTER = r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9'])"
# The letter after "answer", "answer:", "answer is (", "answer is **"...: preferred to the first
_AFTER_ANSWER = re.compile(r"\b(?i:answer)\b(?:\s+(?i:is))?\s*:?\s*[(\[*]*\s*" + _LETTER)
_ANY_LETTER = re.compile(_LETTER)


class RewardError(UserError):
    """A user's reward function that raised or returned something other than a finite number
    on a completion; the message names the function, the record and what was wrong."""


@dataclass
class Scores:
    """A rollout's rewards: `total` [N] float64 the weighted sum; `by_name` each reward's own
    values [N], keyed by its `rl.rewards` name (a repeated name: `name#2`, `name#3`...)."""

    total: np.ndarray
    by_name: dict[str, np.ndarray]


def normalise(text: str) -> str:
    """`text` as answers are compared: casefolded, whitespace runs as one space, and spaces,
    punctuation, quotes and backticks stripped from both ends."""
    return " ".join(text.casefold().split()).strip(_END_PUNCTUATION)


def choice_letter(text: str) -> str | None:
    """The multiple-choice letter `text` gives: the one after "answer" (is|:) if there is one,
    else its first standalone capital; None when it gives none."""
    found = _AFTER_ANSWER.search(text) or _ANY_LETTER.search(text)
    return found.group(1) if found else None


def _same_answer(found: str | None, answer: str) -> float:
    """1.0 when `found` is the record's (non-empty) answer, normalised."""
    return float(found is not None and bool(answer) and normalise(found) == normalise(answer))


def _regex_found(pattern: re.Pattern, completion: str) -> str | None:
    """The first group of `pattern`'s first match in `completion` (the whole match when it has
    no group; None when it does not match or its group took no part)."""
    match = pattern.search(completion)
    return match and match.group(1 if pattern.groups else 0)


def _built_in(i: int, cfg: RewardConfig) -> Callable[[dict, str], float]:
    """The built-in reward `cfg.name` as fn(record, completion) -> 0.0 or 1.0."""
    if cfg.name == "exact_answer":
        return lambda record, completion: _same_answer(completion, record["answer"])
    if cfg.name == "choice":

        def choice(record: dict, completion: str) -> float:
            want = choice_letter(record["answer"])
            return float(want is not None and choice_letter(completion) == want)

        return choice
    if cfg.name == "math":
        return _math_reward(i)
    try:  # compiled once here: a bad pattern is the config's error, before any rollout
        pattern = re.compile(cfg.pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(
            f"rl.rewards[{i}].pattern: {cfg.pattern!r} is not a Python regular expression "
            f"({e}); fix it"
        ) from e
    if cfg.name == "regex":
        return lambda record, completion: _same_answer(
            _regex_found(pattern, completion), record["answer"]
        )
    return lambda record, completion: float(pattern.fullmatch(completion.strip()) is not None)


def _math_reward(i: int) -> Callable[[dict, str], float]:
    """`math`: math-verify's judgement of the completion against the record's answer
    (imported here, so only runs that use it need the package)."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ConfigError(
            f"rl.rewards[{i}].name: math needs the math-verify package ({e}); "
            "`pip install math-verify`, or choose another reward"
        ) from e
    # verify(gold, target): the order matters, the gold answer's form decides how to compare
    return lambda record, completion: float(
        bool(record["answer"]) and bool(verify(parse(record["answer"]), parse(completion)))
    )


def _user_function(i: int, name: str) -> Callable:
    """The user's reward `module:function`, imported."""
    module_name, attribute = name.split(":", 1)
    where = f"rl.rewards[{i}].name: {name!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # (any error its import raises: the user's module, the user's fix)
        raise ConfigError(
            f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e}); put it "
            "on PYTHONPATH, or name a built-in reward or another module:function"
        ) from e
    if not hasattr(module, attribute):
        raise ConfigError(
            f"{where}: module {module_name!r} has no {attribute!r}; name a function it defines"
        )
    obj = getattr(module, attribute)
    if not callable(obj):
        raise ConfigError(
            f"{where}: {attribute!r} is a {type(obj).__name__}, not a function; name a function "
            "taking (record, completion) and returning a number"
        )
    return obj


def _checked_call(name: str, fn: Callable, record: dict, completion: str) -> float:
    """`fn(record, completion)` as a float; RewardError when it raises or returns something
    other than a finite number (bool counts; None, a str, nan or inf do not)."""
    where = f"reward {name} on record {record.get('id')!r}"
    try:
        value = fn(record, completion)
    except Exception as e:
        raise RewardError(
            f"{where} raised {type(e).__name__}: {e}; fix the function (it must return a "
            "number for every completion)"
        ) from e
    if not isinstance(value, numbers.Real | np.bool_) or not _finite(value):
        raise RewardError(
            f"{where} returned {value!r}; it must return a finite number (int, float or bool)"
        )
    return float(value)


def _finite(value: numbers.Real | np.bool_) -> bool:
    """Whether a real number is finite (an int too large for a float is not)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


class Rewards:
    """`rl.rewards` resolved: call it on a rollout's records and completions for its Scores."""

    def __init__(self, configs: tuple[RewardConfig, ...]):
        """Resolves each reward (a built-in, or imports `module:function`), so a bad name or
        pattern is a ConfigError at start-up, not at the first rollout."""
        self.configs = tuple(configs)
        self.functions: list[Callable] = []
        self.keys: list[str] = []
        for i, cfg in enumerate(self.configs):
            user = ":" in cfg.name
            fn = _user_function(i, cfg.name) if user else _built_in(i, cfg)
            if user:  # (a built-in's result is ours: only the user's is checked per call)
                fn = lambda r, c, name=cfg.name, f=fn: _checked_call(name, f, r, c)
            self.functions.append(fn)
            count = sum(c.name == cfg.name for c in self.configs[: i + 1])
            self.keys.append(cfg.name if count == 1 else f"{cfg.name}#{count}")

    def __call__(self, records: list[dict], completions: list[str]) -> Scores:
        """Each reward of each (record, completion) pair, and their weighted sum."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        by_name = {
            key: np.array([fn(r, c) for r, c in zip(records, completions, strict=True)], float)
            for key, fn in zip(self.keys, self.functions, strict=True)
        }
        total = np.zeros(len(completions), np.float64)
        for key, cfg in zip(self.keys, self.configs, strict=True):
            total += cfg.weight * by_name[key]
        return Scores(total=total, by_name=by_name)


def group_advantages(
    rewards: np.ndarray, group_size: int, advantage: str
) -> tuple[np.ndarray, np.ndarray]:
    """Each completion's advantage within its group, and which groups' rewards are all equal.

    Args:
      rewards: [P*G] the completions' rewards, prompt p's G in rows p*G .. p*G+G-1.
      group_size: G (>= 2: a group's std).
      advantage: "group": (r - mean) / (std + 1e-4), std with Bessel's correction (TRL's
        GRPOTrainer, scale_rewards="group"); "mean_only": r - mean (Dr. GRPO, TRL's "none").

    Returns:
      advantages [P*G] float32 (0 in a group whose rewards are all the same), and equal [P]
      bool: the groups whose std is within 1e-6 of 0 (they teach nothing).
    """
    r = np.asarray(rewards, np.float64)
    if group_size < 2 or r.ndim != 1 or len(r) % group_size:
        raise ValueError(
            f"rewards of shape {r.shape} are not whole groups of group_size {group_size} (>= 2)"
        )
    if advantage not in ADVANTAGES:
        raise ValueError(f"advantage {advantage!r} must be one of {ADVANTAGES}")
    groups = r.reshape(-1, group_size)
    std = groups.std(axis=1, ddof=1, keepdims=True)
    centred = groups - groups.mean(axis=1, keepdims=True)
    # Identical rewards: exactly 0, not the mean's rounding error (which "group" would divide by
    # 1e-4 into a small, meaningless push)
    centred[np.ptp(groups, axis=1) == 0] = 0.0
    scaled = centred / (std + 1e-4) if advantage == "group" else centred
    equal = np.isclose(std[:, 0], 0.0, rtol=0.0, atol=1e-6)
    return scaled.reshape(-1).astype(np.float32), equal
