"""The tests the quick suite (``python -m pytest``) leaves to the extended run (``python -m pytest -m extended``).

The quick suite is what CI and every change run: it keeps each behaviour at least once in each front end, on the
cheapest job that shows it (two ranks rather than four, one launcher rather than each), or, where its 10 minutes
cannot pay for a second front end's fault-tolerance job, CI runs that job in a step of its own. The extended run
adds the rest of the matrix (more ranks, the two-node layouts again under another backend, every launcher and fault
kind, the examples' accuracy for every algorithm) and the long studies (the GPT convergence gate, the sanitizer
builds). conftest.py marks every test whose node id matches a pattern here ``extended``; pyproject's ``addopts``
deselects them unless ``-m`` asks otherwise (``-m "extended or not extended"`` runs everything).
"""

from __future__ import annotations

import re

EXTENDED: dict[str, str] = {
    # the long studies
    r"test_gpt_convergence_gate\.py::": "the convergence gate: 19 GPT runs that each cross the 2.5 nats/byte bar "
    "(182-222 s at loads 1.5-2.2, over the 150 s the quick suite can pay; .ci/run runs it after the quick suite)",
    r"test_flax_examples_jax\.py::test_every_algorithm_reaches": "every algorithm on flax's MNIST example (170 s); "
    "the examples' five-line diffs stay quick",
    r"test_cuda_shim\.py::": "the CUDA kernels under the shim (20 s to build); .ci/run runs them where nvcc is",
    r"test_framework_examples_jax\.py::test_(flax_cnn|equinox_mlp)_trains": "the flax and equinox examples' runs",
    r"test_cuda_resources\.py::": "nvcc's registers and occupancy of every kernel (compiles them for sm_90, 130 s); "
    "the package build fails on any spill already",
    r"test_bagua_upstream_torch\.py::": "Bagua's own three decentralized tests (45-95 s each: each of their runs "
    "spawns its ranks anew, each importing torch); Bagua's spelling against Bagua's reference stays quick "
    "(test_bagua_compat_torch)",
    r"test_bagua_migration_torch\.py::test_digits_script_trains_on_every_rank\[qadam\]": "the fused gradient "
    "allreduce run of the same script stays quick",
    # fault handling: one fault of each kind per front end stays quick
    r"test_fault_tolerance_torch\.py::test_(gradient_allreduce|powersgd|streaming_diloco|"
    r"a_death_before_the_vote_puts_the_algorithms_state_back\[(?!low_precision)|"
    r"a_rank_lost_before_the_job_formed|a_survivor_goes_on_alone|a_node_whose_only_rank_died|"
    r"a_diloco_joiner_whose_state_holder_dies|a_diloco_joiner_sits_out_with_the_fused|"
    r"a_joiner_lost_in_the_step_it_is_weighed_out_of|a_joiner_weighed_out_while_its_state_holder_hangs|"
    r"decentralized_training_with_the_fused_optimizer|"
    r"a_decentralized_joiner_starts_from_the_first_members_weights_and_optimizer_state\[(decentralized|low))": (
        "torch's in-process recovery matrix: 3-4 ranks, several faults and replacements per job (30-80 s each under "
        "load); survivors going on after a SIGKILL, one of them given the other's state, DiLoCo's survivors training "
        "on to the exchange and its joiner sitting out a round, and the refusal stay quick, and so do the launcher's "
        "slot's decisions (test_fault_tolerance_job_end); so does a joiner weighed out of its first step, and the "
        "low-precision decentralized copies' restart (5 s), and an asynchronous averaging joiner sitting out its first "
        "step (7 s)"
    ),
    r"test_fault_tolerance_torch\.py::test_a_rank_cut_off_for_good_stops_naming_the_partition": "a rank cut off by a "
    "partition for good (10 s); JAX's partitioned coordinator joining the majority again stays quick",
    r"test_fault_tolerance_torch\.py::test_a_partitioned_coordinator_stops_training_and_joins_the_majority_again_once_"
    r"its_link_is_back\[(?!gradient_allreduce\])": "the partitioned coordinator's return under the fused optimizer and "
    "each stateful per-step algorithm (10 s each; gradient allreduce's runs in CI's step of its own)",
    r"test_fault_tolerance_torch\.py::test_a_rank_that_raises_is_taken_for_lost_as_the_exception_ends": "torch's "
    "rank whose exit is slow after an exception (11 s; the membership's exit handler is shared, and JAX's test of it "
    "runs in CI's step of its own)",
    r"test_fault_tolerance_(torch|jax)\.py::test_a_coordinator_cut_off_in_a_checkpoint": "a coordinator cut off by a "
    "partition in a save, then a restart (14-17 s each; a rank killed in a save stays quick in both front ends)",
    r"test_fault_tolerance_(torch|jax)\.py::test_a_partitioned_decentralized_member_returns_with_a_members_weights": (
        "a decentralized member back from a partition (9-10 s each; JAX's partitioned coordinator taken for dead "
        "stays quick, torch's partitioned coordinator's return runs in CI's step of its own, and a decentralized "
        "joiner's state stays quick in torch's asynchronous averaging)"
    ),
    r"test_fault_tolerance_torch\.py::test_decentralized_survivors_of_a_hang_mid_exchange_go_on\[": "the "
    "decentralized step taken alone, with the plain optimizer, fused, and exchanging every second step (7-8 s each; "
    "asynchronous averaging's step taken alone, the same JoinerSitsOutOneStep, stays quick, checked against torch's "
    "SGD step)",
    r"test_fault_tolerance_jax\.py::test_diloco_survivors_of_a_hang_mid_round_and_a_kill_in_an_exchange_lose_no_"
    r"inner_step\[(diloco-uint8|streaming-uint8)\]": "the 8-bit and Streaming variants of JAX's DiLoCo survivors "
    "(10 s each; the full-precision case runs in CI's step of its own)",
    r"test_fault_tolerance_torch\.py::test_a_member_lost_in_a_checkpoint_leaves_it_uncommitted_and_a_restart_goes_"
    r"on_from_the_next_one\[diloco\]": "DiLoCo's lost checkpoint (7-10 s; gradient allreduce's stays quick, and "
    "JAX's DiLoCo restart is quick)",
    r"test_fault_tolerance_jax\.py::test_streaming_diloco_survivors_retry_an_overlapped_exchange_among_themselves_"
    r"and_admit_a_joiner\[after\]": "JAX's Streaming joiner that asks once the recovery is over (11 s; the one that "
    "asks before it, admitted where the overlapped exchange is retried, stays quick)",
    r"test_fault_tolerance_jax\.py::test_a_member_taken_for_dead_joins_again_under_each_per_step_algorithm": "JAX's "
    "member taken for dead joining again under ByteGrad, PowerSGD, QAdam and 1-bit Adam (10 s each); gradient "
    "allreduce's and DiLoCo's stay quick",
    r"test_fault_tolerance_torch\.py::test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_"
    r"peers_do_not_wait\[(decentralized|low)\]": "torch's decentralized joiners sitting out a step (8-10 s each; "
    "torch's asynchronous averaging joiner sitting out a step while its state is 1.5 s late stays quick, the same "
    "JoinerSitsOutOneStep, and so does JAX's low-precision one)",
    r"test_fault_tolerance_torch\.py::test_asynchronous_averaging_survives_a_death_with_a_member_one_behind_and_"
    r"admits_a_joiner\[(warm-up|fused)\]": "torch's asynchronous averaging through a death and an admission during "
    "its warm-up, and with the optimizer fused (6 s each; after the warm-up, unfused, stays quick)",
    r"test_fault_tolerance_jax\.py::test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_"
    r"peers_do_not_wait\[(decentralized|low)\]": "JAX's decentralized joiners sitting out a step (8-10 s each; "
    "torch's asynchronous averaging joiner sitting out stays quick, the same rules)",
    r"test_fault_tolerance_jax\.py::test_a_member_taken_for_dead_while_alive_joins_again_and_trains_on\[pause-2\]": (
        "JAX's member taken for dead after a SIGSTOP (8 s; the partitioned coordinator taken for dead stays quick)"
    ),
    r"test_fault_tolerance_jax\.py::test_a_diloco_member_taken_for_dead_mid_round_joins_again_and_sits_out_a_round": (
        "JAX's DiLoCo member taken for dead (10 s; its Streaming DiLoCo joiner admitted at a retried exchange and "
        "its member taken for dead under gradient allreduce stay quick)"
    ),
    r"test_fault_tolerance_jax\.py::test_members_whose_step_times_out_at_every_attempt_stop_naming_the_timeout": (
        "JAX's stop after a step timed out three times (13 s; the rule's own test in test_fault_tolerance_membership "
        "stays quick, and .ci/run runs torch's job and JAX's stop under the launcher)"
    ),
    r"test_fault_tolerance_jax\.py::test_a_member_lost_while_the_survivors_shrink": "JAX's death during a recovery "
    "(10 s; its stop after the shrink's timeout is the MPI engine's own dead-peer bound, which stays quick)",
    r"test_fault_tolerance_jax\.py::test_a_member_lost_while_the_survivors_rebuild_the_communicator_costs_them_one_"
    r"more_epoch\[tcp-start\]": "a death before its address reaches the store (12 s; the death as it would connect, "
    "whose build is abandoned, and MPI's death before the survivors' meeting stay quick)",
    r"test_fault_tolerance_jax\.py::test_a_member_lost_while_the_state_communicator_is_split_stops_the_others": "the "
    "MPI engine's stop at a death in the state's split (12 s; the TCP engine's recovery from it runs in CI's step of "
    "its own)",
    r"test_fault_tolerance_torch\.py::test_a_joiner_takes_part_in_its_first_step_weighed_out_while_its_state_arrives"
    r"\[(bytegrad|powersgd|qadam|onebit_adam|gradient_allreduce-fused)\]": "ByteGrad's, PowerSGD's, QAdam's and 1-bit "
    "Adam's weighed-out joiners, and gradient allreduce's with the fused optimizer (10-12 s each; gradient "
    "allreduce's stays quick, and so do a survivor's fused optimizer laid out again, PowerSGD's weighed-out step "
    "against its reference, in test_powersgd_torch.py, and 1-bit Adam's against its simulation, in "
    "test_qadam_onebit_torch.py)",
    r"test_fault_tolerance_jax\.py::test_each_per_step_algorithm_survives_a_kill_and_admits_a_joiner\[(powersgd|"
    r"onebit_adam|bytegrad)\]": "JAX's PowerSGD, 1-bit Adam and ByteGrad through a death and an admission (5.5-6 s "
    "each; QAdam's and gradient allreduce's run in CI's step of their own)",
    r"test_fault_tolerance_jax\.py::test_a_decentralized_job_restarted_from_its_checkpoint": "JAX's decentralized "
    "restart into another world size on a flax TrainState with a joiner (16 s: eight processes; the flax restart's "
    "rows stay quick, and decentralized training through a death and an admission runs in CI's step of its own)",
    r"test_fault_tolerance_jax\.py::test_a_joiner_whose_state_holder_dies_before_sending_is_given_the_state_by_the_"
    r"next_one\[powersgd\]": "JAX's PowerSGD joiner given the state again after its holder died (gradient "
    "allreduce's runs in CI's step of its own, and PowerSGD's weighed-out step is checked against its reference in "
    "test_weighed_out_step_jax.py)",
    r"test_fault_tolerance_jax\.py::test_low_precision_decentralized_copies_start_again": "JAX's low-precision "
    "decentralized ring through a death and an admission (10 s; decentralized's job runs in CI's step of its own, "
    "and the copies' restart against its definition stays quick in test_fault_tolerance_state_jax.py)",
    r"test_fault_tolerance_jax\.py::test_a_powersgd_job_restarted_from_its_checkpoint_admits_a_joiner": "JAX's "
    "PowerSGD restart from a checkpoint with a flax TrainState, then a weighed-out joiner (two jobs, 15 s; a flax "
    "state restored into another world size stays quick in test_checkpoint_jax.py, and PowerSGD's weighed-out step "
    "against its reference in test_weighed_out_step_jax.py)",
    r"test_fault_tolerance_jax\.py::test_a_survivor_that_had_not_applied": "JAX's survivor given another's state "
    "(torch's stays quick, and JAX's weighed-out joiner receives the state the same way)",
    r"test_fault_paths\.py::(test_mpi_survivor_raises_within_the_timeout|test_mesh_fault_ends_every_process_under_"
    r"plain_processes|test_mpi_launcher_names_the_rank_that_raised\[torch\]|test_mpi_raising_rank_exits_"
    r"under_plain_mpiexec)": "the native communicators' own dead-peer tests stay quick, and so do the launcher's "
    "cases of a killed and a raising rank (the ranks' side is the same without it)",
    r"test_lax_communicator_processes_jax\.py::test_(collectives_across_processes\[4\]|a_dead_peer_fails_the_"
    r"survivors_within_a_bound\[(exits-before-first-collective|hangs-alive)\])": "two processes and the other "
    "dead-peer cases stay quick",
    r"test_communicators_torch\.py::test_(every_primitive_matches_numpy\[gloo-4ranks\]|a_dead_or_stalled_peer_"
    r"raises_within_the_timeout\[(gloo|mpi)-stall\])": "two ranks and a dead peer per engine stay quick",
    r"test_native_communicator_jax\.py::test_(a_dead_peer_raises_on_the_survivors_within_the_timeout|an_average_"
    r"divides_by_the_ranks_set_at_run_time)\[ring": "the MPI engine's dead peer and its run-time divisor stay quick",
    r"test_process_group\.py::test_a_timed_out_run_kills_every_process_of_its_group\[rank 1\]": "rank 0's case "
    "stays quick",
    r"test_clean_exit_torch\.py::": "a gloo job's clean exit and a DCP job's (22 s and 36 s, 3 launched jobs each)",
    r"test_nccl_engine_host\.py::test_nccl_engine_host_logic_under_thread_sanitizer": "the NCCL engine's host "
    "logic under the thread sanitizer (its build)",
    # the same scenarios on a larger job of the same kind
    r"test_async_model_average_torch\.py::.*\[gloo-4\]": "two gloo ranks stay quick",
    r"test_async_model_average_jax\.py::.*\[mpi-4\]": "two ranks stay quick",
    r"test_async_model_average_jax\.py::test_background_averaging_keeps_replicas_together_and_trains\[mpi-2\]": "the "
    "200-step training job over MPI (torch's stays quick; JAX's one round, abort and resume and never-waits jobs over "
    "MPI stay quick)",
    r"test_async_model_average_jax\.py::test_warmup_equals_synchronous_allreduce_sgd\[mpi-2\]": "the transform's "
    "warm-up allreduce in one process (test_transform_allreduces_during_warmup_then_steps_locally) and torch's "
    "warm-up against synchronous SGD on two gloo ranks stay quick",
    r"test_(qadam_onebit_jax\.py::test_two_mpi_processes_match|decentralized_jax\.py::test_two_processes_with_the_"
    r"native_mpi)": "QAdam's, 1-bit Adam's and decentralized's steps over two MPI processes (5 s each): their exact "
    "runs against the NumPy simulation stay quick in one process, every primitive they call on the MPI engine in "
    "test_native_communicator_jax, and gradient allreduce and ByteGrad over two MPI processes end to end",
    r"test_launcher\.py::test_torch_distributed_gloo_job": "torch's gloo jobs under bagua-launch stay quick in "
    "test_lightning_torch, test_bagua_migration_torch and test_elastic_launch",
    r"test_gradient_allreduce_bytegrad_torch\.py::.*\[(gloo|mpi)-4ranks-2nodes": "two gloo ranks stay quick, two "
    "nodes in JAX's tests",
    r"test_decentralized_torch\.py::.*\[(gloo|mpi)-4ranks-2nodes": "two ranks stay quick, two nodes in JAX's tests",
    r"test_(decentralized|gradient_allreduce_bytegrad)_torch\.py::test_jobs_use_the_intended_communicators": "it "
    "checks the two-node jobs above (each runs them)",
    r"test_qadam_onebit_torch\.py::.*\[(gloo|mpi)-4ranks-2nodes": "two gloo ranks stay quick, two nodes in JAX's tests",
    r"test_autotune_torch\.py::": "torch's autotuned jobs (47 s); JAX's jobs between nodes and the tuner's own "
    "tests stay quick",
    r"test_advisor_probe_jax\.py::test_the_command_line_probes": "the probe of injected levels stays quick",
    r"test_checkpoint_jax\.py::test_restore_into_another_world_size_follows_the_rule\[.*-4-2\]": "from two to four "
    "ranks stays quick",
    r"test_checkpoint_torch\.py::test_restore_into_another_world_size": "JAX's restores into other sizes stay quick",
    r"test_diloco_jax\.py::test_native_communicator_matches": "the simulation's other communicators stay quick",
    r"test_mpi_ring_min_bytes\.py::test_(torch_threshold|one_node_does_not_span)": "JAX's threshold stays quick",
    r"test_elastic_launch\.py::test_(jax_coordinator_gets_a_port|an_unreachable_rendezvous)": "the launcher's "
    "restarts and summaries stay quick",
    r"test_lightning_torch\.py::test_lightning_launcher_every_algorithm_resumes": "bagua-launch starting the "
    "trainer stays quick",
    r"test_cached_dataset_torch\.py::.*\[spawn\]": "forked workers stay quick",
    r"test_ddp_hooks_torch\.py::.*\[mpiexec": "the hooks under the python launcher stay quick",
    r"test_distributed_checkpoint_torch\.py::test_restore_into_(one|two)_rank": "the bit-for-bit resume stays quick; "
    "JAX's restores into another world size too",
    # what CI runs in steps of its own right after the quick suite (.ci/run), each a build or a set of jobs
    r"test_docs_examples\.py::": "every code block of the README and the docs (about 130 s: most pages train jobs)",
    r"test_bagua_net\.py::": "Bagua-Net: the plugin's build, its contract, fuzzers and sanitizer builds (30 s)",
    r"test_examples\.py::test_a_fault_tolerant_jax_job|test_fault_tolerance_jax\.py::test_members_that_stop_with_no_"
    r"progress_under_the_launcher|test_fault_tolerance_torch\.py::test_when_every_rank_dies_the_launcher_restarts": (
        "the fault-tolerant jobs under bagua-launch (about 55 s: JAX's replacements through the launcher, the "
        "launcher's summary of members that stopped with no progress, torch's restart from a checkpoint when every "
        "rank died); the ranks' side of each stays quick"
    ),
    # the quick suite's 10-minute budget, run by CI in a step of its own (.ci/run): combinations and second cases
    # of behaviours the suite keeps once (200 s)
    r"test_fault_tolerance_torch\.py::test_(a_joiner_admitted_before_a_restarted_jobs_first_commit|a_diloco_joiner_"
    r"sits_out_its_first_round_while_its_state_arrives|a_partitioned_coordinator_stops_training_and_joins_the_majority_"
    r"again_once_its_link_is_back\[gradient_allreduce\]|ranks_whose_step_times_out_at_every_attempt_stop|a_"
    r"decentralized_member_one_behind_before_its_optimizer_steps)": "torch's "
    "joiner of a restarted job (a restart and a joiner each stay quick), its DiLoCo joiner's round timed (the "
    "sit-out's checkpoints and samples stay quick), its partitioned coordinator's return (JAX's stays quick), its stop "
    "after a step timed out three times (12 s; the rule's own test stays quick), its decentralized member one behind "
    "given the state (8 s; a survivor given another's state stays quick)",
    r"test_fault_tolerance_jax\.py::test_(a_member_lost_while_the_state_communicator_is_split_costs|a_member_lost_"
    r"while_a_joiner_is_late_for_its_state|diloco_joiner_admitted_at_a_retried_exchange|survivors_of_a_kill_a_hang_"
    r"and_an_exception_resume_and_a_joiner_trains|each_per_step_algorithm_survives_a_kill_and_admits_a_joiner\["
    r"(gradient_allreduce|qadam)\]|diloco_survivors_of_a_hang_mid_round_and_a_kill_in_an_exchange_lose_no_inner_"
    r"step\[diloco\]|decentralized_survivors_of_a_kill_average_over_all_while_odd|a_joiner_whose_state_holder_dies_"
    r"before_sending_is_given_the_state_by_the_next_one\[gradient_allreduce\]|a_member_that_raises_is_taken_for_lost|"
    r"a_decentralized_member_one_behind_before_its_step_began|asynchronous_averaging_survives_a_kill_with_a_member_one_"
    r"behind|asynchronous_averaging_rounds_failed_by_a_member_that_left_early|a_death_during_a_joiners_admission_costs_one_more_epoch_"
    r"and_the_joiner_trains_in_it\[(mpi-joiner-meeting|tcp-member-start)\])": "JAX's deaths in the state's split and "
    "in a late joiner's transfer (a death while the survivors rebuild stays quick), its DiLoCo joiner at a retried "
    "exchange (the Streaming one stays quick, and torch's), the kill, hang and exception job with a joiner over each "
    "engine (10-12 s each; a kill while the survivors rebuild and a slow member's timed-out step stay quick, and "
    "MPI's revoke, shrink and replacement in test_membership_change_jax), gradient allreduce's and QAdam's kill and "
    "joiner (10 s each; JAX's weighed-out joiner stays quick, and torch's survivor given another's state), its DiLoCo "
    "survivors of a hang and a kill (10 s; a death while DiLoCo's survivors rebuild and the Streaming survivors' "
    "retried exchange stay quick), its decentralized survivors averaging over an odd ring with a joiner (10 s; torch's "
    "asynchronous averaging through a death and a joiner stays quick, the same rules), the joiner whose state holder "
    "dies (9 s; a joiner given the state stays quick), its member whose exit is slow after an exception (9 s), its "
    "decentralized member one behind given the state (10 s over each engine; torch's runs here too), its asynchronous "
    "averaging through a kill and a joiner (14 s; torch's stays quick, the same rules) and through rounds a member "
    "that left failed (8 s), and its joiner's "
    "own death in its admission over MPI before the members' meeting and a member's over TCP (7 s each; a member's "
    "over MPI stays quick, and a joiner's after the meeting)",
    # the quick suite's 10-minute budget: the larger or repeated jobs of a behaviour the suite keeps once
    r"test_membership_change_jax\.py::test_a_killed_rank_is_revoked_shrunk_away_and_replaced\[1\]": "the MPI engine's "
    "revoke, shrink and replacement with rank 1 killed (8 s); rank 2's death, which holds rank 1 inside MPICH as the "
    "revoke comes, stays quick",
    r"test_native_communicator_jax\.py::test_(every_primitive_matches|large_allreduces_match)_numpy\[[34]-": (
        "two ranks, on one node and between nodes, stay quick"
    ),
    r"test_communicators_torch\.py::.*\[(gloo|mpi)-4ranks": "two ranks per engine stay quick",
    r"test_communicators_torch\.py::test_a_dead_or_stalled_peer_raises_within_the_timeout\[mpi-die\]": "the MPI "
    "engine's dead peer stays quick in JAX's tests (the same engine); gloo's here",
    r"test_adam_convergence_(torch|jax)\.py::": "QAdam and 1-bit Adam training like Adam (25 s); the convergence gate "
    "(.ci/run) trains both in both front ends past 2.5 nats/byte",
    r"test_examples\.py::(?!test_a_fault_tolerant_jax_job)": "the examples' accuracy; the README's job (.ci/run) "
    "trains JAX's digits with ByteGrad and test_bagua_migration_torch trains torch's digits script",
    r"test_elastic_agent\.py::": "torch's elastic agent restarting a JAX job (17 s); bagua-launch's elastic restart "
    "stays quick in test_elastic_launch",
    r"test_qadam_onebit_torch\.py::test_native_mpi_communicator_used": "the native MPI communicator stays quick in "
    "test_communicators_torch",
    r"test_lm_study\.py::test_one_rank_times_its_phases_behind_the_gate": "the load gate's own tests stay quick",
    r"test_diloco_jax\.py::test_streaming_": "Streaming DiLoCo's overlapped exchange over MPI in JAX (20 s); its outer "
    "steps against the NumPy simulation stay quick",
    r"test_frozen_parameters_jax\.py::.*-hierarchical\]": "the flat layout stays quick",
    r"test_frozen_parameters_jax\.py::.*\[(onebit_adam|low_precision_decentralized|decentralized_shift_one|"
    r"bytegrad)-flat\]": "one algorithm of each kind stays quick: gradient averaging without state and with it "
    "(gradient_allreduce, bytegrad_error_feedback), Adam-type (qadam), weight averaging (decentralized)",
    r"test_checkpoint_jax\.py::test_restore_into_another_world_size_follows_the_rule\[(qadam|onebit_adam|powersgd|"
    r"bytegrad_error_feedback)-2-4\]": "the rule's two kinds (decentralized's own weights, low-precision's "
    "residuals) stay quick",
    r"test_fault_paths\.py::test_mesh_fault_(ends_every_process_under_plain_processes\[(raise|term)\]|under_the_"
    r"launcher_names_rank_1\[raise\])": "a SIGKILL stays quick",
    r"test_gpt_models\.py::test_jax_and_torch_train_the_same_losses": "the two front ends' GPTs training the same "
    "losses (13 s); their forward pass against the reference stays quick, and the convergence gate (.ci/run) trains "
    "both",
    r"test_qadam_onebit_jax\.py::(.*\[(qadam-|onebit-)?4\]|test_with_default_compiler_flags_fused_multiply_adds_"
    r"only_round_differently\[onebit\])": "QAdam's and 1-bit Adam's exact runs on 4 flat ranks (the 2x2 mesh has 4 "
    "ranks and stays quick, with 2 flat ranks) and 1-bit Adam with FMA (QAdam's stays quick: the same warm-up)",
    r"test_async_model_average_torch\.py::.*\[mpi-2\]": "torch's asynchronous averaging over the MPI engine (a "
    "2-rank job, 6 s): the same scenarios on two gloo ranks stay quick, and JAX's averaging over the same engine",
    r"test_composition_matrix_jax\.py::test_(a_two_level_mesh_trains_as_the_flat_one\[(diloco|async)\]|bf16_"
    r"parameters_train_as_bf16\[(qadam|onebit_adam|diloco|decentralized|low_precision_decentralized)\]|a_group_at_"
    r"rate_zero_and_an_unused_leaf_never_move\[diloco\])": "PowerSGD's and the others' cases of each stay quick",
    r"test_mpi_ring_min_bytes\.py::test_environment_sets_the_default_and_is_validated\[(-5|12k)": "a valid value "
    "stays quick; the refusal of a bad one in test_ranks_with_different_environment_values",
    r"test_cross_rank_check_jax\.py::test_ranks_that_differ_get_one_clear_error\[native\]": "the mesh's stays quick",
}
"""Node-id pattern (matched at the start of the id relative to tests/) -> what it holds, what stays quick."""

_PATTERN = re.compile("^(?:" + "|".join(f"(?:{p})" for p in EXTENDED) + ")")


def is_extended(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/test_x.py::name[id]``) belongs to the extended run only."""
    return _PATTERN.search(nodeid.removeprefix("tests/")) is not None
