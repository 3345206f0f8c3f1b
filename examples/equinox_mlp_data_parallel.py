"""The equinox MLP of ``equinox_mlp.py`` trained data-parallel with Bagua, one process per rank.

The model, the loss, the train step and the loop are ``equinox_mlp.py``'s; the lines below are all it
takes to make them data-parallel: the optimizer becomes ByteGrad's per-rank transformation over the
native engine, and each rank trains on its slice of every batch. Start it with the launcher:

    bagua-launch --nproc-per-node 2 --mpi examples/equinox_mlp_data_parallel.py --steps 300
"""

import optax
from equinox_mlp import main

from bagua_jax import NativeCommunicator, algorithms

comm = NativeCommunicator.world()
tx = algorithms.ByteGrad().transformation(optax.adam(3e-3), comm)

if __name__ == "__main__":
    main(tx, rank=int(comm.rank()), size=comm.size)
