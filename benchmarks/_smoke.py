"""Data of the benchmarks' --smoke mode: the synthetic dataset at LeNet-5's input size, so that a
smoke run takes seconds yet goes through the same model and code paths as the full benchmark."""

import dataclasses

import torch.nn.functional as F

from perinstance.train.data import load_dataset
from perinstance.train.nets import LENET_IMAGE_SIZE

SMOKE_TRAIN_SIZE = 128


def synthetic_lenet_dataset():
    """The first SMOKE_TRAIN_SIZE training points (and all 128 test points) of the synthetic dataset,
    each 8×8 image repeated up to 32×32."""
    dataset = load_dataset("synthetic")

    def resize(images):
        return F.interpolate(images, size=LENET_IMAGE_SIZE, mode="nearest")

    return dataclasses.replace(dataset, train_x=resize(dataset.train_x[:SMOKE_TRAIN_SIZE]),
                               train_y=dataset.train_y[:SMOKE_TRAIN_SIZE], test_x=resize(dataset.test_x))
