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
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bagua_common.workload import gpt_spec


class _Parameters(nnx.Module):
    """A module holding ``params[prefix + name]`` as the parameter ``name``, for each of its ``names``."""

    names: ClassVar[tuple[str, ...]]

    def __init__(self, params: Mapping[str, Any], prefix: str):
        for name in self.names:
            setattr(self, name, nnx.Param(jnp.asarray(params[prefix + name])))


class Linear(_Parameters):
    """``x @ kernel + bias``, ``kernel`` laid out ``(inputs, outputs)``."""

    names = ("kernel", "bias")
    kernel: nnx.Param
    bias: nnx.Param

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class LayerNorm(_Parameters):
    """Normalization over the last axis with a learned ``scale`` and ``bias``."""

    names = ("scale", "bias")
    scale: nnx.Param
    bias: nnx.Param

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        variance = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(variance + gpt_spec.LAYER_NORM_EPS) * self.scale[...] + self.bias[...]


class Attention(gpt_spec.AttentionLayout, nnx.Module):
    """Causal multi-head self-attention: ``proj(softmax(q k^T / sqrt(head width) + causal mask) v)``."""

    linear_type = Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (
            part.reshape(gpt_spec.head_shape(x.shape, self.heads)) for part in jnp.split(self.qkv(x), 3, axis=-1)
        )
        return self.proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape))


class MLP(gpt_spec.MLPLayout, nnx.Module):
    """``proj(gelu(fc(x)))`` with the exact (erf) GELU."""

    linear_type = Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=False))


class Block(gpt_spec.BlockLayout, nnx.Module):
    """One pre-LayerNorm block (:class:`~bagua_common.workload.gpt_spec.BlockLayout`)."""

    layer_norm_type, attention_type, mlp_type = LayerNorm, Attention, MLP

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.residual(x)


class GPT(nnx.Module):
    """The GPT ``size`` (a name of :data:`~bagua_common.workload.gpt_spec.GPT_CONFIGS` or a config), its parameters
    ``params`` (default: :func:`~bagua_common.workload.gpt_spec.init_gpt_params` of ``seed``). Called on int tokens
    ``(batch, length <= context)`` it returns float32 logits ``(batch, length, vocab)``."""

    def __init__(self, size: str | gpt_spec.GPTConfig, params: Mapping[str, Any] | None = None, *, seed: int = 0):
        self.config, params = gpt_spec.gpt_and_params(size, params, seed)
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
    """The spec's flat name -> the module's attribute path.

    ``blocks.0.ln1.scale`` -> ``("blocks", 0, "ln1", "scale")``.
    """
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


def gpt_loss_fn(
    size: str | gpt_spec.GPTConfig,
) -> Callable[[Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]:
    """``loss_fn(params, batch)``: the next-token loss of the GPT ``size`` with the flat parameter dictionary
    ``params`` on ``batch["tokens"]`` (int, ``(batch, length <= context + 1)``); pure, for ``jax.grad`` and
    :class:`~bagua_jax.trainer.DataParallel`."""
    config = gpt_spec.gpt_config(size)
    shapes = config.parameter_shapes()
    abstract = nnx.eval_shape(lambda: GPT(config, {name: jnp.zeros(shape) for name, shape in shapes.items()}))
    graphdef, _ = nnx.split(abstract)

    def loss_fn(params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        state = nnx.from_flat_state({_module_path(name): nnx.Param(params[name]) for name in shapes})
        tokens = batch["tokens"]
        return next_token_loss(nnx.merge(graphdef, state)(tokens[:, :-1]), tokens)

    return loss_fn
