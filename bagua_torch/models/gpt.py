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
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from bagua_common.workload import gpt_spec


def _parameter(params: Mapping[str, Any], name: str) -> nn.Parameter:
    return nn.Parameter(torch.as_tensor(np.array(params[name], dtype=np.float32)))


class _Parameters(nn.Module):
    """A module holding ``params[prefix + name]`` as the parameter ``name``, for each of its ``names``."""

    names: ClassVar[tuple[str, ...]]

    def __init__(self, params: Mapping[str, Any], prefix: str):
        super().__init__()
        for name in self.names:
            setattr(self, name, _parameter(params, prefix + name))


class Linear(_Parameters):
    """``x @ kernel + bias``, ``kernel`` laid out ``(inputs, outputs)``."""

    names = ("kernel", "bias")
    kernel: nn.Parameter
    bias: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.kernel).reshape(*x.shape[:-1], -1)


class LayerNorm(_Parameters):
    """Normalization over the last axis with a learned ``scale`` and ``bias``."""

    names = ("scale", "bias")
    scale: nn.Parameter
    bias: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.scale.shape, self.scale, self.bias, gpt_spec.LAYER_NORM_EPS)


class Attention(gpt_spec.AttentionLayout, nn.Module):
    """Causal multi-head self-attention: ``proj(softmax(q k^T / sqrt(head width) + causal mask) v)``."""

    linear_type = Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = gpt_spec.head_shape(x.shape, self.heads)
        q, k, v = (part.reshape(shape).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(x.shape))


class MLP(gpt_spec.MLPLayout, nn.Module):
    """``proj(gelu(fc(x)))`` with the exact (erf) GELU."""

    linear_type = Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(gpt_spec.BlockLayout, nn.Module):
    """One pre-LayerNorm block (:class:`~bagua_common.workload.gpt_spec.BlockLayout`)."""

    layer_norm_type, attention_type, mlp_type = LayerNorm, Attention, MLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual(x)


class GPT(nn.Module):
    """The GPT ``size`` (a name of :data:`~bagua_common.workload.gpt_spec.GPT_CONFIGS` or a config), its parameters
    ``params`` (default: :func:`~bagua_common.workload.gpt_spec.init_gpt_params` of ``seed``), in float32 on the CPU
    (move it with ``.to()``). Called on int tokens ``(batch, length <= context)`` it returns logits
    ``(batch, length, vocab)``."""

    def __init__(self, size: str | gpt_spec.GPTConfig, params: Mapping[str, Any] | None = None, *, seed: int = 0):
        super().__init__()
        self.config, params = gpt_spec.gpt_and_params(size, params, seed)
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
