"""A JAX step a rank is weighed out of (a fault-tolerant job's joiner while its state arrives), under PowerSGD, on
three MPI ranks against the float64 NumPy reference of the other two alone (``powersgd_reference``).

Tolerance as in test_powersgd_jax.py: float32 against float64, below 1e-4 of the gradients' scale, while a step that
counted the weighed-out rank (an average over three) is off by a third.
"""

import numpy as np
import pytest
from multiprocess import run_ranks
from powersgd_reference import PowerSGDReference
from scenarios import has_mpi
from weighed_out_step_workers_jax import SHAPES, STEPS, gradients

import bagua_jax
from bagua_common.algorithms.configs import PowerSGDConfig

pytestmark = pytest.mark.skipif(not has_mpi(bagua_jax.build_info()), reason="needs the MPI engine and mpiexec")


def test_a_rank_weighed_out_of_powersgd_steps_applies_the_others_step_and_keeps_zero_residuals():
    """The last rank, given only PowerSGD's step count and Q before each step, applies what the reference applies for
    the other two alone (one exact step, then compressed ones with error feedback), bit-identical to them; the two keep
    the reference's residuals and ``Q``; the weighed-out rank's residuals stay zero."""
    seed, options = 5, {"rank": 2, "start_iter": 1}
    runs = run_ranks("weighed_out_step_workers_jax:weighed_out", 3, seed, options, launcher="mpiexec", timeout=180)
    ranks = [r.value for r in runs]
    names = sorted(SHAPES)
    reference = PowerSGDReference([SHAPES[n] for n in names], 2, PowerSGDConfig(**options), ranks[0]["initial_qs"])
    for step in range(STEPS):
        expected = reference.step([[gradients(seed, step, r)[n] for n in names] for r in range(2)])
        for rank in ranks:
            for name, want in zip(names, expected):
                got = rank["applied"][step][name]
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"{step}")
    for rank in ranks[1:]:
        for name in names:
            np.testing.assert_array_equal(rank["params"][name], ranks[0]["params"][name])
        for q, want in zip(rank["qs"], ranks[0]["qs"]):
            np.testing.assert_array_equal(q, want)
    for q, want in zip(ranks[0]["qs"], reference.qs):
        np.testing.assert_allclose(q, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for rank, residuals in zip(ranks[:2], reference.residuals):
        for got, want in zip(rank["residuals"], residuals):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert all(not np.any(e) for e in ranks[2]["residuals"]) and len(ranks[2]["residuals"]) == 2
    assert [r["step"] for r in ranks] == [STEPS] * 3
