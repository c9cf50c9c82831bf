"""Benchmarks for ppo_jax: figures to report, never asserted (shared machines are noisy).

    python bench.py            # every config, about 15 minutes on 2 CPU cores
    python bench.py --quick    # shorter runs of the two CartPole headline configs, about 1.5 minutes
    python bench.py --configs cartpole_classic cartpole_512envs   # some of them
    python bench.py --gpu      # on an accelerator: 1 to 2048 CartPole agents x 5e5 steps, brax:ant x 5e7
    python bench.py --no-plain # without the plain-PPO yardstick (below)
    python bench.py --sweep-outputs 100 10 1000   # a sweep's files at scale: 100 points x 10 seeds x 1000 updates
    python bench.py --envpool  # EnvPool's envs: its own Python loop, the program's host round trip, PPO and A2C (pip install -r requirements-envpool.txt); ale-py's vector env beside it if installed
    python bench.py --pbt      # population-based training's cost: the same sweep with and without its exploit steps

Prints a table and writes bench.json (the figures, the machine, the versions). Each config runs in
its own fresh process, so its compile is cold and its peak RSS its own. For each config:

- lower / compile seconds (cold, the init program compiling during the lowering; and, for the
  classic config, warm from the persistent compilation cache that `python ppo_jax.py` keeps), run
  seconds and env steps/s (median of >= 3 runs of the compiled program after a warm-up run);
- two references measured in the same process, on the same env and number of envs: the env alone
  (random actions, vmapped, scanned) and env + actor-critic forward + sampling. PPO / (env+fwd) is
  the headline: how close the whole algorithm gets to just acting. They run on the same devices as
  the PPO run (the envs split evenly over them); where that is more than one, also on one device
  (env_forward_one_device), as the issue's public figures were measured;
- where one agent's envs were sharded over several devices (--env-devices auto), the same run
  with --env-devices 1 (unsharded_steps_per_s), for what the sharding gains;
- for the discrete (CartPole) configs, a yardstick in the same process: plain_ppo, the same PPO on
  the same work written the straightforward way of single-file JAX PPOs (ppo_over_plain: how much
  ppo_jax's speed work buys, independent of the machine's drift), and its final return;
- achieved FLOP/s: the network's dense-layer FLOPs per env step (rollout forward, the next-value and
  KL passes, and update_epochs x forward+backward, counted as 3 forwards) x env steps/s, against a
  measured matmul peak of this machine (1024 x 1024 float32 matmuls).
"""

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

CONFIGS = {  # name -> (Config overrides, total steps per agent, quick steps, agents)
    "cartpole_classic": (dict(env="CartPole-v1"), 500_000, 131_072, 1),
    "cartpole_64envs": (dict(env="CartPole-v1", num_envs=64), 1_048_576, 524_288, 1),
    "cartpole_512envs": (dict(env="CartPole-v1", num_envs=512), 2_097_152, 524_288, 1),
    "pendulum": (dict(env="Pendulum-v1"), 262_144, 65_536, 1),
    "cartpole_8_agents": (dict(env="CartPole-v1"), 262_144, 65_536, 8),
    "cartpole_64_agents": (dict(env="CartPole-v1"), 65_536, 16_384, 64),
    # the loop with a language model: PPO's step on ToyRLHF at the README's size, the MLP vs the transformer
    "rlhf_mlp": (dict(env="ToyRLHF-v0", env_params=("vocab=8", "length=6"), num_steps=12), 153_600, 38_400, 1),
    "rlhf_transformer": (dict(env="ToyRLHF-v0", env_params=("vocab=8", "length=6"), num_steps=12,
                              torso="transformer", shared_trunk=True), 153_600, 38_400, 1),
    # --gpu: the accelerator's headline figures (far too long for a CPU)
    "gpu_cartpole_1_agent": (dict(env="CartPole-v1"), 500_000, 131_072, 1),
    "gpu_cartpole_64_agents": (dict(env="CartPole-v1"), 500_000, 131_072, 64),
    "gpu_cartpole_1024_agents": (dict(env="CartPole-v1"), 500_000, 131_072, 1024),
    "gpu_cartpole_2048_agents": (dict(env="CartPole-v1"), 500_000, 131_072, 2048),
    "gpu_brax_ant": (dict(env="brax:ant", num_envs=2048, num_steps=16, update_epochs=4),  # the README's accelerator
                     50_000_000, 5_242_880, 1),  # setting for Brax; needs requirements-brax.txt
}
QUICK = ("cartpole_classic", "cartpole_512envs")
GPU = tuple(name for name in CONFIGS if name.startswith("gpu_"))


def timed(fn, *args, repeats=3, warm_up=True):
    """Median wall seconds of fn(*args) over `repeats` runs after one warm-up run (warm_up=False:
    the caller has run it already)."""
    import jax

    if warm_up:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def references(env_id: str, num_envs: int, steps: int, repeats: int, devices: int = 1):
    """Env steps/s of (the env alone, env + actor-critic forward + sampling) with gymnax's own
    auto-resetting step, random keys split per step, as a plain scan would do it. With devices > 1
    the envs are split evenly over that many devices, each running its share side by side, as
    run_batch shards a batch of agents (so the reference uses the machine as the PPO run does)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import ppo_jax as P

    num_envs //= devices
    env = P.VecEnv(env_id, num_envs)
    network = P.ActorCritic(env.action_dim, env.discrete)
    num_steps = max(1, steps // num_envs)
    keys = jax.random.split(jax.random.PRNGKey(1), devices) if devices > 1 else jax.random.PRNGKey(1)

    def make(with_network: bool):
        def rollout(key):
            reset_key, init_key, key = jax.random.split(key, 3)
            obs, state = jax.vmap(env.env.reset, in_axes=(0, None))(jax.random.split(reset_key, num_envs), env.env_params)
            params = network.init(init_key, env._flat(obs))

            def step(carry, _):
                obs, state, key = carry
                key, action_key, step_key = jax.random.split(key, 3)
                if with_network:
                    dist = network.apply(params, env._flat(obs)).dist
                    action = dist.sample(action_key)
                else:
                    space = env.env.action_space(env.env_params)
                    action = jax.vmap(space.sample)(jax.random.split(action_key, num_envs))
                if not env.discrete:
                    action = action.reshape(num_envs, *env.action_shape)
                obs, state, reward, _, _, _ = jax.vmap(env.env.step, in_axes=(0, 0, 0, None))(
                    jax.random.split(step_key, num_envs), state, action, env.env_params)
                return (obs, state, key), reward.sum()

            (obs, _, _), rewards = jax.lax.scan(step, (obs, state, key), None, length=num_steps)
            # The last observation too: where the reward is a constant (Brax's inverted_pendulum: 1 per
            # step), XLA would otherwise drop the physics.
            return rewards.sum() + env._flat(obs).sum()

        if devices == 1:
            return jax.jit(rollout).lower(jax.random.PRNGKey(0)).compile()
        sharding = NamedSharding(Mesh(np.asarray(jax.devices()[:devices]), ("envs",)), PartitionSpec("envs"))
        return jax.jit(jax.vmap(rollout), in_shardings=sharding).lower(keys).compile()

    env_only = devices * num_steps * num_envs / timed(make(False), keys, repeats=repeats)
    env_forward = devices * num_steps * num_envs / timed(make(True), keys, repeats=repeats)
    return env_only, env_forward


def plain_ppo(config, agents: int):
    """A yardstick for the speed of the whole algorithm: the same PPO (network, hyperparameters, work
    per env step) written the straightforward way of single-file JAX PPOs, with none of ppo_jax's
    speed work: gymnax's own auto-resetting step, keys split at every step, the critic evaluated in
    the rollout loop, optax's clipping and Adam over the parameter tree, a jax.random.permutation
    and a gather per epoch, agents vmapped, the layers flax's own nn.Dense (JAX's gradient of each
    matmul, no kernel_grad). Discrete actions only. Returns (compiled program,
    its argument, env steps per call); the program returns metrics as ppo_jax's do, [agents,
    updates]: episode_return (the mean of the episodes that ended in the update) and episodes."""
    import flax.linen
    import jax
    import jax.numpy as jnp
    import optax

    import ppo_jax as P

    h = config.hparams
    env = P.make_env(config)
    network = P.make_network(config, env)
    gym, gym_params = env.env, env.env_params
    n, t, m = config.num_envs, config.num_steps, config.num_minibatches
    num_updates = config.num_updates

    def schedule(count):  # linear annealing, per update
        return h.lr * (1.0 - (count // (m * config.update_epochs)) / num_updates)

    tx = optax.chain(optax.clip_by_global_norm(h.max_grad_norm), optax.adam(schedule, eps=h.adam_eps))

    def train(key):
        key, init_key, reset_key = jax.random.split(key, 3)
        obs, env_state = jax.vmap(gym.reset, in_axes=(0, None))(jax.random.split(reset_key, n), gym_params)
        obs = obs.reshape(n, -1)
        params = network.init(init_key, obs[None], jnp.ones((1, n), bool), jnp.zeros((n, 0)))
        carry = (params, tx.init(params), env_state, obs, jnp.zeros(n), key)

        def loss(params, obs, action, old_log_prob, old_value, advantage, target):
            out = network.apply(params, obs)
            dist, value = out.dist, out.value
            ratio = jnp.exp(dist.log_prob(action) - old_log_prob)
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
            surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - h.clip_eps, 1 + h.clip_eps) * advantage)
            clipped_value = old_value + jnp.clip(value - old_value, -h.clip_eps, h.clip_eps)
            value_loss = 0.5 * jnp.maximum((value - target) ** 2, (clipped_value - target) ** 2).mean()
            return -surrogate.mean() + h.vf_coef * value_loss - h.ent_coef * dist.entropy().mean()

        def update(carry, _):
            def step(carry, _):
                params, opt_state, env_state, obs, running_return, key = carry
                key, action_key, step_key = jax.random.split(key, 3)
                out = network.apply(params, obs)
                dist, value = out.dist, out.value
                action = dist.sample(action_key)
                next_obs, env_state, reward, terminated, truncated, _ = jax.vmap(
                    gym.step, in_axes=(0, 0, 0, None))(jax.random.split(step_key, n), env_state, action, gym_params)
                done = (terminated | truncated).astype(jnp.float32)
                running_return = running_return + reward  # for the learning check: episode returns
                out = (obs, action, dist.log_prob(action), value, reward, done, running_return)
                running_return = running_return * (1 - done)
                return (params, opt_state, env_state, next_obs.reshape(n, -1), running_return, key), out

            carry, (obs, action, log_prob, value, reward, done, returns) = jax.lax.scan(step, carry, None, length=t)
            params, opt_state, env_state, last_obs, running_return, key = carry
            last_value = network.apply(params, last_obs).value

            def gae(carry, x):
                advantage, next_value = carry
                reward, value, done = x
                delta = reward + h.gamma * next_value * (1 - done) - value
                advantage = delta + h.gamma * h.gae_lambda * (1 - done) * advantage
                return (advantage, value), advantage

            _, advantage = jax.lax.scan(gae, (jnp.zeros(n), last_value), (reward, value, done), reverse=True)
            batch = jax.tree.map(lambda x: x.reshape(n * t, *x.shape[2:]),
                                 (obs, action, log_prob, value, advantage, advantage + value))

            def epoch(carry, _):
                params, opt_state, key = carry
                key, shuffle_key = jax.random.split(key)
                order = jax.random.permutation(shuffle_key, n * t)
                minibatches = jax.tree.map(lambda x: jnp.take(x, order, axis=0).reshape(m, -1, *x.shape[1:]), batch)

                def minibatch(carry, minibatch):
                    params, opt_state = carry
                    grads = jax.grad(loss)(params, *minibatch)
                    updates, opt_state = tx.update(grads, opt_state)
                    return (optax.apply_updates(params, updates), opt_state), None

                (params, opt_state), _ = jax.lax.scan(minibatch, (params, opt_state), minibatches)
                return (params, opt_state, key), None

            (params, opt_state, key), _ = jax.lax.scan(epoch, (params, opt_state, key), None,
                                                       length=config.update_epochs)
            metrics = {"episode_return": jnp.sum(done * returns) / jnp.sum(done),  # NaN where none ended
                       "episodes": jnp.sum(done)}
            return (params, opt_state, env_state, last_obs, running_return, key), metrics

        return jax.lax.scan(update, carry, None, length=num_updates)[1]

    keys = jax.random.split(jax.random.PRNGKey(0), agents)
    dense = P.dense  # while it traces, the network's layers are flax's own nn.Dense (no kernel_grad)
    P.dense = lambda features, kernel_init, name: flax.linen.Dense(features, kernel_init=kernel_init, name=name)
    try:
        compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    finally:
        P.dense = dense
    return compiled, keys, agents * num_updates * config.batch_size


def matmul_peak(repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    n, k = 1024, 10
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)).astype(np.float32)) / n
    fn = jax.jit(lambda a: jax.lax.fori_loop(0, k, lambda i, x: x @ a, a)).lower(a).compile()
    return 2 * n**3 * k / timed(fn, a, repeats=repeats)


def network_flops_per_step(config, env) -> float:
    """Dense-layer FLOPs of the actor-critic per env step, over the whole algorithm."""
    import jax

    import ppo_jax as P

    network = P.make_network(config, env)
    params = jax.eval_shape(network.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, env.obs_dim), np.float32))
    kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(params) if "kernel" in str(path[-1])]
    forward = sum(2 * int(np.prod(k.shape)) for k in kernels)  # per sample
    # rollout forward + next-value pass + post-update KL pass + epochs x (forward + backward = 3 forwards)
    return forward * (3 + 3 * config.update_epochs)


def one_config(name: str, quick: bool, repeats: int, cache_dir: str | None, with_plain: bool = True) -> dict:
    """Runs in its own process: measure one config."""
    import jax

    import ppo_jax as P

    overrides, steps, quick_steps, agents = CONFIGS[name]
    config = dataclasses.replace(P.default_config(overrides["env"]), **overrides, num_seeds=agents, table_rows=0,
                                 total_timesteps=quick_steps if quick else steps)
    P.validate(config, check_run_dir=False)
    keys = P.seed_keys(config)
    hparams = P.stack_hparams([config.hparams] * agents)
    result = P.run_batch(config, keys, hparams, timed_runs=repeats)  # lower, cold compile, warm-up, timed runs
    row = {
        "config": name,
        "env": config.env,
        "agents": agents,
        "envs": config.num_envs,
        "devices": result.num_devices,
        "steps_per_agent": config.num_updates * config.batch_size,
        "lower_s": round(result.lower_seconds, 2),
        "compile_s": round(result.compile_seconds, 2),
        "final_return": round(float(np.nanmean(P.final_return(result.metrics))), 1),
    }
    run_seconds = result.run_seconds
    steps_per_s = row["steps_per_agent"] * agents / run_seconds
    work = (config.env, config.num_envs * agents, min(row["steps_per_agent"] * agents, 1 << 21), repeats)
    env_only, env_forward = references(*work, result.num_devices)
    if result.num_devices > 1:  # the references on one device too (as the public figures were measured)
        _, one_device = references(*work, 1)
        row["env_forward_one_device"] = round(one_device)
        row["ppo_over_env_forward_one_device"] = round(steps_per_s / one_device, 3)
    if result.num_devices > agents:  # the agent's envs were sharded: the same run unsharded, for the gain
        unsharded = P.run_batch(dataclasses.replace(config, env_devices=1), keys, hparams, timed_runs=repeats)
        row["unsharded_steps_per_s"] = round(row["steps_per_agent"] * agents / unsharded.run_seconds)
    env = P.make_env(config)
    flops = network_flops_per_step(config, env) * steps_per_s
    peak = matmul_peak(repeats)
    if with_plain and env.discrete:  # the plain PPO yardstick, same work, same process
        plain, plain_keys, plain_steps = plain_ppo(config, agents)
        plain_metrics = jax.tree.map(np.asarray, plain(plain_keys))  # also the warm-up run
        row["plain_steps_per_s"] = round(plain_steps / timed(plain, plain_keys, repeats=repeats, warm_up=False))
        row["ppo_over_plain"] = round(steps_per_s / row["plain_steps_per_s"], 2)
        row["plain_final_return"] = round(float(np.nanmean(P.final_return(plain_metrics))), 1)
    row.update({
        "run_s": round(run_seconds, 2),
        "env_steps_per_s": round(steps_per_s),
        "env_only_steps_per_s": round(env_only),
        "env_forward_steps_per_s": round(env_forward),
        "ppo_over_env_forward": round(steps_per_s / env_forward, 3),
        "achieved_gflops": round(flops / 1e9, 1),
        "peak_gflops": round(peak / 1e9, 1),
        "achieved_over_peak": round(flops / peak, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    })
    if cache_dir:  # warm compile: the persistent cache ppo_jax.py keeps (two compiles, the second reads it)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        for _ in range(2):
            warm = P.run_batch(dataclasses.replace(config, total_timesteps=config.batch_size), keys, hparams)
        row["warm_lower_s"] = round(warm.lower_seconds, 2)
        row["warm_compile_s"] = round(warm.compile_seconds, 2)
    return row


COLUMNS = ("config", "agents", "envs", "devices", "lower_s", "compile_s", "run_s", "env_steps_per_s", "unsharded_steps_per_s",
           "env_only_steps_per_s", "env_forward_steps_per_s", "ppo_over_env_forward", "env_forward_one_device",
           "ppo_over_env_forward_one_device", "plain_steps_per_s", "ppo_over_plain", "achieved_gflops",
           "peak_gflops", "achieved_over_peak", "peak_rss_mb", "final_return", "plain_final_return")


def sweep_outputs(points: int, seeds: int, updates: int, chunks: int = 20) -> dict:
    """What a sweep of points x seeds agents x updates writes, from a synthetic batch (no training:
    random metrics, a zero train state of CartPole-v1's defaults), through the sweep's own writers:
    every point's metrics.csv appended after each of `chunks` chunks, the setting's checkpoint
    rewritten after each, then the points' params.msgpack. -> sizes, seconds, peak memory."""
    import jax

    import ppo_jax as P

    run_dir = tempfile.mkdtemp(prefix="ppo_jax_sweep_outputs_")
    config = P.default_config("CartPole-v1", num_seeds=seeds, total_timesteps=512 * updates)
    sweep = P.Sweep("bench", [config], [{"lr": float(lr)} for lr in np.geomspace(1e-5, 1e-2, points)],
                    [f"lr={lr:.4g}" for lr in np.geomspace(1e-5, 1e-2, points)], ["lr"], False, "")
    agents = points * seeds
    keys = sweep.keys(config)
    state = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), P.abstract_train_state(config, keys))
    names = [name for name in P.metric_names(config) if name != "env_steps"]
    rng = np.random.default_rng(0)
    metrics = {name: rng.normal(size=(agents, updates)).astype(np.float32) for name in names}
    metrics["episodes"] = rng.integers(1, 5, (agents, updates)).astype(np.float32)
    P.start_setting(run_dir, sweep, 0)
    recorder = P.SweepRecorder(sweep, 0, run_dir, P.StopRequests(), P.Progress(1, quiet=True), 0, [])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    csv_seconds = checkpoint_seconds = 0.0
    for chunk in range(1, chunks + 1):
        done = updates * chunk // chunks
        so_far = P.with_env_steps({name: values[:, :done] for name, values in metrics.items()}, config.batch_size)
        start = time.perf_counter()
        recorder.write_points(so_far)
        csv_seconds += time.perf_counter() - start
        start = time.perf_counter()
        P.save_checkpoint(P.setting_dir(run_dir, 0), config,
                          P.Checkpoint(state, {name: values[:, :done] for name, values in metrics.items()}))
        checkpoint_seconds += time.perf_counter() - start
    setting = P.SweepSetting(config, P.RunResult(state, P.with_env_steps(metrics, config.batch_size), 0, 0, 1.0,
                                                 config=config), None)
    start = time.perf_counter()
    P.write_point_outputs(run_dir, sweep, 0, setting)
    params_seconds = time.perf_counter() - start
    sizes = {}
    for folder, _, files in os.walk(run_dir):
        for name in files:
            sizes.setdefault(name, []).append(os.path.getsize(os.path.join(folder, name)))
    start = time.perf_counter()
    with open(os.path.join(P.point_dir(run_dir, 0, 0), "metrics.csv")) as f:
        rows = sum(1 for _ in f) - 1
    read_seconds = time.perf_counter() - start
    result = {
        "points": points, "seeds": seeds, "updates": updates, "chunks": chunks, "metrics_columns": len(names) + 3,
        "metrics_csv_total_mb": round(sum(sizes["metrics.csv"]) / 1e6, 1),
        "metrics_csv_per_point_mb": round(max(sizes["metrics.csv"]) / 1e6, 2), "rows_per_point": rows,
        "checkpoint_mb": round(sum(sizes[P.CHECKPOINT]) / 1e6, 1),
        "params_msgpack_total_mb": round(sum(sizes["params.msgpack"]) / 1e6, 1),
        "csv_seconds_per_chunk": round(csv_seconds / chunks, 2),
        "checkpoint_seconds_per_chunk": round(checkpoint_seconds / chunks, 2),
        "params_seconds": round(params_seconds, 1), "read_one_point_s": round(read_seconds, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
        "peak_rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024, 0),
    }
    import shutil

    shutil.rmtree(run_dir)
    return result


ENVPOOL = {"hopper_1env": ("envpool:Hopper-v4", 1, 4096), "hopper_8envs": ("envpool:Hopper-v4", 8, 1024),
           "breakout_8envs": ("envpool:Breakout-v5", 8, 256)}  # name -> (env, envs, steps per measurement)


def envpool_figures(repeats: int) -> dict:
    """For each ENVPOOL env, in this process: env steps/s of EnvPool's own Python loop (pool.step, random
    actions), of the adapter stepped in a jitted lax.scan (random actions: each step a host round trip),
    the round trip's cost per step (their difference), and the PPO run at the env's defaults (steps/s;
    the share of its time that the env steps would take alone). Atari's run is 2 updates: its Nature CNN
    is most of its time on a CPU."""
    import jax
    import jax.numpy as jnp

    import ppo_jax

    rows = {}
    for name, (env_id, num_envs, steps) in ENVPOOL.items():
        env = ppo_jax.vec_env(env_id, num_envs)
        numbers, _ = env.open_pool(np.arange(num_envs, dtype=np.int32))
        pool = ppo_jax.ENVPOOL_POOLS[int(numbers[0])]
        rng = np.random.default_rng(0)
        if env.discrete:
            actions = rng.integers(0, env.action_dim, (steps, num_envs)).astype(np.int32)
        else:
            actions = rng.uniform(-1, 1, (steps, num_envs, env.action_dim)).astype(env.pool_action_dtype)

        def python_loop():
            for action in actions:
                pool.step(action)

        def in_program(key):
            _, state = env.reset(key)

            def step(state, action):
                _, state, reward, *_ = env.step(None, state, action, None)
                return state, reward.sum()

            return jax.lax.scan(step, state, jnp.asarray(actions, jnp.int32 if env.discrete else jnp.float32))[1]

        program = jax.jit(in_program)
        python_s = timed(python_loop, repeats=repeats)
        program_s = timed(lambda: jax.block_until_ready(program(jax.random.PRNGKey(0))), repeats=repeats)
        ppo_per_s = run_steps_per_s(ppo_jax.default_config(env_id, num_envs=num_envs), 2 if "Breakout" in env_id else 8)
        env_per_s = steps * num_envs / program_s
        rows[name] = {"env": env_id, "num_envs": num_envs, "python_loop_steps_per_s": round(steps * num_envs / python_s),
                      "in_program_steps_per_s": round(env_per_s),
                      "round_trip_us_per_step": round((program_s - python_s) / steps * 1e6, 1),
                      "ppo_steps_per_s": round(ppo_per_s), "env_share_of_ppo": round(ppo_per_s / env_per_s, 3)}
        print(f"  {name}: {rows[name]}", flush=True)
    config = ppo_jax.default_config("envpool:Breakout-v5", algo="a2c")  # A2C's Atari update: 16 envs x 5 steps
    rows["breakout_a2c"] = {"env": config.env, "num_envs": config.num_envs,
                            "a2c_steps_per_s": round(run_steps_per_s(config, 20))}
    print(f"  breakout_a2c: {rows['breakout_a2c']}", flush=True)
    return {**rows, **ale_py_figures(repeats)}


def run_steps_per_s(config, updates: int) -> float:
    """Env steps/s of a run of `config` (one program of `updates` updates, timed after its compile)."""
    import ppo_jax

    config = dataclasses.replace(config, total_timesteps=updates * config.batch_size, checkpoint_every=updates)
    return ppo_jax.run_batch(config, ppo_jax.seed_keys(config), ppo_jax.stack_hparams([config.hparams]),
                             timed_runs=1).steps_per_second


def ale_py_figures(repeats: int, num_envs: int = 8, steps: int = 512) -> dict:
    """Breakout through ale-py's own vector env (ale_py.vector_env.AtariVectorEnv, 0.12) beside EnvPool's,
    with the same preprocessing (84 x 84 grayscale, 4 frames stacked, frame skip 4, 30 no-ops, episodic
    life, clipped rewards): env steps/s of each one's Python loop and of each one's XLA op in a jitted
    lax.scan. Empty (and a line saying how to get it) without ale-py."""
    try:
        from ale_py.vector_env import AtariVectorEnv
    except ImportError:
        print("  ale-py: not installed (pip install ale-py==0.12.1 for its row)", flush=True)
        return {}
    import envpool
    import jax
    import jax.numpy as jnp

    actions = np.random.default_rng(0).integers(0, 4, (steps, num_envs)).astype(np.int32)
    pools = {"envpool": envpool.make("Breakout-v5", env_type="gymnasium", num_envs=num_envs, episodic_life=True,
                                     reward_clip=True, noop_max=30, seed=0),
             "ale_py": AtariVectorEnv("breakout", num_envs=num_envs, episodic_life=True, reward_clipping=True,
                                      noop_max=30, repeat_action_probability=0.0)}
    row = {}
    for name, pool in pools.items():
        pool.reset(seed=0) if name == "ale_py" else pool.reset()
        handle, *_, step = pool.xla()  # both: (handle, ..., step(handle, actions) -> (handle, outputs))

        def in_program(handle, step=step):
            return jax.lax.scan(lambda h, a: (step(h, a)[0], None), handle, jnp.asarray(actions))[0]

        program = jax.jit(in_program)
        row[f"{name}_python_loop_steps_per_s"] = round(steps * num_envs / timed(lambda pool=pool: [pool.step(a) for a in actions],
                                                                                 repeats=repeats))
        row[f"{name}_xla_steps_per_s"] = round(steps * num_envs / timed(
            lambda program=program, handle=handle: jax.block_until_ready(program(handle)), repeats=repeats))
    print(f"  ale_py_vs_envpool (Breakout, {num_envs} envs): {row}", flush=True)
    return {"ale_py_vs_envpool": {"env": "Breakout", "num_envs": num_envs, **row}}


def pbt_overhead(repeats: int) -> dict:
    """What population-based training costs, in this process: one CartPole sweep (16 points x 2 seeds =
    32 agents, 40 updates, chunks of 2) run with a [pbt] step every 2 updates (the host's decision from
    the metrics, the device's gather of every agent's state, the HParams sent again) and without
    (the same program and chunks: --pbt-interval 0), median of `repeats` runs after a warm-up."""
    import ppo_jax

    spec = {"base": {"env": "CartPole-v1", "total_timesteps": 4 * 128 * 40, "num_seeds": 2},
            "grid": {"lr": [float(x) for x in np.geomspace(1e-5, 1e-2, 16)]}, "pbt": {"interval": 2}}
    sweep = ppo_jax.resolve_sweep(spec, "bench", "", ppo_jax.Config(), {})
    config = sweep.configs[0]
    hparams = ppo_jax.stack_hparams([h for h in sweep.hparams(config) for _ in range(config.num_seeds)])
    seconds = {}
    for name in ("plain", "pbt"):
        population = ppo_jax.Population(sweep.pbt, config, len(sweep.points), hparams) if name == "pbt" else None
        result = ppo_jax.run_batch(config, sweep.keys(config), hparams, timed_runs=repeats, population=population)
        seconds[name] = result.run_seconds
    steps = config.num_updates // sweep.pbt.interval - 1
    return {"agents": len(sweep.points) * config.num_seeds, "updates": config.num_updates, "pbt_steps": steps,
            "plain_seconds": seconds["plain"], "pbt_seconds": seconds["pbt"], "pbt_over_plain": seconds["pbt"] / seconds["plain"],
            "ms_per_pbt_step": 1e3 * (seconds["pbt"] - seconds["plain"]) / steps}


def print_table(rows):
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in COLUMNS]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(COLUMNS, widths)))


def machine():
    import jax

    import ppo_jax  # noqa: F401  (it sets the CPU device count: one per core)

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(jax.devices()[0]),
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"shorter runs of {', '.join(QUICK)} (about 1.5 minutes)")
    parser.add_argument("--out", default="bench.json", help="where to write the figures (default: bench.json)")
    parser.add_argument("--gpu", action="store_true", help=f"the accelerator configs: {', '.join(GPU)}")
    parser.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), help="only these configs")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median; default 3)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-PPO yardstick (saves ~1/3 of the time)")
    parser.add_argument("--sweep-outputs", nargs=3, type=int, metavar=("POINTS", "SEEDS", "UPDATES"),
                        help="measure a sweep's files at this scale (a synthetic batch) and exit")
    parser.add_argument("--envpool", action="store_true", help="EnvPool's envs: its own loop, the host round trip, PPO")
    parser.add_argument("--pbt", action="store_true", help="population-based training's cost per exploit step")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one config in this process
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sweep_outputs:
        print(json.dumps(sweep_outputs(*args.sweep_outputs), indent=2))
        return
    if args.envpool or args.pbt:
        results = {"machine": machine(), **({"envpool": envpool_figures(args.repeats)} if args.envpool else {}),
                   **({"pbt": pbt_overhead(args.repeats)} if args.pbt else {})}
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")
        return
    if args.one:
        print(json.dumps(one_config(args.one, args.quick, args.repeats, args.cache_dir, not args.no_plain)))
        return
    names = args.configs or (GPU if args.gpu else QUICK if args.quick else [n for n in CONFIGS if n not in GPU])
    results = {"machine": machine(), "quick": args.quick, "configs": []}
    print(f"machine: {results['machine']}", flush=True)
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            command = [sys.executable, __file__, "--one", name, "--repeats", str(args.repeats)]
            command += ["--quick"] if args.quick else []
            command += ["--no-plain"] if args.no_plain else []
            command += ["--cache-dir", cache_dir] if name == "cartpole_classic" else []
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results["configs"].append(json.loads(output.strip().splitlines()[-1]))
            print(f"  {name}: {results['configs'][-1]['env_steps_per_s']:,} env steps/s", flush=True)
    print()
    print_table(results["configs"])
    classic = next((r for r in results["configs"] if r["config"] == "cartpole_classic"), None)
    if classic:
        print(f"\ncartpole_classic compile: cold {classic['lower_s'] + classic['compile_s']:.1f} s "
              f"(lower {classic['lower_s']} + compile {classic['compile_s']}), warm from the persistent cache "
              f"{classic['warm_lower_s'] + classic['warm_compile_s']:.1f} s")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
