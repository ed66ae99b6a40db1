"""Online RL (train.objective: grpo): the GRPO step over a rollout packed by the planner, held
to TRL's GRPOTrainer loss over the same completions one per row, and the rollout feed's
bookkeeping (each completion once, the sampling policy's log-probs kept, resumable state)."""

from __future__ import annotations

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmllm.batch.prompts import split_answer
from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.samples import Sample
from jaxmllm.init_from import start_reference
from jaxmllm.loop.rollouts import RolloutIterator, group_samples, rollout_index
from jaxmllm.plan.tiles import packed_tiles
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.grpo import make_grpo_loss_and_grads
from jaxmllm.step.program import build_program

TEXT_ONLY = [
    "model.vision.enabled=false",
    "model.audio.enabled=false",
    *(f"data.synthetic.{k}_fraction=0" for k in ("image", "multi_image", "audio", "video")),
    "data.eval.source=none",
]


def grpo_config(*sets: str):
    """The tiny model, text only, under GRPO."""
    return load_config("configs/tiny.yaml", [*TEXT_ONLY, "train.objective=grpo", *sets])


def completions(n: int, seed: int = 0) -> list[Sample]:
    """`n` prompt-and-completion samples of random bytes (prompts of 4-24 tokens, completions
    of 2-40), each with its own advantage (distinct: the test finds a sample's tokens by it)."""
    rng = np.random.default_rng(seed)
    out = []
    advantages = rng.permutation(np.linspace(-1.5, 1.5, n))
    for k in range(n):
        prompt = rng.integers(3, 250, rng.integers(4, 25))
        answer = rng.integers(3, 250, rng.integers(2, 41))
        tokens = np.concatenate([prompt, answer]).astype(np.int32)
        loss = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(answer), bool)])
        out.append(Sample(k, tokens, loss, advantage=float(advantages[k])))
    return out


def per_completion(batch: dict, values: np.ndarray, samples: list[Sample]) -> list[np.ndarray]:
    """Each sample's values at its learned positions, in order, read off the packed batch by
    its advantage (the loss mask marks the positions that predict a completion token)."""
    adv = np.asarray(batch["llm_advantage"]).reshape(-1)
    mask = np.asarray(batch["llm_loss_mask"]).reshape(-1) > 0
    flat = np.asarray(values).reshape(-1)
    return [flat[mask & np.isclose(adv, s.advantage)] for s in samples]


class _Accelerator:
    """What TRL's loss asks of accelerate on one process."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_loss(cfg, logps, old, ref, advantages, entropies=None) -> tuple[float, dict]:
    """TRL's GRPOTrainer._compute_loss (loss_type bnpo for `token`, grpo for `sequence`) on
    completions given as lists of per-token arrays (right-padded here, as TRL's batches are),
    with its per-token log-probs (and entropies) forward replaced by these values."""
    loss, metrics = trl_compute_loss(cfg, logps, old, ref, advantages, entropies)
    return float(loss), metrics


def trl_compute_loss(cfg, logps, old, ref, advantages, entropies=None, dtype="float64"):
    """`trl_loss`'s (loss tensor, TRL's metrics); a completion given as a torch tensor keeps
    its autograd graph (torch's gradient of TRL's loss: tests/test_grpo_grad.py), the others
    become `dtype` tensors."""
    torch = pytest.importorskip("torch")
    from trl.trainer.grpo_trainer import GRPOTrainer

    dtype = getattr(torch, dtype)
    width = max(len(x) for x in logps)

    def pad(rows):
        tensor = lambda r: r if torch.is_tensor(r) else torch.as_tensor(np.asarray(r), dtype=dtype)
        return torch.stack([torch.nn.functional.pad(tensor(r), (0, width - len(r))) for r in rows])

    mask = pad([np.ones(len(x)) for x in logps])
    rl = cfg.rl
    fake = types.SimpleNamespace(
        loss_type={"token": "bnpo", "sequence": "grpo"}[rl.loss_aggregation],
        beta=rl.kl_beta,
        epsilon_low=rl.clip_low,
        epsilon_high=rl.clip_high,
        importance_sampling_level="token",
        off_policy_mask_threshold=None,
        top_entropy_quantile=1.0,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False),
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    entropy = mask * 0 if entropies is None else pad(entropies)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (pad(logps), entropy, None)
    inputs = {
        "prompt_ids": torch.zeros(len(logps), 1, dtype=torch.long),
        "prompt_mask": torch.ones(len(logps), 1, dtype=torch.long),
        "completion_ids": torch.zeros(len(logps), width, dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.as_tensor(np.asarray(advantages), dtype=dtype),
        "old_per_token_logps": pad(old),
        "ref_per_token_logps": pad(ref),
    }
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


@pytest.mark.torch  # (TRL, the oracle, runs on torch)
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_packed_rollouts_second_update_is_trls_loss_over_its_completions(aggregation):
    """A rollout of 12 completions packed by the planner over 4 devices x 2 microbatches, two
    updates on it: the second step's loss (its ratio against the first's sampling policy, its
    clipping at 0.2 / 0.28, its k3 KL against the starting weights, all at temperature 0.7),
    clip shares and entropy (the fused projection's, against the whole logits') equal TRL's over
    the same completions; the first's ratio is 1 and its KL 0."""
    cfg = grpo_config(
        f"rl.loss_aggregation={aggregation}",
        "rl.updates_per_rollout=2",
        "rl.kl_beta=0.1",
        "rl.clip_high=0.28",
        "rl.temperature=0.7",
        "optim.lr=0.03",
        "optim.warmup_steps=0",
        "optim.weight_decay=0",
        "batch.llm_row_len=128",
    )
    run = resolve_run(cfg)
    with jax.set_mesh(run.mesh):
        prog = build_program(run.cfg, run.mesh)
        state = start_reference(run.cfg, prog, prog.init())
        start = jax.tree.map(jnp.copy, prog.weights(state))
        feed = RolloutIterator(run, prog, lambda: prog.weights(state))
        samples = completions(12)
        [step] = feed.plan(samples, prog.weights(state))
        batch = step["batch"]
        state, first = prog.step(state, batch)
        assert float(first["rl/ratio"]) == pytest.approx(1.0, abs=1e-6)
        assert float(first["rl/kl"]) == pytest.approx(0.0, abs=1e-6)
        now = jax.tree.map(jnp.copy, prog.weights(state))
        state, second = prog.step(state, batch)
        logps = feed.logps(now["params"], now["frozen"], batch)
        ref = feed.logps(start["params"], start["frozen"], batch)
        entropy = entropies(prog.parts.merge(now["params"], now["frozen"]), batch, 0.7)
    host = jax.device_get(batch)
    cur = per_completion(host, jax.device_get(logps), samples)
    old = per_completion(host, host["llm_old_logps"], samples)
    refs = per_completion(host, jax.device_get(ref), samples)
    ent = per_completion(host, entropy, samples)
    assert [len(x) for x in cur] == [int(s.loss.sum()) for s in samples]  # each once, whole
    loss, metrics = trl_loss(run.cfg, cur, old, refs, [s.advantage for s in samples], ent)
    assert float(second["loss"]) == pytest.approx(loss, rel=1e-4, abs=1e-6)
    for ours, theirs in [
        ("rl/clip_low", "clip_ratio/low_mean"),
        ("rl/clip_high", "clip_ratio/high_mean"),
        ("rl/clip_region", "clip_ratio/region_mean"),
        ("rl/kl", "kl"),
        ("rl/entropy", "entropy"),
    ]:
        assert float(second[ours]) == pytest.approx(metrics[theirs], rel=1e-4, abs=1e-6), ours
    assert float(second["rl/clip_region"]) > 0  # (the lr moves the ratio past its clips)
    # the first update made the completions with an advantage likelier, the others less likely
    moved = [float(np.mean(c - r)) for c, r in zip(cur, refs, strict=True)]
    adv = np.array([s.advantage for s in samples])
    assert np.mean(np.array(moved)[adv > 0]) > 0 > np.mean(np.array(moved)[adv < 0]), moved


def entropies(model, batch: dict, temperature: float) -> np.ndarray:
    """Each token's entropy of its next-token distribution at `temperature` [M, D, R, L], from
    the model's whole logits (what the fused projection must equal without forming them)."""
    logits = jax.jit(lambda mb: jax.lax.map(model, mb))(batch) / temperature
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(-jnp.sum(jnp.exp(logp) * logp, -1))


def test_a_rollout_index_counts_text_and_items_as_the_planner_does():
    samples = completions(3)
    index = rollout_index(samples, types.SimpleNamespace(phase_ids=lambda name: []))
    assert index.text.tolist() == [len(s.tokens) for s in samples]


def test_a_completion_that_cannot_fit_a_row_is_refused_naming_the_keys():
    cfg = grpo_config("rl.max_new_tokens=400")
    run = resolve_run(cfg)
    with jax.set_mesh(run.mesh), pytest.raises(ConfigError, match="batch.llm_row_len"):
        RolloutIterator(run, build_program(run.cfg, run.mesh), dict)


def test_a_rollout_over_several_steps_says_once_the_rows_that_hold_it_in_one(caplog):
    """48 completions (~1,700 tokens) where a step holds 1,024: planned over several steps
    (each once), and the log says so once a run, naming batch.llm_rows and a number of rows
    with which the same rollout is planned in one step."""
    import re

    sets = ["batch.llm_row_len=64", "rl.max_new_tokens=8"]
    samples = completions(48)
    steps = {}
    for rows in (1, None):
        if rows is None:  # (the rows the warning named)
            [said] = [r.message for r in caplog.records if "training steps" in r.message]
            rows = int(re.search(r"raise batch.llm_rows to (\d+) or more", said).group(1))
        run = resolve_run(grpo_config(*sets, f"batch.llm_rows={rows}"))
        with jax.set_mesh(run.mesh):
            prog = build_program(run.cfg, run.mesh)
            weights = prog.weights(prog.init())
            feed = RolloutIterator(run, prog, dict)  # (plan is given the weights)
            with caplog.at_level("WARNING", logger="jaxmllm"):
                steps[rows] = [len(feed.plan(samples, weights)) for _ in range(2)]
    [first, named] = steps
    assert steps[first][0] > 1 and steps[named] == [1, 1], steps
    said = [r.message for r in caplog.records if "training steps" in r.message]
    assert len(said) == 1, said  # (once a run: the second rollout over several says nothing)
    assert "a step holds 1024 (batch.llm_rows=1 x batch.llm_row_len=64 x 16 buckets" in said[0]


# ----------------------------------------------------------------------------- runs

# A GRPO run of the tiny model from random weights, on the built-in images' questions (the
# mechanics, not learning: configs/tiny_grpo.yaml learns from the SFT model)
RUN = [
    "model.audio.enabled=false",
    *(f"data.synthetic.{k}_fraction=0" for k in ("audio", "video")),
    "data.synthetic.image_fraction=1.0",
    "data.synthetic.max_image_side=8",
    "data.eval.source=none",
    "train.objective=grpo",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.max_new_tokens=8",
    "train.steps=4",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.progress_bar=false",
]


def test_a_reward_that_raises_stops_the_run_naming_the_function_and_the_record(
    tmp_path, monkeypatch
):
    from jaxmllm import train
    from jaxmllm.data.rewards import RewardError

    (tmp_path / "my_rewards.py").write_text(
        "def broken(record, completion):\n    return {'score': 1}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = [*RUN, f"train.output_dir={tmp_path / 'run'}", "rl.rewards=[{name: my_rewards:broken}]"]
    with pytest.raises(RewardError, match=r"my_rewards:broken.*record") as e:
        train.main(load_config("configs/tiny.yaml", sets))
    assert "{'score': 1}" in str(e.value)


@pytest.mark.slow  # ~1 min: three short GRPO runs of the tiny model
def test_a_killed_run_resumes_to_the_same_rollouts_and_weights(tmp_path):
    """A rollout is a function of the weights that sampled it and its number: a run stopped
    after step 2 (its checkpoint) and rerun samples the same completions, earns the same
    rewards and trains the same steps as one run through; a checkpoint waits for its
    rollout's end (three updates a rollout: none is saved inside one)."""
    from jaxmllm import train
    from jaxmllm.loop.metrics import read_metrics

    def run(out, stop_at=None, *more):
        def on_step(done, _):
            if done == stop_at:
                raise KeyboardInterrupt

        cfg = load_config("configs/tiny.yaml", [*RUN, f"train.output_dir={out}", *more])
        return train.main(cfg, on_step=on_step)

    run(tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "stopped", 2)
    run(tmp_path / "stopped")
    keys = ("rl/reward", "rl/completion_len_mean", "loss", "grad_norm", "rl/rollout")
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "stopped")
    assert [[r[k] for k in keys] for r in whole] == [[r[k] for k in keys] for r in resumed]
    thrice = ["rl.updates_per_rollout=3", "train.steps=6", "train.checkpoint_every=2"]
    run(tmp_path / "thrice", None, *thrice)
    rows = read_metrics(tmp_path / "thrice")
    pairs = zip(rows, rows[1:], strict=False)
    ends = {r["step"] for r, after in pairs if after["rl/rollout"] != r["rl/rollout"]}
    saved = {int(p.name) for p in (tmp_path / "thrice" / "checkpoints").iterdir()}
    assert len(saved) >= 2 and saved <= ends | {6}, (saved, ends)


@pytest.mark.slow  # ~15 s: indexes a file, two GRPO steps
def test_prompts_with_answers_from_jsonl_reach_the_rewards(tmp_path, monkeypatch):
    """TRL's GRPO records ({"prompt", "solution"} and {"question", "answer"}) in a JSONL file,
    indexed, trained on: each reward call sees the record's question in its prompt and its
    answer as the record's, and the completion the model sampled."""
    import json

    from jaxmllm import train
    from jaxmllm.data.index import build_index
    from jaxmllm.loop.metrics import read_metrics

    data = tmp_path / "math.jsonl"
    lines = [
        {"prompt": f"{a} + {b} =", "solution": str(a + b)}
        if a % 2
        else {"question": f"{a} + {b} =", "answer": a + b}
        for a in range(1, 9)
        for b in (2, 3)
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "spy.py").write_text(
        "import json\n"
        f"def reward(record, completion):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps([record['prompt'], record['answer'], completion]) + '\\n')\n"
        "    return float(completion.strip() == record['answer'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = grpo_config(
        "data.source=files",
        f"data.path={data}",
        "data.tokenizer=byte",
        "data.workers=0",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rl.max_new_tokens=6",
        "rl.rewards=[{name: spy:reward}, {name: exact_answer, weight: 0.5}]",
        "train.steps=2",
        "train.log_every=1",
        "train.progress_bar=false",
        f"train.output_dir={tmp_path / 'run'}",
    )
    build_index(cfg, progress=False)
    train.main(cfg)
    calls = [json.loads(x) for x in seen.read_text().splitlines()]
    assert len(calls) == 2 * 2 * 2  # (steps x prompts x group)
    truth = {f"{a} + {b} =": str(a + b) for a in range(1, 9) for b in (2, 3)}
    for prompt, answer, completion in calls:
        [question] = [q for q in truth if q in prompt]
        assert answer == truth[question] and isinstance(completion, str)
    rows = read_metrics(tmp_path / "run")
    assert [r["rl/skipped_prompts"] for r in rows] == [0, 0]
    assert {"rl/reward/spy:reward", "rl/reward/exact_answer"} <= set(rows[0])


@pytest.mark.parametrize(
    "sets, key",
    [
        (["rl.group_size=1"], "rl.group_size"),
        (["rl.temperature=0"], "rl.temperature"),
        (["rl.advantage=ratio"], "rl.advantage"),
        (["rl.loss_aggregation=batch"], "rl.loss_aggregation"),
        (["rl.rewards=[{name: regex}]"], "pattern"),
        (["rl.rewards=[{name: nomodule}]"], "name"),
        (["rl.kl_beta=0.1", "preference.reference=precomputed"], "preference.reference"),
        (["mesh.context=2", "mesh.data=2"], "mesh.context"),
    ],
)
def test_a_bad_rl_setting_is_refused_naming_its_key(sets, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        grpo_config(*sets)


def test_a_rollout_whose_cache_cannot_fit_is_refused_naming_the_keys(monkeypatch):
    from jaxmllm.step import generate

    cfg = grpo_config()
    run = resolve_run(cfg)
    with jax.set_mesh(run.mesh):
        prog = build_program(run.cfg, run.mesh)
        feed = RolloutIterator(run, prog, lambda: {})
        monkeypatch.setattr(generate, "memory_bytes", lambda: 1000)
        with pytest.raises(ConfigError, match=r"rl\.prompts_per_step, rl\.group_size"):
            feed.generator(completions(4))


def test_a_group_is_prefilled_once_and_decoded_as_its_copies_would_be(monkeypatch):
    """Generator(repeat=G): each prompt's prefill runs once (its media encoded once: the prefill
    batch holds each prompt once) and its cache serves G rows; greedy, each of the G answers is
    the one the prompt gets alone; sampled, a group's answers differ."""
    from jaxmllm.batch.prompts import PromptShapes
    from jaxmllm.step import generate as gen

    cfg = grpo_config()
    run = resolve_run(cfg)
    prompts = [dataclasses.replace(s, tokens=s.tokens[:9], loss=s.loss[:9]) for s in completions(3)]
    batches = []
    laid_out = gen.prompt_batch
    monkeypatch.setattr(
        gen, "prompt_batch", lambda p, *a: batches.append(len(p)) or laid_out(p, *a)
    )
    with jax.set_mesh(run.mesh):
        weights = build_program(run.cfg, run.mesh).init()
        shapes = PromptShapes.fit(prompts, run.cfg, 6)
        grouped = gen.Generator(run.cfg, shapes, repeat=4)
        alone = gen.Generator(run.cfg, PromptShapes.fit(prompts * 4, run.cfg, 6))
        args = (weights["params"], weights["frozen"])
        greedy = grouped.generate(*args, prompts, max_new_tokens=6)
        each = alone.generate(*args, [p for p in prompts for _ in range(4)], max_new_tokens=6)
        sampled = grouped.generate(*args, prompts, max_new_tokens=6, temperature=5.0, seed=1)
    assert batches == [3, 12, 3]  # (the grouped generator's prefill: the 3 prompts once)
    assert [a.ids for a in greedy] == [a.ids for a in each]
    assert len({tuple(a.ids) for a in sampled[:4]}) > 1


def test_a_rollouts_sampling_time_leaves_out_the_wait_for_its_weights():
    """time/rollout_s is sampling's (the prompts, prefill and decoding), not the wait for the
    policy's weights: the last step's update, dispatched asynchronously, ends there, and counted
    as sampling it made sampling look most of a step. Here the policy takes 2 s to give them."""
    import time

    cfg = grpo_config("rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=4")
    run = resolve_run(cfg)
    with jax.set_mesh(run.mesh):
        prog = build_program(run.cfg, run.mesh)
        weights = prog.weights(prog.init())
        feed = RolloutIterator(run, prog, lambda: time.sleep(2.0) or weights)
        feed.prompts = lambda: [
            types.SimpleNamespace(sample=s, record={"id": s.id, "prompt": "", "answer": ""})
            for s in completions(2)
        ]
        start = time.perf_counter()
        [step] = feed.roll()
        took = time.perf_counter() - start
    metrics = step["info"].extra
    assert 0 < metrics["time/rollout_s"] <= took - 2.0, (metrics["time/rollout_s"], took)


def test_a_rollout_is_planned_once_without_repeats_in_the_fewest_steps():
    """A rollout is a finite set: the balancer reads no sample past its end (no repeat takes a
    straggler's room) and defers for at most two steps, so a rollout that fits a step's rows
    is one step holding each completion once; with the endless stream's settings the same set
    came back to fill the step (computed, masked, paid for)."""
    from jaxmllm.loop.rollouts import drain

    cfg = grpo_config()
    run = resolve_run(cfg)
    samples = completions(40)
    with jax.set_mesh(run.mesh):
        feed = RolloutIterator(run, build_program(run.cfg, run.mesh), lambda: None)
        steps = feed.plan(samples, {"params": None, "frozen": None})  # (one step: no old log-probs)
    tokens = sum(len(s.tokens) for s in samples)
    [step] = steps
    batch = jax.device_get(step["batch"])
    assert int((batch["llm_segment_ids"] > 0).sum()) == tokens  # (every token once, no repeat)
    endless = run.planner(rollout_index(samples, feed.specials))
    planned = endless.plan().samples
    assert len(planned) > len(samples)  # (the endless stream repeats to fill the step)
    drain(endless)
    assert endless.max_age == 2 and endless.finite


# The tiny model with images under GRPO, a group of 3 completions a prompt
IMAGE_GROUPS = [
    "model.audio.enabled=false",
    *(f"data.synthetic.{k}_fraction=0" for k in ("audio", "video")),
    "data.synthetic.image_fraction=1.0",
    "data.synthetic.max_image_side=8",
    "data.eval.source=none",
    "train.objective=grpo",
    "rl.group_size=3",
]


def image_group(run, specials, seed: int = 0):
    """A prompt of the data with an image (its sample before its answer), 3 completions of
    random ids and their advantages."""
    prompt = next(
        split[0]
        for split in (split_answer(run.source[i], specials) for i in range(len(run.source)))
        if split is not None and split[0].media["vision"]
    )
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, 250, rng.integers(3, 12)).astype(np.int32) for _ in range(3)]
    return prompt, ids, np.array([-1.1, 0.4, 0.7])


def group_batches(run, feed, seed: int = 0, sampling=None) -> tuple[list, dict, dict]:
    """(the prompt's vision items, the step batch of a group of 3 completions as one sample of
    3 documents sharing the prompt's image, the step batch of the same completions a sample
    each, each with its own copy of the image); `sampling`: the sampling policy's weights, whose
    log-probs the batches keep (rl.updates_per_rollout > 1)."""
    prompt, ids, adv = image_group(run, feed.specials, seed)
    room = feed.room(prompt)
    grouped = group_samples(prompt, ids, adv, room)
    assert len(grouped) == 1 and len(grouped[0].documents) == 3  # (one sample, 3 documents)
    alone = [s for k in range(3) for s in group_samples(prompt, ids[k : k + 1], adv[k:], room, k)]
    none = {"params": None, "frozen": None}  # (one step, one update: no old log-probs)
    [one], [each] = (feed.plan(samples, sampling or none) for samples in (grouped, alone))
    return prompt.media["vision"], one["batch"], each["batch"]


def test_a_groups_image_is_encoded_once_in_the_step_and_read_by_each_completion():
    """A prompt's G completions are one sample of G documents sharing its media: the step's
    vision phase encodes the image once (its patches once in the vision buckets, where a
    sample a completion encodes them G times), and each completion's slots read those rows."""
    run = resolve_run(load_config("configs/tiny.yaml", IMAGE_GROUPS))
    with jax.set_mesh(run.mesh):
        feed = RolloutIterator(run, build_program(run.cfg, run.mesh), lambda: None)
        items, one, each = group_batches(run, feed)
    patches = sum(len(values) for values, _ in items)
    rows = patches // run.caps.per_token["vision"]
    encoded = [int((np.asarray(b["vision_segment_ids"]) > 0).sum()) for b in (one, each)]
    assert encoded == [patches, 3 * patches]
    # A group that overruns a bucket's LLM tiles (here: room for two of its documents) makes
    # as few samples as hold it, each with the image once and its documents' advantages
    prompt, ids, adv = image_group(run, feed.specials)
    n = np.array([len(prompt.tokens) + len(x) for x in ids])
    two = int(packed_tiles(np.array([0, n[0]]), n[:2], run.caps.attention_block, True).sum())
    feed.run = dataclasses.replace(run, caps=dataclasses.replace(run.caps, tiles={"llm": two}))
    parts = group_samples(prompt, ids, adv, feed.room(prompt))
    assert [len(x.documents) for x in parts] == [2, 0]  # (2 documents, then 1: no split)
    assert parts[0].advantage == tuple(adv[:2]) and parts[1].advantage == adv[2]
    assert all(len(x.media["vision"]) == len(prompt.media["vision"]) for x in parts)
    for b, sources in ((one, rows), (each, 3 * rows)):  # (slots: 3 x the image's rows either way)
        src = np.asarray(b["llm_vision_src"])
        m, d = np.nonzero(src >= 0)[:2]  # (each slot's microbatch and device, and its row)
        read = np.unique(np.stack([m, d, src[src >= 0]]), axis=1)
        assert int((src >= 0).sum()) == 3 * rows and read.shape[1] == sources


@pytest.mark.slow  # ~15 s: compiles the GRPO step of the tiny model with images
def test_a_groups_step_is_the_step_of_its_completions_each_with_its_image():
    """Same math: the GRPO loss and the gradient of every parameter over a group of 3
    completions sharing one encoding of the prompt's image equal those over the same
    completions a sample each, each encoding its own copy (within 1e-5 relative), each
    completion its own mean (`sequence`: its weight its document's, not its sample's). The
    sampling policy is another (the weights x 0.9, its log-probs kept as a second update's):
    the ratio is not 1, so the loss depends on every completion's log-probs, image included."""
    sets = ["rl.updates_per_rollout=2", "rl.loss_aggregation=sequence"]  # (a weight a document)
    cfg = load_config("configs/tiny.yaml", [*IMAGE_GROUPS, *sets])
    run = resolve_run(cfg)
    with jax.set_mesh(run.mesh):
        prog = build_program(run.cfg, run.mesh)
        weights = prog.weights(prog.init())
        sampling = {**weights, "params": jax.tree.map(lambda x: 0.9 * x, weights["params"])}
        feed = RolloutIterator(run, prog, lambda: weights)
        _, one, each = group_batches(run, feed, seed=1, sampling=sampling)
        step = jax.jit(make_grpo_loss_and_grads(run.cfg, prog.parts))
        (loss, grads, metrics), (loss_each, grads_each, _) = (
            jax.device_get(step(weights["params"], weights["frozen"], b)) for b in (one, each)
        )
    assert float(loss) == pytest.approx(float(loss_each), rel=1e-5)
    assert abs(float(metrics["rl/ratio"]) - 1) > 1e-3  # (the ratio is not 1)
    flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    theirs = dict(jax.tree_util.tree_leaves_with_path(grads_each))
    assert flat.keys() == theirs.keys()
    vision = [k for k in flat if "vision" in jax.tree_util.keystr(k)]
    assert vision and all(np.abs(flat[k]).max() > 0 for k in vision)  # (the tower learns)
    for k, g in flat.items():
        bound = 1e-5 * max(float(np.abs(theirs[k]).max()), 1e-12)
        assert float(np.abs(g - theirs[k]).max()) <= bound, jax.tree_util.keystr(k)


@pytest.mark.slow  # ~25 s: two GRPO steps of the tiny model with images
def test_groups_whose_answers_all_score_alike_are_left_out_and_counted(tmp_path, monkeypatch):
    """rl.skip_equal_groups: a group whose rewards are all equal (here every prompt of an even
    index: a constant reward) is left out of the step and counted; a rollout whose groups are
    all equal is trained on (every advantage 0) rather than dropped."""
    from jaxmllm import train
    from jaxmllm.loop.metrics import read_metrics

    (tmp_path / "even.py").write_text(
        "def reward(record, completion):\n"
        "    return 1.0 if record['id'] % 2 == 0 else float(len(completion))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = [*RUN, f"train.output_dir={tmp_path / 'run'}", "rl.rewards=[{name: even:reward}]"]
    sets += ["rl.skip_equal_groups=true", "rl.prompts_per_step=4", "rl.group_size=3"]
    sets += ["train.steps=2", "train.checkpoint_every=2"]
    train.main(load_config("configs/tiny.yaml", sets))
    rows = read_metrics(tmp_path / "run")
    assert any(0 < r["rl/equal_groups"] < 1 for r in rows), rows
    for r in rows:
        equal = round(r["rl/equal_groups"] * 4)
        assert r["rl/skipped_groups"] == (equal if equal < 4 else 0), r
