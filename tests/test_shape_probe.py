"""tools/shape_probe.py: the built-in shapes are drawn so that their pixels tell them apart."""

import numpy as np

from jaxmllm.config.load import load_config
from tools import shape_probe as probe


def test_a_linear_probe_on_a_shapes_own_pixels_names_it():
    """Cropped to the shape and resized, a linear probe names every shape of the built-in
    images (a renderer drawing two shapes alike, or one off its image, fails it)."""
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=1600"])
    images = probe.single_images(cfg, 1600)
    p = cfg.model.vision.patch_size
    crops, shapes = [], []
    for patches, positions, shape, grid in images:
        mask = probe.image_of(patches, positions, grid, p).max(-1) > 0.1
        ys, xs = np.nonzero(mask)
        crops.append(probe.resized(mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1], 12))
        shapes.append(shape)
    y = np.array(shapes)
    right = probe.probe(np.array(crops, np.float32).reshape(len(y), -1), y)
    held = y[int(0.75 * len(y)) :]
    assert len(held) > 100 and set(held.tolist()) == {0, 1, 2, 3}
    assert all(right[held == s].mean() > 0.85 for s in range(4)), right.mean()
