"""The flax CNN of ``flax_cnn.py`` trained data-parallel with Bagua: every device is one rank.

The model, the loss and the training loop are ``flax_cnn.py``'s; the lines below are all it takes to
make them data-parallel. On one CPU, simulate four devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/flax_cnn_data_parallel.py
"""

import jax
import optax
from flax_cnn import loss_fn, main

from bagua_jax import DataParallel

mesh = jax.make_mesh((jax.device_count(),), ("ranks",))
dp = DataParallel(loss_fn, optax.adam(3e-3), "bytegrad", mesh=mesh, has_aux=True)

if __name__ == "__main__":
    main(train_step=dp.step, prepare_state=dp.init)
