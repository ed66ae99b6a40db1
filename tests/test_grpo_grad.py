"""GRPO's loss and gradient against TRL's on transformers' model: the parity of the GRPO step.

Held: for fixed rollouts, rewards and old log-probs, the loss and the gradient of every
parameter that `make_grpo_loss_and_grads` computes (the training step's program: microbatches
scanned, the step's denominator over all of them, log-probs of the fused output projection at
the sampling temperature, the reference policy run inside the step) equal those of TRL's
`GRPOTrainer._compute_loss` (token and sequence aggregation: its bnpo and grpo loss types; the
ratio clipped at 1 - 0.2 and 1 + 0.28; the k3 KL) on transformers' own log-probs of the same
completions (TRL's fused LM head at temperature 0.7, `add_fused_lm_head`, on the checkpoint's
transformers class), differentiated by torch on transformers' parameters.

The model is a tiny random Qwen2.5-VL whole checkpoint loaded by `hf import`'s path
(`towers.load_model`); the reference policy is that policy moved 5% of the way toward a
second random checkpoint (another seed), the same on both sides. The rollout is two groups of
three completions of random ids (one prompt with an image, one of text alone), advantages from
their rewards (`group_advantages`), packed by bucketize as training packs them, two
microbatches of one row each; transformers runs each completion alone. Old log-probs are ours
perturbed, so the ratio leaves the clip range on both sides. Our gradients are mapped to
transformers' tensors by the export's links (`hf_tensors`, the checkpoint's names as
transformers names its parameters): gradients are linear in a parameter the way the parameter
is, so the mapping of the weights is the mapping of their gradients. Bounds: the loss within
1e-4 (relative); each tensor's gradient within 1e-4 x max(1, the largest of transformers'
gradient of that tensor).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from test_grpo import trl_compute_loss
from test_hf_whole_train import whole_dir

from jaxmllm.batch.prompts import packed_row
from jaxmllm.data.rewards import group_advantages
from jaxmllm.data.samples import Sample
from jaxmllm.hf.check import _torch, hf_module
from jaxmllm.hf.check_whole import (
    _image_sample,
    _text_sample,
    check_specials,
    hf_vocab,
    text_pool,
)
from jaxmllm.hf.export import hf_tensors
from jaxmllm.hf.registry import read_hf_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.towers import load_model
from jaxmllm.hf.whole import Part
from jaxmllm.hf.wholes import whole_for
from jaxmllm.step.grpo import make_grpo_loss_and_grads, make_logps_program
from jaxmllm.step.program import ModelParts
from sharding.rules import keyed_leaves

pytest.importorskip("trl")
pytestmark = pytest.mark.torch  # (transformers' model, TRL's loss: the oracle runs on torch)

TEMPERATURE = 0.7
BOUND = 1e-4
MIX = np.float32(0.05)
REWARDS = [[1.0, 0.0, 0.4], [0.2, 1.5, -0.5]]  # (two groups of three)
LENGTHS = [[9, 14, 8], [7, 15, 16]]  # each completion's tokens, by group
# The microbatches' completions (group, k): each row the same length once rounded, one image
# or two in its vision row (one capacity): the two stack as a step's [M, ...] batch
MICRO = [[(0, 0), (0, 1), (1, 0)], [(0, 2), (1, 1), (1, 2)]]
PER_SAMPLE = ("input_ids", "mm_token_type_ids")  # (transformers' inputs that take a batch axis)


@dataclasses.dataclass
class Checkpoints:
    """The policy's and the reference's checkpoints, loaded on both sides."""

    cfg: object
    hf: dict
    whole: object
    policy: str  # the policy's directory
    other: str  # the checkpoint the reference is moved toward
    params: dict  # ours, the policy's
    ref_params: dict  # ours, the reference policy's (`toward`)
    parts: ModelParts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    """A tiny Qwen2.5-VL loaded as `hf import` loads it, every parameter trained (nothing
    frozen), and its reference policy: the policy moved MIX of the way toward another random
    checkpoint of its architecture (another seed)."""
    d = tmp_path_factory.mktemp("grpo_grad")
    policy = whole_dir("qwen2_5_vl", d / "policy")
    other = whole_dir("qwen2_5_vl", d / "other", seed=1)
    cfg, model = load_model(policy, policy)
    _, other_model = load_model(other, other)
    hf = read_hf_config(policy)
    assert cfg.model.llm.vocab_size == hf_vocab(hf)  # (no placeholder rows added: all columns)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return Checkpoints(
        cfg=cfg,
        hf=hf,
        whole=whole_for(hf),
        policy=policy,
        other=other,
        params=params,
        ref_params=jax.tree.map(
            toward, jax.device_get(params), nnx.to_pure_dict(nnx.state(other_model, nnx.Param))
        ),
        parts=ModelParts(graphdef, abstract, frozen_keys=()),
    )


def toward(policy, other):
    """A reference policy's parameter: the policy's moved MIX of the way toward `other`'s
    (the same on both sides: the mapping between them is linear). The k3 KL at MIX is ~0.5 a
    token, its share of the loss about the clipped surrogate's (between the two random
    checkpoints themselves ~24: its exponential would drown the surrogate's gradient)."""
    return policy + MIX * (np.asarray(other) - policy)


def grpo_config(cfg, aggregation: str):
    """The loaded model's config under GRPO: temperature 0.7, clips 0.2 / 0.28, k3 KL 0.1."""
    rl = dataclasses.replace(
        cfg.rl,
        loss_aggregation=aggregation,
        temperature=TEMPERATURE,
        clip_low=0.2,
        clip_high=0.28,
        kl_beta=0.1,
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="grpo"), rl=rl)


def rollout(ck: Checkpoints) -> tuple[list[list[Sample]], object]:
    """Two groups of three completions (random ids of the checkpoint's own vocabulary, none a
    placeholder or a special of the row) of two prompts: one with a 6 x 4-patch image (two of
    the tower's windows), one of text alone; each completion's advantage its group's
    (`group_advantages` of REWARDS); the loss on the completion's tokens only. By group, and
    the row's special ids."""
    hf, whole = ck.hf, ck.whole
    rng = np.random.default_rng(0)
    pool, spare = text_pool(hf, hf_vocab(hf))
    specials = check_specials(whole, hf, spare)
    text = lambda n: rng.choice(pool, n)
    wrap = [[hf["vision_start_token_id"]], [hf["vision_end_token_id"]]]
    token = whole.token_id("vision", hf)
    _, image = _image_sample(ck.cfg, (6, 4), token, wrap, rng, text, 5, 7)
    prompts = [image, _text_sample(text(11))]
    advantages, _ = group_advantages(np.ravel(REWARDS), 3, "group")
    groups = []
    for g, (prompt, lengths) in enumerate(zip(prompts, LENGTHS, strict=True)):
        group = []
        for k, n in enumerate(lengths):
            tokens = np.concatenate([prompt.tokens, text(n)]).astype(np.int32)
            loss = np.concatenate([np.zeros(len(prompt.tokens), bool), np.ones(n, bool)])
            adv = float(advantages[3 * g + k])
            group.append(dataclasses.replace(prompt, tokens=tokens, loss=loss, advantage=adv))
        groups.append(group)
    return groups, specials


def packed(cfg, groups, specials) -> tuple[dict, list[list[tuple[Sample, int]]]]:
    """The step's batch [M, 1, ...]: each microbatch's completions packed into one row by
    bucketize (`packed_row`); each microbatch's (sample, its first token in the row)."""
    rows, where = [], []
    for micro in MICRO:
        samples = [groups[g][k] for g, k in micro]
        mb, starts = packed_row(samples, cfg, specials)
        rows.append(mb)
        where.append(list(zip(samples, starts.tolist(), strict=True)))
    shapes = [{k: v.shape for k, v in mb.items()} for mb in rows]
    assert shapes[0] == shapes[1], shapes  # (MICRO's rows: one shape)
    return {k: np.stack([mb[k] for mb in rows]) for k in rows[0]}, where


def learned(batch: dict, values, where) -> list[np.ndarray]:
    """Each completion's values at its learned positions (those predicting its completion's
    tokens), in MICRO's order, read off the packed batch [M, 1, 1, L]."""
    mask = np.asarray(batch["llm_loss_mask"])[:, 0, 0] > 0
    values = np.asarray(values)[:, 0, 0]
    out = []
    for m, row in enumerate(where):
        for sample, start in row:
            span = slice(start, start + len(sample.tokens))
            out.append(values[m, span][mask[m, span]])
    return out


def transformers_logps(model, ck: Checkpoints, sample: Sample, specials):
    """transformers' log-probs of a completion's tokens, the sample run alone (its image as the
    checkpoint's processor gives it): TRL's fused LM head at the temperature, its scored
    positions the completion's (`labels` -100 before it), as GRPOTrainer computes them."""
    inputs = ck.whole.reference_inputs(sample, ck.cfg, specials)
    tensors = {
        k: _torch(v[None] if k in PER_SAMPLE else v)
        for k, v in inputs.items()
        if isinstance(v, np.ndarray)
    }
    n = int(sample.loss.sum())
    labels = tensors["input_ids"].clone().long()
    labels[:, :-n] = -100
    out = model(**tensors, labels=labels, fused_lm_head=True)
    return out.log_probs[0, -n:]


def torch_models(ck: Checkpoints):
    """transformers' policy and reference (`toward`), fp32, each with TRL's fused LM head at
    the temperature (GRPOTrainer's `add_fused_lm_head` on its model and its reference model)."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    policy, ref = (hf_module(d, read_hf_config(d), "llm") for d in (ck.policy, ck.other))
    mine = dict(policy.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.from_numpy(toward(mine[name].detach().numpy(), p.detach().numpy())))
    for model in (policy, ref):
        add_fused_lm_head(model, temperature=TEMPERATURE)
    return policy, ref


def mapped(ck: Checkpoints, grads: dict) -> dict[str, np.ndarray]:
    """Our gradients as transformers' tensors by their parameter names: the export's links of
    each part of the whole (`hf_tensors`), named as transformers 5 names the module."""
    flat = keyed_leaves(jax.device_get(grads))
    names = Checkpoint(ck.policy).names()
    out = {}
    for role in ck.whole.parts:
        part = Part(ck.whole, role, ck.hf, names)
        for name, value in hf_tensors(part, ck.cfg, ck.hf, flat).items():
            out[part.runtime(name)] = np.asarray(value, np.float64)
    return out


def worst(ours: dict, theirs: dict) -> tuple[float, str]:
    """The largest gradient difference over its tensor's bound (BOUND x max(1, the largest of
    transformers' gradient of that tensor)), and which tensor it is."""
    ratios = {
        k: np.abs(ours[k] - g).max() / (BOUND * max(1.0, np.abs(g).max()))
        for k, g in theirs.items()
    }
    name = max(ratios, key=ratios.get)
    return float(ratios[name]), name


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_the_grpo_loss_and_gradient_are_trls_on_transformers_log_probs(checkpoints, aggregation):
    """Two groups of three completions (an image prompt's and a text prompt's) in two
    microbatches, old log-probs ours plus N(0, 0.3) (some ratios clipped below, some above):
    our step's loss, clip shares and KL equal TRL's on transformers' log-probs, and our
    gradient of every parameter (the LLM's, the vision tower's, the merger's: every tensor of
    transformers' model) equals torch's of TRL's loss within the bound. The comparison can
    fail: the same batch with the loss mask on the prompts' tokens too, or with the policy as
    its own reference (the KL's gradient left out), gives a gradient far past the bound."""
    import torch

    ck = checkpoints
    cfg = grpo_config(ck.cfg, aggregation)
    groups, specials = rollout(ck)
    batch, where = packed(cfg, groups, specials)
    logps = jax.jit(make_logps_program(cfg, ck.parts))(ck.params, {}, batch)
    noise = np.random.default_rng(1).normal(0.0, 0.3, batch["llm_old_logps"].shape)
    batch["llm_old_logps"] = (np.asarray(logps) + noise).astype(np.float32)
    batch["llm_old_given"] = np.ones_like(batch["llm_old_given"])
    step = jax.jit(make_grpo_loss_and_grads(cfg, ck.parts))
    loss, grads, metrics = step(ck.params, {}, batch, ck.ref_params)

    policy, ref_model = torch_models(ck)
    samples = [s for row in where for s, _ in row]
    theirs = [transformers_logps(policy, ck, s, specials) for s in samples]
    with torch.no_grad():
        refs = [transformers_logps(ref_model, ck, s, specials).numpy() for s in samples]
    old = learned(batch, batch["llm_old_logps"], where)
    assert [len(x) for x in old] == [int(s.loss.sum()) for s in samples]
    advantages = [s.advantage for s in samples]
    trl, trl_metrics = trl_compute_loss(cfg, theirs, old, refs, advantages, dtype="float32")
    trl.backward()
    torch_grads = {k: p.grad.double().numpy() for k, p in policy.named_parameters()}

    assert float(loss) == pytest.approx(trl.item(), rel=BOUND)
    for ours, trls in [
        ("rl/clip_low", "clip_ratio/low_mean"),
        ("rl/clip_high", "clip_ratio/high_mean"),
        ("rl/kl", "kl"),
    ]:
        assert float(metrics[ours]) == pytest.approx(trl_metrics[trls], rel=BOUND, abs=1e-6)
    assert float(metrics["rl/clip_low"]) > 0 and float(metrics["rl/clip_high"]) > 0
    assert float(metrics["rl/kl"]) > 0.1
    ours = mapped(ck, grads)
    assert set(ours) == set(torch_grads)  # (every tensor of transformers' model compared)
    assert all(np.abs(g).max() > 1e-3 for g in torch_grads.values())  # (none trivially 0)
    ratio, name = worst(ours, torch_grads)
    assert ratio <= 1, (name, ratio)

    real = (batch["llm_segment_ids"] > 0) & (batch["llm_targets"] != specials.pad)
    prompts_too = {**batch, "llm_loss_mask": real.astype(batch["llm_loss_mask"].dtype)}
    for wrong_batch, reference in [(prompts_too, ck.ref_params), (batch, ck.params)]:
        _, wrong, _ = step(ck.params, {}, wrong_batch, reference)
        assert worst(mapped(ck, wrong), torch_grads)[0] > 10
