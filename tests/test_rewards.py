"""Online RL's rewards (`jaxmllm.data.rewards`): each built-in on right and wrong completions,
the weighted sum, the user's `module:function` and the errors a bad one raises, and the group
advantages held to TRL's GRPOTrainer formula computed independently with torch."""

from __future__ import annotations

import sys
import textwrap
import types

import numpy as np
import pytest

from jaxmllm.config.checks import ConfigError, UserError
from jaxmllm.config.rl import RewardConfig
from jaxmllm.data.rewards import RewardError, Rewards, Scores, choice_letter, group_advantages

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)


def score(name: str, answer: str, completions: list[str], pattern: str = "") -> list[float]:
    """The built-in reward `name`'s values of `completions` against one record's `answer`."""
    rewards = Rewards((RewardConfig(name=name, pattern=pattern),))
    records = [{"id": k, "prompt": "q", "answer": answer} for k in range(len(completions))]
    return rewards(records, completions).by_name[name].tolist()


def test_exact_answer_normalises_case_spaces_and_end_punctuation():
    right = ["Paris", "  paris. ", "PARIS!", '"Paris"', "`paris`", "paris?!"]
    assert score("exact_answer", "Paris", right) == [1.0] * len(right)
    assert score("exact_answer", "New  York", ["new york", "new\n\tYork."]) == [1.0, 1.0]
    wrong = ["Pari", "Paris is the capital", "par is", "", "Paris-"]
    assert score("exact_answer", "Paris", wrong) == [0.0] * len(wrong)
    # A record without an answer rewards nothing, not the empty completion
    assert score("exact_answer", "", ["", "anything"]) == [0.0, 0.0]


def test_regex_compares_the_first_group_or_the_whole_match():
    grouped = r"<answer>(.*?)</answer>"
    completions = [
        "think... <answer> 42. </answer>",
        "<answer>\n42\n</answer> then <answer>7</answer>",  # (DOTALL; the first match)
        "<answer>7</answer> then <answer>42</answer>",
        "42 without tags",
    ]
    assert score("regex", "42", completions, grouped) == [1.0, 1.0, 0.0, 0.0]
    # Without a group the whole match is compared
    assert score("regex", "42", ["is 42", "is 7", "none"], r"\d+") == [1.0, 0.0, 0.0]
    assert score("regex", "x=42", ["so X = 42"], r"x\s*=\s*\d+") == [0.0]
    assert score("regex", "X = 42", ["so X = 42"], r"x\s*=\s*\d+") == [0.0]
    assert score("regex", "X = 42", ["so X = 42"], r"X\s*=\s*\d+") == [1.0]


@pytest.mark.parametrize(
    "text, letter",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B) because", "B"),
        ("Answer: B", "B"),
        ("I think the answer is (C)", "C"),
        ("answer is **D**", "D"),
        ("**C**", "C"),
        ("Options A and B differ; the answer: C", "C"),  # ("answer" first, then the first)
        ("Between A and B, B.", "A"),
        ("(B) the second option", "B"),
        ("I'm sure: E", "E"),
        ("Because of DNA", None),
        ("no letter here", None),
    ],
)
def test_choice_letter_forms(text, letter):
    assert choice_letter(text) == letter


def test_choice_compares_the_letters():
    completions = ["The answer is (B).", "B", "**B**", "A", "answer: C", "nothing", "b"]
    assert score("choice", "(B) a cat", completions) == [1, 1, 1, 0, 0, 0, 0]
    assert score("choice", "no letter", ["A", "no letter"]) == [0.0, 0.0]


def test_format_needs_the_whole_stripped_completion_to_match():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    completions = [
        "<think>a\nb</think>\n<answer>4</answer>",
        "  <think>x</think><answer>4</answer>\n",
        "<think>x</think><answer>4</answer> and more",
        "prefix <think>x</think><answer>4</answer>",
        "<answer>4</answer>",
    ]
    assert score("format", "", completions, pattern) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_weights_sum_into_total_and_repeated_names_keep_their_own_values():
    rewards = Rewards(
        (
            RewardConfig("exact_answer", weight=2.0),
            RewardConfig("format", weight=0.5, pattern=r"\d+"),
            RewardConfig("format", weight=-1.0, pattern=r"4"),
        )
    )
    records = [{"id": k, "prompt": "", "answer": "4"} for k in range(3)]
    scores = rewards(records, ["4", "5", "x"])
    assert isinstance(scores, Scores)
    assert list(scores.by_name) == ["exact_answer", "format", "format#2"]
    assert scores.by_name["format"].tolist() == [1.0, 1.0, 0.0]
    assert scores.by_name["format#2"].tolist() == [1.0, 0.0, 0.0]
    assert scores.total.dtype == np.float64
    np.testing.assert_allclose(scores.total, [2.0 + 0.5 - 1.0, 0.5, 0.0])


def user_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    """Writes module `name` with `source` into tmp_path, importable for this test only."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_user_reward_is_imported_and_called_per_completion(tmp_path, monkeypatch):
    user_module(
        tmp_path,
        monkeypatch,
        "my_rewards_ok",
        """
        import numpy as np

        def length(record, completion):
            return len(completion) + (record["id"] == 1)

        def flag(record, completion):
            return completion == record["answer"]

        def numpy_value(record, completion):
            return np.float32(0.25)
        """,
    )
    rewards = Rewards(
        (
            RewardConfig("my_rewards_ok:length", weight=0.5),
            RewardConfig("my_rewards_ok:flag"),
            RewardConfig("my_rewards_ok:numpy_value"),
        )
    )
    records = [{"id": 0, "prompt": "p", "answer": "ab"}, {"id": 1, "prompt": "p", "answer": ""}]
    scores = rewards(records, ["ab", "abcd"])
    assert scores.by_name["my_rewards_ok:length"].tolist() == [2.0, 5.0]
    assert scores.by_name["my_rewards_ok:flag"].tolist() == [1.0, 0.0]  # (a bool: a number)
    np.testing.assert_allclose(scores.total, [1.0 + 1.0 + 0.25, 2.5 + 0.25])


def test_a_user_reward_that_raises_stops_the_run_naming_it_and_the_record(tmp_path, monkeypatch):
    user_module(
        tmp_path,
        monkeypatch,
        "my_rewards_raise",
        """
        def parse_number(record, completion):
            return float(completion)
        """,
    )
    rewards = Rewards((RewardConfig("my_rewards_raise:parse_number"),))
    records = [
        {"id": "rec-7", "prompt": "", "answer": "1"},
        {"id": "rec-8", "prompt": "", "answer": "1"},
    ]
    with pytest.raises(RewardError) as e:
        rewards(records, ["1.5", "not a number"])
    msg = str(e.value)
    assert "my_rewards_raise:parse_number" in msg and "'rec-8'" in msg, msg
    assert "ValueError" in msg and "not a number" in msg, msg
    assert isinstance(e.value, UserError)


@pytest.mark.parametrize(
    "returned, shown",
    [
        ("None", "None"),
        ("'1'", "'1'"),
        ("float('nan')", "nan"),
        ("float('-inf')", "-inf"),
        ("[1.0]", "[1.0]"),
        ("10**400", "1000"),
    ],
)
def test_a_user_reward_that_returns_no_finite_number_stops_the_run(
    tmp_path, monkeypatch, returned, shown
):
    user_module(
        tmp_path,
        monkeypatch,
        "my_rewards_bad",
        f"""
        def bad(record, completion):
            return {returned}
        """,
    )
    rewards = Rewards((RewardConfig("my_rewards_bad:bad"),))
    with pytest.raises(RewardError) as e:
        rewards([{"id": 3, "prompt": "", "answer": ""}], ["x"])
    msg = str(e.value)
    assert "my_rewards_bad:bad" in msg and "record 3" in msg and f"returned {shown}" in msg, msg


def test_a_missing_module_function_or_non_function_is_a_config_error(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "my_rewards_attrs", "SCALE = 2\n")
    cases = {
        "no_such_module_xyz:reward": "cannot import module 'no_such_module_xyz'",
        "my_rewards_attrs:missing": "has no 'missing'",
        "my_rewards_attrs:SCALE": "not a function",
    }
    for name, why in cases.items():
        with pytest.raises(ConfigError) as e:
            Rewards((RewardConfig("exact_answer"), RewardConfig(name)))
        msg = str(e.value)
        assert "rl.rewards[1].name" in msg and name in msg and why in msg, msg


def test_a_pattern_that_does_not_compile_is_a_config_error():
    for name in ("regex", "format"):
        with pytest.raises(ConfigError) as e:
            Rewards((RewardConfig(name, pattern="(unclosed"),))
        assert "rl.rewards[0].pattern" in str(e.value) and "(unclosed" in str(e.value)


def test_math_without_math_verify_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # (import fails: as if not installed)
    with pytest.raises(ConfigError) as e:
        Rewards((RewardConfig("math"),))
    msg = str(e.value)
    assert "rl.rewards[0].name" in msg and "pip install math-verify" in msg, msg


def test_math_asks_math_verify_with_the_gold_answer_first(monkeypatch):
    calls = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text: ("parsed", text)
    fake.verify = lambda gold, target: calls.append((gold, target)) or gold[1] == target[1]
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert score("math", "1/2", ["1/2", "0.3"]) == [1.0, 0.0]
    assert calls[0] == (("parsed", "1/2"), ("parsed", "1/2"))
    assert calls[1] == (("parsed", "1/2"), ("parsed", "0.3"))
    assert score("math", "", [""]) == [0.0]  # (no answer: nothing to verify against)


def trl_advantages(rewards: np.ndarray, group_size: int, scale: bool) -> np.ndarray:
    """TRL's GRPOTrainer advantages, written as it computes them, in torch (unbiased std)."""
    torch = pytest.importorskip("torch")  # (CI's Python 3.12 leg has none)
    r = torch.tensor(rewards, dtype=torch.float64)
    grouped = r.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    std = grouped.std(dim=1).repeat_interleave(group_size)
    advantages = r - mean
    if scale:
        advantages = advantages / (std + 1e-4)
    return advantages.numpy()


@pytest.mark.torch
@pytest.mark.parametrize("advantage", ["group", "mean_only"])
def test_group_advantages_match_trl(advantage):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=4 * 5) * 3
    rewards[5:10] = 0.7  # an equal group
    rewards[10:15] = [1, 0, 0, 1, 1]  # a binary reward's group
    adv, equal = group_advantages(rewards, 5, advantage)
    assert adv.dtype == np.float32 and adv.shape == (20,)
    want = trl_advantages(rewards, 5, scale=advantage == "group")
    np.testing.assert_allclose(adv, want, rtol=0, atol=1e-6)
    assert equal.tolist() == [False, True, False, False]
    assert (adv[5:10] == 0).all()
    # Negative control: the biased std (numpy's default) is not TRL's
    biased = (rewards[:5] - rewards[:5].mean()) / (rewards[:5].std() + 1e-4)
    if advantage == "group":
        assert np.abs(adv[:5] - biased).max() > 1e-2


def test_group_advantages_of_equal_groups_are_exactly_zero_and_flagged():
    # Three 0.7s: their mean is 0.7 + 1e-16, so r - mean is not 0 until it is set to 0
    rewards = np.array([0.7, 0.7, 0.7, 1.0, 1.0 + 1e-9, 1.0, 0.0, 0.0, 1e-3])
    assert (rewards[:3] - rewards[:3].mean()).any()
    for advantage in ("group", "mean_only"):
        adv, equal = group_advantages(rewards, 3, advantage)
        assert (adv[:3] == 0).all()
        assert equal.tolist() == [True, True, False]  # (within 1e-6, as well as exactly)


def test_group_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="group_size 4"):
        group_advantages(np.zeros(10), 4, "group")
    with pytest.raises(ValueError, match="advantage"):
        group_advantages(np.zeros(8), 4, "whiten")
