"""Datasets as in-memory tensors, preprocessed once, with a content fingerprint.

DP-SGD here samples Poisson batches by index from a fixed tensor dataset, so every dataset is decoded and normalised
up front (no augmentation, no per-step transforms).

`Dataset.fingerprint` hashes the full dataset even when `less_point` removed a point, so a run on D and its neighbour
run on D minus x* record the same fingerprint (and the removed index records which neighbour it is).
"""

import dataclasses
import gzip
import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from perinstance.errors import UsageError
from perinstance.train import user_code

DATASET_CHOICES = ("mnist-embedded", "MNIST", "FashionMNIST", "CIFAR10", "synthetic", "imagefolder:PATH",
                   "scatternet:DATASET", "first:N:DATASET", "holdout:M:DATASET", "PATH.py:NAME", "package.module:NAME")

IMAGE_SIZE = 32
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_IMAGES = "t10k-images-idx3-ubyte.gz"
EMBEDDED_LABELS = "t10k-labels-idx1-ubyte.gz"
# md5 of the official files (the same values torchvision checks after downloading them).
EMBEDDED_MD5 = {EMBEDDED_IMAGES: "9fb629c4189551a2d022fa330f9573f3",
                EMBEDDED_LABELS: "ec29112dd5afa0611ce80d1b7f02629c"}
EMBEDDED_TRAIN_SIZE = 8000
EMBEDDED_SPLIT_SEED = 0

SYNTHETIC_SEED = 20240601
SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE = 512, 128
SYNTHETIC_CLASSES, SYNTHETIC_SIDE = 4, 8
# Spread of the class means relative to unit pixel noise: a small MLP reaches about 90%
# test accuracy without noise, well above the 25% of chance but not perfect.
SYNTHETIC_MEAN_SCALE = 0.3

IMAGEFOLDER_WORKERS = 2
IMAGEFOLDER_BATCH = 256
PROGRESS_MIN_FILES = 5000

SCATTERNET_PREFIX = "scatternet:"
# Names the ScatterNet's definition (perinstance/train/nets.py) in the feature cache: change it with the filters.
SCATTERNET_VERSION = "scatternet-j2-l8-v1"
FIRST_PREFIX, HOLDOUT_PREFIX = "first:", "holdout:"
# holdout:M: holds out M training points drawn from this seed (a uniform sample whatever the training set's order); the
# tag puts that rule in the fingerprint (it once held out the last M).
HOLDOUT_SEED, HOLDOUT_TAG = 20260101, ":random-sample"

# Features of datasets with at least this many images are kept in <data-root>/cache/ (CIFAR-10's
# 60,000 take minutes to compute on 2 cores and seconds to read back); smaller ones are recomputed.
CACHE_MIN_IMAGES = 5000


@dataclasses.dataclass
class Dataset:
    name: str  # canonical name, e.g. "mnist-embedded", "MNIST", "imagefolder:/abs/path"
    train_x: torch.Tensor  # float32, N×C×H×W, normalised (a dataset spec's: any shape)
    train_y: torch.Tensor  # int64 class indices (a dataset spec's: any targets, N × target shape)
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int  # classes; a spec's floating targets: the values of one target (user_code.target_classes)
    class_names: list[str]
    fingerprint: str  # sha256 of the full preprocessed dataset (before less_point removal)
    # Images: the per-channel (mean, std) of the [0, 1] pixels that train_x is standardised by (display_images undoes
    # it); None for inputs that are not images (synthetic points, features, a dataset spec's inputs).
    pixel_scale: tuple[tuple[float, ...], tuple[float, ...]] | None = None


def load_dataset(name: str, data_root: str = "./data", less_point: int | None = None,
                 class_labels: bool = True) -> Dataset:
    """Load dataset `name` (see DATASET_CHOICES; case-insensitive), without training point `less_point`.

    `data_root` is where the torchvision datasets live. The fingerprint is always that of
    the full dataset, so the runs with and without the point share it. class_labels=False (a run with a --loss of
    its own) takes a dataset spec's targets as it gives them, where the default loss needs class indices.
    """
    dataset = _load_full_dataset(name, data_root, class_labels)
    if less_point is not None:
        dataset = without_point(dataset, less_point)
    return dataset


def _load_full_dataset(name, data_root, class_labels):
    key = name.lower()
    if key.startswith(FIRST_PREFIX) or key.startswith(HOLDOUT_PREFIX):
        return _load_first(name, data_root, class_labels)
    if key.startswith(SCATTERNET_PREFIX):
        return _load_scatternet(name[len(SCATTERNET_PREFIX):], data_root, class_labels)
    if key.startswith("imagefolder:"):
        return _load_imagefolder(name[len("imagefolder:"):])
    if user_code.is_spec(name):  # PATH.py:NAME or package.module:NAME, the user's own data
        return _load_user_dataset(name, data_root, class_labels)
    loaders = {
        "mnist-embedded": _load_embedded_mnist,
        "mnist": lambda: _load_torchvision("MNIST", data_root),
        "fashionmnist": lambda: _load_torchvision("FashionMNIST", data_root),
        "cifar10": lambda: _load_torchvision("CIFAR10", data_root),
        "synthetic": _load_synthetic,
    }
    if key not in loaders:
        raise UsageError("--dataset", f"unknown dataset '{name}' (allowed: {', '.join(DATASET_CHOICES)})")
    return loaders[key]()


def without_point(dataset: Dataset, index: int) -> Dataset:
    """`dataset` without training point `index` (--less-point); its fingerprint stays that of the full dataset."""
    size = len(dataset.train_y)
    if not 0 <= index < size:
        raise UsageError("--less-point", f"point {index} is out of range 0..{size - 1}")
    keep = torch.arange(size) != index
    return dataclasses.replace(dataset, train_x=dataset.train_x[keep], train_y=dataset.train_y[keep])


def _load_user_dataset(spec, data_root, class_labels):
    """The Dataset of a dataset spec (user_code.py): named by the spec, its targets class indices or as the function
    gives them (`class_labels`, user_code.load_examples), fingerprinted as every dataset is."""
    train, test, _ = user_code.load_examples(spec, data_root, class_labels)
    num_classes = user_code.target_classes(train.targets, test.targets)
    return _make_dataset(spec, train.inputs, train.targets, test.inputs, test.targets,
                         [str(label) for label in range(num_classes)])


def display_images(dataset: Dataset, points: np.ndarray, data_root: str = "./data") -> np.ndarray | None:
    """The training images `points` (indices into dataset.train_x) as they look, for a figure: n×H×W×C floats in
    [0, 1], train_x's standardisation undone by its pixel_scale; for ScatterNet features, the images they were
    computed from (loaded from `data_root`). None for inputs that are not images (synthetic points, a dataset spec's
    inputs)."""
    if dataset.pixel_scale is None:
        images_of = _feature_images(dataset.name)
        return None if images_of is None else display_images(_load_full_dataset(images_of, data_root, True), points,
                                                               data_root)
    mean, std = (torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1) for values in dataset.pixel_scale)
    images = dataset.train_x[torch.as_tensor(np.asarray(points), dtype=torch.int64)] * std + mean
    return images.clamp(0, 1).permute(0, 2, 3, 1).numpy()


def _feature_images(name):
    """The dataset whose images the ScatterNet features `name` (scatternet:X, first:N:scatternet:X, holdout:M:...,
    nested in any order) were computed from, training point for training point (X, first:N:X, holdout:M:X, nested
    the same way); None for any other dataset."""
    for subset in (FIRST_PREFIX, HOLDOUT_PREFIX):  # the same training points, in the same order, as the inner ones'
        if name.lower().startswith(subset):
            count, _, inner = name[len(subset):].partition(":")
            images = _feature_images(inner)
            return None if images is None else f"{subset}{count}:{images}"
    return name[len(SCATTERNET_PREFIX):] if name.lower().startswith(SCATTERNET_PREFIX) else None


def are_class_labels(targets: torch.Tensor) -> bool:
    """Whether `targets` are class indices: one integer >= 0 per point."""
    return targets.dim() == 1 and not targets.is_floating_point() and targets.dtype != torch.bool \
        and not bool((targets < 0).any())


def _make_dataset(name, train_x, train_y, test_x, test_y, class_names, pixel_scale=None):
    return Dataset(name=name, train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
                   num_classes=len(class_names), class_names=list(class_names),
                   fingerprint=_fingerprint(train_x, train_y, test_x, test_y), pixel_scale=pixel_scale)


def _fingerprint(*tensors):
    """sha256 over each tensor's dtype, shape and bytes: equal exactly when the data is."""
    digest = hashlib.sha256()
    for tensor in tensors:
        array = tensor.contiguous().numpy()
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array)
    return digest.hexdigest()


def _normalise(images, mean, std):
    """uint8 N×C×H×W → float32 scaled to [0, 1], then standardised per channel."""
    mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return images.to(torch.float32).div_(255).sub_(mean).div_(std)


def _pad_digits(images):
    """uint8 N×28×28 → N×1×32×32 with a zero (black) border, the LeNet-5 input size."""
    border = (IMAGE_SIZE - images.shape[-1]) // 2
    return F.pad(images.unsqueeze(1), (border, border, border, border))


def _digit_tensors(images, labels, mean, std):
    return _normalise(_pad_digits(images), mean, std), labels.to(torch.int64)


# --- mnist-embedded ---------------------------------------------------------------------

def _load_embedded_mnist():
    images = torch.from_numpy(_read_idx(EMBEDDED_DIR / EMBEDDED_IMAGES, magic=2051))
    labels = torch.from_numpy(_read_idx(EMBEDDED_DIR / EMBEDDED_LABELS, magic=2049))
    x, y = _digit_tensors(images, labels, MNIST_MEAN, MNIST_STD)
    order = torch.from_numpy(np.random.default_rng(EMBEDDED_SPLIT_SEED).permutation(len(y)))
    train, test = order[:EMBEDDED_TRAIN_SIZE], order[EMBEDDED_TRAIN_SIZE:]
    return _make_dataset("mnist-embedded", x[train], y[train], x[test], y[test], [str(d) for d in range(10)],
                         (MNIST_MEAN, MNIST_STD))


def _read_idx(path, magic):
    """A gzipped IDX file (the MNIST format) as a uint8 array, after checking its md5."""
    if not path.is_file():
        raise UsageError("--dataset", f"mnist-embedded file {path} is missing; restore it from git")
    compressed = path.read_bytes()
    md5 = hashlib.md5(compressed).hexdigest()
    if md5 != EMBEDDED_MD5[path.name]:
        raise UsageError("--dataset", f"mnist-embedded file {path} is corrupted (md5 {md5}, expected "
                                      f"{EMBEDDED_MD5[path.name]}); restore it from git")
    raw = gzip.decompress(compressed)
    # Header: big-endian int32 magic (0x08 = uint8, low byte = number of dims), then the dims.
    header = np.frombuffer(raw, dtype=">i4", count=1)[0]
    if header != magic:
        raise UsageError("--dataset", f"mnist-embedded file {path} is not an IDX file of the expected kind")
    ndim = magic & 0xFF
    shape = tuple(np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


# --- torchvision datasets ---------------------------------------------------------------

def _load_torchvision(name, data_root):
    import torchvision

    dataset_class = getattr(torchvision.datasets, name)
    try:
        train = dataset_class(data_root, train=True, download=True)
        test = dataset_class(data_root, train=False, download=True)
    except (RuntimeError, OSError) as error:
        # The last line of torchvision's multi-line message is the root cause.
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise UsageError("--dataset", f"could not download {name} into {data_root} ({reason}); place the files "
                                      "there (torchvision layout) or use mnist-embedded") from error
    if name == "CIFAR10":
        train_x, train_y = _cifar_tensors(train)
        test_x, test_y = _cifar_tensors(test)
        mean, std = CIFAR10_MEAN, CIFAR10_STD
    else:
        mean, std = (MNIST_MEAN, MNIST_STD) if name == "MNIST" else (FASHION_MNIST_MEAN, FASHION_MNIST_STD)
        train_x, train_y = _digit_tensors(train.data, train.targets, mean, std)
        test_x, test_y = _digit_tensors(test.data, test.targets, mean, std)
    return _make_dataset(name, train_x, train_y, test_x, test_y, train.classes, (mean, std))


def _cifar_tensors(dataset):
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2)  # torchvision keeps CIFAR as N×H×W×C
    return _normalise(images, CIFAR10_MEAN, CIFAR10_STD), torch.tensor(dataset.targets, dtype=torch.int64)


# --- imagefolder:PATH -------------------------------------------------------------------

# The last image folder decoded in this process, {(root, listing signature): Dataset}.
_imagefolder_memo = {}


def _load_imagefolder(path):
    """Decode PATH/train and PATH/test once per process; again only when a file was added, removed
    or changed (its size or modification time)."""
    if not path:
        raise UsageError("--dataset", "imagefolder: needs a directory, e.g. imagefolder:/data/cifar10")
    root = os.path.abspath(path)
    for folder in (root, os.path.join(root, "train"), os.path.join(root, "test")):
        if not os.path.isdir(folder):
            raise UsageError("--dataset", f"imagefolder: {folder} is not a directory (need PATH/train/<class>/ "
                                          "and PATH/test/<class>/)")
    train_files, class_names = _list_images(os.path.join(root, "train"))
    test_files, test_class_names = _list_images(os.path.join(root, "test"))
    if test_class_names != class_names:
        raise UsageError("--dataset", f"imagefolder: train/ has classes {class_names} but test/ has "
                                      f"{test_class_names}")
    key = (root, _listing_signature(train_files + test_files))
    if key not in _imagefolder_memo:
        _imagefolder_memo.clear()
        _imagefolder_memo[key] = _decode_imagefolder(root, train_files, test_files, class_names)
    return _imagefolder_memo[key]


def _listing_signature(files):
    """sha256 over every file's path, label, size and modification time."""
    digest = hashlib.sha256()
    for path, label in files:
        try:
            stat = os.stat(path)
        except OSError:  # vanished since the listing: the decoder reports it
            stat = None
        digest.update(f"{path}\0{label}\0{stat and stat.st_size}\0{stat and stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _decode_imagefolder(root, train_files, test_files, class_names):
    train_images, train_gray = _decode_images([file for file, _ in train_files])
    test_images, test_gray = _decode_images([file for file, _ in test_files])
    grayscale = train_gray and test_gray
    train_images, test_images = _to_nchw(train_images, grayscale), _to_nchw(test_images, grayscale)
    mean, std = _channel_stats(train_images)
    return _make_dataset(f"imagefolder:{root}", _normalise(train_images, mean, std), _labels(train_files),
                         _normalise(test_images, mean, std), _labels(test_files), class_names, (mean, std))


def _list_images(folder):
    """(path, class index) pairs in ImageFolder order, and the class names."""
    from torchvision.datasets import ImageFolder

    try:
        listing = ImageFolder(folder)
    except OSError as error:
        raise UsageError("--dataset", f"imagefolder: {error}") from error
    return listing.samples, listing.classes


def _labels(files):
    return torch.tensor([label for _, label in files], dtype=torch.int64)


def _decode_images(paths):
    """Decode all images in parallel; returns (list of uint8 H×W or H×W×3 arrays, all grayscale?)."""
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    loader = DataLoader(_ImageFiles(paths), batch_size=IMAGEFOLDER_BATCH, num_workers=IMAGEFOLDER_WORKERS,
                        collate_fn=list)
    images = []
    with tqdm(total=len(paths), desc="decoding images", unit="img", disable=len(paths) < PROGRESS_MIN_FILES) as bar:
        for batch in loader:
            images.extend(batch)
            bar.update(len(batch))
    unreadable = [path for path, image in zip(paths, images, strict=True) if image is None]
    if unreadable:
        raise UsageError("--dataset", f"imagefolder: cannot read {len(unreadable)} image(s), e.g. {unreadable[0]}")
    return images, all(image.ndim == 2 for image in images)


class _ImageFiles(torch.utils.data.Dataset):
    """Image files decoded to uint8 arrays at IMAGE_SIZE×IMAGE_SIZE; None for an unreadable file.

    Returning None instead of raising keeps the error a one-line UsageError: an exception
    raised in a DataLoader worker comes back wrapped in the worker's traceback.
    """

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        from PIL import Image

        try:
            with Image.open(self.paths[index]) as image:
                image = image if image.mode == "L" else image.convert("RGB")
                if image.size != (IMAGE_SIZE, IMAGE_SIZE):
                    image = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
                return np.asarray(image, dtype=np.uint8)
        except OSError:
            return None


def _to_nchw(images, grayscale):
    """Stack decoded images as uint8 N×C×H×W; grayscale images are repeated to RGB unless all are gray."""
    if grayscale:
        return torch.from_numpy(np.stack(images)).unsqueeze(1)
    rgb = [np.repeat(image[:, :, None], 3, axis=2) if image.ndim == 2 else image for image in images]
    return torch.from_numpy(np.stack(rgb)).permute(0, 3, 1, 2).contiguous()


def _channel_stats(images):
    """Exact per-channel mean and std of uint8 images scaled to [0, 1], from 256-bin histograms."""
    levels = np.arange(256, dtype=np.float64) / 255
    means, stds = [], []
    for channel in range(images.shape[1]):
        counts = np.bincount(images[:, channel].numpy().ravel(), minlength=256)
        mean = counts @ levels / counts.sum()
        variance = counts @ (levels - mean) ** 2 / counts.sum()
        means.append(mean)
        # A constant channel carries no information; dividing by 1 keeps it finite (all zeros).
        stds.append(np.sqrt(variance) if variance > 0 else 1.0)
    return tuple(means), tuple(stds)


# --- scatternet:DATASET ------------------------------------------------------------------

# The last features computed in this process, {cache key: Dataset}: a script that loads its dataset
# twice (to plan a run, then to train it) computes them once.
_scatternet_memo = {}


def _load_scatternet(base_name, data_root, class_labels):
    """The fixed ScatterNet features (nets.ScatterNet) of every image of dataset `base_name`.

    The transform is the same for every dataset and uses no data, so a model trained on the
    features with DP-SGD is DP for the images (Tramèr & Boneh, ICLR 2021). Features of large
    datasets are cached under <data-root>/cache/, keyed by the images' fingerprint.
    """
    from perinstance.train.nets import scatter_features

    if not base_name or base_name.lower().startswith(SCATTERNET_PREFIX):
        raise UsageError("--dataset", "scatternet: needs one dataset of images, e.g. scatternet:imagefolder:PATH")
    base = _load_full_dataset(base_name, data_root, class_labels)
    # The features are a fixed function of the images, so the images' fingerprint names them: hashing
    # the float features instead would tie a run to the last bits of one process's convolutions.
    fingerprint = hashlib.sha256(f"{SCATTERNET_VERSION}:{base.fingerprint}".encode()).hexdigest()
    key = fingerprint[:16]
    if key in _scatternet_memo:
        return _scatternet_memo[key]
    name = f"{SCATTERNET_PREFIX}{base.name}"
    size = len(base.train_y) + len(base.test_y)
    cache = os.path.join(data_root, "cache", f"scatternet-{key}.pt")
    dataset = _read_feature_cache(cache, name, base, fingerprint) if size >= CACHE_MIN_IMAGES else None
    if dataset is None:
        from tqdm import tqdm

        with tqdm(total=size, desc="scatternet features", unit="img", disable=size < PROGRESS_MIN_FILES) as bar:
            train_x, test_x = (scatter_features(images, bar.update) for images in (base.train_x, base.test_x))
        dataset = Dataset(name=name, train_x=train_x, train_y=base.train_y, test_x=test_x, test_y=base.test_y,
                          num_classes=base.num_classes, class_names=base.class_names, fingerprint=fingerprint)
        if size >= CACHE_MIN_IMAGES:
            from perinstance.files import fileio

            # Written straight to the temp file: fileio.save_torch would first hold a second copy in memory.
            with fileio.atomic_path(cache, "--data-root") as temp_path:
                torch.save({"name": name, "train_x": train_x, "test_x": test_x}, temp_path)
    _scatternet_memo.clear()
    _scatternet_memo[key] = dataset
    return dataset


def _read_feature_cache(path, name, base, fingerprint):
    """The cached features of `base` as a Dataset, or None when the cache is missing or unreadable
    (then they are computed again and the cache rewritten)."""
    try:
        cached = torch.load(path, weights_only=True)
        train_x, test_x = cached["train_x"], cached["test_x"]
        if len(train_x) != len(base.train_y) or len(test_x) != len(base.test_y) or cached["name"] != name:
            return None
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError, pickle.UnpicklingError):
        return None
    return Dataset(name=name, train_x=train_x, train_y=base.train_y, test_x=test_x, test_y=base.test_y,
                   num_classes=base.num_classes, class_names=base.class_names, fingerprint=fingerprint)


# --- first:N:DATASET, holdout:M:DATASET -----------------------------------------------------

def _load_first(name, data_root, class_labels):
    """first:N:DATASET, the first N training points of DATASET with its test set whole: a training set small enough
    that the realised-size mean rule's rare small batches are frequent (docs/audit.md). holdout:M:DATASET, DATASET's
    training points but M drawn at random (HOLDOUT_SEED; not the last M: an imagefolder lists its points class by
    class), which become the test set: a held-out split never trained on, to choose a setting by (a filtered run's
    cap) before DATASET's own test set is looked at. Named by N (M) and DATASET's fingerprint (which fixes every point
    of it): a run is recognised whatever the last bits of DATASET's preprocessing in this process."""
    prefix = HOLDOUT_PREFIX if name.lower().startswith(HOLDOUT_PREFIX) else FIRST_PREFIX
    count_text, _, base_name = name[len(prefix):].partition(":")
    count = int(count_text) if count_text.isascii() and count_text.isdigit() else 0
    if count < 1 or not base_name:
        raise UsageError("--dataset", f"{prefix}N:DATASET needs an integer N >= 1 and a dataset, e.g. "
                                      f"{prefix}64:mnist-embedded (got {name})")
    base = _load_full_dataset(base_name, data_root, class_labels)
    if count > len(base.train_y) or (prefix == HOLDOUT_PREFIX and count == len(base.train_y)):
        raise UsageError("--dataset", f"{prefix}{count}: {base.name} has only {len(base.train_y)} training points")
    rule = HOLDOUT_TAG if prefix == HOLDOUT_PREFIX else ""
    fingerprint = hashlib.sha256(f"{prefix}{count}:{base.fingerprint}{rule}".encode()).hexdigest()
    if prefix == FIRST_PREFIX:
        parts = base.train_x[:count].clone(), base.train_y[:count].clone(), base.test_x.clone(), base.test_y.clone()
    else:  # index_select copies: no clone on top (CIFAR-10's ScatterNet features are 3 GB)
        held = torch.from_numpy(np.sort(np.random.default_rng(HOLDOUT_SEED).choice(len(base.train_y), count, False)))
        kept = torch.from_numpy(np.setdiff1d(np.arange(len(base.train_y)), held.numpy()))
        parts = [tensor.index_select(0, rows) for rows in (kept, held) for tensor in (base.train_x, base.train_y)]
    return Dataset(f"{prefix}{count}:{base.name}", *parts, num_classes=base.num_classes, class_names=base.class_names,
                   fingerprint=fingerprint, pixel_scale=base.pixel_scale)


# --- synthetic --------------------------------------------------------------------------

def _load_synthetic():
    """Gaussian class clusters in 8×8 pixel space: small, learnable, not separable."""
    rng = np.random.default_rng(SYNTHETIC_SEED)
    pixels = SYNTHETIC_SIDE * SYNTHETIC_SIDE
    class_means = SYNTHETIC_MEAN_SCALE * rng.standard_normal((SYNTHETIC_CLASSES, pixels))
    train_x, train_y = _synthetic_points(rng, class_means, SYNTHETIC_TRAIN_SIZE)
    test_x, test_y = _synthetic_points(rng, class_means, SYNTHETIC_TEST_SIZE)
    class_names = [f"class{label}" for label in range(SYNTHETIC_CLASSES)]
    return _make_dataset("synthetic", train_x, train_y, test_x, test_y, class_names)


def _synthetic_points(rng, class_means, count):
    """`count` points, classes balanced and shuffled, each its class mean plus unit Gaussian noise."""
    labels = rng.permutation(np.arange(count) % len(class_means))
    points = class_means[labels] + rng.standard_normal((count, class_means.shape[1]))
    images = torch.from_numpy(points.astype(np.float32)).view(count, 1, SYNTHETIC_SIDE, SYNTHETIC_SIDE)
    return images, torch.from_numpy(labels.astype(np.int64))
