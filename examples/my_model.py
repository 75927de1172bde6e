"""A network of your own for `--model examples/my_model.py:TokenTransformer` (docs/commands.md, "Your own model").

A one-layer Transformer encoder over token embeddings, mean-pooled, then a linear head. The suite passes
`num_classes` and `input_shape` (here `(12,)`, the sequence length) because the signature names them.
Per-sample gradients: the token embedding, attention, the feed-forward Linear layers on tokens, LayerNorm and the
head by the fast norms engine; the position table, a weight the model reads directly, by torch.func, as
train_dpsgd.py prints once.
"""

from torch import nn

VOCABULARY, WIDTH, HEADS = 16, 16, 2


class TokenTransformer(nn.Module):
    def __init__(self, num_classes: int, input_shape: tuple):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.position = nn.Embedding(input_shape[0], WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, num_classes)

    def forward(self, tokens):
        positions = self.position.weight[: tokens.shape[1]]
        return self.head(self.encoder(self.embed(tokens) + positions).mean(dim=1))
