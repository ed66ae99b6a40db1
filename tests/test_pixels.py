"""Pixels travel to the devices as uint8 and the vision encoder normalises them there
(`jaxmllm.config.spec.Inputs`, `jaxmllm.models.inputs`): bit for bit the float32 values the
host computed when it normalised them itself, padding zero, a quarter of the bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmllm.batch.bucketize import batch_shapes, bucketize
from jaxmllm.config import VisionConfig, load_config
from jaxmllm.config.spec import Inputs
from jaxmllm.models.inputs import decode
from jaxmllm.models.vision import VisionEncoder
from jaxmllm.resolve.run import resolve_run

BF16 = np.dtype(jnp.bfloat16)
CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


def host_normalised(x: np.ndarray, mean, std) -> np.ndarray:
    """What the host computed before pixels travelled as uint8 (data/media/image.py)."""
    v = x.astype(np.float32)
    if tuple(mean) == tuple(std) == (0.5, 0.5, 0.5):
        v /= 127.5
        v -= 1.0
    else:
        v /= 255.0
        v -= np.tile(np.asarray(mean, np.float32), x.shape[-1] // 3)
        v /= np.tile(np.asarray(std, np.float32), x.shape[-1] // 3)
    return v


@pytest.mark.parametrize("mean,std", [((0.5,) * 3, (0.5,) * 3), CLIP])
@pytest.mark.parametrize("width", [48, 96])  # a 4x4 RGB patch; two frames of one side by side
def test_pixels_normalised_on_the_device_are_the_hosts_bit_for_bit(mean, std, width):
    inputs = Inputs.pixels(mean, std)
    x = np.random.default_rng(width).integers(0, 256, (2, 10, width), dtype=np.uint8)
    x[0, 0, :3] = (0, 128, 255)
    seg = np.array([[1] * 4 + [2] * 3 + [0] * 3, [3] * 10], np.int32)
    want = np.where((seg > 0)[..., None], host_normalised(x, mean, std), np.float32(0))
    assert np.array_equal(inputs.normalise(x), host_normalised(x, mean, std))
    got = np.asarray(jax.jit(lambda x, s: decode(x, s, inputs))(x, seg))
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # (bits: -0.0 too)
    floats = want + 0.25  # values already normalised pass as they are
    assert np.array_equal(np.asarray(decode(jnp.asarray(floats), seg, inputs)), floats)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_encoder_on_uint8_pixels_is_the_encoder_on_normalised_ones(dtype):
    """Same features, bit for bit, in fp32 and bf16 compute (the first layer casts either)."""
    cfg = VisionConfig(patch_size=4, channels=3, width=32, depth=2, heads=2, mlp_dim=64)
    inputs = Inputs.pixels(*CLIP)
    kw = dict(dtype=jnp.dtype(dtype), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    encoder = VisionEncoder(cfg, inputs=inputs, **kw)
    x = np.random.default_rng(0).integers(0, 256, (1, 12, 48), dtype=np.uint8)
    seg = np.array([[1] * 8 + [2] * 4], np.int32)
    pos = np.concatenate([np.argwhere(np.ones((2, 4))), np.argwhere(np.ones((2, 2)))])[None]
    floats = np.where((seg > 0)[..., None], inputs.normalise(x), np.float32(0))
    run = nnx.jit(lambda m, x: m(x, jnp.asarray(seg), jnp.asarray(pos, jnp.int32)))
    a, b = np.asarray(run(encoder, jnp.asarray(x))), np.asarray(run(encoder, jnp.asarray(floats)))
    assert np.array_equal(a.astype(np.float32), b.astype(np.float32))


def test_a_steps_vision_bucket_holds_the_samples_pixels_and_refuses_floats():
    """The batch's vision inputs are the loaded uint8 pixels where the plan put them; a loader
    handing floats to a pixel bucket is refused by name, never cast."""
    run = resolve_run(load_config("configs/tiny.yaml", ["data.synthetic.num_samples=256"]))
    cfg, source, index, caps = run.cfg, run.source, run.index, run.caps
    shapes = batch_shapes(cfg, 8)
    assert shapes["vision_patches"][1] == np.uint8 and shapes["audio_frames"][1] == np.float32
    plan = run.planner().plan()
    samples = {int(i): source[int(i)] for i in np.unique(plan.samples)}
    batch = bucketize(plan, samples, cfg, caps, index=index)
    assert batch["vision_patches"].dtype == np.uint8
    pixels = [v for i in samples for v, _ in samples[i].media["vision"]]
    assert sum(len(v) for v in pixels) == (batch["vision_segment_ids"] > 0).sum() > 0
    assert batch["vision_patches"][batch["vision_segment_ids"] == 0].max() == 0
    owner = next(i for i in samples if samples[i].media["vision"])
    values, positions = samples[owner].media["vision"][0]
    samples[owner].media["vision"][0] = (values.astype(np.float32) / 127.5 - 1, positions)
    with pytest.raises(TypeError, match=f"sample {owner} image 0: float32 inputs"):
        bucketize(plan, samples, cfg, caps, index=index)


def test_features_travel_in_the_bf16_compute_dtype_and_change_no_value():
    """Under bf16 compute the audio bucket is bfloat16 (half float32's bytes): the host's cast
    is the one the encoder's first layer made of float32 frames, so its output is the same."""
    from jaxmllm.config import AudioConfig
    from jaxmllm.config.phases import AUDIO
    from jaxmllm.config.spec import inputs_of
    from jaxmllm.models.audio import AudioEncoder

    assert inputs_of(AUDIO, None, "bfloat16").numpy_dtype == BF16
    assert inputs_of(AUDIO, None, "float32").numpy_dtype == np.float32
    frames = np.random.default_rng(0).normal(0, 3, (1, 16, 8)).astype(np.float32)
    seg = jnp.asarray([[1] * 8 + [2] * 4 + [0] * 4], jnp.int32)
    pos = jnp.asarray([list(range(8)) + list(range(4)) + [0] * 4], jnp.int32)
    for stem in ("pairs", "whisper"):
        cfg = AudioConfig(n_mels=8, width=32, depth=1, heads=2, mlp_dim=64, stem=stem)
        kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        encoder = AudioEncoder(cfg, inputs=inputs_of(AUDIO, None, "bfloat16"), **kw)
        run = nnx.jit(lambda m, x: m(x, seg, pos))
        a = np.asarray(run(encoder, jnp.asarray(frames)), np.float32)
        b = np.asarray(run(encoder, jnp.asarray(frames.astype(BF16))), np.float32)
        assert np.array_equal(a, b), stem


def test_under_bf16_compute_the_audio_bucket_holds_the_frames_cast():
    cfg = load_config(
        "configs/tiny.yaml", ["data.synthetic.num_samples=256", "model.compute_dtype=bfloat16"]
    )
    run = resolve_run(cfg)
    cfg, source, index = run.cfg, run.source, run.index
    plan = run.planner().plan()
    samples = {int(i): source[int(i)] for i in np.unique(plan.samples)}
    batch = bucketize(plan, samples, cfg, run.caps, index=index)
    frames = batch["audio_frames"]
    assert frames.dtype == BF16 and batch["vision_patches"].dtype == np.uint8
    clips = [f for i in samples for f, _ in samples[i].media["audio"]]
    rows = lambda a: sorted(np.float32(a).sum(-1).tolist())
    written = frames[batch["audio_segment_ids"] > 0]
    assert clips and rows(written) == rows(np.concatenate(clips).astype(BF16))
