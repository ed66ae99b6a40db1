"""Online RL (`train.objective: grpo`): the rollouts a step samples, how they are scored, and
GRPO's objective over them (`jaxmllm.step.grpo`, `jaxmllm.loop.rollouts`).

Each rollout takes `prompts_per_step` prompts of the data set (records with an answer: the
tokens before a sample's first learned token are its prompt, the learned ones its answer),
samples `group_size` completions of each from the policy being trained, scores each completion
with `rewards` (their weighted sum), and trains `updates_per_rollout` optimizer steps on them,
every one over the whole rollout. With rewards r of a group of G completions, a completion's
advantage is A = (r - mean) / (std + 1e-4) (`advantage: group`; std with Bessel's correction,
TRL's), or r - mean (`mean_only`: Dr. GRPO); each completion token's loss is PPO's clipped
surrogate

    -min(ratio x A, clip(ratio, 1 - clip_low, 1 + clip_high) x A),  ratio = p / p_old,

plus `kl_beta` x the k3 estimate of KL(policy || reference), exp(q - p) - (q - p) - 1 with q
the reference's log-prob (TRL's GRPO `loss_type` grpo / bnpo: `loss_aggregation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxmllm.config.checks import check, positive

if TYPE_CHECKING:
    from jaxmllm.config.sections import MeshConfig, PreferenceConfig, TrainConfig

BUILT_IN_REWARDS = ("exact_answer", "regex", "choice", "format", "math")
ADVANTAGES = ("group", "mean_only")
AGGREGATIONS = ("token", "sequence")


@dataclass(frozen=True)
class RewardConfig:
    """One reward function of `rl.rewards` and its weight in the sum.

    Built-ins (no network): `exact_answer` 1 when the completion, normalised (case, spaces,
    punctuation at its ends), is the record's answer; `regex` the same for the first group of
    `pattern`'s first match in the completion (the whole match without a group); `choice` 1
    when the first multiple-choice letter the completion gives (A-Z, alone or as "(B)", "B.",
    "answer: B") is the answer's; `format` 1 when the whole completion matches `pattern`;
    `math` 1 when math-verify finds the completion's answer equal to the record's (install
    `math-verify`). Or `module:function`, the user's own: called as function(record,
    completion) with the record's prompt, answer and id, returning a number.
    """

    name: str = "exact_answer"  # a built-in (BUILT_IN_REWARDS) or module:function
    weight: float = 1.0
    pattern: str = ""  # regex: where the answer is; format: what the completion must be

    def __post_init__(self):
        builtin = self.name in BUILT_IN_REWARDS
        check(
            builtin or (":" in self.name and all(self.name.split(":", 1))),
            f"{self.name!r} must be one of {BUILT_IN_REWARDS} or module:function",
            "name",
        )
        check(
            self.name not in ("regex", "format") or bool(self.pattern),
            f"{self.name} needs a pattern (a Python regular expression)",
            "pattern",
        )


@dataclass(frozen=True)
class RLConfig:
    """Online RL's rollouts, rewards and objective (`train.objective: grpo`; the Online RL page
    of the docs has the formulas and what a step costs)."""

    prompts_per_step: int = 8  # prompts sampled for each rollout
    group_size: int = 4  # completions sampled of each prompt (G >= 2: the group's statistics)
    # Optimizer steps on each rollout (more than one: the rollout's log-probs under the policy
    # that sampled it are kept, the ratio's p_old)
    updates_per_rollout: int = 1
    max_new_tokens: int = 64  # a completion's longest; one cut there is counted (truncated)
    temperature: float = 1.0  # sampling's (> 0: GRPO learns from the group's differences)
    top_p: float = 1.0  # nucleus sampling's mass
    rewards: tuple[RewardConfig, ...] = (RewardConfig(),)
    advantage: str = "group"  # group: (r - mean) / (std + 1e-4); mean_only: r - mean (Dr. GRPO)
    clip_low: float = 0.2  # the ratio's clip below 1 (PPO's epsilon)
    clip_high: float = 0.2  # above 1 (DAPO's clip-higher: e.g. 0.28)
    # token: the step's loss is the mean over its completion tokens (DAPO, TRL's bnpo); sequence:
    # each completion's mean over its tokens, averaged over the completions (GRPO's paper)
    loss_aggregation: str = "token"
    # The KL penalty's weight against the reference policy (preference.reference: base, or a
    # checkpoint); 0: no reference is held nor run
    kl_beta: float = 0.0
    # Groups whose completions all have the same reward teach nothing (every advantage 0):
    # left out of the training batch and counted (rl/skipped_groups), DAPO's dynamic sampling
    skip_equal_groups: bool = False

    def __post_init__(self):
        positive(self, "prompts_per_step", "updates_per_rollout", "max_new_tokens")
        check(self.group_size >= 2, "must be >= 2 (a group's mean and spread)", "group_size")
        greedy = "must be > 0 (greedy completions of a prompt would all be the same)"
        check(self.temperature > 0, greedy, "temperature")
        check(0 < self.top_p <= 1, "must be in (0, 1]", "top_p")
        check(bool(self.rewards), "name at least one reward", "rewards")
        object.__setattr__(self, "rewards", tuple(self.rewards))
        check(self.advantage in ADVANTAGES, f"must be one of {ADVANTAGES}", "advantage")
        check(0 <= self.clip_low < 1, "must be in [0, 1)", "clip_low")
        check(self.clip_high >= 0, "must be >= 0", "clip_high")
        aggregations = f"must be one of {AGGREGATIONS}"
        check(self.loss_aggregation in AGGREGATIONS, aggregations, "loss_aggregation")
        check(self.kl_beta >= 0, "must be >= 0 (0: no reference)", "kl_beta")

    @property
    def sequences(self) -> int:
        """Completions a rollout samples."""
        return self.prompts_per_step * self.group_size


def check_objective(
    train: TrainConfig, mesh: MeshConfig, rl: RLConfig, preference: PreferenceConfig
) -> None:
    """What a preference or RL objective needs of the rest of the config: a pair's two
    documents and a completion are summed in one device's row (no context group splits them),
    the loss is the one step's (not the pipeline's), and GRPO's KL reference is a policy it
    runs (rollouts are new each step: no log-probs can be computed before training). Takes
    the sections, not the whole config, which is assembled above this module."""
    objective = train.objective
    check(
        mesh.context == 1,
        f"must be 1 with train.objective: {objective} (a pair's documents and a completion "
        "are summed in one device's row; context groups split rows)",
        "mesh.context",
    )
    check(
        mesh.stage == 1,
        f"must be 1 with train.objective: {objective} (pipelined stages train SFT only)",
        "mesh.stage",
    )
    check(
        objective != "grpo" or not rl.kl_beta or preference.reference != "precomputed",
        "precomputed log-probs are the data's, and GRPO's completions are sampled anew each "
        "step: with rl.kl_beta > 0 use base (the starting weights) or a checkpoint",
        "preference.reference",
    )
