"""A dataset of your own for `--dataset examples/my_data.py:token_sequences` (docs/commands.md, "Your own model").

Sequences of 12 token ids out of 16; the label is which of the tokens 0-3 occurs most often (ties: the
smallest). Integer inputs: nothing in the suite assumes float images. The suite calls the function with
torch's generator seeded (and restores it after), so the data is the same in every process.
"""

import torch

VOCABULARY, LENGTH, CLASSES = 16, 12, 4


def token_sequences(train_size: int = 256, test_size: int = 64):
    """(train, test), each a pair (token ids N×LENGTH int64, labels N)."""
    tokens = torch.randint(0, VOCABULARY, (train_size + test_size, LENGTH))
    counts = torch.stack([(tokens == token).sum(dim=1) for token in range(CLASSES)], dim=1)
    labels = counts.argmax(dim=1)
    return (tokens[:train_size], labels[:train_size]), (tokens[train_size:], labels[train_size:])
