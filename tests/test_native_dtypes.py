"""The native core maps element types twice, from XLA's (JAX's FFI calls) and from DLPack's (torch's
tensors); both must name every dtype the same, and refuse the same ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bagua_jax._native import library as _bagua_ffi

DTYPES = [
    ("float64", torch.float64, jnp.float64),
    ("uint8", torch.uint8, jnp.uint8),
    ("int32", torch.int32, jnp.int32),
    ("int64", torch.int64, jnp.int64),
    ("an unsupported dtype", torch.int16, jnp.int16),
]
N, K = 10, 2


def _compressed_bytes() -> int:
    return _bagua_ffi.compressed_bytes("minmax_uint8", N, K)


def _torch_message(dtype: torch.dtype) -> str:
    out = torch.zeros(_compressed_bytes(), dtype=torch.uint8)
    with pytest.raises(ValueError) as error:
        _bagua_ffi.compress("minmax_uint8", torch.zeros(N, dtype=dtype), out, K)
    return str(error.value)


def _jax_message(dtype) -> str:
    call = jax.ffi.ffi_call("bagua_minmax_compress", jax.ShapeDtypeStruct((_compressed_bytes(),), jnp.uint8))
    with jax.enable_x64(True), pytest.raises(Exception) as error:
        jax.block_until_ready(call(jnp.zeros(N, dtype), k=np.int64(K)))
    return str(error.value)


@pytest.mark.parametrize(("name", "torch_dtype", "jax_dtype"), DTYPES, ids=[d[0] for d in DTYPES])
def test_xla_and_dlpack_name_each_dtype_alike(name, torch_dtype, jax_dtype):
    expected = f"x must be float32, float16 or bfloat16, got {name}"
    assert expected in _torch_message(torch_dtype)
    assert expected in _jax_message(jax_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_both_maps_accept_the_kernel_float_types(dtype):
    x = torch.linspace(-1, 1, N).to(dtype)
    from_torch = torch.zeros(_compressed_bytes(), dtype=torch.uint8)
    _bagua_ffi.compress("minmax_uint8", x, from_torch, K)
    jax_dtype = {torch.float32: jnp.float32, torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}[dtype]
    call = jax.ffi.ffi_call("bagua_minmax_compress", jax.ShapeDtypeStruct((_compressed_bytes(),), jnp.uint8))
    from_jax = call(jnp.asarray(x.float().numpy(), jax_dtype), k=np.int64(K))
    np.testing.assert_array_equal(np.asarray(from_jax), from_torch.numpy())
