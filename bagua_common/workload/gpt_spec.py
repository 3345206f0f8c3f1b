"""The GPT both front ends train: its sizes, its parameters' names and shapes, and their initial values.

A decoder-only transformer in the GPT-2 layout: learned token and position embeddings, ``layers``
pre-LayerNorm blocks (causal multi-head self-attention, then a GELU MLP of width ``4 * width``,
each added to the residual stream), a final LayerNorm, and output logits from the token
embedding itself (tied input and output embeddings). ``bagua_jax.models.gpt`` (flax NNX) and
``bagua_torch.models.gpt`` (``torch.nn.Module``) implement it with parameters of the same names,
shapes and layouts (a ``kernel`` is ``(inputs, outputs)``), so the NumPy arrays of
:func:`init_gpt_params` load into either and the two compute the same function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

LAYER_NORM_EPS = 1e-5
"""The LayerNorm epsilon of both front ends (GPT-2's)."""

INIT_STD = 0.02
"""Standard deviation of the embeddings and kernels (GPT-2's).

Residual projections get ``INIT_STD / sqrt(2 layers)``.
"""


@dataclass(frozen=True)
class GPTConfig:
    """One GPT size: ``layers`` blocks of ``width`` channels in ``heads`` heads, ``context`` positions, ``vocab``
    tokens."""

    name: str
    layers: int
    width: int
    heads: int
    context: int
    vocab: int = 256

    def __post_init__(self) -> None:
        for field in ("layers", "width", "heads", "context", "vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT {self.name!r}: {field} must be an int >= 1, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"GPT {self.name!r}: width {self.width} is not a multiple of heads {self.heads}")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape, in the order :func:`init_gpt_params` draws them."""
        d = self.width
        shapes: dict[str, tuple[int, ...]] = {"wte": (self.vocab, d), "wpe": (self.context, d)}
        for i in range(self.layers):
            block = f"blocks.{i}."
            shapes.update(
                {
                    block + "ln1.scale": (d,),
                    block + "ln1.bias": (d,),
                    block + "attn.qkv.kernel": (d, 3 * d),
                    block + "attn.qkv.bias": (3 * d,),
                    block + "attn.proj.kernel": (d, d),
                    block + "attn.proj.bias": (d,),
                    block + "ln2.scale": (d,),
                    block + "ln2.bias": (d,),
                    block + "mlp.fc.kernel": (d, 4 * d),
                    block + "mlp.fc.bias": (4 * d,),
                    block + "mlp.proj.kernel": (4 * d, d),
                    block + "mlp.proj.bias": (d,),
                }
            )
        shapes.update({"ln_f.scale": (d,), "ln_f.bias": (d,)})
        return shapes

    @property
    def parameter_count(self) -> int:
        """The number of trainable scalars (the tied output embedding counted once)."""
        return sum(math.prod(shape) for shape in self.parameter_shapes().values())


def head_shape(shape: Sequence[int], heads: int) -> tuple[int, int, int, int]:
    """The shape ``(batch, length, heads, head width)`` attention splits its queries, keys and values of ``shape``
    ``(batch, length, width)`` into."""
    batch, length, width = shape
    return batch, length, heads, width // heads


# The composite modules' parts, once for both front ends. A front end's class inherits the layout beside its own
# module class (``class Block(BlockLayout, nn.Module)``), names the classes of its parts, and writes the forward
# pass of attention and the MLP in its own arrays; each part is built from the parameters and its name prefix.


class AttentionLayout:
    """Causal self-attention's parts: ``heads``, and the ``qkv`` and ``proj`` projections (``linear_type``)."""

    linear_type: ClassVar[type]

    def __init__(self, params: Mapping[str, Any], prefix: str, heads: int):
        super().__init__()  # the front end's module class
        self.heads = heads
        self.qkv = self.linear_type(params, prefix + "qkv.")
        self.proj = self.linear_type(params, prefix + "proj.")


class MLPLayout:
    """The MLP's parts: the ``fc`` and ``proj`` projections (``linear_type``)."""

    linear_type: ClassVar[type]

    def __init__(self, params: Mapping[str, Any], prefix: str):
        super().__init__()
        self.fc = self.linear_type(params, prefix + "fc.")
        self.proj = self.linear_type(params, prefix + "proj.")


class BlockLayout:
    """One pre-LayerNorm block: its parts ``ln1``, ``attn``, ``ln2`` and ``mlp`` (of ``layer_norm_type``,
    ``attention_type`` and ``mlp_type``), and its forward pass :meth:`residual`."""

    layer_norm_type: ClassVar[type]
    attention_type: ClassVar[type]
    mlp_type: ClassVar[type]

    def __init__(self, params: Mapping[str, Any], prefix: str, heads: int):
        super().__init__()
        self.ln1 = self.layer_norm_type(params, prefix + "ln1.")
        self.attn = self.attention_type(params, prefix + "attn.", heads)
        self.ln2 = self.layer_norm_type(params, prefix + "ln2.")
        self.mlp = self.mlp_type(params, prefix + "mlp.")

    def residual(self, x: Any) -> Any:
        """The block applied to the residual stream ``x`` (an array of the front end): ``x + attn(ln1(x))``, then
        ``+ mlp(ln2(x))``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


GPT_CONFIGS: dict[str, GPTConfig] = {
    config.name: config
    for config in (
        GPTConfig("tiny", layers=2, width=64, heads=4, context=64),  # 120,576 parameters: tests
        GPTConfig("mini", layers=4, width=128, heads=4, context=128),  # 842,496: the LM study
        GPTConfig("small", layers=4, width=256, heads=8, context=128),  # 3.26M: CPU studies
        GPTConfig("gpt2", layers=12, width=768, heads=12, context=1024, vocab=50257),  # 124.4M: GPT-2 small's shape
    )
}
"""The sizes by name. ``mini`` is the LM study's (``benchmarks/lm_study_settings.py`` says why). ``gpt2`` keeps
GPT-2's vocabulary of 50257 tokens (byte tokens use the first 256)."""


def gpt_config(size: str | GPTConfig) -> GPTConfig:
    """The configuration called ``size`` (a key of :data:`GPT_CONFIGS`); a :class:`GPTConfig` is returned as is."""
    if isinstance(size, GPTConfig):
        return size
    if size not in GPT_CONFIGS:
        raise ValueError(f"GPT size {size!r} is unknown; sizes: {', '.join(GPT_CONFIGS)}")
    return GPT_CONFIGS[size]


def init_gpt_params(size: str | GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial float32 parameters of the GPT ``size``, drawn from ``seed``: the same arrays for both front ends.

    GPT-2's initialization: embeddings and kernels from N(0, 0.02^2), the two projections that
    write into the residual stream (``attn.proj``, ``mlp.proj``) from N(0, (0.02 / sqrt(2 layers))^2),
    biases 0, LayerNorm scales 1.
    """
    config = gpt_config(size)
    rng = np.random.default_rng(seed)
    residual_std = INIT_STD / math.sqrt(2 * config.layers)
    params = {}
    for name, shape in config.parameter_shapes().items():
        if name.endswith(".scale"):
            params[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            params[name] = np.zeros(shape, np.float32)
        else:
            std = residual_std if name.endswith("proj.kernel") else INIT_STD
            params[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return params


def check_gpt_params(size: str | GPTConfig, params: Mapping[str, Any]) -> None:
    """Raise a ValueError unless ``params`` has exactly the parameters of the GPT ``size``, each of its shape."""
    config = gpt_config(size)
    shapes = config.parameter_shapes()
    missing, unknown = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or unknown:
        raise ValueError(f"GPT {config.name!r}: parameters missing: {missing or 'none'}; unknown: {unknown or 'none'}")
    for name, shape in shapes.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"GPT {config.name!r}: {name} has shape {tuple(params[name].shape)}, expected {shape}")


def gpt_and_params(
    size: str | GPTConfig, params: Mapping[str, Any] | None = None, seed: int = 0
) -> tuple[GPTConfig, Mapping[str, Any]]:
    """The configuration of the GPT ``size`` and the parameters a model of it starts from: ``params``, checked
    with :func:`check_gpt_params`, or when None :func:`init_gpt_params` of ``seed``."""
    config = gpt_config(size)
    if params is None:
        return config, init_gpt_params(config, seed)
    check_gpt_params(config, params)
    return config, params
