"""How learnable the built-in shapes are, and why the tiny model names them last of what it
sees: is the shape in the pixels, how big is it, and how many images does a tower of the
config's size need to learn it when taught the shape directly (no LLM in the way)?

    python -m tools.shape_probe [--config configs/tiny.yaml] [--samples 8000] [--steps 600]

Prints, over the single-image samples of the built-in data (`jaxmllm.data.synthetic`):
1. per image's shorter side, the shape's extent in patches and in LLM tokens (merge blocks);
2. the held-out accuracy of probes on raw pixels: the shape's pixels cropped to it and resized
   (position and scale taken away: is the shape drawn right?), the whole image's shape pixels
   resized (position and scale left in), and the mean and spread of the raw patches (a bag of
   patches, what pooling keeps);
3. the config's own vision tower (`jaxmllm.models.vision.VisionEncoder`, float32, dense
   attention) with a mean pool and a linear head, trained on the shape label alone at batch
   32, Adam, lr 3e-3: its held-out accuracy as the images seen grow.
A CPU is enough (a few minutes at the defaults).
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmllm.config.load import load_config
from jaxmllm.data.synthetic import SHAPES, SyntheticSource
from jaxmllm.models.vision import VisionEncoder


def single_images(cfg, samples: int):
    """(patches, positions, shape number, grid) of every one-image sample among `samples`."""
    source = SyntheticSource(cfg)
    out = []
    for i in range(min(samples, len(source))):
        params = source._table.params(i)
        if params["kind"] == "image" and len(params["images"]) == 1:
            patches, positions = source[i].media["vision"][0]
            gh, gw, _, shape = params["images"][0]
            out.append((patches, positions, SHAPES.index(shape), (gh, gw)))
    return out


def image_of(patches, positions, grid, patch: int) -> np.ndarray:
    """The image (values in [-1, 1]) its patches were cut from."""
    img = np.zeros((grid[0] * patch, grid[1] * patch, 3), np.float32)
    for values, (r, c) in zip(patches, positions, strict=True):
        img[r * patch : (r + 1) * patch, c * patch : (c + 1) * patch] = values.reshape(
            patch, patch, 3
        )
    return img / 127.5 - 1


def resized(a: np.ndarray, n: int) -> np.ndarray:
    """a resampled to n x n (nearest)."""
    rows = ((np.arange(n) + 0.5) * a.shape[0] / n).astype(int)
    cols = ((np.arange(n) + 0.5) * a.shape[1] / n).astype(int)
    return a[rows][:, cols]


def probe(x: np.ndarray, y: np.ndarray, hidden: int = 0) -> np.ndarray:
    """Which held-out quarter's samples a linear (or one-hidden-layer) probe gets right
    (full batch, Adam, 400 steps)."""
    n = int(0.75 * len(y))
    x = (x - x[:n].mean(0)) / (x[:n].std(0) + 1e-4)
    rngs = nnx.Rngs(0)
    if hidden:
        net = nnx.Sequential(
            nnx.Linear(x.shape[1], hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, 4, rngs=rngs)
        )
    else:
        net = nnx.Linear(x.shape[1], 4, rngs=rngs)
    tx = optax.adamw(3e-3 if hidden else 1e-2, weight_decay=1e-4)
    opt = nnx.Optimizer(net, tx, wrt=nnx.Param)
    xs, ys = jnp.asarray(x[:n]), jnp.asarray(y[:n])

    @nnx.jit
    def step(net, opt):
        loss = lambda net: optax.softmax_cross_entropy_with_integer_labels(net(xs), ys).mean()  # noqa: E731
        opt.update(net, nnx.grad(loss)(net))

    for _ in range(400):
        step(net, opt)
    return np.asarray(net(jnp.asarray(x[n:])).argmax(1)) == y[n:]


class Tower(nnx.Module):
    """jaxmllm's vision tower of the config (`model.vision`), one image a row, with a
    mean-pool shape head."""

    def __init__(self, vision, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.float32, param_dtype=jnp.float32)
        self.tower = VisionEncoder(vision, **kw, rngs=rngs)
        self.head = nnx.Linear(vision.width, len(SHAPES), rngs=rngs)

    def __call__(self, x, pos, mask):
        h = self.tower(x, mask.astype(jnp.int32), pos)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        return self.head(pooled)


def train_tower(images, vision, steps: int, every: int) -> list[tuple[int, float]]:
    """(images seen, held-out accuracy) every `every` steps of the tower taught the shape
    (batches of 32, Adam, lr 3e-3)."""
    n, longest = len(images), max(len(p) for p, *_ in images)
    x = np.zeros((n, longest, images[0][0].shape[1]), np.float32)
    pos, mask = np.zeros((n, longest, 2), np.int32), np.zeros((n, longest), bool)
    for k, (patches, positions, _, _) in enumerate(images):
        x[k, : len(patches)] = patches / 127.5 - 1
        pos[k, : len(patches)], mask[k, : len(patches)] = positions, True
    y, train = np.array([s for _, _, s, _ in images]), int(0.75 * n)
    net = Tower(vision, nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(net, opt, x, pos, mask, y):
        def loss(net):
            logits = net(x, pos, mask)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        opt.update(net, nnx.grad(loss)(net))

    @nnx.jit
    def predict(net, x, pos, mask):
        return net(x, pos, mask).argmax(1)

    rng, curve = np.random.default_rng(0), []
    for k in range(1, steps + 1):
        batch = rng.integers(0, train, 32)
        step(net, opt, x[batch], pos[batch], mask[batch], y[batch])
        if k % every == 0:
            right = [
                np.asarray(predict(net, x[a : a + 256], pos[a : a + 256], mask[a : a + 256]))
                == y[a : a + 256]
                for a in range(train, n, 256)
            ]
            curve.append((32 * k, float(np.concatenate(right).mean())))
    return curve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--samples", type=int, default=8000, help="built-in samples drawn")
    ap.add_argument("--steps", type=int, default=600, help="the tower's steps (32 images each)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [f"data.synthetic.num_samples={args.samples}", *args.set])
    vision, p = cfg.model.vision, cfg.model.vision.patch_size
    images = single_images(cfg, args.samples)
    y = np.array([s for _, _, s, _ in images])
    side = np.array([min(grid) for *_, grid in images])
    cropped, whole, bag, extent = [], [], [], []
    for patches, positions, _, grid in images:
        shape = image_of(patches, positions, grid, p).max(-1) > 0.1  # (a colour has a channel
        ys, xs = np.nonzero(shape)  # >= 0.6; the background is -0.5 +- 0.15)
        extent.append(max(np.ptp(ys), np.ptp(xs)) / p + 1 / p)
        cropped.append(resized(shape[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1], 12))
        whole.append(resized(shape, 24))
        values = patches / 127.5 - 1
        bag.append(np.concatenate([values.mean(0), values.std(0)]))
    extent = np.array(extent)
    print(f"{len(y)} one-image samples of {args.samples}; patch {p} px, merge {vision.merge}")
    for s in np.unique(side):
        e = extent[side == s]
        print(
            f"  shorter side {s:2d} patches ({(side == s).mean():4.0%} of images): shape "
            f"{np.median(e):.1f} patches across (median), {np.median(e) / vision.merge:.1f} "
            "LLM tokens"
        )
    flat = lambda rows: np.array(rows, np.float32).reshape(len(rows), -1)  # noqa: E731
    print("probes on raw pixels, held-out accuracy (chance 25%), by shorter side:")
    held = side[int(0.75 * len(y)) :]
    for name, x, hidden in (
        ("shape pixels cropped to it, 12 x 12, linear", flat(cropped), 0),
        ("shape pixels of the image, 24 x 24, MLP", flat(whole), 256),
        ("bag of patches (mean, std), MLP", flat(bag), 256),
    ):
        right = probe(x, y, hidden)
        per = " ".join(f"{s}:{right[held == s].mean():.0%}" for s in np.unique(held))
        print(f"  {name:44s} {right.mean():4.0%}  [{per}]")
    print("the tower taught the shape alone (held-out accuracy by images seen):")
    for seen, acc in train_tower(images, vision, args.steps, max(1, args.steps // 6)):
        print(f"  {seen:6d} images seen: {acc:.0%}")


if __name__ == "__main__":
    main()
