"""The GPT of :mod:`bagua_common.workload.gpt_spec` as a plain ``torch.nn.Module``.

Its ``state_dict()`` keys, shapes and layouts are the spec's (a ``kernel`` is ``(inputs, outputs)``), so the NumPy
arrays of :func:`~bagua_common.workload.gpt_spec.init_gpt_params` load into it as they are and it computes the same
function as ``bagua_jax.models.gpt.GPT`` from the same arrays. Training it with any algorithm::

    from bagua_common.workload import load_corpus
    from bagua_torch.models.gpt import GPT, next_token_loss

    model = GPT("tiny", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = bagua_torch.with_bagua(model, [optimizer], "bytegrad")
    tokens = torch.from_numpy(load_corpus().batch(seed, step, rank, 8, 65))
    loss = next_token_loss(wrapped(tokens[:, :-1]), tokens)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from bagua_common.workload.gpt_spec import LAYER_NORM_EPS, GPTConfig, check_gpt_params, gpt_config, init_gpt_params


def _parameter(params: Mapping[str, Any], name: str) -> nn.Parameter:
    return nn.Parameter(torch.as_tensor(np.array(params[name], dtype=np.float32)))


class Linear(nn.Module):
    """``x @ kernel + bias``, ``kernel`` laid out ``(inputs, outputs)``."""

    def __init__(self, params: Mapping[str, Any], prefix: str):
        super().__init__()
        self.kernel = _parameter(params, prefix + "kernel")
        self.bias = _parameter(params, prefix + "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.kernel).reshape(*x.shape[:-1], -1)


class LayerNorm(nn.Module):
    """Normalization over the last axis with a learned ``scale`` and ``bias``."""

    def __init__(self, params: Mapping[str, Any], prefix: str):
        super().__init__()
        self.scale = _parameter(params, prefix + "scale")
        self.bias = _parameter(params, prefix + "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.scale.shape, self.scale, self.bias, LAYER_NORM_EPS)


class Attention(nn.Module):
    """Causal multi-head self-attention: ``proj(softmax(q k^T / sqrt(head width) + causal mask) v)``."""

    def __init__(self, params: Mapping[str, Any], prefix: str, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = Linear(params, prefix + "qkv.")
        self.proj = Linear(params, prefix + "proj.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            part.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.qkv(x).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with the exact (erf) GELU."""

    def __init__(self, params: Mapping[str, Any], prefix: str):
        super().__init__()
        self.fc = Linear(params, prefix + "fc.")
        self.proj = Linear(params, prefix + "proj.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``."""

    def __init__(self, params: Mapping[str, Any], prefix: str, heads: int):
        super().__init__()
        self.ln1 = LayerNorm(params, prefix + "ln1.")
        self.attn = Attention(params, prefix + "attn.", heads)
        self.ln2 = LayerNorm(params, prefix + "ln2.")
        self.mlp = MLP(params, prefix + "mlp.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The GPT ``size`` (a name of :data:`~bagua_common.workload.gpt_spec.GPT_CONFIGS` or a config), its parameters
    ``params`` (default: :func:`~bagua_common.workload.gpt_spec.init_gpt_params` of ``seed``), in float32 on the CPU
    (move it with ``.to()``). Called on int tokens ``(batch, length <= context)`` it returns logits
    ``(batch, length, vocab)``."""

    def __init__(self, size: str | GPTConfig, params: Mapping[str, Any] | None = None, *, seed: int = 0):
        super().__init__()
        self.config = gpt_config(size)
        params = init_gpt_params(self.config, seed) if params is None else params
        check_gpt_params(self.config, params)
        self.wte = _parameter(params, "wte")
        self.wpe = _parameter(params, "wpe")
        self.blocks = nn.ModuleList(Block(params, f"blocks.{i}.", self.config.heads) for i in range(self.config.layers))
        self.ln_f = LayerNorm(params, "ln_f.")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.config.context:
            raise ValueError(f"GPT {self.config.name!r}: {length} tokens exceed its context of {self.config.context}")
        x = F.embedding(tokens, self.wte) + self.wpe[:length]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.T


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (of ``tokens[:, :-1]``) predicting ``tokens[:, 1:]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1).long())
