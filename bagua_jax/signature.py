"""The cross-rank checks before the first step: every rank trains the same model the same way, on its own data.

The model's tree (paths, shapes, dtypes) and the algorithm's configuration are compared over
the native communicator, or between the processes of ``jax.distributed`` in mesh mode (one
process has nothing to compare). See :mod:`bagua_common.job.signature`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from bagua_common.job.signature import JobSignature, algorithm_config, check_same_job
from bagua_jax.native_communicator import NativeCommunicator


def job_signature(params: Any, algorithm: Any) -> JobSignature:
    """The signature of training ``params`` (a pytree) with ``algorithm``."""
    leaves = [
        (jax.tree_util.keystr(path), np.shape(leaf), str(np.asarray(leaf).dtype))
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    ]
    return JobSignature.of(leaves, algorithm_config(algorithm))


def check_ranks_agree(params: Any, algorithm: Any, communicator: NativeCommunicator | None) -> None:
    """Raise a ``ValueError`` naming each difference unless all ranks train the same job.

    Over ``communicator`` (native mode) or, when it is None, between the processes of
    ``jax.distributed``. Every rank must call it.
    """
    signature = job_signature(params, algorithm)
    if communicator is not None:
        check_same_job(
            signature,
            lambda x: np.asarray(communicator.allgather(jax.numpy.asarray(x))),
        )
    elif jax.process_count() > 1:
        check_same_job(signature, lambda x: np.asarray(multihost_utils.process_allgather(x)))


def check_batches_differ(batch: Any, communicator: NativeCommunicator) -> None:
    """Raise a ``ValueError`` when every process passes the same batch (native mode: each passes its own part).

    Every process passing the whole global batch would train each rank on the same examples,
    silently. Compared by the SHA-256 of the batch's bytes over ``communicator``. Every rank must
    call it.
    """
    if communicator.size < 2:
        return
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(batch):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    words = np.frombuffer(digest.digest(), np.int32)
    gathered = np.asarray(communicator.allgather(jax.numpy.asarray(words))).reshape(communicator.size, -1)
    if (gathered == words).all():
        raise ValueError(
            f"every one of the {communicator.size} processes passed the same batch to DataParallel.step: each "
            "passes its own part of the global batch (bagua_jax.rank_slice(global_batch) cuts it), or every "
            "rank would train on the same examples"
        )
