"""A model's accuracy and losses on a tensor dataset, in eval mode and without gradients: the test evaluation of
training (training.Trainer.evaluate), the held-out and test accuracies the experiments compare, and each example's
prediction, loss and correctness for points.csv."""

import math

import numpy as np
import torch
from torch import nn

from perinstance.persample import batches


@torch.no_grad()
def evaluate(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, device: str | torch.device,
             chunk: int = 1024, loss_fn: batches.LossFn | None = None) -> tuple[float, float]:
    """Accuracy and mean loss of `model` on a tensor dataset (the loss of batches.per_example_loss: the
    cross-entropy unless `loss_fn`); the accuracy is nan where the targets are not class labels."""
    model.eval()
    correct, loss_sum = 0.0, 0.0
    for start in range(0, len(labels), chunk):
        x = inputs[start:start + chunk].to(device)
        y = labels[start:start + chunk].to(device)
        outputs = model(x)
        loss_sum += batches.per_example_loss(outputs, y, loss_fn).sum().item()
        hits = batches.correct_predictions(outputs, y)
        correct += math.nan if hits is None else hits.sum().item()
    return correct / len(labels), loss_sum / len(labels)


def class_accuracy(correct: np.ndarray, labels: np.ndarray | torch.Tensor, num_classes: int) -> list[float]:
    """Accuracy of each class from each example's correctness (1.0 or 0.0, example_outputs) and class label: its
    hits over its examples (nan for a class without examples)."""
    labels = np.asarray(labels, dtype=np.int64)
    hits = np.bincount(labels, weights=np.asarray(correct, dtype=float), minlength=num_classes)
    counts = np.bincount(labels, minlength=num_classes)
    with np.errstate(invalid="ignore"):
        return (hits / counts).tolist()


@torch.no_grad()
def per_class_accuracy(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int,
                       device: str | torch.device, chunk: int = 1024) -> list[float]:
    """Test accuracy of each class (nan for a class without test points)."""
    model.eval()
    predictions = torch.cat([model(inputs[start:start + chunk].to(device)).argmax(dim=1).cpu()
                             for start in range(0, len(labels), chunk)])
    return class_accuracy((predictions == labels).double().numpy(), labels, num_classes)


@torch.no_grad()
def example_outputs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, device: str | torch.device,
                    chunk: int = 1024, loss_fn: batches.LossFn | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray]:
    """Per example of a tensor dataset: the predicted class (the largest output; NaN where the targets are not class
    labels), the loss (batches.per_example_loss: the cross-entropy unless `loss_fn`) and whether the prediction is
    correct (1.0 or 0.0; NaN where the targets are not class labels)."""
    model.eval()
    predicted, losses, correct = [], [], []
    for start in range(0, len(targets), chunk):
        x, y = inputs[start:start + chunk].to(device), targets[start:start + chunk].to(device)
        outputs = model(x)
        losses.append(batches.per_example_loss(outputs, y, loss_fn).double().cpu().numpy())
        hits = batches.correct_predictions(outputs, y)
        predicted.append(np.full(len(y), np.nan) if hits is None else outputs.argmax(dim=1).double().cpu().numpy())
        correct.append(np.full(len(y), np.nan) if hits is None else hits.double().cpu().numpy())
    return np.concatenate(predicted), np.concatenate(losses), np.concatenate(correct)
