"""The per-sample gradient engine: per-sample gradient norms and the clipped gradient sum of any model, by
closed forms per layer (layer_forms), torch.func where those do not hold (fallback_norms), or Opacus's
per-sample gradients (gradients).

May import the package top only (errors, console).
"""
