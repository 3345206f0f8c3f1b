"""The GPT of bagua_common.workload.gpt_spec written out in plain NumPy (float64), to check both front ends against.

Attention is computed with an explicit lower-triangular mask and softmax, LayerNorm and GELU from their formulas,
so neither front end's library calls are reused.
"""

from __future__ import annotations

import math

import numpy as np


def _layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def logits(params: dict[str, np.ndarray], tokens: np.ndarray, layers: int, heads: int) -> np.ndarray:
    """Logits ``(batch, length, vocab)`` of the GPT with ``params`` on int ``tokens`` ``(batch, length)``."""
    p = {name: value.astype(np.float64) for name, value in params.items()}
    batch, length = tokens.shape
    x = p["wte"][tokens] + p["wpe"][:length]
    width = x.shape[-1]
    hw = width // heads
    future = np.triu(np.ones((length, length), bool), k=1)
    for i in range(layers):
        b = f"blocks.{i}."
        h = _layer_norm(x, p[b + "ln1.scale"], p[b + "ln1.bias"]) @ p[b + "attn.qkv.kernel"] + p[b + "attn.qkv.bias"]
        q, k, v = (h[..., j * width : (j + 1) * width].reshape(batch, length, heads, hw) for j in range(3))
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hw)
        scores[:, :, future] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
        x = x + attended @ p[b + "attn.proj.kernel"] + p[b + "attn.proj.bias"]
        h = _layer_norm(x, p[b + "ln2.scale"], p[b + "ln2.bias"]) @ p[b + "mlp.fc.kernel"] + p[b + "mlp.fc.bias"]
        x = x + _gelu(h) @ p[b + "mlp.proj.kernel"] + p[b + "mlp.proj.bias"]
    return _layer_norm(x, p["ln_f.scale"], p["ln_f.bias"]) @ p["wte"].T


def next_token_loss(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean cross-entropy of ``logits`` (of ``tokens[:, :-1]``) predicting ``tokens[:, 1:]``."""
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    targets = tokens[:, 1:]
    return float(-np.take_along_axis(log_probs, targets[..., None], -1).mean())
