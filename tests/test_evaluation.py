import math

import numpy as np
import pytest
import torch

from perinstance.train import evaluation


def counted_accuracy(predictions: list[int], labels: list[int], num_classes: int) -> list[float]:
    """Each class's accuracy by counting its examples one by one (nan for a class without examples)."""
    accuracy = []
    for label in range(num_classes):
        mine = [prediction == target for prediction, target in zip(predictions, labels, strict=True)
                if target == label]
        accuracy.append(sum(mine) / len(mine) if mine else math.nan)
    return accuracy


def assert_same(found: list[float], expected: list[float]) -> None:
    """The same accuracies, a ratio of two counts each, at a tolerance far below one point in a class's count."""
    assert found == pytest.approx(expected, rel=1e-12, nan_ok=True)


def test_class_accuracy_counts_hits_per_class_and_is_nan_for_a_class_without_points():
    labels = [0, 0, 0, 1, 1, 3, 3, 3, 3]  # class 2 has no point
    correct = np.array([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    found = evaluation.class_accuracy(correct, torch.tensor(labels), 4)
    assert_same(found, [2 / 3, 1.0, math.nan, 0.25])
    assert_same(evaluation.class_accuracy(correct, np.array(labels), 4), found)


def test_per_class_accuracy_of_a_model_is_its_class_accuracy_from_one_pass():
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(6, 5)
    inputs = torch.randn(2100, 6, generator=generator)  # more than one chunk of 1024
    labels = torch.randint(0, 4, (2100,), generator=generator)  # class 4 has no point
    predictions = model(inputs).argmax(dim=1).tolist()
    expected = counted_accuracy(predictions, labels.tolist(), 5)
    assert_same(evaluation.per_class_accuracy(model, inputs, labels, 5, "cpu"), expected)
    _, _, correct = evaluation.example_outputs(model, inputs, labels, "cpu")
    assert_same(evaluation.class_accuracy(correct, labels, 5), expected)
