"""The cross-rank check before the first step: every rank trains the same model the same way.

The model's tree (paths, shapes, dtypes) and the algorithm's configuration are compared over
the native communicator, or between the processes of ``jax.distributed`` in mesh mode (one
process has nothing to compare). See :mod:`bagua_common.job.signature`.
"""

from __future__ import annotations

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
