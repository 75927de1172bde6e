"""Per-sample gradient norms of the layers of sequence models, from each layer's input and the gradient of its
output, as layer_forms.py's: Embedding, LayerNorm, RMSNorm and MultiheadAttention (self-attention), whose Linear
layers on tokens (the feed-forward block, attention's output projection) are layer_forms.linear_parts's
(docs/sensitivity.md).

MultiheadAttention's packed input projection is applied by torch inside the layer's forward, out of reach of
hooks; within `attention_projections` the layer runs a forward of its own that applies it itself (the same
function as torch's, tests/test_gradients.py), hands the projection's input and output to the engine's
recorder, and calls its output projection as a module.
"""

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from perinstance.persample.layer_forms import LayerNorms, affine_gradients, linear_parts


def embedding_squared_norms(layer: nn.Embedding, ids: torch.Tensor, grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of an Embedding layer on (n, ...) token ids: the gradient of row v is the sum of the output
    gradients b_t of the example's tokens t with id v (none for padding_idx), so ||g_i||² sums the squared norms of
    those sums over the distinct ids of the example. Nothing is materialised beyond one row per (example, id)."""
    keys, rows = _keyed_rows(layer, ids, grad_outputs)
    distinct, position = torch.unique(keys, return_inverse=True)
    sums = rows.new_zeros(len(distinct), rows.shape[1]).index_add_(0, position, rows)
    return LayerNorms(rows.new_zeros(len(ids)).index_add_(0, distinct // layer.num_embeddings,
                                                          sums.square().sum(dim=1)), {})


def _keyed_rows(layer, ids, grad_outputs):
    """(example·V + id, b_t) of every token of the examples that is not padding."""
    count = len(ids)
    ids = ids.reshape(count, -1)
    rows = grad_outputs.reshape(count * ids.shape[1], -1)
    keys = (torch.arange(count, device=ids.device)[:, None] * layer.num_embeddings + ids).reshape(-1)
    if layer.padding_idx is not None:
        kept = ids.reshape(-1) != layer.padding_idx
        keys, rows = keys[kept], rows[kept]
    return keys, rows


def layer_norm_squared_norms(layer: nn.LayerNorm | nn.RMSNorm, inputs: torch.Tensor,
                             grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a LayerNorm or RMSNorm layer on (n, ..., *normalized_shape) inputs: g_γ = Σ_positions b ⊙ x̂ and
    g_β = Σ_positions b, with x̂ the normalised input, both formed per sample (n, *normalized_shape)."""
    positions = tuple(range(1, inputs.dim() - len(layer.normalized_shape)))
    per_sample = {}
    if layer.weight is not None and layer.weight.requires_grad:
        if isinstance(layer, nn.RMSNorm):
            normalized = F.rms_norm(inputs, layer.normalized_shape, eps=layer.eps)
        else:
            normalized = F.layer_norm(inputs, layer.normalized_shape, eps=layer.eps)
        products = normalized.mul_(grad_outputs)
        per_sample[layer.weight] = products.sum(dim=positions) if positions else products
    bias = getattr(layer, "bias", None)
    if bias is not None and bias.requires_grad:
        per_sample[bias] = grad_outputs.sum(dim=positions) if positions else grad_outputs
    return LayerNorms.of_per_sample(per_sample)


def attention_squared_norms(layer: nn.MultiheadAttention, inputs: torch.Tensor,
                            grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a self-attention layer's packed input projection (in_proj_weight, in_proj_bias): a Linear map on
    tokens, from the input (n, length, embed_dim) and the gradient of its (n, length, 3·embed_dim) output that
    `attention_projections` records. The output projection is a layer of its own."""
    return linear_parts(layer.in_proj_weight, layer.in_proj_bias, inputs, grad_outputs)


SQUARED_NORMS = {nn.Embedding: embedding_squared_norms, nn.LayerNorm: layer_norm_squared_norms,
                 nn.RMSNorm: layer_norm_squared_norms, nn.MultiheadAttention: attention_squared_norms}
# Layers whose applications `attention_projections` records, not a forward hook.
SELF_RECORDING = (nn.MultiheadAttention,)


def closed_form_applies(layer: nn.Module) -> bool:
    """Whether the settings of `layer` (one of SQUARED_NORMS) allow its closed form: an Embedding that neither
    renormalises its rows (max_norm) nor scales their gradients, a MultiheadAttention with one packed projection
    and no extra key/value bias or zero attention."""
    if isinstance(layer, nn.Embedding):
        return layer.max_norm is None and not layer.scale_grad_by_freq
    if isinstance(layer, nn.MultiheadAttention):
        return layer._qkv_same_embed_dim and layer.bias_k is None and not layer.add_zero_attn \
            and layer.in_proj_weight is not None
    return True


def weight_gradients(layer: nn.Module, inputs: torch.Tensor, grad_outputs: torch.Tensor,
                     params: Sequence[nn.Parameter]) -> dict:
    """The gradients of `params` (some of `layer`'s own, not materialised by its norms) for the gradient
    `grad_outputs` of its output (of its input projection, for attention)."""
    if isinstance(layer, nn.Embedding):
        keys, rows = _keyed_rows(layer, inputs, grad_outputs)
        ids = keys % layer.num_embeddings
        return {layer.weight: rows.new_zeros(layer.weight.shape).index_add_(0, ids, rows)}
    return affine_gradients(layer.in_proj_weight, inputs, grad_outputs, params)


@contextmanager
def attention_projections(model: nn.Module, layers: Sequence[nn.Module], record: Callable) -> Iterator[None]:
    """Within the block, every MultiheadAttention of `model` applies its packed input projection itself and calls
    its output projection as a module (so that a pass sees that projection's application, also where the input
    projection is frozen); one of `layers` calls record(layer, (input,), projection) with the batch-first
    (n, length, embed_dim) input. Where the closed form does not hold (cross-attention, unbatched inputs) the
    layer runs torch's forward, and one of `layers` calls record(layer, (None,), None): applied, not covered."""
    attention = [module for module in model.modules() if type(module) is nn.MultiheadAttention]
    recorded = set(layers)
    for layer in attention:
        layer.forward = _recorded_forward(layer, record if layer in recorded else None)
    try:
        yield
    finally:
        for layer in attention:
            del layer.forward


def _recorded_forward(layer, record):
    original = type(layer).forward.__get__(layer)

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not (query is key and key is value and query.dim() == 3 and closed_form_applies(layer)):
            if record is not None:
                record(layer, (None,), None)
            return original(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                            attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        tokens = query if layer.batch_first else query.transpose(0, 1)
        projected = F.linear(tokens, layer.in_proj_weight, layer.in_proj_bias)
        if record is not None:
            record(layer, (tokens,), projected)
        output, weights = self_attention(layer, projected, key_padding_mask, need_weights, attn_mask,
                                         average_attn_weights, is_causal)
        return (output if layer.batch_first else output.transpose(0, 1)), weights

    return forward


def self_attention(layer: nn.MultiheadAttention, projected: torch.Tensor, key_padding_mask: torch.Tensor | None,
                   need_weights: bool, attn_mask: torch.Tensor | None, average_attn_weights: bool,
                   is_causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rest of torch's F.multi_head_attention_forward after the input projection, batch first: the masks
    merged as torch merges them, attention by scaled_dot_product_attention (or, with need_weights, explicitly, its
    weights returned), the heads joined and the output projection applied as a module."""
    count, length, _ = projected.shape
    heads, head_dim = layer.num_heads, layer.head_dim

    def split(part):
        return part.reshape(count, length, heads, head_dim).transpose(1, 2)

    query, key, value = (split(part) for part in projected.chunk(3, dim=-1))
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # scaled_dot_product_attention's causal hint alone
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if attn_mask is not None:
        attn_mask = attn_mask.reshape(1, 1, length, length) if attn_mask.dim() == 2 else \
            attn_mask.reshape(count, heads, length, length)
    if key_padding_mask is not None:
        padding = key_padding_mask.reshape(count, 1, 1, length)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout = layer.dropout if layer.training else 0.0
    weights = None
    if need_weights:
        scores = (query * math.sqrt(1.0 / head_dim)) @ key.transpose(-2, -1)
        weights = torch.softmax(scores if attn_mask is None else scores + attn_mask, dim=-1)
        if dropout > 0:
            weights = F.dropout(weights, p=dropout)
        attended = weights @ value
        weights = weights.mean(dim=1) if average_attn_weights else weights
    else:
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask, dropout, is_causal)
    return layer.out_proj(attended.transpose(1, 2).reshape(count, length, heads * head_dim)), weights
