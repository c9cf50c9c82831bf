"""ppo_jax: Proximal Policy Optimization as one XLA program.

PPO-Clip (Schulman et al., 2017, arXiv:1707.06347) on any gymnax environment. Environment
stepping, GAE and the multi-epoch minibatch update all run inside a single `jax.jit`, and
`--num-seeds N` vmaps the whole run over N seeds in that same program.

    python ppo_jax.py                                        # CartPole-v1, the classic config
    python ppo_jax.py --env Pendulum-v1 --num-seeds 4
    python ppo_jax.py --env Acrobot-v1 --help                # every flag, with Acrobot's defaults

Sections, top to bottom:
    1. Config, HParams    what fixes the compiled program / what can vary inside it
    2. Environment        gymnax, vmapped over envs: flat float32 obs, clipped actions, episode stats
    3. Network            ActorCritic; Categorical and diagonal Gaussian in closed form
    4. Math               compute_gae, clipped_surrogate, value_loss, explained_variance
    5. Training           make_train(config) -> train(key, hparams) -> (TrainState, metrics)
    6. Running            validation, compile + run, metrics to numpy
    7. Outputs            run directory: config.json, summary.json, metrics.csv, curve.png,
                          params.msgpack
    8. CLI                main()
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import difflib
import functools
import json
import math
import os
import sys
import time
from typing import Annotated, Any, Literal, Sequence

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import serialization, struct
from gymnax.environments import spaces

# ================================================================================================
# 1. Config and HParams
# ================================================================================================


@struct.dataclass
class HParams:
    """Hyperparameters that are traced, not compiled in: changing one never recompiles.

    Because this is a pytree, `jax.vmap(train, in_axes=(0, 0))` over stacked HParams runs a whole
    sweep as one program. Booleans are switches: they become 0/1 arrays inside the program and
    select a branch with `jnp.where`, so they can be swept too.
    """

    lr: float = 2.5e-4
    """Adam learning rate (the starting value when --anneal-lr is on)."""
    anneal_lr: bool = True
    """Linearly anneal the learning rate from --lr towards 0 over the run (one step per update)."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE lambda (PPO paper, Eq. 11-12)."""
    clip_eps: float = 0.2
    """Clipping epsilon of the surrogate objective (PPO paper, Eq. 7); also the value-clip range."""
    ent_coef: float = 0.01
    """Entropy bonus coefficient c2 (PPO paper, Eq. 9)."""
    vf_coef: float = 0.5
    """Value loss coefficient c1 (PPO paper, Eq. 9)."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this value (inf: no clipping)."""
    norm_adv: bool = True
    """Normalise advantages to zero mean and unit std within each minibatch."""
    clip_vloss: bool = True
    """Clip the value update around the old value prediction (OpenAI baselines form)."""
    adam_eps: float = 1e-5
    """Adam epsilon."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that fixes shapes and the compiled program, plus the default HParams point."""

    env: str = "CartPole-v1"
    """gymnax environment id (e.g. CartPole-v1, Pendulum-v1, Acrobot-v1, MountainCarContinuous-v0,
    Breakout-MinAtar, Catch-bsuite). The defaults shown by --help are that env's defaults."""
    total_timesteps: int = 500_000
    """Environment steps per seed (rounded down to a whole number of updates)."""
    num_envs: int = 4
    """Parallel environments per seed."""
    num_steps: int = 128
    """Steps per environment in each rollout; a batch is num_envs * num_steps transitions."""
    update_epochs: int = 4
    """Passes over each batch (PPO paper's K epochs)."""
    num_minibatches: int = 4
    """Minibatches per epoch; must divide the batch."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Widths of the hidden layers of the actor and of the (separate) critic."""
    activation: Literal["tanh", "relu"] = "tanh"
    """Hidden-layer activation."""
    seed: int = 0
    """Base random seed; seed i of --num-seeds uses key i of split(PRNGKey(seed), num_seeds)."""
    num_seeds: int = 1
    """Independent runs vmapped in one program."""
    run_dir: str | None = None
    """Output directory (default: runs/<env>-<timestamp>). Must not exist: nothing is overwritten."""
    table_rows: int = 20
    """Rows of the metrics table printed after the run (0: none)."""
    hparams: Annotated[HParams, tyro.conf.OmitArgPrefixes] = HParams()
    """Traced hyperparameters: the point that a single run uses."""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size


# Defaults per environment family. CartPole is the classic PPO config (CleanRL / the 37 details),
# which is also Config's own default. Pendulum was tuned here: see README, "Defaults".
CLASSIC_DISCRETE: dict[str, Any] = {}
CLASSIC_CONTINUOUS: dict[str, Any] = dict(
    total_timesteps=1_000_000,
    num_envs=16,
    num_steps=256,
    update_epochs=10,
    num_minibatches=16,
    hparams=dict(lr=1e-3, gamma=0.95, ent_coef=0.0, max_grad_norm=0.5),
)
ENV_DEFAULTS: dict[str, dict[str, Any]] = {
    "CartPole-v1": CLASSIC_DISCRETE,
    "Acrobot-v1": CLASSIC_DISCRETE,
    "MountainCar-v0": CLASSIC_DISCRETE,
    "Pendulum-v1": CLASSIC_CONTINUOUS,
    "MountainCarContinuous-v0": CLASSIC_CONTINUOUS,
}


def default_config(env_id: str) -> Config:
    """The Config a user gets for `--env env_id` before any other flag."""
    overrides = ENV_DEFAULTS.get(env_id)
    if overrides is None:  # any other gymnax env: pick by its action space
        if env_id not in gymnax.registered_envs:
            return Config(env=env_id)  # validate() reports the unknown id
        env, env_params = gymnax.make(env_id)
        discrete = isinstance(env.action_space(env_params), spaces.Discrete)
        overrides = CLASSIC_DISCRETE if discrete else CLASSIC_CONTINUOUS
    overrides = dict(overrides)
    hparams = HParams(**overrides.pop("hparams", {}))
    return Config(env=env_id, hparams=hparams, **overrides)


# ================================================================================================
# 2. Environment
# ================================================================================================


@struct.dataclass
class EnvState:
    env_state: Any  # the gymnax state, batched over envs
    episode_return: jax.Array  # [N] return of the running episode so far
    episode_length: jax.Array  # [N]


class VecEnv:
    """A gymnax env vmapped over `num_envs`, with three thin, pure additions:
    observations flattened to float32 vectors; continuous actions clipped to the action space's
    bounds (the policy's log-prob stays that of the unclipped sample); and per-env episode return
    and length, reported in `info` at the step an episode ends. gymnax resets automatically and
    puts the observation before the reset in `info["final_observation"]`.
    """

    def __init__(self, env_id: str, num_envs: int):
        self.env, self.env_params = gymnax.make(env_id)
        self.num_envs = num_envs
        action_space = self.env.action_space(self.env_params)
        self.discrete = isinstance(action_space, spaces.Discrete)
        if self.discrete:
            self.action_dim = int(action_space.n)
        else:
            self.action_shape = tuple(action_space.shape)
            self.action_dim = int(np.prod(self.action_shape))
            self.action_low = np.broadcast_to(np.asarray(action_space.low, np.float32), self.action_shape)
            self.action_high = np.broadcast_to(np.asarray(action_space.high, np.float32), self.action_shape)
        obs_shape = self.env.observation_space(self.env_params).shape
        self.obs_dim = int(np.prod(obs_shape))

    def _flat(self, obs):  # [N, *obs_shape] -> [N, obs_dim] float32
        return obs.reshape(self.num_envs, self.obs_dim).astype(jnp.float32)

    def reset(self, key) -> tuple[jax.Array, EnvState]:
        keys = jax.random.split(key, self.num_envs)
        obs, env_state = jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.env_params)
        zeros = jnp.zeros(self.num_envs, jnp.float32)
        return self._flat(obs), EnvState(env_state, zeros, jnp.zeros(self.num_envs, jnp.int32))

    def step(self, key, state: EnvState, action):
        """action: [N] int32 (discrete) or [N, action_dim] float32 (continuous, unclipped)."""
        if not self.discrete:
            action = jnp.clip(action.reshape(self.num_envs, *self.action_shape), self.action_low, self.action_high)
        keys = jax.random.split(key, self.num_envs)
        obs, env_state, reward, terminated, truncated, info = jax.vmap(
            self.env.step, in_axes=(0, 0, 0, None)
        )(keys, state.env_state, action, self.env_params)
        reward = reward.astype(jnp.float32)
        terminated = terminated.astype(bool)
        truncated = truncated.astype(bool)
        done = terminated | truncated
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        info = {
            "final_observation": self._flat(info["final_observation"]),
            "episode_return": episode_return,  # meaningful where done
            "episode_length": episode_length,
        }
        state = EnvState(
            env_state,
            jnp.where(done, 0.0, episode_return),
            jnp.where(done, 0, episode_length),
        )
        return self._flat(obs), state, reward, terminated, truncated, info


# ================================================================================================
# 3. Network and action distributions
# ================================================================================================
# Closed-form distributions instead of distrax: distrax pulls in tfp-nightly and warns at import on
# this jax, and each of these is a few lines that the tests check against scipy.

LOG_2PI = math.log(2.0 * math.pi)


@struct.dataclass
class Categorical:
    logits: jax.Array  # [..., num_actions]

    def sample(self, key):
        return jax.random.categorical(key, self.logits).astype(jnp.int32)

    def mode(self):
        return jnp.argmax(self.logits, axis=-1).astype(jnp.int32)

    def log_prob(self, action):
        log_p = jax.nn.log_softmax(self.logits)
        return jnp.take_along_axis(log_p, action[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self):
        log_p = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


@struct.dataclass
class DiagGaussian:
    mean: jax.Array  # [..., action_dim]
    log_std: jax.Array  # [action_dim], state-independent, broadcast over the batch

    def sample(self, key):
        return self.mean + jnp.exp(self.log_std) * jax.random.normal(key, self.mean.shape)

    def mode(self):
        return self.mean

    def log_prob(self, action):
        z = (action - self.mean) * jnp.exp(-self.log_std)
        return jnp.sum(-0.5 * z**2 - self.log_std - 0.5 * LOG_2PI, axis=-1)

    def entropy(self):
        log_std = jnp.broadcast_to(self.log_std, self.mean.shape)
        return jnp.sum(log_std + 0.5 + 0.5 * LOG_2PI, axis=-1)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs with orthogonal init: sqrt(2) on hidden layers, 0.01 on the
    policy head (near-uniform initial policy), 1.0 on the value head; zero biases."""

    action_dim: int
    discrete: bool
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, obs):  # obs: [B, obs_dim] -> (distribution over [B] actions, values [B])
        activation = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        hidden_init = nn.initializers.orthogonal(math.sqrt(2.0))

        def trunk(x, name):
            for i, width in enumerate(self.hidden_sizes):
                x = activation(nn.Dense(width, kernel_init=hidden_init, name=f"{name}_{i}")(x))
            return x

        policy_out = nn.Dense(self.action_dim, kernel_init=nn.initializers.orthogonal(0.01), name="policy_head")(
            trunk(obs, "actor")
        )
        values = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0), name="value_head")(trunk(obs, "critic"))
        if self.discrete:
            return Categorical(policy_out), values[..., 0]
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        return DiagGaussian(policy_out, log_std), values[..., 0]


# ================================================================================================
# 4. Math: pure functions, each tested alone
# ================================================================================================


def compute_gae(rewards, values, next_values, terminated, dones, gamma, gae_lambda):
    """Generalised advantage estimation (Schulman et al., 2016; PPO paper, Eq. 11-12).

    All arrays are time-major [T, N]. `next_values[t]` is the critic's value of the true next
    state: of the final observation where an episode ended at t, of the next observation otherwise.
    Truncation (a time limit) bootstraps from it; termination does not:
        delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t
        A_t     = delta_t + gamma * lambda * (1 - dones_t) * A_{t+1}
    Returns (advantages, targets = advantages + values), both [T, N].
    """
    not_terminated = 1.0 - terminated.astype(jnp.float32)
    not_done = 1.0 - dones.astype(jnp.float32)
    deltas = rewards + gamma * not_terminated * next_values - values

    def backward(next_advantage, step):
        delta, continues = step
        advantage = delta + gamma * gae_lambda * continues * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(deltas[0]), (deltas, not_done), reverse=True)
    return advantages, advantages + values


def clipped_surrogate(ratio, advantages, clip_eps):
    """Per-sample clipped surrogate objective, to be maximised (PPO paper, Eq. 7)."""
    return jnp.minimum(ratio * advantages, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages)


def value_loss(values, old_values, targets, clip_eps, clip_vloss):
    """0.5 * squared error; with `clip_vloss` the OpenAI-baselines pessimistic clipped form."""
    unclipped = (values - targets) ** 2
    clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
    clipped = jnp.maximum(unclipped, (clipped_values - targets) ** 2)
    return 0.5 * jnp.mean(jnp.where(clip_vloss, clipped, unclipped))


def explained_variance(predictions, targets):
    """1 - Var[targets - predictions] / Var[targets]: 1 is perfect, 0 no better than the mean."""
    return 1.0 - jnp.var(targets - predictions) / jnp.var(targets)


def learning_rate(hparams: HParams, update, num_updates):
    """The learning rate during (0-based) update `update`: linear annealing as in CleanRL."""
    fraction_left = 1.0 - update / num_updates
    return hparams.lr * jnp.where(hparams.anneal_lr, fraction_left, 1.0)


# ================================================================================================
# 5. Training: one jit, one lax.scan over updates
# ================================================================================================


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    env_state: EnvState
    obs: jax.Array  # [N, obs_dim] the observation each env is in now
    key: jax.Array
    update: jax.Array  # updates done so far (int32)


@struct.dataclass
class Transition:  # every field time-major [T, N, ...]
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    terminated: jax.Array
    done: jax.Array
    final_obs: jax.Array  # the true next observation (before any automatic reset)
    episode_return: jax.Array  # return of the episode that ended here (where done)
    episode_length: jax.Array


@struct.dataclass
class Batch:  # flat [B, ...]
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantages: jax.Array
    targets: jax.Array


def make_optimizer(hparams: HParams, steps_per_update: int, num_updates: int):
    """Global-norm clipping, then Adam, then the (annealed) learning rate. Built inside the traced
    train function, so every coefficient here is an HParams leaf."""
    schedule = lambda count: learning_rate(hparams, count // steps_per_update, num_updates)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(hparams.max_grad_norm),
        optax.scale_by_adam(eps=hparams.adam_eps),
        optax.scale_by_learning_rate(schedule),
    )


def collect_rollout(state: TrainState, env: VecEnv, network: ActorCritic, num_steps: int):
    """lax.scan over num_steps of (policy forward, sample, vmapped env step) -> [T, N] Transition."""

    def step(state: TrainState, _):
        key, action_key, step_key = jax.random.split(state.key, 3)
        dist, value = network.apply(state.params, state.obs)
        action = dist.sample(action_key)
        obs, env_state, reward, terminated, truncated, info = env.step(step_key, state.env_state, action)
        transition = Transition(
            obs=state.obs,
            action=action,
            log_prob=dist.log_prob(action),
            value=value,
            reward=reward,
            terminated=terminated,
            done=terminated | truncated,
            final_obs=info["final_observation"],
            episode_return=info["episode_return"],
            episode_length=info["episode_length"],
        )
        return state.replace(obs=obs, env_state=env_state, key=key), transition

    return jax.lax.scan(step, state, None, length=num_steps)


def ppo_loss(params, network: ActorCritic, batch: Batch, hparams: HParams):
    """PPO-Clip loss on one minibatch (PPO paper, Eq. 9, negated for minimisation)."""
    dist, values = network.apply(params, batch.obs)
    log_probs = dist.log_prob(batch.action)
    log_ratio = log_probs - batch.log_prob
    ratio = jnp.exp(log_ratio)
    advantages = batch.advantages
    normalised = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    advantages = jnp.where(hparams.norm_adv, normalised, advantages)

    policy_loss = -jnp.mean(clipped_surrogate(ratio, advantages, hparams.clip_eps))
    v_loss = value_loss(values, batch.value, batch.targets, hparams.clip_eps, hparams.clip_vloss)
    entropy = jnp.mean(dist.entropy())
    total = policy_loss + hparams.vf_coef * v_loss - hparams.ent_coef * entropy
    diagnostics = {
        "policy_loss": policy_loss,
        "value_loss": v_loss,
        "entropy": entropy,
        "approx_kl": jnp.mean((ratio - 1.0) - log_ratio),  # the low-variance k3 estimator
        "clip_frac": jnp.mean((jnp.abs(ratio - 1.0) > hparams.clip_eps).astype(jnp.float32)),
    }
    return total, diagnostics


def minibatch_step(carry, minibatch: Batch, network, tx, hparams):
    params, opt_state = carry
    grads, diagnostics = jax.grad(ppo_loss, has_aux=True)(params, network, minibatch, hparams)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), diagnostics


def shuffle_into_minibatches(key, batch: Batch, num_minibatches: int) -> Batch:
    """[B, ...] -> [M, B/M, ...] in a random order (sampling without replacement)."""
    permutation = jax.random.permutation(key, batch.obs.shape[0])
    return jax.tree.map(lambda x: jnp.take(x, permutation, axis=0).reshape(num_minibatches, -1, *x.shape[1:]), batch)


def epoch_step(carry, key, batch: Batch, config: Config, network, tx, hparams):
    """One pass over the batch: a lax.scan of gradient steps over shuffled minibatches."""
    step = functools.partial(minibatch_step, network=network, tx=tx, hparams=hparams)
    return jax.lax.scan(step, carry, shuffle_into_minibatches(key, batch, config.num_minibatches))


def make_batch(traj: Transition, advantages, targets) -> Batch:
    """Flatten what the update needs from [T, N, ...] to [B, ...] (B = T * N)."""
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    return Batch(
        obs=flat(traj.obs),
        action=flat(traj.action),
        log_prob=flat(traj.log_prob),
        value=flat(traj.value),
        advantages=flat(advantages),
        targets=flat(targets),
    )


def update_step(state: TrainState, _, config: Config, env: VecEnv, network, tx, hparams: HParams):
    """One PPO iteration: rollout -> GAE -> update_epochs x num_minibatches gradient steps."""
    state, traj = collect_rollout(state, env, network, config.num_steps)

    # The critic's value of the true next state of every step, in one batched pass. Where no
    # episode ended, final_obs is simply the next observation.
    _, next_values = network.apply(state.params, traj.final_obs)  # [T, N]
    advantages, targets = compute_gae(
        traj.reward, traj.value, next_values, traj.terminated, traj.done, hparams.gamma, hparams.gae_lambda
    )
    batch = make_batch(traj, advantages, targets)

    key, epoch_key = jax.random.split(state.key)
    epoch = functools.partial(epoch_step, batch=batch, config=config, network=network, tx=tx, hparams=hparams)
    (params, opt_state), diagnostics = jax.lax.scan(
        epoch, (state.params, state.opt_state), jax.random.split(epoch_key, config.update_epochs)
    )

    ended = traj.done.astype(jnp.float32)
    metrics = {  # one scalar each; NaN return/length when no episode ended in this update
        "episode_return": jnp.sum(ended * traj.episode_return) / jnp.sum(ended),
        "episode_length": jnp.sum(ended * traj.episode_length) / jnp.sum(ended),
        "episodes": jnp.sum(ended),
        **{name: jnp.mean(value) for name, value in diagnostics.items()},  # mean over epochs x minibatches
        "explained_variance": explained_variance(traj.value, targets),
        "learning_rate": learning_rate(hparams, state.update, config.num_updates),
    }
    state = state.replace(params=params, opt_state=opt_state, key=key, update=state.update + 1)
    return state, metrics


def make_network(config: Config, env: VecEnv) -> ActorCritic:
    return ActorCritic(env.action_dim, env.discrete, tuple(config.hidden_sizes), config.activation)


def init_train_state(key, env: VecEnv, network: ActorCritic, tx) -> TrainState:
    key, init_key, reset_key = jax.random.split(key, 3)
    obs, env_state = env.reset(reset_key)
    params = network.init(init_key, obs)
    return TrainState(params, tx.init(params), env_state, obs, key, jnp.zeros((), jnp.int32))


def make_train(config: Config):
    """Returns the pure function train(key, hparams) -> (TrainState, metrics).

    Only `config`'s static fields shape the program; `config.hparams` is not read here. The
    metrics are a dict of float32 arrays of shape [num_updates].
    """
    env = VecEnv(config.env, config.num_envs)
    network = make_network(config, env)

    def train(key, hparams: HParams):
        tx = make_optimizer(hparams, config.update_epochs * config.num_minibatches, config.num_updates)
        state = init_train_state(key, env, network, tx)
        step = functools.partial(update_step, config=config, env=env, network=network, tx=tx, hparams=hparams)
        return jax.lax.scan(step, state, None, length=config.num_updates)

    return train


# ================================================================================================
# 6. Running: validation before compiling, then one compile and one run
# ================================================================================================


class ConfigError(ValueError):
    """A bad flag: the message names the flag, the value and the fix."""


def validate(config: Config) -> None:
    """Raise ConfigError for the first invalid setting, before anything is compiled."""
    if config.env not in gymnax.registered_envs:
        close = difflib.get_close_matches(config.env, gymnax.registered_envs, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "see gymnax.registered_envs"
        raise ConfigError(f"--env {config.env!r} is not a gymnax environment: {hint}")
    for flag in ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches", "num_seeds"):
        value = getattr(config, flag)
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be a positive integer")
    if not config.hidden_sizes or min(config.hidden_sizes) < 1:
        raise ConfigError(f"--hidden-sizes {config.hidden_sizes}: give one or more positive widths, e.g. 64 64")
    if config.table_rows < 0:
        raise ConfigError(f"--table-rows {config.table_rows}: must be >= 0")
    if config.batch_size % config.num_minibatches:
        raise ConfigError(
            f"--num-minibatches {config.num_minibatches} does not divide the batch "
            f"(--num-envs {config.num_envs} x --num-steps {config.num_steps} = {config.batch_size})"
        )
    if config.minibatch_size < 2:
        raise ConfigError(f"--num-minibatches {config.num_minibatches}: minibatches of {config.minibatch_size} "
                          "sample(s) cannot be normalised; use fewer minibatches")
    if config.total_timesteps < config.batch_size:
        raise ConfigError(f"--total-timesteps {config.total_timesteps} is less than one batch "
                          f"({config.batch_size} = --num-envs x --num-steps)")
    h = config.hparams
    if not h.lr > 0:
        raise ConfigError(f"--lr {h.lr}: the learning rate must be > 0")
    for flag in ("gamma", "gae_lambda"):
        if not 0.0 <= getattr(h, flag) <= 1.0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(h, flag)}: must be in [0, 1]")
    for flag in ("clip_eps", "ent_coef", "vf_coef", "adam_eps"):
        if not getattr(h, flag) >= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(h, flag)}: must be >= 0")
    if not h.max_grad_norm > 0:
        raise ConfigError(f"--max-grad-norm {h.max_grad_norm}: must be > 0 (inf turns clipping off)")
    if config.run_dir is not None and os.path.exists(config.run_dir):
        raise ConfigError(f"--run-dir {config.run_dir} already exists: pick a new directory (nothing is overwritten)")


@dataclasses.dataclass
class RunResult:
    state: TrainState  # leaves with a leading [num_seeds] axis
    metrics: dict[str, np.ndarray]  # name -> [num_seeds, num_updates]; includes env_steps
    lower_seconds: float
    compile_seconds: float
    run_seconds: float

    @property
    def steps_per_second(self) -> float:
        return float(self.metrics["env_steps"][0, -1]) * self.metrics["env_steps"].shape[0] / self.run_seconds


def seed_keys(config: Config):
    return jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)


def run(config: Config) -> RunResult:
    """Compile and run config.num_seeds seeds of the config as one program."""
    train = jax.jit(jax.vmap(make_train(config), in_axes=(0, None)))
    keys = seed_keys(config)
    start = time.perf_counter()
    lowered = train.lower(keys, config.hparams)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(keys, config.hparams))
    finished_at = time.perf_counter()
    metrics = {name: np.asarray(value) for name, value in metrics.items()}
    updates = np.arange(1, config.num_updates + 1, dtype=np.int64)  # host-side: no int32 overflow
    metrics["env_steps"] = np.broadcast_to(updates * config.batch_size, (config.num_seeds, config.num_updates))
    return RunResult(state, metrics, lowered_at - start, compiled_at - lowered_at, finished_at - compiled_at)


# ================================================================================================
# 7. Outputs
# ================================================================================================

TABLE_COLUMNS = (  # (metric, header, format)
    ("env_steps", "steps", "{:.0f}"),
    ("episode_return", "return", "{:.1f}"),
    ("episode_length", "length", "{:.1f}"),
    ("policy_loss", "pi_loss", "{:.4f}"),
    ("value_loss", "v_loss", "{:.4g}"),
    ("entropy", "entropy", "{:.3f}"),
    ("approx_kl", "kl", "{:.5f}"),
    ("clip_frac", "clip", "{:.3f}"),
    ("explained_variance", "expl_var", "{:.3f}"),
    ("learning_rate", "lr", "{:.2e}"),
)


def final_return(metrics: dict[str, np.ndarray], fraction: float = 0.1) -> np.ndarray:
    """Per seed: mean return of the episodes that ended in the last `fraction` of updates."""
    num_updates = metrics["episode_return"].shape[1]
    tail = slice(num_updates - max(1, int(num_updates * fraction)), None)
    returns, counts = metrics["episode_return"][:, tail], metrics["episodes"][:, tail]
    ended = counts > 0
    return np.sum(np.where(ended, returns * counts, 0.0), axis=1) / np.sum(counts, axis=1)


def format_table(metrics: dict[str, np.ndarray], rows: int) -> str:
    """Every few updates, each metric averaged over seeds (NaN-aware; '-' where no episode ended)."""
    num_updates = metrics["episode_return"].shape[1]
    picks = sorted(set(np.linspace(0, num_updates - 1, min(rows, num_updates)).round().astype(int)))
    header = ["update"] + [title for _, title, _ in TABLE_COLUMNS]
    lines = [header]
    for i in picks:
        line = [str(i + 1)]
        for name, _, fmt in TABLE_COLUMNS:
            column = metrics[name][:, i]
            value = np.nanmean(column) if np.any(np.isfinite(column)) else float("nan")
            line.append("-" if np.isnan(value) else fmt.format(value))
        lines.append(line)
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def new_run_dir(config: Config) -> str:
    """Create and return a fresh run directory; never reuse an existing one."""
    if config.run_dir is not None:
        os.makedirs(config.run_dir)  # raises if it appeared since validate(): nothing is overwritten
        return config.run_dir
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", f"{config.env}-{stamp}")
    path, suffix = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            suffix += 1
            path = f"{base}-{suffix}"


def write_metrics_csv(path: str, metrics: dict[str, np.ndarray]) -> None:
    names = ["env_steps"] + sorted(name for name in metrics if name != "env_steps")
    num_seeds, num_updates = metrics["env_steps"].shape
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "update"] + names)
        for seed in range(num_seeds):
            for update in range(num_updates):
                row = [metrics[name][seed, update] for name in names]
                writer.writerow([seed, update + 1] + [f"{v:.8g}" if isinstance(v, float | np.floating) else v for v in row])


def plot_curve(path: str, metrics: dict[str, np.ndarray], title: str) -> None:
    """Return vs env steps: mean over seeds, shaded min..max spread; updates where no episode
    ended in any seed are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = metrics["env_steps"][0]
    returns = metrics["episode_return"]
    seen = np.any(np.isfinite(returns), axis=0)
    fig, ax = plt.subplots(figsize=(7, 4))
    if np.any(seen):
        mean = np.nanmean(returns[:, seen], axis=0)
        ax.plot(steps[seen], mean, label=f"mean of {returns.shape[0]} seed(s)")
        if returns.shape[0] > 1:
            ax.fill_between(steps[seen], np.nanmin(returns[:, seen], 0), np.nanmax(returns[:, seen], 0), alpha=0.25,
                            label="min-max over seeds")
    ax.set(xlabel="environment steps (per seed)", ylabel="episode return", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(run_dir: str, config: Config, result: RunResult) -> None:
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(config), f, indent=2)
    finals = final_return(result.metrics)
    summary = {
        "final_return_per_seed": [float(x) for x in finals],
        "final_return_mean": float(np.nanmean(finals)),
        "env_steps_per_seed": int(result.metrics["env_steps"][0, -1]),
        "num_updates": config.num_updates,
        "lower_seconds": result.lower_seconds,
        "compile_seconds": result.compile_seconds,
        "run_seconds": result.run_seconds,
        "env_steps_per_second": result.steps_per_second,
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    write_metrics_csv(os.path.join(run_dir, "metrics.csv"), result.metrics)
    plot_curve(os.path.join(run_dir, "curve.png"), result.metrics, f"PPO on {config.env}")
    with open(os.path.join(run_dir, "params.msgpack"), "wb") as f:  # leading [num_seeds] axis
        f.write(serialization.to_bytes(jax.device_get(result.state.params)))


# ================================================================================================
# 8. CLI
# ================================================================================================


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Two passes: read --env first, then let tyro parse everything with that env's defaults (so
    `--env Pendulum-v1 --help` shows Pendulum's defaults)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=Config.env)
    env_id = pre.parse_known_args(argv)[0].env
    return tyro.cli(Config, args=argv, default=default_config(env_id), description=__doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> RunResult:
    config = parse_config(argv)
    try:
        validate(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    run_dir = new_run_dir(config)
    print(f"ppo_jax: {config.env}, {config.num_seeds} seed(s) x {config.num_updates} updates x "
          f"{config.batch_size} steps ({config.num_envs} envs x {config.num_steps}) on {jax.devices()[0]}")
    result = run(config)
    write_outputs(run_dir, config, result)
    if config.table_rows:
        print(format_table(result.metrics, config.table_rows))
    finals = final_return(result.metrics)
    print(f"final return (last 10% of updates): {np.nanmean(finals):.1f}"
          + (f"  per seed: {' '.join(f'{x:.1f}' for x in finals)}" if len(finals) > 1 else ""))
    print(f"compile {result.lower_seconds + result.compile_seconds:.1f} s (lower {result.lower_seconds:.1f} + "
          f"compile {result.compile_seconds:.1f}), run {result.run_seconds:.1f} s, "
          f"{result.steps_per_second:,.0f} env steps/s")
    print(f"outputs: {run_dir}/")
    return result


if __name__ == "__main__":
    main()
