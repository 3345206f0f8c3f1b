"""The GPT of :mod:`bagua_common.workload.gpt_spec` in flax NNX, and its loss as a function of plain arrays.

``GPT(size)`` is an ``nnx.Module`` holding the parameters of :func:`~bagua_common.workload.gpt_spec.init_gpt_params`
(or any arrays with those names and shapes) under the same names, so ``bagua_torch.models.gpt`` computes the same
function from the same arrays. For :class:`~bagua_jax.trainer.DataParallel`, whose parameters are a pytree of
arrays, :func:`gpt_loss_fn` gives the loss of the flat name -> array dictionary itself::

    from bagua_common.workload import init_gpt_params, load_corpus
    from bagua_jax.models.gpt import gpt_loss_fn

    trainer = DataParallel(gpt_loss_fn("tiny"), optax.adamw(1e-3), ByteGrad(), mesh=mesh)
    state = trainer.init(init_gpt_params("tiny", seed=0))
    state, loss = trainer.step(state, {"tokens": load_corpus().batch(seed, step, 0, 8, 65)})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bagua_common.workload.gpt_spec import LAYER_NORM_EPS, GPTConfig, check_gpt_params, gpt_config, init_gpt_params


class Linear(nnx.Module):
    """``x @ kernel + bias``, ``kernel`` laid out ``(inputs, outputs)``."""

    def __init__(self, params: Mapping[str, Any], prefix: str):
        self.kernel = nnx.Param(jnp.asarray(params[prefix + "kernel"]))
        self.bias = nnx.Param(jnp.asarray(params[prefix + "bias"]))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class LayerNorm(nnx.Module):
    """Normalization over the last axis with a learned ``scale`` and ``bias``."""

    def __init__(self, params: Mapping[str, Any], prefix: str):
        self.scale = nnx.Param(jnp.asarray(params[prefix + "scale"]))
        self.bias = nnx.Param(jnp.asarray(params[prefix + "bias"]))

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        variance = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPS) * self.scale[...] + self.bias[...]


class Attention(nnx.Module):
    """Causal multi-head self-attention: ``proj(softmax(q k^T / sqrt(head width) + causal mask) v)``."""

    def __init__(self, params: Mapping[str, Any], prefix: str, heads: int):
        self.heads = heads
        self.qkv = Linear(params, prefix + "qkv.")
        self.proj = Linear(params, prefix + "proj.")

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (part.reshape(shape) for part in jnp.split(self.qkv(x), 3, axis=-1))
        return self.proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, length, width))


class MLP(nnx.Module):
    """``proj(gelu(fc(x)))`` with the exact (erf) GELU."""

    def __init__(self, params: Mapping[str, Any], prefix: str):
        self.fc = Linear(params, prefix + "fc.")
        self.proj = Linear(params, prefix + "proj.")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=False))


class Block(nnx.Module):
    """One pre-LayerNorm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``."""

    def __init__(self, params: Mapping[str, Any], prefix: str, heads: int):
        self.ln1 = LayerNorm(params, prefix + "ln1.")
        self.attn = Attention(params, prefix + "attn.", heads)
        self.ln2 = LayerNorm(params, prefix + "ln2.")
        self.mlp = MLP(params, prefix + "mlp.")

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    """The GPT ``size`` (a name of :data:`~bagua_common.workload.gpt_spec.GPT_CONFIGS` or a config), its parameters
    ``params`` (default: :func:`~bagua_common.workload.gpt_spec.init_gpt_params` of ``seed``). Called on int tokens
    ``(batch, length <= context)`` it returns float32 logits ``(batch, length, vocab)``."""

    def __init__(self, size: str | GPTConfig, params: Mapping[str, Any] | None = None, *, seed: int = 0):
        self.config = gpt_config(size)
        params = init_gpt_params(self.config, seed) if params is None else params
        check_gpt_params(self.config, params)
        self.wte = nnx.Param(jnp.asarray(params["wte"]))
        self.wpe = nnx.Param(jnp.asarray(params["wpe"]))
        self.blocks = nnx.List([Block(params, f"blocks.{i}.", self.config.heads) for i in range(self.config.layers)])
        self.ln_f = LayerNorm(params, "ln_f.")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[-1]
        if length > self.config.context:
            raise ValueError(f"GPT {self.config.name!r}: {length} tokens exceed its context of {self.config.context}")
        x = self.wte[...][tokens] + self.wpe[...][:length]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte[...].T


def _module_path(name: str) -> tuple[str | int, ...]:
    """The spec's flat name -> the module's attribute path (``blocks.0.ln1.scale`` -> ``("blocks", 0, "ln1", "scale")``)."""
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


def gpt_params(model: GPT) -> dict[str, jax.Array]:
    """``model``'s parameters under the spec's flat names (what :class:`GPT` and :func:`gpt_loss_fn` take)."""
    return {name: _get(model, _module_path(name))[...] for name in model.config.parameter_shapes()}


def _get(node: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (of ``tokens[:, :-1]``) predicting ``tokens[:, 1:]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def gpt_loss_fn(size: str | GPTConfig) -> Callable[[Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]:
    """``loss_fn(params, batch)``: the next-token loss of the GPT ``size`` with the flat parameter dictionary
    ``params`` on ``batch["tokens"]`` (int, ``(batch, length <= context + 1)``); pure, for ``jax.grad`` and
    :class:`~bagua_jax.trainer.DataParallel`."""
    config = gpt_config(size)
    shapes = config.parameter_shapes()
    abstract = nnx.eval_shape(lambda: GPT(config, {name: jnp.zeros(shape) for name, shape in shapes.items()}))
    graphdef, _ = nnx.split(abstract)

    def loss_fn(params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        state = nnx.from_flat_state({_module_path(name): nnx.Param(params[name]) for name in shapes})
        tokens = batch["tokens"]
        return next_token_loss(nnx.merge(graphdef, state)(tokens[:, :-1]), tokens)

    return loss_fn
