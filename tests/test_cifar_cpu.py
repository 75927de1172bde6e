"""The CPU-sized CIFAR-10 preset (docs/paper-scale.md, "CIFAR-10 on a CPU") on a tiny generated image folder:
ScatterNet features of `scatternet:imagefolder:PATH`, their cache, and the preset's training and
all-point Δ* measurement run through the scripts."""

import dataclasses
import hashlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error, run_script
from PIL import Image

from perinstance.errors import UsageError
from perinstance.experiments.config import PRESETS, training_flags
from perinstance.train import data
from perinstance.train.data import load_dataset

CLASSES, TRAIN_PER_CLASS, TEST_PER_CLASS, SIDE = 3, 10, 4, 16
# imagefolder: resizes every image to 32×32 (data.IMAGE_SIZE); the ScatterNet samples every 4 pixels.
FEATURE_SIDE = data.IMAGE_SIZE // 4


def write_jpeg_folder(root):
    """PATH/train/<class>/*.jpg and PATH/test/<class>/*.jpg: 16×16 colour images (the loader scales them to
    32×32), a hue per class plus noise."""
    rng = np.random.default_rng(3)
    for split, count in (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)):
        for label in range(CLASSES):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                colour = np.roll([200, 60, 60], label)
                pixels = np.clip(colour + rng.normal(0, 50, size=(SIDE, SIDE, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels, "RGB").save(folder / f"{index}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_jpeg_folder(tmp_path_factory.mktemp("cifar_like"))


@pytest.fixture(autouse=True)
def fresh_memos(monkeypatch):
    """Every test loads from files: the per-process memos start empty."""
    monkeypatch.setattr(data, "_scatternet_memo", {})
    monkeypatch.setattr(data, "_imagefolder_memo", {})


def test_features_are_the_scatternet_of_the_normalised_images(folder):
    images = load_dataset(f"imagefolder:{folder}")
    features = load_dataset(f"scatternet:imagefolder:{folder}")
    assert features.name == f"scatternet:imagefolder:{folder}"
    # 81 scattering channels per colour channel, at a quarter of the resolution.
    assert features.train_x.shape == (CLASSES * TRAIN_PER_CLASS, 3 * 81, FEATURE_SIDE, FEATURE_SIDE)
    assert features.test_x.shape == (CLASSES * TEST_PER_CLASS, 3 * 81, FEATURE_SIDE, FEATURE_SIDE)
    assert torch.equal(features.train_y, images.train_y) and torch.equal(features.test_y, images.test_y)
    assert features.class_names == images.class_names == [f"class{label}" for label in range(CLASSES)]
    # S0 is the Gaussian low-pass of each colour channel: its mean over the image is close to the
    # channel's mean (the images are standardised per channel, so it is ~0 over all images) and
    # varies with the class colour.
    low_pass = features.train_x[:, ::81].mean(dim=(2, 3))
    pixel_means = images.train_x.mean(dim=(2, 3))
    assert np.corrcoef(low_pass.ravel(), pixel_means.ravel())[0, 1] > 0.99
    assert features.fingerprint != images.fingerprint


def test_feature_cache_round_trip(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CACHE_MIN_IMAGES", 0)
    fresh = load_dataset(f"scatternet:imagefolder:{folder}", str(tmp_path))
    [cache] = (tmp_path / "cache").glob("scatternet-*.pt")
    monkeypatch.setattr(data, "_scatternet_memo", {})
    cached = load_dataset(f"scatternet:imagefolder:{folder}", str(tmp_path))
    assert cached is not fresh  # read back from the file, not the memo
    assert torch.equal(cached.train_x, fresh.train_x) and torch.equal(cached.test_x, fresh.test_x)
    # Named by the images and the transform's version, not by the float features' last bits.
    images = load_dataset(f"imagefolder:{folder}")
    expected = hashlib.sha256(f"{data.SCATTERNET_VERSION}:{images.fingerprint}".encode()).hexdigest()
    assert cached.fingerprint == fresh.fingerprint == expected
    # A damaged cache is recomputed and rewritten, never an error.
    cache.write_bytes(b"not a torch file")
    monkeypatch.setattr(data, "_scatternet_memo", {})
    again = load_dataset(f"scatternet:imagefolder:{folder}", str(tmp_path))
    assert torch.equal(again.train_x, fresh.train_x)
    assert torch.equal(torch.load(cache, weights_only=True)["train_x"], fresh.train_x)


def test_small_datasets_write_no_cache(folder, tmp_path):
    load_dataset(f"scatternet:imagefolder:{folder}", str(tmp_path))
    assert not (tmp_path / "cache").exists()


def test_changed_image_folder_is_decoded_again(tmp_path):
    root = write_jpeg_folder(tmp_path / "images")
    first = load_dataset(f"imagefolder:{root}")
    assert load_dataset(f"imagefolder:{root}") is first  # memo: same files
    Image.fromarray(np.zeros((SIDE, SIDE, 3), np.uint8), "RGB").save(root / "train" / "class0" / "extra.jpg")
    changed = load_dataset(f"imagefolder:{root}")
    assert len(changed.train_y) == len(first.train_y) + 1


@pytest.mark.parametrize("name, fragment", [
    ("scatternet:", "needs one dataset of images"),
    ("scatternet:scatternet:synthetic", "needs one dataset of images"),
    ("scatternet:synthetic", "at least 16 pixels, got 8×8"),
    ("scatternet:nothing", "unknown dataset 'nothing'"),
])
def test_bad_scatternet_datasets(name, fragment):
    with pytest.raises(UsageError) as error:
        load_dataset(name)
    assert error.value.flag == "--dataset" and fragment in str(error.value) and "\n" not in str(error.value)


def test_bad_scatternet_dataset_is_one_line_from_the_script(tmp_path):
    result = run_script("train_dpsgd.py", "--dataset", "scatternet:synthetic", "--model", "linear", cwd=tmp_path)
    assert_usage_error(result, "--dataset")


def test_preset_trains_and_measures_every_point_at_every_checkpoint(folder, tmp_path):
    """The preset's training flags, shrunk to the tiny folder, through train_dpsgd.py and
    compute_sensitivity.py; Δ* of every point at every checkpoint equals ||∇ loss|| (C is set above
    it) computed here from the saved weights with the closed form of a linear layer's gradient."""
    config = dataclasses.replace(PRESETS["cifar10-cpu"], dataset=f"scatternet:imagefolder:{folder}",
                                 batch_size=10, epochs=2.0, save_freq=3)
    # A clipping norm above every gradient norm, so that Δ* is the norm itself and the check below can fail.
    flags = [*training_flags(config, "cpu"), "--save-name", "cifar", "--cn", "1000"]
    assert flags[flags.index("--model") + 1] == "linear"
    trained = run_script("train_dpsgd.py", *flags, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    measured = run_script("compute_sensitivity.py", *flags, "--exp", "eps_delta", "--reduction", "sum", "--points",
                          "all", "--stage", "all", "--res-name", "cifar", "--no-train", cwd=tmp_path)
    assert measured.returncode == 0, measured.stderr[-3000:]

    run = json.loads((tmp_path / "models" / "cifar" / "run.json").read_text())
    assert run["dataset"] == f"scatternet:imagefolder:{folder}" and run["input_shape"] == [243, FEATURE_SIDE, FEATURE_SIDE]
    assert run["total_steps"] == 6 and run["checkpoint_steps"] == [0, 3, 6]
    rows = pd.read_csv(tmp_path / "res" / "cifar.csv")
    dataset = load_dataset(run["dataset"])
    points = len(dataset.train_y)
    assert sorted(rows["step"].unique()) == [0, 3, 6] and len(rows) == 3 * points
    # The head's input: GroupNorm of 27 groups, then the mean of each 2×2 block of the 8×8 grid.
    normed = F.group_norm(dataset.train_x.double(), 27)
    inputs = normed.reshape(points, 243, 4, 2, 4, 2).mean(dim=(3, 5)).flatten(1)
    for step, at_step in rows.groupby("step"):
        weights = torch.load(tmp_path / "models" / "cifar" / f"step_{step:07d}.pt", weights_only=True)["model"]
        logits = inputs @ weights["3.weight"].double().T + weights["3.bias"].double()
        residual = logits.softmax(dim=1) - F.one_hot(dataset.train_y, CLASSES).double()
        # ∇_W = residual·xᵀ and ∇_b = residual, so ||∇||² = ||residual||²·(||x||² + 1).
        norms = residual.norm(dim=1) * (inputs.square().sum(dim=1) + 1).sqrt()
        assert (norms < run["clip_bound"]).all()
        expected = norms.numpy()
        at_step = at_step.sort_values("point")
        assert at_step["point"].tolist() == list(range(points))
        np.testing.assert_allclose(at_step["value"].to_numpy(), expected, rtol=1e-4)
    # Training moved the weights: the norms at the last checkpoint are not those at the first.
    first, last = (rows[rows["step"] == step].sort_values("point")["value"].to_numpy() for step in (0, 6))
    assert not np.allclose(first, last)
