"""pytest's set-up, read by the main process before it starts the workers (pytest.ini: -n 2).

One compilation cache for every worker: the cache directory is chosen here, in the main process,
so that both workers (and their subprocesses) inherit it, and a program that tests on different
workers compile alike is compiled once (test_ppo_jax.py explains the cache; it is removed when the
main process exits). The longest tests go first, so that the two workers end together rather than
one waiting on the last long test (order only: every test is independent of the others)."""

import os
import tempfile

import pytest

if "PPO_JAX_COMPILE_CACHE" not in os.environ:
    _throwaway_cache = tempfile.TemporaryDirectory(prefix="ppo_jax_test_cache_")
    os.environ["PPO_JAX_COMPILE_CACHE"] = _throwaway_cache.name

# Quick compiles (ppo_jax.quick_compile): most tests are one XLA compile and a few updates, and compile
# in about half the time this way. The tests that run long loops (the learning tests) are marked
# `optimised` and compile as users' runs do (the fixture below).
os.environ.setdefault("PPO_JAX_QUICK_COMPILE", "1")


@pytest.fixture(autouse=True)
def _optimised_compile(request, monkeypatch):
    if request.node.get_closest_marker("optimised"):
        monkeypatch.setenv("PPO_JAX_QUICK_COMPILE", "0")


LONGEST_FIRST = (  # the tests that took over 20 s on 2 cores (pytest --durations), longest first
    "test_playground_learns_cartpole_balance_and_resumes_bit_identically",
    "test_jumanji_tetris_learns_through_its_mask_and_resumes_bit_identically",
    "test_learns_at_the_tuned_defaults_of_each_env",
    "test_ctrl_c_stops_after_the_chunk_and_a_second_ctrl_c_stops_at_once",
    "test_craftax_trains_reports_achievements_and_resumes_bit_identically",
    "test_a_full_disk_or_a_kill_inside_a_write_loses_nothing",
    "test_distributed_sweep_equals_one_process_with_as_many_devices",
    "test_craftax_adapter_steps_as_the_suite_does_across_deaths_limits_and_its_reset_pool",
    "test_xminigrid_learns_empty_and_resumes_bit_identically",
    "test_one_agents_envs_sharded_over_devices_equal_one_device",
    "test_learns_memory_chain_with_the_gru_where_the_mlp_cannot",
    "test_distributed_faults_are_one_line",
    "test_learns_brax_inverted_pendulum_on_mjx_and_resumes_bit_identically",
    "test_distributed_run_stops_on_one_signal_resumes_and_equals_one_process",
    "test_every_brax_backends_state_goes_through_a_checkpoint_unchanged",
    "test_playground_adapter_steps_as_the_suite_does_across_limits_and_a_failed_physics",
    "test_every_program_lowers_for_gpu_and_tpu_as_an_accelerator_host_runs_it",
    "test_learns_minatar_breakout_with_the_cnn_torso",
    "test_an_update_equals_the_independent_reference",
    "test_readme_python_entry_trains_acts_and_vmaps_a_sweep",
    "test_learns_cartpole_with_ppo_penalty_adaptive_kl",
    "test_a_sweep_killed_anywhere_resumes_to_the_same_bytes",
    "test_wandb_offline_runs_hold_metrics_csv",
    "test_brax_adapter_flags_truncation_and_termination_and_keeps_the_final_observation",
    "test_learns_catch_with_grpo_the_leash_in_the_loss_and_no_critic",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(rank)))  # stable: the rest in file order
