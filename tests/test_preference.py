"""Preference tuning (train.objective: dpo): the fused per-token log-probs against a plain
log-softmax, the pair losses against TRL's, and a packed, balanced, routed DPO step against the
same pairs' documents computed one by one (each alone in its bucket, its media encoded for it),
with a reference policy that is not the policy."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pairs import PairSource, document

import sharding
from jaxmllm.batch.bucketize import bucketize
from jaxmllm.config import load_config
from jaxmllm.config.phases import ENCODERS
from jaxmllm.config.sections import PreferenceConfig
from jaxmllm.models.loss import Head, token_logps, token_logps_and_entropy
from jaxmllm.plan.contract import ItemPlan, StepPlan
from jaxmllm.resolve.run import resolve_run
from jaxmllm.resolve.sizing import capacities, planner_from_config
from jaxmllm.step.preference import PairSums, pair_losses, reference_weights
from jaxmllm.step.program import RouterLoss, build_program

C, D, CHUNK, WIDTH, VOCAB = 3, 2, 8, 16, 40


# ----------------------------------------------------------------------------- token log-probs


@pytest.mark.parametrize("rows_first", [True, False], ids=["tied", "head"])
def test_token_logps_and_their_gradients_equal_a_plain_log_softmax(rows_first):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(C, D, CHUNK, WIDTH)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, VOCAB, (C, D, CHUNK)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(C, D, CHUNK)), jnp.float32)  # a per-token weight
    shape = (VOCAB, WIDTH) if rows_first else (WIDTH, VOCAB)
    w = jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
    head = Head(rows_first, 2.0)

    def plain(w, h):
        logits = jnp.einsum("...w,wv->...v", h, w.T if rows_first else w, precision="highest")
        logp = jax.nn.log_softmax(logits / 2.0, axis=-1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]

    np.testing.assert_allclose(token_logps(w, h, targets, head), plain(w, h), rtol=1e-5, atol=1e-5)
    fused = jax.grad(lambda w, h: jnp.sum(g * token_logps(w, h, targets, head)), (0, 1))(w, h)
    want = jax.grad(lambda w, h: jnp.sum(g * plain(w, h)), (0, 1))(w, h)
    for a, b in zip(fused, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # only the gradient asked for is computed: a frozen head gets none
    only_h = jax.grad(lambda h: jnp.sum(g * token_logps(w, h, targets, head)))(h)
    np.testing.assert_allclose(only_h, want[1], rtol=1e-4, atol=1e-5)
    # with each token's entropy (a metric beside the same log-probs and their gradients)
    logps, entropy = token_logps_and_entropy(w, h, targets, head)
    logits = jnp.einsum("...w,wv->...v", h, w.T if rows_first else w, precision="highest") / 2
    p = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(entropy, -jnp.sum(p * jnp.log(p), -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logps, plain(w, h), rtol=1e-5, atol=1e-5)
    both = lambda w, h: jnp.sum(g * token_logps_and_entropy(w, h, targets, head)[0])
    for a, b in zip(jax.grad(both, (0, 1))(w, h), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the formulas


def _sums(rng, n):
    tokens = lambda: jnp.asarray(rng.integers(1, 30, n), jnp.float32)
    return PairSums(
        jnp.asarray(rng.normal(size=n) * 20 - 40, jnp.float32),
        jnp.asarray(rng.normal(size=n) * 20 - 40, jnp.float32),
        tokens(),
        tokens(),
    )


@pytest.mark.torch
@pytest.mark.parametrize(
    "loss,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("simpo", 0.1)]
)
def test_pair_losses_equal_trl(loss, smoothing):
    """TRL's `CPOTrainer.cpo_loss` is DPO's sigmoid (conservative with label smoothing) and
    ipo when given the log-ratios to the reference (summed; averaged for ipo), and simpo given
    the policy's averaged log-probs."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    rng = np.random.default_rng(1)
    pol, ref = _sums(rng, 64), _sums(rng, 64)
    ref = ref._replace(chosen_tokens=pol.chosen_tokens, rejected_tokens=pol.rejected_tokens)
    pref = PreferenceConfig(loss=loss, beta=0.3, label_smoothing=smoothing, simpo_gamma=0.7)
    ours = pair_losses(pref, pol, ref)
    trainer = types.SimpleNamespace(
        alpha=0.0,
        loss_type=loss,
        beta=0.3,
        label_smoothing=smoothing,
        simpo_gamma=0.7,
        accelerator=types.SimpleNamespace(device="cpu"),
    )
    t = lambda x: torch.tensor(np.asarray(x), dtype=torch.float64)  # noqa: E731
    c, r = pol.chosen - ref.chosen, pol.rejected - ref.rejected
    if loss == "ipo":
        c, r = c / pol.chosen_tokens, r / pol.rejected_tokens
    if loss == "simpo":
        c, r = pol.chosen / pol.chosen_tokens, pol.rejected / pol.rejected_tokens
    want, chosen, rejected = CPOTrainer.cpo_loss(trainer, t(c), t(r))
    np.testing.assert_allclose(ours["loss"], want.numpy(), rtol=1e-4, atol=1e-6)
    if loss != "ipo":  # (TRL's DPO rewards are on the summed log-ratios, whatever the loss)
        np.testing.assert_allclose(ours["rewards/chosen"], chosen.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ours["rewards/rejected"], rejected.numpy(), rtol=1e-4)


def test_sft_weight_adds_the_chosen_mean_nll():
    rng = np.random.default_rng(2)
    pol, ref = _sums(rng, 8), _sums(rng, 8)
    plain = pair_losses(PreferenceConfig(), pol, ref)["loss"]
    more = pair_losses(PreferenceConfig(sft_weight=0.5), pol, ref)["loss"]
    np.testing.assert_allclose(more - plain, -0.5 * pol.chosen / pol.chosen_tokens, rtol=1e-5)


# ----------------------------------------------------------------------------- the step


@pytest.fixture(scope="module")
def planned():
    """tiny.yaml's model on 8 devices (4 data x 2 fsdp), its built-in data as pairs, one
    planned step and its host arrays (no program: the fast test reads the plan alone)."""
    cfg = load_config(
        "configs/tiny.yaml",
        ["data.synthetic.num_samples=128", "batch.llm_row_len=384", "train.objective=dpo"],
    )
    run = resolve_run(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="sft"))
    )
    cfg = dataclasses.replace(
        run.cfg,
        train=dataclasses.replace(run.cfg.train, objective="dpo"),
        batch=dataclasses.replace(run.cfg.batch, llm_tiles=160),
        preference=PreferenceConfig(beta=2.0, label_smoothing=0.1),  # (conservative DPO)
    )
    pairs = PairSource(run.source, run.index)
    caps = capacities(cfg, 8)
    plan = planner_from_config(cfg, pairs.index, 8).plan()
    samples = {int(i): pairs[int(i)] for i in np.unique(plan.samples)}
    host = bucketize(plan, samples, cfg, caps, index=pairs.index)
    return types.SimpleNamespace(cfg=cfg, run=run, caps=caps, plan=plan, samples=samples, host=host)


@pytest.fixture(scope="module")
def setup(planned):
    """`planned`, with its program and a policy and a different reference."""
    with jax.set_mesh(planned.run.mesh):
        prog = build_program(planned.cfg, planned.run.mesh)
        state = prog.init()
        noise = lambda x: x + 0.02 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)  # noqa: E731
        state = {**state, "params": jax.tree.map(noise, state["params"])}  # (policy != ref)
        state = prog.with_reference(state, prog.initial_weights())
    return types.SimpleNamespace(**vars(planned), prog=prog, state=state)


def test_a_pairs_sequences_sit_in_one_bucket_and_its_media_fill_both(planned):
    b = planned.host
    for m in range(b["llm_sequence"].shape[0]):
        for d in range(b["llm_sequence"].shape[1]):
            seq = b["llm_sequence"][m, d]
            n = int(b["llm_pairs"][m, d])
            assert set(np.unique(seq[seq >= 0]).tolist()) == set(range(2 * n))
    # every placeholder of both documents reads a row (none left at -1 among vision slots)
    for p in ENCODERS:
        src = b.get(p.src)
        if src is None:
            continue
        slots = np.isin(b["llm_tokens"], list(planned.run.source.specials.phase_ids(p.name)))
        assert (src[slots] >= 0).all()
        for bucket in src.reshape(-1, src[0, 0].size):  # each row read by two slots
            counts = np.unique(bucket[bucket >= 0], return_counts=True)[1]
            assert (counts == 2).all()


def _one_by_one_batches(setup):
    """Every document of the step's pairs alone in a bucket (device j of microbatch m), its
    media encoded on that device, bucketized as SFT samples: [(host batch, [(pair k, side)])]."""
    cfg = dataclasses.replace(
        setup.cfg, train=dataclasses.replace(setup.cfg.train, objective="sft")
    )
    docs = [(k, s) for k in range(len(setup.plan.samples)) for s in (0, 1)]
    m_n, d_n = setup.host["llm_tokens"].shape[:2]
    out = []
    for start in range(0, len(docs), m_n * d_n):
        group = docs[start : start + m_n * d_n]
        samples = {
            j: document(setup.samples[int(setup.plan.samples[k])], s)
            for j, (k, s) in enumerate(group)
        }
        where = np.arange(len(group))
        items = {}
        for p in ENCODERS:
            owner, item, offset = [], [], []
            for j, x in samples.items():
                at = 0
                for i, it in enumerate(x.media[p.name]):
                    owner.append(j), item.append(i), offset.append(at)
                    at += len(it[0])
            owner = np.asarray(owner, np.int64)
            dev = (where % d_n)[owner] if len(owner) else owner
            items[p.name] = ItemPlan(owner, np.asarray(item, np.int64), dev, np.asarray(offset))
        zero = np.zeros(len(group), np.int64)
        plan = StepPlan(0, where, where // d_n, where % d_n, zero, zero.copy(), items)
        out.append((bucketize(plan, samples, cfg, setup.caps), group))
    return out


def _doc_sums_fn(setup):
    """(params, frozen, stacked batches) -> each document's (completion log-prob sum, every
    token's sum, completion tokens) [groups, M, D], and the documents' (pair, side)."""
    parts = setup.prog.parts
    batches = _one_by_one_batches(setup)
    stacked = {k: jnp.asarray(np.stack([b[k] for b, _ in batches])) for k in batches[0][0]}

    def doc_sums(params, frozen):
        def one(b):
            model = parts.merge(params, frozen)

            def micro(mb):
                logps = model.token_logps_and_router(mb)[0]
                mask, real = mb["llm_loss_mask"], (mb["llm_segment_ids"] > 0).astype(jnp.float32)
                total = lambda x: x.sum((-2, -1))  # noqa: E731
                return total(logps * mask), total(logps * real), total(mask)

            return jax.lax.map(micro, b)

        return jax.lax.map(one, stacked)

    return doc_sums, [g for _, g in batches]


def _pairs_of(values, owners, ref_values):
    """PairSums of the policy and of the reference from per-document values."""
    flat = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731
    table = {}
    for g, group in enumerate(owners):
        for j, (k, side) in enumerate(group):
            table[k, side] = (
                flat(values[0])[g, j],
                flat(values[1])[g, j],
                flat(ref_values[0])[g, j],
            )
    pairs = sorted({k for k, _ in table})
    col = lambda i, side: jnp.stack([table[k, side][i] for k in pairs])  # noqa: E731
    pol = PairSums(col(0, 0), col(0, 1), col(1, 0), col(1, 1))
    ref = PairSums(col(2, 0), col(2, 1), col(1, 0), col(1, 1))
    return pol, ref


@pytest.fixture(scope="module")
def one_by_one(setup):
    """The step's documents one by one, forward: the policy's and the reference's sums."""
    fn, owners = _doc_sums_fn(setup)
    s = setup.state
    ref_params = reference_weights(s["params"], s["frozen"], s["reference"])
    with jax.set_mesh(setup.run.mesh):
        sums = jax.jit(fn)
        pol = sums(s["params"], s["frozen"])
        ref = sums(*ref_params)
    return fn, owners, pol, ref


def _oracle(one_by_one, pref: PreferenceConfig, every_token: bool = False):
    """The step's loss and metrics from its documents one by one: TRL's formulas (those
    `test_pair_losses_equal_trl` holds `pair_losses` to) over their summed log-probs."""
    _, owners, (c, every, n), (rc, _, _) = one_by_one
    pol, ref = _pairs_of((every if every_token else c, n), owners, (rc,))
    out = pair_losses(pref, pol, ref)
    return {k: float(v.mean()) for k, v in out.items()}


def _step(setup, cfg=None):
    cfg = cfg or setup.cfg
    from jaxmllm.step.preference import make_preference_loss_and_grads

    fn = make_preference_loss_and_grads(cfg, setup.prog.parts, RouterLoss.of(cfg))
    with jax.set_mesh(setup.run.mesh):
        batch = sharding.make_global_batch(setup.host, setup.run.mesh)
        s = setup.state
        loss, grads, metrics = jax.jit(fn)(s["params"], s["frozen"], batch, s["reference"])
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


def _grad_gap(a, b) -> float:
    num = sum(
        float(jnp.sum((x - y) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def _holds_to_the_oracle(loss, metrics, one_by_one, pref, n_pairs):
    """A packed step's loss and metrics are its pairs' one by one (TRL's formulas)."""
    want = _oracle(one_by_one, pref)
    assert loss == pytest.approx(want["loss"], rel=1e-4)
    for key, value in want.items():
        if key != "loss":
            assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert metrics["pairs"] == n_pairs
    # negative controls: the prompt's tokens counted; the policy as its own reference
    unmasked = _oracle(one_by_one, pref, every_token=True)
    assert abs(unmasked["logps/chosen"] - metrics["logps/chosen"]) > 1.0
    assert pref.loss != "sigmoid" or abs(loss - np.log(2)) > 1e-3  # (policy == ref: log 2)


@pytest.mark.slow  # (the DPO program's step compiled: ~30 s; its loss, the same formulas, is
# held fast by test_pair_losses_equal_trl and the packed sequences by the bucket test)
def test_a_training_step_equals_its_pairs_one_by_one_and_keeps_the_reference(setup, one_by_one):
    """The program's own step (conservative DPO, two microbatches): its first loss and metrics
    are its pairs' one by one; over three steps every trained leaf moves and the reference
    stays."""
    prog = setup.prog
    with jax.set_mesh(setup.run.mesh):
        state = jax.tree.map(jnp.copy, setup.state)
        before = jax.device_get(state["reference"])
        batch = sharding.make_global_batch(setup.host, setup.run.mesh)
        losses = []
        for _ in range(3):
            state, metrics = prog.step(state, batch)
            losses.append(float(metrics["loss"]))
            if len(losses) == 1:
                first = {k: float(v) for k, v in metrics.items()}
        after = jax.device_get(state["reference"])
    _holds_to_the_oracle(
        first["loss"], first, one_by_one, setup.cfg.preference, len(setup.plan.samples)
    )
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    # the policy moved (its first step is warm-up's lr 0; at beta 2 the next overshoot: learning is
    # test_preference_learn's); every step finite
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), setup.state["params"], state["params"])
    assert all(jax.tree.leaves(moved)) and np.isfinite(losses).all()
    assert "reference" not in prog.saved(state)
    # the reference holds what trains (no adapters here): every trained leaf, no frozen one
    assert len(jax.tree.leaves(state["reference"])) == len(jax.tree.leaves(state["params"]))


@pytest.mark.slow  # (SimPO's length-normalised step, a program of its own, and the
# one-by-one documents' backward)
def test_a_simpo_steps_loss_and_gradient_equal_its_pairs_one_by_one(setup, one_by_one):
    """SimPO's sums are the packed step's own, normalised by each document's token count; its
    gradient through the fused log-probs, the routed media rows filling both documents and the
    per-bucket pair sums is the one-by-one documents'. (The gradient of DPO's formula is the
    same backward: the step's `grad_fn` takes the reference's sums as a constant and only
    `pair_totals`' formula differs, which `test_pair_losses_equal_trl` holds; DPO's packed loss
    is the fast test's. IPO is left out: its formula is TRL's, on the same per-pair sums as
    DPO's.)"""
    pref = PreferenceConfig(loss="simpo", beta=2.0, label_smoothing=0.1)
    loss, metrics, grads = _step(setup, dataclasses.replace(setup.cfg, preference=pref))
    _holds_to_the_oracle(loss, metrics, one_by_one, pref, len(setup.plan.samples))
    fn, owners, _, (rc, _, _) = one_by_one
    s = setup.state

    def oracle_loss(params):
        c, _, n = fn(params, s["frozen"])
        pol, ref = _pairs_of((c, n), owners, (rc,))
        return pair_losses(pref, pol, ref)["loss"].mean()

    with jax.set_mesh(setup.run.mesh):
        want = jax.jit(jax.grad(oracle_loss))(s["params"])
    assert _grad_gap(grads, want) < 1e-4


def test_the_base_reference_switches_the_adapters_off():
    """With LoRA the reference is the policy with its adapters zeroed (no copy of the base):
    every adapter leaf zero, every other leaf the policy's own, a given leaf in its place."""
    ones = lambda: jnp.ones(3)  # noqa: E731
    params = {"llm": {"q": {"kernel": ones(), "lora_a": ones(), "lora_b": ones()}}}
    frozen = {"vision": {"kernel": ones()}}
    ref_params, ref_frozen = reference_weights(params, frozen, {"vision": {"kernel": jnp.zeros(3)}})
    assert not ref_params["llm"]["q"]["lora_a"].any() and not ref_params["llm"]["q"]["lora_b"].any()
    assert ref_params["llm"]["q"]["kernel"].all() and not ref_frozen["vision"]["kernel"].any()
