import gzip
import pickle
import shutil
from urllib.error import URLError

import numpy as np
import pytest
import torch
import torchvision.datasets.cifar
import torchvision.datasets.mnist
from PIL import Image

from perinstance.errors import UsageError
from perinstance.train import data
from perinstance.train.data import load_dataset

# Pinned so that a change in the shipped files, the split or the preprocessing shows up.
EMBEDDED_FINGERPRINT = "4e36ecd65c91d677a28ff6a3d53b231d6f45c1f0a83dba7a29fd139b399f9511"
MNIST_RAW_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                   "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@pytest.fixture(scope="module")
def embedded():
    return load_dataset("mnist-embedded")


@pytest.fixture
def offline(monkeypatch):
    """torchvision's downloaders fail as without network, and record that they were called."""
    calls = []

    def refuse_download(url, *args, **kwargs):
        calls.append(url)
        raise URLError("no network in tests")

    monkeypatch.setattr(torchvision.datasets.mnist, "download_and_extract_archive", refuse_download)
    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", refuse_download)
    return calls


def assert_usage_error(call, flag, *fragments):
    with pytest.raises(UsageError) as error:
        call()
    assert error.value.flag == flag
    assert "\n" not in str(error.value)
    for fragment in fragments:
        assert fragment in str(error.value)


# --- mnist-embedded ---------------------------------------------------------------------

def test_embedded_sizes_and_types(embedded):
    assert embedded.name == "mnist-embedded"
    assert embedded.train_x.shape == (8000, 1, 32, 32) and embedded.test_x.shape == (2000, 1, 32, 32)
    assert embedded.train_x.dtype == torch.float32 and embedded.train_y.dtype == torch.int64
    assert embedded.num_classes == 10 and embedded.class_names == [str(digit) for digit in range(10)]


def test_embedded_labels_roughly_balanced(embedded):
    for labels, size in ((embedded.train_y, 8000), (embedded.test_y, 2000)):
        counts = torch.bincount(labels, minlength=10)
        assert len(counts) == 10
        assert counts.min() > 0.07 * size and counts.max() < 0.13 * size


def test_embedded_split_is_deterministic(embedded):
    again = load_dataset("MNIST-Embedded")
    assert torch.equal(again.train_x, embedded.train_x) and torch.equal(again.test_y, embedded.test_y)
    assert again.fingerprint == embedded.fingerprint
    assert embedded.fingerprint == EMBEDDED_FINGERPRINT


def test_embedded_pixels_normalised_like_lenet5_mnist(embedded):
    digits = embedded.train_x[:, :, 2:30, 2:30]
    assert abs(digits.mean().item()) < 0.05 and abs(digits.std().item() - 1) < 0.05
    border = embedded.train_x.clone()
    border[:, :, 2:30, 2:30] = float("nan")
    black = torch.tensor(-0.1307 / 0.3081)
    assert torch.allclose(border[~border.isnan()], black)


def test_less_point_removes_exactly_that_row(embedded):
    without = load_dataset("mnist-embedded", less_point=5)
    assert torch.equal(without.train_x, torch.cat([embedded.train_x[:5], embedded.train_x[6:]]))
    assert torch.equal(without.train_y, torch.cat([embedded.train_y[:5], embedded.train_y[6:]]))
    assert torch.equal(without.test_x, embedded.test_x)
    assert without.fingerprint == embedded.fingerprint  # documented: fingerprint of the full dataset


@pytest.mark.parametrize("index", [-1, 512])
def test_less_point_out_of_range(index):
    assert_usage_error(lambda: load_dataset("synthetic", less_point=index), "--less-point", "0..511")


def test_corrupted_embedded_file_is_refused(tmp_path, monkeypatch):
    for name in data.EMBEDDED_MD5:
        shutil.copy(data.EMBEDDED_DIR / name, tmp_path / name)
    with open(tmp_path / data.EMBEDDED_LABELS, "ab") as handle:
        handle.write(b"x")
    monkeypatch.setattr(data, "EMBEDDED_DIR", tmp_path)
    assert_usage_error(lambda: load_dataset("mnist-embedded"), "--dataset", "corrupted", data.EMBEDDED_LABELS)


def test_unknown_dataset():
    assert_usage_error(lambda: load_dataset("svhn"), "--dataset", "unknown dataset 'svhn'", "imagefolder:PATH")


# --- torchvision datasets, offline -----------------------------------------------------

def write_mnist_raw(root, folder):
    """torchvision's MNIST layout (<root>/<folder>/raw/, decompressed IDX files), with the
    shipped 10k test digits standing in for the training files too."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    for name in MNIST_RAW_NAMES:
        kind = "images-idx3-ubyte" if "images" in name else "labels-idx1-ubyte"
        with gzip.open(data.EMBEDDED_DIR / f"t10k-{kind}.gz") as source:
            (raw / name).write_bytes(source.read())


def test_torchvision_mnist_loads_offline_like_embedded(tmp_path, offline, embedded):
    write_mnist_raw(tmp_path, "MNIST")
    mnist = load_dataset("mnist", str(tmp_path))
    assert offline == []
    assert mnist.name == "MNIST" and mnist.train_x.shape == mnist.test_x.shape == (10000, 1, 32, 32)
    assert len(mnist.class_names) == 10
    # Same digits, same preprocessing: the embedded split is a fixed permutation of them.
    order = np.random.default_rng(data.EMBEDDED_SPLIT_SEED).permutation(10000)[:8000]
    assert torch.equal(mnist.train_x[order], embedded.train_x)
    assert torch.equal(mnist.train_y[order], embedded.train_y)


def test_torchvision_fashion_mnist_uses_its_own_normalisation(tmp_path, offline):
    write_mnist_raw(tmp_path, "FashionMNIST")
    fashion = load_dataset("fashionmnist", str(tmp_path))
    assert fashion.name == "FashionMNIST" and fashion.class_names[0] == "T-shirt/top"
    assert torch.allclose(fashion.train_x[:, :, 0, 0], torch.tensor(-0.2860 / 0.3530))


def test_torchvision_cifar10_is_channels_first_and_normalised(tmp_path, offline, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    planes = np.concatenate([np.zeros(1024), np.full(1024, 255), np.full(1024, 51)]).astype(np.uint8)
    batch = {"data": np.tile(planes, (2, 1)), "labels": [3, 7]}  # rows are R, G, B planes of 32×32
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args: True)  # fake files
    cifar = load_dataset("CIFAR10", str(tmp_path))
    assert cifar.train_x.shape == (10, 3, 32, 32) and cifar.test_x.shape == (2, 3, 32, 32)
    assert cifar.train_y.tolist() == [3, 7] * 5 and cifar.class_names == [f"c{i}" for i in range(10)]
    expected = [(value - mean) / std for value, mean, std in zip((0, 1, 0.2), data.CIFAR10_MEAN,
                                                                 data.CIFAR10_STD, strict=True)]
    torch.testing.assert_close(cifar.train_x.mean(dim=(0, 2, 3)), torch.tensor(expected))
    assert offline == []


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST", "CIFAR10"])
def test_torchvision_download_failure_is_one_line(tmp_path, offline, name):
    root = str(tmp_path / "nothing-here")
    assert_usage_error(lambda: load_dataset(name, root), "--dataset", f"could not download {name} into {root}",
                       "mnist-embedded")
    assert offline  # a download was attempted (and refused)


# --- imagefolder:PATH -------------------------------------------------------------------

def write_images(root, split, classes, count, mode="RGB", size=(32, 32)):
    rng = np.random.default_rng(len(split) + count)
    channels = (3,) if mode == "RGB" else ()
    for label in classes:
        folder = root / split / label
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(count):
            pixels = rng.integers(0, 256, size=(size[1], size[0], *channels), dtype=np.uint8)
            Image.fromarray(pixels, mode).save(folder / f"{index}.png")


def test_imagefolder_rgb(tmp_path):
    write_images(tmp_path, "train", ["cat", "dog"], 3)
    write_images(tmp_path, "test", ["cat", "dog"], 2)
    folder = load_dataset(f"imagefolder:{tmp_path}")
    assert folder.name == f"imagefolder:{tmp_path}"
    assert folder.train_x.shape == (6, 3, 32, 32) and folder.test_x.shape == (4, 3, 32, 32)
    assert folder.class_names == ["cat", "dog"] and folder.train_y.tolist() == [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(folder.train_x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(folder.train_x.std(dim=(0, 2, 3), correction=0), torch.ones(3))
    assert load_dataset(f"ImageFolder:{tmp_path}").fingerprint == folder.fingerprint


def test_imagefolder_grayscale_keeps_one_channel_and_resizes(tmp_path):
    write_images(tmp_path, "train", ["a", "b"], 2, mode="L", size=(28, 20))
    write_images(tmp_path, "test", ["a", "b"], 1, mode="L")
    folder = load_dataset(f"imagefolder:{tmp_path}")
    assert folder.train_x.shape == (4, 1, 32, 32) and folder.test_x.shape == (2, 1, 32, 32)


def test_imagefolder_mixed_modes_become_rgb(tmp_path):
    write_images(tmp_path, "train", ["a"], 2, mode="L")
    write_images(tmp_path, "test", ["a"], 1, mode="RGB")
    assert load_dataset(f"imagefolder:{tmp_path}").train_x.shape == (2, 3, 32, 32)


def test_imagefolder_without_train_folder(tmp_path):
    write_images(tmp_path, "test", ["a"], 1)
    assert_usage_error(lambda: load_dataset(f"imagefolder:{tmp_path}"), "--dataset", str(tmp_path / "train"))


def test_imagefolder_missing_path(tmp_path):
    assert_usage_error(lambda: load_dataset(f"imagefolder:{tmp_path / 'absent'}"), "--dataset", "absent")


def test_imagefolder_class_mismatch(tmp_path):
    write_images(tmp_path, "train", ["a", "b"], 1)
    write_images(tmp_path, "test", ["a", "c"], 1)
    assert_usage_error(lambda: load_dataset(f"imagefolder:{tmp_path}"), "--dataset", "classes")


def test_imagefolder_unreadable_image(tmp_path):
    write_images(tmp_path, "train", ["a"], 1)
    write_images(tmp_path, "test", ["a"], 1)
    (tmp_path / "train" / "a" / "broken.png").write_bytes(b"not a png")
    assert_usage_error(lambda: load_dataset(f"imagefolder:{tmp_path}"), "--dataset", "broken.png")


# --- synthetic --------------------------------------------------------------------------

def test_synthetic_sizes_and_determinism():
    first, second = load_dataset("synthetic"), load_dataset("Synthetic")
    assert first.train_x.shape == (512, 1, 8, 8) and first.test_x.shape == (128, 1, 8, 8)
    assert first.num_classes == 4 and torch.bincount(first.train_y).tolist() == [128] * 4
    assert torch.equal(first.train_x, second.train_x) and first.fingerprint == second.fingerprint


def test_synthetic_is_learnable_but_not_separable():
    synthetic = load_dataset("synthetic")
    train = synthetic.train_x.flatten(1)
    centroids = torch.stack([train[synthetic.train_y == label].mean(0) for label in range(4)])
    predicted = torch.cdist(synthetic.test_x.flatten(1), centroids).argmin(1)
    accuracy = (predicted == synthetic.test_y).float().mean().item()
    assert 0.6 < accuracy < 0.99


# --- first:N:DATASET --------------------------------------------------------------------

def test_first_takes_the_first_training_points_and_the_whole_test_set():
    full, head = load_dataset("synthetic"), load_dataset("First:64:synthetic")
    assert head.name == "first:64:synthetic"
    assert torch.equal(head.train_x, full.train_x[:64]) and torch.equal(head.train_y, full.train_y[:64])
    assert torch.equal(head.test_x, full.test_x) and torch.equal(head.test_y, full.test_y)
    assert head.num_classes == full.num_classes and head.class_names == full.class_names
    assert head.fingerprint == load_dataset("first:64:synthetic").fingerprint
    assert len({head.fingerprint, full.fingerprint, load_dataset("first:63:synthetic").fingerprint}) == 3
    without = load_dataset("first:64:synthetic", less_point=3)
    assert torch.equal(without.train_y, torch.cat([full.train_y[:3], full.train_y[4:64]]))
    assert without.fingerprint == head.fingerprint


# --- holdout:M:DATASET ------------------------------------------------------------------

def test_holdout_holds_out_a_random_sample_not_the_last_points(tmp_path):
    """An imagefolder lists its training points class by class: the last M of them would be one class, missing from
    the training set. The held-out split is a uniform random sample, the same every time."""
    write_images(tmp_path, "train", ["ant", "bee", "cat", "dog"], 10)
    write_images(tmp_path, "test", ["ant", "bee", "cat", "dog"], 1)
    full = load_dataset(f"imagefolder:{tmp_path}")
    assert full.train_y.tolist() == sorted(full.train_y.tolist())  # the order that made "the last M" one class
    split = load_dataset(f"holdout:10:imagefolder:{tmp_path}")
    assert len(split.test_y) == 10 and len(split.train_y) == 30
    assert len(set(split.test_y.tolist())) > 1 and set(split.train_y.tolist()) == {0, 1, 2, 3}
    # Every training point is in exactly one part, each part in the training set's order.
    rows = {bytes(image.numpy()): index for index, image in enumerate(full.train_x)}
    held = [rows[bytes(image.numpy())] for image in split.test_x]
    kept = [rows[bytes(image.numpy())] for image in split.train_x]
    assert sorted(held + kept) == list(range(40)) and held == sorted(held) and kept == sorted(kept)
    assert held != list(range(30, 40))
    assert torch.equal(split.test_y, full.train_y[held]) and torch.equal(split.train_y, full.train_y[kept])
    again = load_dataset(f"holdout:10:imagefolder:{tmp_path}")
    assert torch.equal(again.test_x, split.test_x) and again.fingerprint == split.fingerprint
    assert len({split.fingerprint, full.fingerprint, load_dataset(f"holdout:11:imagefolder:{tmp_path}").fingerprint,
                load_dataset(f"first:30:imagefolder:{tmp_path}").fingerprint}) == 4


@pytest.mark.parametrize("name, fragment", [
    ("holdout:512:synthetic", "only 512 training points"),
    ("holdout:-3:synthetic", "integer N >= 1"),
    ("holdout:²:synthetic", "integer N >= 1"),
])
def test_bad_holdout_datasets(name, fragment):
    assert_usage_error(lambda: load_dataset(name), "--dataset", fragment)


@pytest.mark.parametrize("name, fragment", [
    ("first:0:synthetic", "integer N >= 1"),
    ("first:x:synthetic", "integer N >= 1"),
    ("first:64", "integer N >= 1"),
    ("first:513:synthetic", "only 512 training points"),
    ("first:8:svhn", "unknown dataset 'svhn'"),
])
def test_bad_first_datasets(name, fragment):
    assert_usage_error(lambda: load_dataset(name), "--dataset", fragment)


@pytest.mark.parametrize("features, images", [
    ("scatternet:imagefolder:/d", "imagefolder:/d"),
    ("first:10:scatternet:cifar10", "first:10:cifar10"),
    ("holdout:5:scatternet:cifar10", "holdout:5:cifar10"),
    # Nested subsets select the same training points of the images as of the features, in the same order.
    ("first:10:holdout:5:scatternet:cifar10", "first:10:holdout:5:cifar10"),
    ("holdout:5:first:10:scatternet:cifar10", "holdout:5:first:10:cifar10"),
    ("first:10:mnist-embedded", None),
    ("cifar10", None),
])
def test_the_images_of_scatternet_features_keep_every_subset(features, images):
    from perinstance.train.data import _feature_images

    assert _feature_images(features) == images
