"""The PyTorch bridge: init_process_group, with_bagua, DistributedDataParallel, GradientAllReduce, ByteGrad.

Multi-process jobs (one per configuration, several scenarios each; see
gradient_allreduce_bytegrad_workers_torch.py) run over gloo on 2 ranks, over gloo on 4 ranks laid out as 2
nodes x 2 (``local_world_size=2``, so hierarchical algorithms really use two levels), and
under ``mpiexec`` through the native MPI communicator. The tests below check:

* GradientAllReduce against ``torch.nn.parallel.DistributedDataParallel`` (same seed,
  same data, SGD with momentum and weight decay, several steps), and bit-identical
  parameters across ranks;
* ByteGrad against a single-process simulation of all ranks (plain torch for the
  gradients and the optimizer, the NumPy kernel reference ``kernels_reference.py`` for the
  compression pipeline), exactly;
* overlap (buckets launch during the backward pass, in order), ``no_sync``, unused
  parameters, checkpoints of the algorithm state, and error messages.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from algorithms_reference import assert_params_equal, bytegrad_bucket, max_diff
from gradient_allreduce_bytegrad_workers_torch import (
    SMALL_BUCKET,
    STEPS,
    batch,
    loss_fn,
    make_bn,
    make_mlp,
    make_optimizer,
)
from scenarios import Job, JobTable, Scenario, has_mpi

import bagua_torch
from bagua_torch import algorithms
from bagua_torch.algorithms import ByteGradAlgorithm, GradientAllReduceAlgorithm
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES, make_buckets

F32 = np.float32


def bytegrad(**options) -> Scenario:
    return Scenario("bytegrad", options)


DDP, OVERLAP, NO_SYNC, UNUSED = (
    Scenario("ddp_equivalence"),
    Scenario("overlap"),
    Scenario("no_sync"),
    Scenario("unused_parameters"),
)
CHECKPOINT, ERRORS = Scenario("checkpoint"), Scenario("errors")
FLAT, EF, SUM = {"hierarchical": False}, {"error_feedback": True}, {"average": False}
JOBS = JobTable(
    "gradient_allreduce_bytegrad_workers_torch:job",
    {
        "gloo-2ranks": Job(
            2,
            "python",
            (
                DDP,
                bytegrad(),
                bytegrad(**FLAT, **EF, **SUM),
                bytegrad(**EF, sync_point="step"),
                OVERLAP,
                NO_SYNC,
                UNUSED,
                CHECKPOINT,
                ERRORS,
            ),
        ),
        "gloo-4ranks-2nodes": Job(
            4, "python", (DDP, bytegrad(), bytegrad(**EF), bytegrad(**SUM), bytegrad(**FLAT, **EF), UNUSED), 2
        ),
        "mpi-4ranks-2nodes": Job(4, "mpiexec", (DDP, bytegrad(**EF), bytegrad(**FLAT), UNUSED), 2),
    },
    mpi=has_mpi(bagua_torch.build_info()),
)


# ============================================================================ single process


def test_registry_by_name_and_by_class():
    assert {"gradient_allreduce", "bytegrad"} <= set(algorithms.available_algorithms())
    assert algorithms.get_algorithm("bytegrad") == ByteGradAlgorithm()
    assert algorithms.get_algorithm("bytegrad", error_feedback=True).error_feedback is True
    assert algorithms.get_algorithm("gradient_allreduce") == GradientAllReduceAlgorithm(hierarchical=False)
    instance = ByteGradAlgorithm(hierarchical=False)
    assert algorithms.get_algorithm(instance) is instance
    assert algorithms.algorithm_class("bytegrad") is ByteGradAlgorithm
    assert ByteGradAlgorithm.name == "bytegrad" and GradientAllReduceAlgorithm.name == "gradient_allreduce"
    # Bagua's defaults.
    assert ByteGradAlgorithm() == ByteGradAlgorithm(hierarchical=True, average=True, error_feedback=False)
    assert GradientAllReduceAlgorithm() == GradientAllReduceAlgorithm(hierarchical=False, average=True)
    # Every built-in name (the same as bagua_jax's: test_algorithm_configs.py) maps to a module and class.
    for name in algorithms.available_algorithms():
        assert issubclass(algorithms.algorithm_class(name), algorithms.Algorithm)


def test_registry_and_options_errors():
    with pytest.raises(TypeError, match="algorithm 'bytegrad' has no option 'hierarchal'; its options: hierarchical"):
        algorithms.get_algorithm("bytegrad", hierarchal=True)
    with pytest.raises(TypeError, match="^bytegrad: hierarchical must be a bool"):
        algorithms.get_algorithm("bytegrad", hierarchical="yes")
    with pytest.raises(TypeError, match="only be given with an algorithm's name"):
        algorithms.get_algorithm(ByteGradAlgorithm(), average=False)
    with pytest.raises(TypeError, match="algorithm must be a name"):
        algorithms.get_algorithm(3)
    with pytest.raises(TypeError, match="not a subclass"):
        algorithms.register_algorithm("mine", dict)


def test_register_a_new_algorithm():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Mine(algorithms.Algorithm):
        name = "mine_for_test"

        def reify(self, context):
            return algorithms.AlgorithmImpl(context)

    algorithms.register_algorithm("mine_for_test", Mine)
    try:
        assert "mine_for_test" in algorithms.available_algorithms()
        assert isinstance(algorithms.get_algorithm("mine_for_test"), Mine)
    finally:
        algorithms._registered.pop("mine_for_test")


def test_bucket_layout_is_reverse_registration_order_padded_to_world_size():
    model = make_mlp(0)
    named = list(model.named_parameters())
    buckets = make_buckets(named, SMALL_BUCKET, pad_to=4)
    # 4.weight+4.bias+2.bias = 524 bytes; 2.weight alone (4096 > 1500); 0.bias+0.weight = 1408 bytes.
    assert [list(b.names) for b in buckets] == [["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
    assert [(b.numel, b.size) for b in buckets] == [(131, 132), (1024, 1024), (352, 352)]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert len(make_buckets(named, DEFAULT_BUCKET_BYTES, pad_to=3)) == 1
    assert DEFAULT_BUCKET_BYTES == 10 * 2**20
    # A dtype change closes a bucket.
    mixed = [
        ("a", torch.nn.Parameter(torch.zeros(3))),
        ("b", torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))),
        ("c", torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))),
    ]
    assert [list(b.names) for b in make_buckets(mixed, 1000)] == [["c", "b"], ["a"]]
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        make_buckets(named, 0)


def test_bucket_flatten_and_unflatten_round_trip():
    model = make_mlp(0)
    bucket = make_buckets(list(model.named_parameters()), SMALL_BUCKET, pad_to=4)[0]
    x, y = batch(0, 0, 0)
    loss_fn(model, x, y).backward()
    flat = bucket.flatten_grads()
    assert flat.shape == (132,) and float(flat[-1]) == 0.0
    expected = torch.cat([p.grad.reshape(-1) for p in bucket.params])
    assert torch.equal(flat[:131], expected)
    for p in bucket.params:
        p.grad = None
    bucket.unflatten_to_grads(flat * 2)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in bucket.params]), expected * 2)
    values = bucket.flatten_params()
    bucket.unflatten_to_params(values + 1)
    assert torch.equal(bucket.flatten_params()[:131], values[:131] + 1)


def test_init_process_group_argument_errors(monkeypatch):
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALNRANKS",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
    ):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="set RANK and WORLD_SIZE"):
        bagua_torch.init_process_group()
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        bagua_torch.init_process_group(rank=2, world_size=2)
    with pytest.raises(ValueError, match="local_world_size=3 must divide world_size=4"):
        bagua_torch.init_process_group(rank=0, world_size=4, local_world_size=3)
    with pytest.raises(ValueError, match="local_rank=1 does not fit rank=2"):
        bagua_torch.init_process_group(rank=2, world_size=4, local_world_size=2, local_rank=1)
    with pytest.raises(ValueError, match="backend must be 'gloo', 'nccl' or None"):
        bagua_torch.init_process_group("mpi", rank=0, world_size=1)
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        bagua_torch.init_process_group()
    assert not bagua_torch.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        bagua_torch.get_process_group()


# ============================================================================ GradientAllReduce vs torch DDP


@pytest.mark.parametrize("name", JOBS.jobs_with(DDP))
def test_gradient_allreduce_matches_torch_ddp(name):
    """Same seed, same data, several SGD steps: GradientAllReduce (every front door) against torch's DDP.

    torch's DDP divides each gradient by n before a sum-allreduce; GradientAllReduce sums, then divides. With
    n a power of two the divisions are exact, so the only difference is the order in which float32 gradients
    of the ranks are summed (the allreduce algorithm splits differently laid-out buckets differently). With two
    ranks a + b == b + a, so the results are bit-identical. With four, each step's averaged gradient may differ
    by a few ulps (relative 2**-22 per addition, 3 additions), which momentum SGD carries through four steps at
    lr 0.05: we allow 1e-6 relative to the parameters' scale, orders of magnitude above that and orders below
    the parameters' change over the run (~1e-2). The hierarchical variant (node means, then the mean of those)
    is a different but equally exact-in-real-arithmetic summation, held to the same bound.
    """
    _, values = JOBS.run(name)
    n = len(values)
    ddp = values[0][DDP.label]["torch_ddp"]
    scale = max(float(np.abs(v).max()) for v in ddp.values())
    for variant in (
        "with_bagua",
        "with_bagua_step",
        "bagua_ddp",
        "bagua_ddp_default_bucket",
        "hierarchical",
        "torch_group",
    ):
        got = values[0][DDP.label][variant]
        if n == 2 and variant != "hierarchical":
            assert_params_equal(got, ddp, f"{variant} vs torch DDP")
        else:
            assert max_diff(got, ddp) <= 1e-6 * scale, (variant, max_diff(got, ddp))
    # Front doors with the same buckets give the same bits; so does waiting in the optimizer step.
    first = values[0][DDP.label]
    assert_params_equal(first["with_bagua_step"], first["with_bagua"])
    assert_params_equal(first["bagua_ddp"], first["with_bagua"])
    assert first["with_bagua/buckets"] == 3 and first["bagua_ddp_default_bucket/buckets"] == 1
    # Summing instead of averaging trains differently.
    assert max_diff(first["sum"], first["with_bagua"]) > 1e-4
    for v in values:
        for variant in (
            "torch_ddp",
            "with_bagua",
            "with_bagua_step",
            "bagua_ddp",
            "hierarchical",
            "torch_group",
            "sum",
        ):
            assert_params_equal(v[DDP.label][variant], first[variant], f"rank {v['rank']} {variant}")
        assert v[DDP.label]["with_bagua/losses"] != first["with_bagua/losses"] or v["rank"] == 0  # different data


@pytest.mark.parametrize("name", JOBS.jobs_with(DDP))
def test_parameters_and_buffers_are_broadcast_from_rank_0(name):
    """A BatchNorm model whose weights, frozen scale and running mean differ per rank before wrapping: after the
    wrap every rank holds rank 0's. Training with buffers broadcast at each forward (our DDP wrapper's default, as
    torch's) matches torch's DDP rank by rank: exactly on two ranks, to the summation-order bound of
    test_gradient_allreduce_matches_torch_ddp on four. Parameters agree across ranks; the running statistics
    do not (each rank's last forward updates them from its own batch after the broadcast, in both wrappers)."""
    seed, values = JOBS.run(name)
    n = len(values)
    initial = {k: t.detach().float().numpy() for k, t in make_bn(seed).state_dict().items()}
    params = [k for k in initial if "running" not in k and "num_batches" not in k]
    for v in values:
        assert_params_equal(v[DDP.label]["bn/after_wrap"], initial, f"rank {v['rank']} after wrap")
        got, want = v[DDP.label]["bn/bagua_ddp"], v[DDP.label]["bn/torch_ddp"]
        for k in params:
            np.testing.assert_array_equal(got[k], values[0][DDP.label]["bn/bagua_ddp"][k], err_msg=k)
        if n == 2:
            assert_params_equal(got, want, f"rank {v['rank']} vs torch DDP")
        else:
            scale = max(float(np.abs(w).max()) for w in want.values())
            assert max_diff(got, want) <= 1e-6 * scale


def test_jobs_use_the_intended_communicators():
    for name in ("gloo-2ranks", "gloo-4ranks-2nodes"):
        _, values = JOBS.run(name)
        assert all(v["world"] == "ProcessGroupCommunicator" and not v["native"] for v in values)
    _, values = JOBS.run("gloo-4ranks-2nodes")
    assert all(v[DDP.label]["hierarchical_levels"] for v in values)
    _, values = JOBS.run("gloo-2ranks")
    assert not any(v[DDP.label]["hierarchical_levels"] for v in values)
    if JOBS.mpi:
        _, values = JOBS.run("mpi-4ranks-2nodes")
        assert all(v["world"] == "NativeCommunicator" and v["native"] for v in values)
        assert all(v[DDP.label]["hierarchical_levels"] for v in values)


# ============================================================================ ByteGrad vs a single-process simulation


def bytegrad_reference(seed: int, n: int, layout, *, local: int | None, error_feedback: bool, average: bool):
    """All n ranks in one process: plain torch gradients and SGD, the NumPy reference pipeline in between."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: the same float32 gradients bit for bit
    try:
        model = make_mlp(seed)
        opt = make_optimizer(model)
        params = dict(model.named_parameters())
        share = local or 1
        residuals = [[np.zeros(size // share, F32) for _, size in layout] for _ in range(n)]
        for step in range(STEPS):
            grads = []
            for r in range(n):
                replica = copy.deepcopy(model)
                x, y = batch(seed, step, r)
                loss_fn(replica, x, y).backward()
                grads.append({name: p.grad.numpy().reshape(-1) for name, p in replica.named_parameters()})
            opt.zero_grad()
            for idx, (names, size) in enumerate(layout):
                flats = []
                for r in range(n):
                    flat = np.concatenate([grads[r][name] for name in names])
                    flats.append(np.concatenate([flat, np.zeros(size - flat.size, F32)]))
                result, new = bytegrad_bucket(
                    flats,
                    [residuals[r][idx] for r in range(n)] if error_feedback else None,
                    local=local,
                    average=average,
                )
                if error_feedback:
                    for r in range(n):
                        residuals[r][idx] = new[r]
                offset = 0
                for name in names:
                    p = params[name]
                    p.grad = torch.from_numpy(result[offset : offset + p.numel()].copy()).view(p.shape)
                    offset += p.numel()
            opt.step()
        return {name: p.detach().numpy().copy() for name, p in params.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name,scenario", JOBS.cases("bytegrad"))
def test_bytegrad_matches_single_process_simulation_exactly(name, scenario):
    seed, values = JOBS.run(name)
    n = len(values)
    options = {"hierarchical": True, "average": True, "error_feedback": False, **scenario.options}
    options.pop("sync_point", None)  # where the wrapper waits does not change the result
    local = JOBS.jobs[name].local_world_size if options["hierarchical"] else None
    got = values[0][scenario.label]
    assert got["levels"] == (local is not None)
    layout = got["layout"]
    assert [names for names, _ in layout] == [["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
    assert all(size % n == 0 for _, size in layout)
    expected = bytegrad_reference(
        seed, n, layout, local=local, error_feedback=options["error_feedback"], average=options["average"]
    )
    for v in values:
        assert_params_equal(v[scenario.label]["params"], expected, f"rank {v['rank']} vs the simulation")
    # Compression changed something (against exact averaging) but training is close to it.
    if options["average"] and name in JOBS.jobs_with(DDP):
        exact = values[0][DDP.label]["with_bagua"]
        assert 0 < max_diff(got["params"], exact) < 1e-2


# ============================================================================ overlap


def test_buckets_launch_during_backward_in_fixed_order():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        o = v["overlap"]
        assert o["buckets"][0] == ["10.bias", "10.weight"] and o["buckets"][-1] == ["0.bias", "0.weight"]
        for step in o["steps"]:
            events = step["events"]
            launches = [(i, t) for kind, i, t in events if kind == "launch"]
            ready = [(i, t) for kind, i, t in events if kind == "ready"]
            (end,) = [t for kind, _, t in events if kind == "backward_end"]
            done = [i for kind, i, _ in events if kind == "done"]
            assert [i for i, _ in launches] == list(range(6)) == done
            assert [i for i, _ in ready] == list(range(6))
            # The first bucket (the last layer) starts communicating while the backward pass still has five
            # layers to go: before the first layer's gradient exists and before the backward pass ends.
            assert launches[0][1] < step["first_layer_grad"] <= end <= step["end"]
            assert sum(t < step["first_layer_grad"] for _, t in launches) >= 5
            # Each bucket launches as soon as it is ready (same hook call).
            for (i, t_launch), (_, t_ready) in zip(launches, ready):
                assert t_launch >= t_ready


def test_a_bucket_ready_early_waits_for_the_ones_before_it():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        o = v["overlap"]
        assert o["swapped_buckets"] == [["b.bias", "b.weight"], ["a.bias", "a.weight"]]
        kinds = [(kind, i) for kind, i, _ in o["swapped_events"]]
        assert kinds == [
            ("ready", 1),
            ("ready", 0),
            ("launch", 0),
            ("launch", 1),
            ("backward_end", -1),
            ("done", 0),
            ("done", 1),
        ]
    # And the gradients are the average of the ranks' own (two ranks: (a + b) / 2 is exact either way round).
    expected = {
        k: (values[0]["overlap"]["swapped_local"][k] + values[1]["overlap"]["swapped_local"][k]) / F32(2)
        for k in values[0]["overlap"]["swapped_local"]
    }
    for v in values:
        assert_params_equal(v["overlap"]["swapped_grads"], expected)


# ============================================================================ no_sync, unused parameters


@pytest.mark.parametrize("sync_point", ["backward", "step"])
def test_no_sync_accumulation_equals_one_step_on_the_concatenated_batch(sync_point):
    """Two half-loss micro-batches (the first under no_sync) against the whole batch, 2 steps of momentum SGD.

    Not bitwise: the mean over 12 rows is a different float32 summation than two means over 6 added together.
    Each gradient differs by a few ulps; 1e-6 absolute on parameters of scale ~0.3 is far above that and far
    below the parameters' movement over the two steps (~1e-2).
    """
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        r = v["no_sync"][sync_point]
        assert r["launches_inside_no_sync"] == [0, 0]
        assert max_diff(r["accumulated"], r["whole"]) < 1e-6
        assert_params_equal(r["accumulated"], values[0]["no_sync"][sync_point]["accumulated"])


@pytest.mark.parametrize("name", JOBS.jobs_with(UNUSED))
def test_unused_parameters_do_not_hang_and_count_as_zeros(name):
    """A branch used on rank 0 only and a layer never used: every rank still issues every bucket's collective.

    The expected average comes from torch.distributed.all_reduce of each rank's plain-torch gradients (zeros
    where missing). Two ranks: exact. Four: the allreduce may add the four addends in another order, so a few
    ulps (1e-6 relative to the largest gradient).
    """
    _, values = JOBS.run(name)
    n = len(values)
    for v in values:
        for sync_point, r in v[UNUSED.label].items():
            for step, (got, want) in enumerate(zip(r["grads"], r["expected"])):
                if n == 2:
                    np.testing.assert_array_equal(got, want, err_msg=f"{sync_point} step {step}")
                else:
                    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))
            assert r["never_grad_is_zero"]
            assert_params_equal(r["params"], values[0][UNUSED.label][sync_point]["params"], f"rank {v['rank']}")


# ============================================================================ checkpoints


def test_checkpoint_of_the_algorithm_state_resumes_identically():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        c = v["checkpoint"]
        assert "_extra_state" in c["keys"] and all(k.startswith("module.") for k in c["keys"] if k != "_extra_state")
        assert c["residual_norm"] > 0
        assert_params_equal(c["resumed"], c["continued"], "resumed from the checkpoint")
        # Restoring the weights and the optimizer but not the residuals does not continue identically.
        assert max_diff(c["without_state"], c["continued"]) > 0
        assert (
            "holds the state of algorithm 'bytegrad', but this model is wrapped with 'gradient_allreduce'"
            in c["wrong_algorithm"]
        )


# ============================================================================ errors


def test_wrong_inputs_give_clear_errors_on_every_rank():
    _, values = JOBS.run("gloo-2ranks")
    expected = {
        "not_module": "TypeError: the model must be a torch.nn.Module, got str",
        "unknown_algorithm": "ValueError: algorithm 'bytegrade' is unknown; available:",
        "bad_bucket": "ValueError: BaguaModule: bucket_bytes must be a positive int",
        "bad_sync_point": "ValueError: sync_point must be 'backward' or 'step', got 'later'",
        "step_without_optimizer": "ValueError: sync_point='step' waits in the optimizer's step",
        "not_optimizer": "TypeError: optimizers must be torch.optim.Optimizer instances, got str",
        "ddp_dim": "ValueError: dim=1",
        "ddp_device": "ValueError: device_ids=[0] but the model is on ['cpu']",
        "bytegrad_float64": "TypeError: bytegrad: parameter 4.bias has dtype torch.float64; the 8-bit codes "
        "compress float32, float16, bfloat16 only",
        "different_models": [
            "ValueError: the ranks do not run the same job",
            "tensor '0.weight': [32, 10] torch.float32 on rank 0; [31, 10] torch.float32 on rank 1",
            "tensor '4.weight': [3, 32] torch.float32 on rank 0; missing on rank 1",
        ],
        "different_algorithms": [
            "ValueError: the ranks do not run the same job",
            "algorithm.hierarchical: True on rank 0; False on rank 1",
        ],
        "custom_algorithm": "no error",
        "wrap_twice": "TypeError: the model is already wrapped",
        "second_backward": "RuntimeError: a second backward pass before the gradients of the first were synchronized",
    }
    for v in values:
        found = v["errors"]
        for key, message in expected.items():
            first, *contained = [message] if isinstance(message, str) else message
            assert found[key].startswith(first), (v["rank"], key, found[key])
            assert all(part in found[key] for part in contained), (v["rank"], key, found[key])
        losses = found["after_errors_still_works"]
        assert len(losses) == 2 and all(np.isfinite(losses))
