"""Every algorithm with every feature, per front end: the composition matrix, as data.

Rows are the registered algorithms (:data:`bagua_common.algorithms.registry.CONFIGS`), columns the
features a user combines them with, and each cell says, for torch and for JAX, one of:

* :class:`Works` — the test (``file::function``) whose assertion proves the algorithm's defining
  property under that feature;
* :class:`Refuses` — wrapping raises a clear error naming both, with the reason, and the test
  asserting that error;
* :class:`Skipped` — no assertion runs for the cell yet, and why.

``tests/test_composition_matrix.py`` checks the table covers every cell, that every test it cites
exists, and that ``docs/guides/combinations.md`` embeds :func:`markdown` as generated. Run
``python -m tests.composition_matrix --markdown`` to print the table, ``--update-docs`` to write it
there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import bagua_common.algorithms.configs  # noqa: F401  (registers the algorithms)
import bagua_common.algorithms.diloco  # noqa: F401
from bagua_common.algorithms.registry import CONFIGS, algorithm_facts

FRONT_ENDS = ("torch", "jax")

FEATURES = {
    "fused_optimizer": "fused optimizer",
    "checkpoint_resume": "checkpoint resume",
    "frozen_unused": "frozen / unused parameters",
    "mixed_precision": "mixed precision",
    "grad_accumulation": "gradient accumulation",
    "param_groups": "parameter groups",
    "hierarchical": "hierarchical (2 nodes of 2)",
    "reshard": "reshard 4→2, 2→4",
    "autotune": "autotune (once)",
    "elastic": "elastic kill and join",
    "rank_lost": "fault tolerance: a rank lost",
    "joiner": "fault tolerance: a joiner",
    "sampler_cached": "balanced sampler + cached dataset",
    "bagua_net": "Bagua-Net",
}
"""Feature key -> its column heading, in order of value."""


@dataclass(frozen=True)
class Works:
    """The cell works: ``test`` (``tests/file.py::function``) asserts the algorithm's defining property under the
    feature."""

    test: str


@dataclass(frozen=True)
class Refuses:
    """Wrapping raises a clear error naming algorithm and feature, for ``reason``; ``test`` asserts the error."""

    reason: str
    test: str


@dataclass(frozen=True)
class Skipped:
    """No assertion runs for the cell, for ``reason``."""

    reason: str


Cell = Works | Refuses | Skipped

ALGORITHMS = tuple(CONFIGS)
TORCH_ONLY = Skipped("a torch feature: optax updates are fused by XLA's compiler")
NOT_YET = Skipped("not yet run by a test (issue 32)")
JAX_ACCUMULATION = Skipped(
    "DataParallel has no micro-batch accumulation; optax.MultiSteps around the optimizer would run the "
    "algorithm's communication on every micro-batch, untested"
)
ELASTIC_GRADIENT_ALLREDUCE_ONLY = Skipped(
    "the agent's kill and join tests (tests/test_elastic_agent.py) train gradient allreduce; torch's DiLoCo is "
    "tested through a worker's restart at the same world size only"
)
DATA_ONLY = Skipped(
    "the sampler and the cached dataset only choose each rank's samples; no test trains an algorithm on them"
)
ELASTIC_KILL = Works("tests/test_elastic_agent.py::test_a_node_dies_the_survivor_finishes_and_matches_the_replay")
PLUGIN_ONLY = Skipped(
    "the plugin is tested alone through the dlopen harness (tests/test_bagua_net.py); a training run with it "
    "needs NCCL, hence a GPU"
)

FAULT_TOLERANCE_TORCH = "tests/test_fault_tolerance_torch.py"
FAULT_TOLERANCE_JAX = "tests/test_fault_tolerance_jax.py"
ASYNC_FAULT_TOLERANCE_TORCH = (
    f"{FAULT_TOLERANCE_TORCH}::test_asynchronous_averaging_survives_a_death_with_a_member_one_behind_and_admits_a_"
    "joiner"
)
ASYNC_FAULT_TOLERANCE_JAX = (
    f"{FAULT_TOLERANCE_JAX}::test_asynchronous_averaging_survives_a_kill_with_a_member_one_behind_and_admits_a_joiner"
)
PER_STEP_JAX = f"{FAULT_TOLERANCE_JAX}::test_each_per_step_algorithm_survives_a_kill_and_admits_a_joiner"
RANK_LOST = {
    "gradient_allreduce": (
        "test_gradient_allreduce_survives_a_kill_a_death_in_recovery_and_a_slow_rank_and_replaces_them",
        "test_survivors_of_a_kill_a_hang_and_an_exception_resume_and_a_joiner_trains",
    ),
    "powersgd": ("test_powersgd_survives_a_hang_and_the_coordinators_exception", None),
    "decentralized": (
        "test_decentralized_survivors_of_a_hang_mid_exchange_go_on",
        "test_decentralized_survivors_of_a_kill_average_over_all_while_odd_and_a_joiner_starts_from_a_member",
    ),
    "low_precision_decentralized": (
        None,
        "test_low_precision_decentralized_copies_start_again_from_the_new_neighbours_after_a_kill_and_an_admission",
    ),
    "diloco": (
        "test_diloco_survivors_train_on_to_the_rounds_exchange_after_a_death_in_an_inner_step",
        "test_diloco_survivors_of_a_hang_mid_round_and_a_kill_in_an_exchange_lose_no_inner_step",
    ),
}
"""Algorithm -> (torch test, JAX test) of its survivors going on after a lost rank; None: the front end's default
(torch: a death before the vote, the algorithm's state put back; JAX: the per-step algorithms' kill and joiner)."""
JOINER = {
    "decentralized": (
        "test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_peers_do_not_wait",
        "test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_peers_do_not_wait",
    ),
    "low_precision_decentralized": (
        "test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_peers_do_not_wait",
        "test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_peers_do_not_wait",
    ),
    "diloco": (
        "test_a_diloco_joiner_sits_out_its_first_round_while_its_state_arrives_and_its_peers_wait_for_nothing",
        "test_diloco_joiner_admitted_at_a_retried_exchange_contributes_nothing_to_it",
    ),
}
"""Algorithm -> (torch test, JAX test) of a joiner given the members' state; the others': torch's joiner weighed out
of its first step, JAX's per-step algorithms' kill and joiner."""


def _fault_tolerance(algorithm: str) -> dict[str, dict[str, Cell]]:
    if algorithm == "async":
        cells = {"torch": Works(ASYNC_FAULT_TOLERANCE_TORCH), "jax": Works(ASYNC_FAULT_TOLERANCE_JAX)}
        return {"rank_lost": cells, "joiner": cells}
    torch_lost, jax_lost = RANK_LOST.get(algorithm, (None, None))
    torch_joiner, jax_joiner = JOINER.get(algorithm, (None, None))
    torch_lost = torch_lost or "test_a_death_before_the_vote_puts_the_algorithms_state_back"
    torch_joiner = torch_joiner or "test_a_joiner_takes_part_in_its_first_step_weighed_out_while_its_state_arrives"
    return {
        "rank_lost": {
            "torch": Works(f"{FAULT_TOLERANCE_TORCH}::{torch_lost}"),
            "jax": Works(f"{FAULT_TOLERANCE_JAX}::{jax_lost}" if jax_lost else PER_STEP_JAX),
        },
        "joiner": {
            "torch": Works(f"{FAULT_TOLERANCE_TORCH}::{torch_joiner}"),
            "jax": Works(f"{FAULT_TOLERANCE_JAX}::{jax_joiner}" if jax_joiner else PER_STEP_JAX),
        },
    }


FUSED_REFUSAL = Refuses(
    "its optimizer does not step elementwise, so fusing would change its math",
    "tests/test_fused_optimizer_torch.py::test_fusing_the_adam_family_is_refused_by_name",
)
AUTOTUNE_REFUSAL_TORCH = Refuses(
    "it keeps state per bucket, which re-bucketing between steps would lose",
    "tests/test_composition_matrix_torch.py::test_autotune_is_refused_naming_the_algorithm",
)
AUTOTUNE_JAX_TEST = "tests/test_composition_matrix_jax.py::test_autotune_keeps_an_exact_algorithms_numbers"
AUTOTUNE_REFUSAL_JAX = Refuses(
    "its numbers depend on its bucket layout (it quantizes per bucket, or is not known to be exact), which tuning "
    "would change",
    AUTOTUNE_JAX_TEST,
)


def _fused_optimizer(algorithm: str) -> dict[str, Cell]:
    if algorithm in ("qadam", "onebit_adam"):
        torch_cell: Cell = FUSED_REFUSAL
    elif algorithm == "async":
        torch_cell = Works(
            "tests/test_fused_optimizer_torch.py::test_fused_asynchronous_averaging_leaves_the_warm_up_and_averages"
        )
    else:
        torch_cell = Works(
            "tests/test_fused_optimizer_torch.py::test_fused_on_the_buckets_equals_unfused_with_as_many_collectives"
        )
    return {"torch": torch_cell, "jax": TORCH_ONLY}


CHECKPOINT_RESUME_JAX = {
    "gradient_allreduce": "tests/test_checkpoint_jax.py::test_same_world_size_restores_every_rank_exactly",
    "powersgd": "tests/test_checkpoint_jax.py::test_same_world_size_restores_every_rank_exactly",
    "bytegrad": "tests/test_gradient_allreduce_bytegrad_jax.py::"
    "test_bytegrad_error_feedback_state_restored_from_a_checkpoint_continues_identically",
    "decentralized": "tests/test_decentralized_jax.py::test_checkpoint_restore_continues_the_same_run",
    "low_precision_decentralized": "tests/test_decentralized_jax.py::test_checkpoint_restore_continues_the_same_run",
    "async": "tests/test_async_model_average_jax.py::test_transform_state_restores_from_a_numpy_checkpoint",
    "qadam": "tests/test_qadam_onebit_jax.py::test_checkpoint_restore_across_the_warmup_boundary",
    "onebit_adam": "tests/test_qadam_onebit_jax.py::test_checkpoint_restore_across_the_warmup_boundary",
    "diloco": "tests/test_diloco_jax.py::test_resume_mid_round_is_bit_identical_and_a_new_world_size_follows_the_rule",
}
"""Algorithm -> the JAX test of a save and resume that continues identically (torch's are the matrix's own)."""
# Asynchronous averaging's rounds run on a clock: its resume is asserted on the step counter and warm-up.
ASYNC_RESUME_TORCH = "tests/test_async_model_average_torch.py::test_checkpoint_restores_the_step_counter"

RESHARD_TORCH = (
    "gradient_allreduce",
    "bytegrad",
    "qadam",
    "onebit_adam",
    "decentralized",
    "low_precision_decentralized",
    "powersgd",
    "async",
)
RESHARD_JAX = (
    "gradient_allreduce",
    "bytegrad",
    "qadam",
    "onebit_adam",
    "powersgd",
    "decentralized",
    "low_precision_decentralized",
    "async",
)
FROZEN_JAX = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "onebit_adam")


MATRIX_TORCH = "tests/test_composition_matrix_torch.py"
MATRIX_JAX = "tests/test_composition_matrix_jax.py"


def _cited(test: str | None) -> Cell:
    return NOT_YET if test is None else Works(test)


HIERARCHICAL = {
    "gradient_allreduce": (
        "tests/test_gradient_allreduce_bytegrad_torch.py::test_gradient_allreduce_matches_torch_ddp",
        "tests/test_gradient_allreduce_bytegrad_jax.py::test_gradient_allreduce_is_the_mean_bit_identical_on_every_rank",
    ),
    "bytegrad": (
        "tests/test_gradient_allreduce_bytegrad_torch.py::test_bytegrad_matches_single_process_simulation_exactly",
        "tests/test_gradient_allreduce_bytegrad_jax.py::test_bytegrad_matches_numpy_pipeline_exactly",
    ),
    "decentralized": (
        "tests/test_decentralized_torch.py::test_decentralized_matches_simulation",
        "tests/test_decentralized_jax.py::test_hierarchical_on_two_nodes_of_two",
    ),
    "low_precision_decentralized": (
        "tests/test_decentralized_torch.py::test_low_precision_decentralized_matches_simulation_exactly",
        "tests/test_decentralized_jax.py::test_low_precision_hierarchical_on_two_nodes_of_two",
    ),
    "qadam": (
        "tests/test_qadam_onebit_torch.py::test_after_warmup_matches_single_process_simulation_exactly",
        "tests/test_qadam_onebit_jax.py::test_qadam_matches_the_numpy_simulation",
    ),
    "onebit_adam": (
        "tests/test_qadam_onebit_torch.py::test_after_warmup_matches_single_process_simulation_exactly",
        "tests/test_qadam_onebit_jax.py::test_onebit_adam_matches_the_numpy_simulation",
    ),
}
"""Algorithm -> (torch test, JAX test) of its hierarchical variant on 2 nodes of 2 against a reference."""

ADAM_IS_THE_OPTIMIZER = Skipped(
    "in JAX it is the optimizer and takes one learning rate (or schedule); groups are optax.multi_transform "
    "around an optax optimizer, which it does not take"
)
FLAT_ONLY_TORCH = Skipped(
    "it has no hierarchical variant (it averages over the world); no torch test runs it on 2 nodes"
)


def _hierarchical(algorithm: str) -> dict[str, Cell]:
    if algorithm in HIERARCHICAL:
        torch_test, jax_test = HIERARCHICAL[algorithm]
        return {"torch": Works(torch_test), "jax": Works(jax_test)}
    return {"torch": FLAT_ONLY_TORCH, "jax": Works(f"{MATRIX_JAX}::test_a_two_level_mesh_trains_as_the_flat_one")}


def _row(algorithm: str) -> dict[str, dict[str, Cell]]:
    jax_resume = CHECKPOINT_RESUME_JAX.get(algorithm)
    reshard_torch = {"diloco": "tests/test_diloco_torch.py::test_restore_into_another_world_size_follows_the_rule"}.get(
        algorithm,
        "tests/test_checkpoint_torch.py::test_restore_into_another_world_size_follows_each_algorithms_rule"
        if algorithm in RESHARD_TORCH
        else None,
    )
    reshard_jax = {"diloco": jax_resume}.get(
        algorithm,
        "tests/test_checkpoint_jax.py::test_restore_into_another_world_size_follows_the_rule"
        if algorithm in RESHARD_JAX
        else None,
    )
    autotune_jax: Cell = (
        Works("tests/test_autotune_jax.py::test_switching_bucket_size_mid_run_gives_bit_identical_parameters")
        if algorithm == "gradient_allreduce"
        else Works(AUTOTUNE_JAX_TEST)
        if algorithm_facts(algorithm).bucket_exact
        else AUTOTUNE_REFUSAL_JAX
    )
    return {
        "fused_optimizer": _fused_optimizer(algorithm),
        "checkpoint_resume": {
            "torch": Works(
                ASYNC_RESUME_TORCH
                if algorithm == "async"
                else f"{MATRIX_TORCH}::test_checkpoint_resume_continues_bit_identically"
            ),
            "jax": _cited(jax_resume),
        },
        "frozen_unused": {
            "torch": Works("tests/test_frozen_parameters_torch.py::test_frozen_parameters_never_move"),
            "jax": Works(
                "tests/test_frozen_parameters_jax.py::test_frozen_parameter_never_moves"
                if algorithm in FROZEN_JAX
                else f"{MATRIX_JAX}::test_a_group_at_rate_zero_and_an_unused_leaf_never_move"
            ),
        },
        "mixed_precision": {
            "torch": Works(f"{MATRIX_TORCH}::test_mixed_precision_bf16_parameters_and_autocast"),
            "jax": Works(f"{MATRIX_JAX}::test_bf16_parameters_train_as_bf16"),
        },
        "grad_accumulation": {
            "torch": Works(f"{MATRIX_TORCH}::test_no_sync_accumulation_matches_the_plain_run"),
            "jax": JAX_ACCUMULATION,
        },
        "param_groups": {
            "torch": Works(f"{MATRIX_TORCH}::test_a_group_at_learning_rate_zero_never_moves"),
            "jax": ADAM_IS_THE_OPTIMIZER
            if algorithm in ("qadam", "onebit_adam")
            else Works(f"{MATRIX_JAX}::test_a_group_at_rate_zero_and_an_unused_leaf_never_move"),
        },
        "hierarchical": _hierarchical(algorithm),
        "reshard": {"torch": _cited(reshard_torch), "jax": _cited(reshard_jax)},
        "autotune": {
            "torch": Works(
                "tests/test_autotune_torch.py::test_ranks_switch_together_and_tuning_leaves_gradient_allreduce_bit_identical"
            )
            if algorithm == "gradient_allreduce"
            else AUTOTUNE_REFUSAL_TORCH,
            "jax": autotune_jax,
        },
        "elastic": dict.fromkeys(
            FRONT_ENDS, ELASTIC_KILL if algorithm == "gradient_allreduce" else ELASTIC_GRADIENT_ALLREDUCE_ONLY
        ),
        **_fault_tolerance(algorithm),
        "sampler_cached": dict.fromkeys(FRONT_ENDS, DATA_ONLY),
        "bagua_net": dict.fromkeys(FRONT_ENDS, PLUGIN_ONLY),
    }


MATRIX: dict[str, dict[str, dict[str, Cell]]] = {algorithm: _row(algorithm) for algorithm in ALGORITHMS}
"""algorithm -> feature -> front end -> its cell."""


def counts() -> dict[str, int]:
    """How many cells work, refuse clearly and are skipped (with their reason)."""
    cells = [cell for row in MATRIX.values() for feature in row.values() for cell in feature.values()]
    return {kind.__name__: sum(isinstance(c, kind) for c in cells) for kind in (Works, Refuses, Skipped)}


def _symbol(cell: Cell, notes: dict[str, int]) -> str:
    if isinstance(cell, Works):
        return "✓"
    reason = cell.reason
    number = notes.setdefault(reason, len(notes) + 1)
    return f"✗{number}" if isinstance(cell, Refuses) else f"–{number}"


def markdown() -> str:
    """The matrix as a Markdown table (cells "torch / JAX": ✓ works, ✗n refuses, –n not run) with its notes."""
    notes: dict[str, int] = {}
    lines = [
        "| algorithm | " + " | ".join(FEATURES.values()) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for algorithm, row in MATRIX.items():
        cells = [" / ".join(_symbol(row[f][fe], notes) for fe in FRONT_ENDS) for f in FEATURES]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    refused = {c.reason for row in MATRIX.values() for f in row.values() for c in f.values() if isinstance(c, Refuses)}
    lines.append("")
    for reason, number in notes.items():
        kind = "refused" if reason in refused else "not run"
        lines.append(f"{number}. {kind}: {reason}.")
    total = counts()
    lines.append("")
    lines.append(f"Cells: {total['Works']} work, {total['Refuses']} refuse clearly, {total['Skipped']} not run.")
    return "\n".join(lines) + "\n"


PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "combinations.md"
BEGIN, END = "<!-- composition-matrix:begin -->\n", "<!-- composition-matrix:end -->"


def embedded_in_docs() -> str:
    """The table the documentation's page holds between its composition-matrix markers."""
    return PAGE.read_text().split(BEGIN)[1].split(END)[0]


def update_docs() -> None:
    """Replace the documentation's table with :func:`markdown`'s."""
    text = PAGE.read_text()
    PAGE.write_text(text.replace(BEGIN + embedded_in_docs() + END, BEGIN + markdown() + END))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--markdown", action="store_true", help="print the table")
    action.add_argument("--update-docs", action="store_true", help="write it into docs/guides/combinations.md")
    if parser.parse_args().update_docs:
        update_docs()
    else:
        print(markdown(), end="")
