"""ppo_jax: Proximal Policy Optimization as one XLA program.

PPO (Schulman et al., 2017, arXiv:1707.06347) on gymnax, Brax, EnvPool's MuJoCo and Atari, and more: the clipped
surrogate, PPO-Penalty (adaptive KL) and a KL leash to a frozen reference policy, every implementation
detail a switch; TRPO, vanilla PG and A2C beside it (--algo), as the paper compared them. Env stepping,
GAE and the epochs of minibatch updates run in one jax.jit; seeds and whole hyperparameter grids are
vmapped inside that one program.

    python ppo_jax.py                                   # CartPole-v1, the classic config
    python ppo_jax.py --sweep sweeps/clip_vs_kl.toml    # the PPO paper's Table 1, one compile per env
    python ppo_jax.py --env Acrobot-v1 --help           # every flag, with Acrobot's defaults
    ppo_jax.run(ppo_jax.default_config("Pendulum-v1", num_seeds=4)).policy(0).act(obs)   # from Python
    ppo_jax.load_run(RUN_DIR).act(obs)                  # a saved run's policy; make_train: vmap your own

Where to hack (the five rules a change must keep are in HParams' docstring):
    surrogate objective      policy_objective       the loss (Eq. 9)       ppo_loss
    advantages, returns      estimate_advantages (GAE: compute_gae; critic-free: group_advantages)
    value loss               value_loss             KL leash               kl_estimate, process_rollout
    PPO-Penalty's beta       adaptive_kl_coef       the leash's controller adaptive_ref_kl_coef
    network and its outputs  ActorCritic -> NetworkOutput (dist, value, hidden, extras: read by name)
    a distribution           a class as Categorical, DiagGaussian, TanhGaussian, Beta; ActorCritic.distribution
    has a critic, recurrent  Config.has_critic, Config.is_recurrent; the critic's parameters: is_critic
    an architecture switch   a Config field (static: shapes, the params tree) -> make_network -> ActorCritic
    rollout, reward shaping  step_envs, process_rollout; new randomness: fold_in (rollout_randomness)
    epochs, minibatches      update_step (per-update HParams schedules), epoch_step, epoch_targets (a hook
                             per epoch), minibatch_step; static choices reach them all as Setup;
                             a pass split over slices and devices: Parts (section 10: speed)
    optimizer, lr schedule   make_optimizer (optax; groups: actor_critic_labels), learning_rate, build_optimizer
    TRPO, VPG, A2C (--algo)  trpo_step, vpg_step (policy_then_critic); A2C is PPO's loss, one step; ALGO_DEFAULTS
    carried across updates   a field of TrainState, its initial value in init_train_state (old checkpoints too)
    environments             VecEnv; adapters: BraxEnv, PlaygroundEnv, XMiniGridEnv, JumanjiEnv, CraftaxEnv,
                             EnvPoolEnv (host-stepped); ToyRLHF (RLHF in miniature; its ground truth: section 8)
    a language model         --torso transformer: Transformer, ActorCritic.language_model; its stages (--lm-stage:
                             pretrain, sft, reward, dpo, ipo) and the exact optima by listing responses: section 8
    metrics                  update_step's `metrics` (every key reaches metrics.csv and the trackers)

Sections: 1 HParams, Config; 2 the PPO (network, rollout, advantages, loss, update, make_train); 3 envs;
4 running; 5 sweeps (population-based training: Pbt, Population; the copy: lower_batch's copy_agents);
6 outputs; 7 evaluation; 8 RLHF's ground truth, the loop with a language model; 9 CLI; 10 speed (docs/speed.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import dataclasses
import datetime
import difflib
import errno
import functools
import gc
import hashlib
import importlib.util
import io
import json
import math
import os
import re
import signal
import sys
import textwrap
import threading
import time
import tomllib
import traceback
import types
import typing
import warnings
from typing import Annotated, Any, Callable, Literal, NamedTuple, Sequence

import jax

# Platform set-up: each line takes effect only before the CPU backend starts, which importing gymnax
# does. A run is one call, so async dispatch buys nothing (and its thread pool sometimes never
# returned on a 2-core machine).
jax.config.update("jax_cpu_enable_async_dispatch", False)


def start_distributed(argv: Sequence[str]) -> None:
    """--distributed: JAX's multi-process runtime must start before any backend, so its flags are
    read here. main() reports a failure in one line; so does a watchdog when the processes do not
    meet in time (the runtime would abort with a stack trace)."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--distributed", action="store_true")
    early.add_argument("--coordinator-address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    for name in ("--num-processes", "--process-id", "--distributed-timeout"):
        early.add_argument(name, type=int)
    watchdog = None
    try:
        options = early.parse_known_args(["--" + a[2:].replace("_", "-") if a[:2] == "--" else a for a in argv])[0]
        address, timeout = options.coordinator_address, max(1, options.distributed_timeout or 300)
        if not options.distributed or "--no-distributed" in argv:
            return
        if address and not (address.rpartition(":")[2].isdigit() and 0 < int(address.rpartition(":")[2]) < 65536):
            raise ValueError(f"--coordinator-address (or $JAX_COORDINATOR_ADDRESS) {address}: give HOST:PORT")

        def give_up():
            print(f"error: --distributed: the processes did not meet at {address or 'the detected coordinator'} "
                  f"within {timeout} s (--distributed-timeout): start all --num-processes, each with process 0's "
                  "HOST:PORT as --coordinator-address", file=sys.stderr, flush=True)
            os._exit(2)

        watchdog = threading.Timer(timeout, give_up)
        watchdog.start()
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives over TCP
        jax.distributed.initialize(address, options.num_processes, options.process_id,
                                   initialization_timeout=timeout + 60)  # the watchdog speaks first
    except (Exception, SystemExit) as error:  # noqa: BLE001 (argparse's errors too): main() reports it
        DISTRIBUTED_FAILURE.append(error)
    finally:
        if watchdog is not None:
            watchdog.cancel()


DISTRIBUTED_FAILURE: list[Exception] = []
if __name__ == "__main__":  # when imported, the importer starts the runtime (jax.distributed.initialize)
    start_distributed(sys.argv[1:])


def usable_cores() -> int:  # the cores this process may run on
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# One CPU device per core (unless the user chose a count): a batch of agents is sharded over the
# cores as over GPUs (docs/speed.md). Imported after JAX started, ppo_jax keeps the devices there are.
if "JAX_NUM_CPU_DEVICES" not in os.environ and "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    with contextlib.suppress(RuntimeError):  # the backends are already up
        jax.config.update("jax_num_cpu_devices", usable_cores())


class DeferredModule(types.ModuleType):  # a stand-in that imports the real module when first used
    def __getattr__(self, attr):
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


# Start-up time: gymnax's Pong imports seaborn (for rendering only), which imports scipy.stats and
# pandas; it gets a stand-in, and `import seaborn` after gymnax's import is the real module.
_stand_in = "seaborn" not in sys.modules and sys.modules.setdefault("seaborn", DeferredModule("seaborn"))
import gymnax  # noqa: E402

if _stand_in and sys.modules.get("seaborn") is _stand_in:
    del sys.modules["seaborn"]

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import flax.traverse_util  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tyro  # noqa: E402
from flax import serialization, struct  # noqa: E402
from gymnax.environments import spaces  # noqa: E402
from gymnax.environments.environment import EnvParams as GymnaxEnvParams  # noqa: E402
from gymnax.environments.environment import EnvState as GymnaxEnvState  # noqa: E402
from gymnax.environments.environment import Environment as GymnaxEnvironment  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402


# ================================================================================================
# 1. Hyperparameters and configuration
# ================================================================================================


class ConfigError(ValueError):
    """A bad flag: the message names the flag, the value and the fix."""


BOOLEAN_WORDS = {"true": True, "1": True, "on": True, "yes": True, "false": False, "0": False, "off": False, "no": False}


def parse_bool(text: str, where: str) -> bool:
    """A yes/no written as text (--sweep-set, --env-params): a word of BOOLEAN_WORDS, in any case;
    any other word is refused, never read as false."""
    try:
        return BOOLEAN_WORDS[text.strip().lower()]
    except KeyError:
        raise ConfigError(f"{where}: {text.strip()!r} is not a yes/no: give true or false (or 1/0, on/off, "
                          "yes/no)") from None


@struct.dataclass
class HParams:
    """Hyperparameters that are traced, not compiled in: changing one never recompiles.

    Because this is a pytree, `jax.vmap(train, in_axes=(0, 0))` over stacked HParams runs a whole
    sweep as one program. Booleans are switches: they become 0/1 arrays inside the program and
    select a branch with `jnp.where`, so they can be swept too.

    Five rules for changing the PPO:
    1. HParams are traced: no Python `if` on a field; switch with `jnp.where` or a coefficient. What
       changes shapes or the params tree (layers, widths, action spaces) is a Config field instead.
    2. Every loss term and diagnostic is a mean over samples: a minibatch may be computed in slices
       (--slices N) and over devices (--env-devices), and the parts' gradients are averaged. A
       per-minibatch statistic (e.g. normalising advantages) goes in epoch_step, not in ppo_loss
       (test_slices_give_the_whole_minibatch_gradient_step fails).
    3. A statistic over the whole batch inside the update goes through Parts.device_mean / device_sum
       (an agent's envs may be sharded over devices, each holding its part of the batch).
    4. A new field defaults to the old behaviour, so old checkpoints and sweep specs still run; so
       does a new TrainState field's initial value (an older checkpoint gets it from there).
    5. Both branches of a `jnp.where` are finite for every HParams value: the unselected branch is
       differentiated too, and its 0 * inf is NaN. `x / (2 * hparams.clip_eps)` in a branch that
       --clip-eps 0 never selects still turns every gradient NaN; divide by a guarded value,
       jnp.where(switch, hparams.clip_eps, 1.0).
    """

    # --- the objective
    clip_eps: float = 0.2
    """Clipping epsilon of the surrogate objective (PPO paper, Eq. 7); 0 or inf: no clipping (the
    paper's Table 1 baseline). Also the value-clip range of --clip-vloss."""
    clip_eps_high: float = 0.0
    """Decoupled clipping, "clip-higher" (DAPO, Yu et al. 2025, arXiv:2503.14476, Sec. 3.1): the
    band's upper edge, clip(r, 1 - clip_eps, 1 + clip_eps_high), so that unlikely actions with a
    positive advantage can grow further; 0: the same as --clip-eps."""
    dual_clip: float = 0.0
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729, Eq. 5): where the advantage is negative, the
    objective is bounded below by dual_clip * A, so that a huge ratio cannot dominate the batch;
    0: off, else > 1 (the paper's c = 3)."""
    kl_coef: float = 0.0
    """PPO-Penalty: initial beta of the loss term beta * KL[pi_old(.|s), pi(.|s)], exact closed-form
    KL (PPO paper, Sec. 4, Eq. 8); 0: no penalty."""
    kl_target: float = 0.0
    """PPO-Penalty: d_targ for adapting beta after each update (halve if KL < d_targ/1.5, double if
    KL > 1.5 d_targ; PPO paper, Sec. 4); 0: beta stays fixed."""
    ref_kl_coef: float = 0.0
    """KL leash to a frozen pi_ref (the initial policy, or --ref-params): beta of the penalty beta * k,
    k an estimate of KL[pi || pi_ref] (--ref-kl-estimator; default k1 = log pi(a|s) - log pi_ref(a|s)),
    subtracted from each reward before GAE (InstructGPT, Eq. 2) or added to the loss (--ref-kl-in);
    0: off."""
    ref_kl_target: float = 0.0
    """The leash's adaptive controller (Ziegler et al. 2019, arXiv:1909.08593, Sec. 2.2): after each
    update, e = clip(KL_seq / ref_kl_target - 1, -0.2, 0.2) and beta <- beta * (1 + e * n / ref_kl_horizon),
    KL_seq the exact KL[pi || pi_ref] per episode (ref_kl_seq) and n the episodes of the update; it
    starts from --ref-kl-coef. Nats per episode; 0: beta stays fixed. Not PPO-Penalty's --kl-target,
    which halves or doubles its beta on the KL between successive policies."""
    ref_kl_horizon: float = 10000.0
    """The controller's horizon H in episodes (--ref-kl-target): how slowly beta moves."""
    target_kl: float = 0.0
    """Skip the update's remaining gradient steps once a minibatch's approx KL exceeds this; 0: never."""
    max_kl: float = 0.01
    """--algo trpo: the trust region's delta, the bound on the mean KL[pi_old || pi] of each step
    (TRPO paper, Schulman et al. 2015, Eq. 12)."""
    cg_damping: float = 0.1
    """--algo trpo: lambda of the damped Fisher matrix F + lambda I that conjugate gradient inverts."""
    ent_coef: float = 0.01
    """Entropy bonus coefficient c2 (PPO paper, Eq. 9)."""
    vf_coef: float = 0.5
    """Value loss coefficient c1 (PPO paper, Eq. 9)."""
    clip_vloss: bool = True
    """Clip the value update around the old value prediction (OpenAI baselines form)."""
    # --- returns and advantages
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE lambda (GAE paper; PPO paper, Eq. 11-12)."""
    bootstrap_truncation: bool = True
    """Bootstrap from the critic's value of the final observation when a time limit truncates an
    episode (off: treat truncation as termination, as most PPO code does)."""
    norm_adv: bool = True
    """Normalise advantages to zero mean and unit std within each minibatch."""
    # --- optimisation
    lr: float = 2.5e-4
    """Adam learning rate (the starting value when --anneal-lr is on)."""
    anneal_lr: bool = True
    """Linearly anneal the learning rate from --lr towards 0 over the run (one step per update)."""
    anneal_clip: bool = False
    """Linearly anneal --clip-eps towards 0 over the run, as the learning rate (the PPO paper's Atari
    runs, Table 5: epsilon = 0.1 alpha, alpha falling from 1 to 0)."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this value (inf: no clipping)."""
    adam_eps: float = 1e-5
    """Adam epsilon (--optimizer rmsprop: RMSprop's)."""
    ortho_init: bool = True
    """Orthogonal init (sqrt 2 hidden, 0.01 policy head, 1 value head); off: flax's default (LeCun normal)."""
    log_std_init: float = 0.0
    """Continuous actions: the initial log std of the Gaussian policy (state-independent, learned);
    0: std 1 (CleanRL, baselines); -0.5: Spinning Up's. Discrete actions: no effect."""
    # --- observation and reward processing
    norm_obs: bool = False
    """Normalise observations by a running mean/variance over all envs (kept with the params)."""
    clip_obs: float = 10.0
    """With --norm-obs, clip normalised observations to [-clip_obs, clip_obs]."""
    scale_reward: bool = False
    """Divide rewards by the running std of the discounted return (gym's NormalizeReward)."""
    clip_reward: float = math.inf
    """Clip the (scaled) reward to [-clip_reward, clip_reward] (inf: no clipping)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that fixes shapes and the compiled program, plus the default HParams point."""

    env: str = "CartPole-v1"
    """gymnax environment id (e.g. CartPole-v1, Pendulum-v1, Acrobot-v1, MountainCarContinuous-v0,
    Breakout-MinAtar, MemoryChain-bsuite), brax:NAME (brax:ant, brax:hopper, brax:inverted_pendulum,
    ...), playground:NAME (MuJoCo Playground: playground:CartpoleBalance, ...), xminigrid:NAME,
    jumanji:NAME, craftax:NAME, envpool:NAME (the real MuJoCo and the ALE: envpool:Hopper-v4,
    envpool:Breakout-v5, ...; one device, one process) (each suite needs its requirements-*.txt; the
    prefix alone lists its envs), or ToyRLHF-v0 (RLHF in miniature: --env-params mode=fluency|gold|proxy|learned vocab length seed
    n_labels reward_model). The defaults shown by --help are that env's defaults."""
    env_params: tuple[str, ...] = ()
    """Override the env's gymnax EnvParams, e.g. --env-params gravity=12.0 max_steps_in_episode=200
    (Brax: max_steps_in_episode, default 1000, and backend=generalized|positional|spring|mjx; EnvPool:
    any field of its config, e.g. episodic_life=false reward_clip=false noop_max=0)."""
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
    algo: Literal["ppo", "trpo", "vpg", "a2c"] = "ppo"
    """The policy's update, on the same rollout, advantages and critic (the PPO paper's Figure 3 compares
    them). ppo: the clipped surrogate, epochs of minibatches. trpo (Schulman et al. 2015): per batch, one
    natural-gradient step on the surrogate, its size set by --max-kl and a backtracking line search
    (conjugate gradient on Fisher-vector products: --cg-iterations, --cg-damping), and the critic fitted
    apart by the epochs of minibatches. vpg: per batch, one Adam step of the policy gradient whose step
    size follows the KL between successive policies towards --kl-target (the PPO paper's "vanilla PG,
    adaptive"), the critic as trpo's. a2c (Mnih et al. 2016, synchronous): one RMSprop step on the policy
    gradient and the value loss per short rollout: PPO's loss at ratio 1, one epoch of one minibatch.
    Each brings its own defaults over the env's (ALGO_DEFAULTS; --algo X --help shows them)."""
    cg_iterations: int = 10
    """--algo trpo: conjugate gradient's iterations (a fixed number, so the step stays in the program)."""
    line_search_steps: int = 10
    """--algo trpo: the backtracking line search's candidates, the full step times 1, 1/2, 1/4, ...: the
    first that improves the surrogate within --max-kl is taken, and none if none does."""
    optimizer: Literal["adam", "rmsprop"] = "adam"
    """The optimizer's rule (make_optimizer): adam, or rmsprop (decay 0.99, epsilon outside the root, as
    the A2C papers' and PyTorch's; --algo a2c's default); --adam-eps is its epsilon either way."""
    adv_estimator: Literal["gae", "grpo", "rloo", "dr_grpo"] = "gae"
    """gae: GAE with a learned critic. The others are critic-free (no critic is built or trained) and
    score whole episodes against the other episodes of their group (--group-size), every step of an
    episode getting its episode's advantage: grpo (Shao et al. 2024, arXiv:2402.03300, Sec. 4.1)
    (R - mean) / std; rloo (Ahmadian et al. 2024, arXiv:2402.14740) R - the mean of the others;
    dr_grpo (Liu et al. 2025, arXiv:2503.20783) R - mean. R is the episode's undiscounted sum of
    (processed) rewards. Needs an env whose episodes all last the same number of steps, which must
    divide --num-steps (Pendulum-v1, Catch-bsuite, DeepSea-bsuite, ...: see FIXED_EPISODE_LENGTH)."""
    group_size: int = 0
    """Critic-free estimators: consecutive groups of this many envs, whose episodes in the same rollout
    slot form a group (0: all --num-envs envs are one group)."""
    slices: int = 1
    """Compute each minibatch's gradient as the mean of the gradients of this many equal slices of
    it, and the next-value and KL passes over the whole batch in as many slices, each slice its own
    piece of the program: the same results up to float rounding, faster on some CPUs for minibatches
    of many thousand samples (see over_slices and docs/speed.md). 1: no slicing; 0: auto (on CPU,
    one slice per SLICE_SAMPLES samples of a minibatch, at most MAX_SLICES; on accelerators 1).
    Feedforward networks only."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Widths of the hidden layers of the actor and of the critic."""
    activation: Literal["tanh", "relu"] = "tanh"
    """Hidden-layer activation."""
    shared_trunk: bool = False
    """One MLP trunk feeding both the policy and the value head (default: separate actor and critic)."""
    torso: Literal["auto", "mlp", "cnn", "nature", "transformer"] = "auto"
    """The network's first layers. cnn: a 3x3 convolution, 16 filters, ReLU, over image observations
    (H x W x C, e.g. MinAtar's 10 x 10 x C) or a Jumanji grid (its other fields beside the conv's
    features), flattened and shared by actor and critic (the PPO paper's Atari setup), then the
    --hidden-sizes layers; nature: the Nature DQN's three convolutions (Mnih et al. 2015: 32 8x8 /4,
    64 4x4 /2, 64 3x3 /1, ReLU), as the PPO paper's Atari network, for images of 36 x 36 and more;
    mlp: only the --hidden-sizes layers, on the flattened observation; transformer (ToyRLHF-v0): a
    causal transformer language model over the response so far (--transformer), its last position's
    features straight into the policy head (the next token's logits) and the value head (--shared-trunk:
    on the same trunk, InstructGPT's; else a critic transformer of its own); auto: nature for EnvPool's
    Atari, cnn for other image observations and Snake's grid, mlp otherwise."""
    transformer: tuple[int, int, int] = (2, 4, 64)
    """--torso transformer: layers, attention heads, width (GPT-2's block: pre-LayerNorm, causal
    self-attention, a 4x GELU MLP; learned token and position embeddings; heads must divide width)."""
    recurrent: Literal["none", "gru"] = "none"
    """A memory. gru: a GRU of --recurrent-size units between the torso and the --hidden-sizes
    layers, shared by actor and critic, its state reset to zero where an episode begins. The rollout
    keeps each env's state, and minibatches are whole env sequences (--num-minibatches must divide
    --num-envs), replayed from the state the rollout started with."""
    recurrent_size: int = 128
    """Units of the --recurrent GRU."""
    action_dist: Literal["gaussian", "tanh_gaussian", "beta"] = "gaussian"
    """Continuous actions' policy. gaussian: a diagonal Gaussian, its sample clipped to the action
    bounds by the env (the PPO paper's); tanh_gaussian: the Gaussian squashed onto the bounds by
    tanh, log-prob with the change of variables (Brax's and MuJoCo Playground's PPO); beta: a Beta
    per dimension, scaled onto the bounds (Chou et al. 2017). The last two need finite bounds."""
    state_std: bool = False
    """The Gaussians' std from a head of its own, softplus(head) + 0.001 (gymnax-blines', Brax's),
    instead of one learned parameter per action dimension, the same in every state (the PPO paper's).
    --log-std-init sets its initial value either way."""
    init_params: str | None = None
    """Start from the policy (params and observation statistics) in this params.msgpack."""
    ref_params: str | None = None
    """The frozen reference policy of --ref-kl-coef, from this params.msgpack (default: the initial policy)."""
    params_index: int = 0
    """Which seed of a multi-seed params.msgpack --init-params and --ref-params load."""
    lm_stage: Literal["none", "pretrain", "sft", "reward", "dpo", "ipo"] = "none"
    """ToyRLHF-v0 with --torso transformer: instead of PPO, one stage of the language-model loop
    (README, "The loop with a language model"), its data drawn by --seed: pretrain (maximum likelihood
    on --lm-data responses of the language B), sft (fine-tuned on the --lm-data best of 10x as many of
    B's by gold), reward (a Bradley-Terry reward model, its scalar the value head after the last token,
    on --lm-data pairs sampled from --ref-params labelled by gold), dpo / ipo (Rafailov et al. 2023;
    Azar et al. 2023: the policy from --init-params on the same pairs, reference --ref-params, one per
    --lm-betas x --num-seeds in one program). Each writes params.msgpack (--init-params, --ref-params and
    reward_model= read it), metrics.csv and lm.png."""
    lm_steps: int = 2000
    """--lm-stage: gradient steps (Adam at --lr, clipped at --max-grad-norm, the lr annealed by --anneal-lr)."""
    lm_batch_size: int = 64
    """--lm-stage: sequences (pairs, for reward, dpo and ipo) per gradient step."""
    lm_data: int = 4096
    """--lm-stage: the training set's size (sequences or pairs); a held-out set of 1024 is drawn beside it."""
    label_scale: float = 4.0
    """--lm-stage reward, dpo, ipo: the pairs' labels are drawn from gold's Bradley-Terry model at this scale,
    P(y_1 preferred) = sigmoid(label_scale (gold(y_1) - gold(y_2))) (gold: standard deviation 1 under B), so
    DPO's exact optimum is pi*_beta of label_scale x gold."""
    label_noise: float = 0.0
    """--lm-stage reward, dpo, ipo: the fraction of the labels then flipped at random."""
    lm_betas: tuple[float, ...] = (0.1,)
    """--lm-stage dpo, ipo: the KL coefficients beta trained side by side (each > 0)."""
    ref_kl_estimator: Literal["k1", "k2", "k3", "full"] = "k1"
    """The KL leash's estimate of KL[pi || pi_ref] at each sampled action (Schulman 2020, "Approximating
    KL divergence"), with log rho = log pi_ref(a|s) - log pi(a|s): k1 = -log rho, k2 = (log rho)^2 / 2,
    k3 = rho - 1 - log rho; full: the exact KL over the action distribution. Which combinations with
    --ref-kl-in give an unbiased gradient: README, "PPO's descendants"."""
    ref_kl_in: Literal["reward", "loss"] = "reward"
    """Where the leash acts: reward (a per-step penalty before the advantages, InstructGPT) or loss
    (the term --ref-kl-coef * mean(k) of the loss, differentiated through pi, as GRPO places it)."""
    seed: int = 0
    """Base random seed; seed i of --num-seeds uses key i of split(PRNGKey(seed), num_seeds)."""
    num_seeds: int = 1
    """Independent runs vmapped in one program."""
    run_dir: str | None = None
    """Output directory (default: runs/<env>-<timestamp>). Must not exist: nothing is overwritten."""
    table_rows: int = 20
    """Rows of the metrics table printed after the run (0: none)."""
    sweep: str | None = None
    """Run the sweep spec in this TOML file (see sweeps/): a grid and/or random search over HParams
    x seeds, one compiled program per static setting."""
    sweep_set: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A sweep from flags: --sweep-set lr=1e-4,3e-4 --sweep-set clip_eps=0.1,0.2 (the cartesian
    product, over HParams fields)."""
    sweep_chunk: int = 0
    """Run at most this many agents (points x seeds) at a time, for batches that do not fit in
    memory (0: all at once). Each chunk reuses the one compiled program."""
    env_devices: int = 0
    """Shard each agent's envs over up to this many devices, when a batch has fewer agents than
    devices: data parallel, each device steps its share of the envs and computes the gradient of its
    share of every minibatch, and the gradients are averaged across them (results equal the
    unsharded run's up to float rounding). 0: auto, as many devices as divide the envs and the
    minibatches while each keeps at least SHARD_SAMPLES samples of a minibatch (on CPU every core is
    a device: see docs/speed.md); 1: never. Single host only (--distributed shards agents alone)."""
    distributed: bool = False
    """Multi-process (multi-host): run the same command in every process; each runs its devices'
    share of the agents, and process 0 writes the outputs. The cluster is detected (SLURM, Open MPI,
    Kubernetes, Cloud TPU) or given by the three flags below or $JAX_COORDINATOR_ADDRESS. Only as
    `python ppo_jax.py` (its runtime starts before anything else of JAX)."""
    coordinator_address: str | None = None
    """--distributed: HOST:PORT of process 0, where every process meets (default: detected)."""
    num_processes: int | None = None
    """--distributed: how many processes take part (default: detected)."""
    process_id: int | None = None
    """--distributed: this process's number, 0 .. num_processes - 1 (default: detected)."""
    distributed_timeout: int = 300
    """--distributed: seconds to wait for every process to reach the coordinator before giving up."""
    compile_cache: str = os.environ.get("PPO_JAX_COMPILE_CACHE", "~/.cache/ppo_jax")
    """Keep compiled programs in this directory (JAX's persistent compilation cache): a later run of
    the same static config, whatever its HParams, skips XLA's compile. "" turns it off. Default:
    $PPO_JAX_COMPILE_CACHE or ~/.cache/ppo_jax; $JAX_COMPILATION_CACHE_DIR, when set, wins."""
    checkpoint_every: int = 0
    """Updates per chunk. A run is a loop of one compiled program over chunks of updates; after each
    chunk, metrics.csv gets its rows, the checkpoint is saved (atomically) and the progress line
    moves. 0: about 20 chunks per run. Splitting a run does not change its results (bit-identical in
    the tests); --resume keeps the run's own value unless given another."""
    resume: str | None = None
    """Continue the run in this run directory from its last checkpoint, with its own config.json:
    the result is bit-identical to an uninterrupted run."""
    eval: str | None = None
    """Evaluate the final policy of this run directory (every seed in its params.msgpack) and exit:
    mean +- std return over complete episodes, in one jitted program."""
    episodes: int = 100
    """With --eval: complete episodes per seed."""
    rank_by: str = "episode_return"
    """The metrics.csv column that ranks a sweep's points, higher first: its final value (the mean
    over the episodes that ended in the last 10 % of updates), IQM over seeds, in the table,
    summary.csv and the figures (e.g. gold_reward on ToyRLHF-v0). A spec may set it: rank_by = ..."""
    pbt_interval: int | None = None
    """Population-based training over a sweep's points (Jaderberg et al. 2017): every this many updates,
    in each seed's population of points, the worst quarter copy a random agent of the best quarter
    (its whole state) and perturb its explored HParams (x0.8 or x1.2, or a new draw). A spec's [pbt]
    table gives the rest (fraction, perturb, resample, explore, rank_by: README, "Population-based
    training"); this flag sets or overrides its interval. 0: no PBT, even where the spec has a [pbt]
    table (the same points as a plain sweep: PBT's baseline of the same compute)."""
    point: str | None = None
    """With --eval SWEEP_DIR: the sweep's point to evaluate, by its number in results.csv's point
    column or its label (with several static settings: S:K, setting S's point K), or best (the
    ranking's first; a PBT sweep: each seed's best agent). Every point's directory,
    SWEEP_DIR/setting-S/point-K, is a run directory of its own."""
    eval_every: int = 0
    """Every this many updates of a run, evaluate each seed's current policy on --eval-episodes
    complete episodes, sampled and with its mode, between chunks (chunks end where evaluations
    fall): metrics.csv's eval_return and eval_return_deterministic (NaN between), the means that
    --eval --seed SEED gives on that update's policy. 0: never. A sweep evaluates every point x seed
    so (--rank-by eval_return_deterministic ranks by the last evaluation)."""
    eval_episodes: int = 10
    """With --eval-every: complete episodes per seed in each evaluation."""
    deterministic: bool = False
    """With --eval: act with the policy's mode (the argmax; the Gaussian's mean) instead of sampling."""
    render: str | None = None
    """With --eval: also write one episode of seed --params-index as a GIF to this path (envs that
    gymnax can draw: classic control, MinAtar, Catch-bsuite, ...)."""
    quiet: bool = False
    """No live progress line."""
    tensorboard: bool = False
    """Also write every metric as TensorBoard scalars at x = env steps, after every chunk: one run per
    seed in RUN_DIR/tb/seed_<i> (a sweep: RUN_DIR/tb/<setting>/<point>/seed_<i>), CleanRL's tag names
    where it has one (charts/episodic_return, losses/value_loss, ...), ppo/<metric> for the rest, and
    the config as text. View with `tensorboard --logdir RUN_DIR/tb`."""
    wandb_project: str | None = None
    """Also log to Weights & Biases (pip install -r requirements-wandb.txt): one W&B run per seed (a
    sweep: per point x seed) with the config, the same scalars as --tensorboard at step = env steps,
    and at the end curve.png and summary.json. WANDB_MODE=offline keeps them in RUN_DIR/wandb/."""
    wandb_entity: str | None = None
    """With --wandb-project: the W&B team or user (default: yours)."""
    wandb_group: str | None = None
    """With --wandb-project: the W&B group of the runs (default: the experiment name)."""
    exp_name: str | None = None
    """With --wandb-project: the experiment name that prefixes the W&B run names (default: the run
    directory's name)."""
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

    @property
    def has_critic(self) -> bool:
        """Whether the run learns a critic (GAE's values): the one place that says so."""
        return self.adv_estimator == "gae"

    @property
    def critic_apart(self) -> bool:
        """Whether the policy takes its own step and the critic is fitted apart (--algo trpo, vpg): the one
        place that says so."""
        return self.algo in ("trpo", "vpg")

    @property
    def is_recurrent(self) -> bool:
        """Whether the network has a memory (--recurrent): the one place that says so."""
        return self.recurrent != "none"


# Defaults per environment family. CartPole is the classic PPO config (CleanRL / the 37 details),
# which is also Config's own default. Pendulum was tuned here: see docs/results.md.
CLASSIC_DISCRETE: dict[str, Any] = {}


CLASSIC_CONTINUOUS: dict[str, Any] = dict(
    total_timesteps=1_000_000,
    num_envs=16,
    num_steps=256,
    update_epochs=10,
    num_minibatches=16,
    hparams=dict(lr=1e-3, gamma=0.95, ent_coef=0.0, max_grad_norm=0.5),
)


MINATAR: dict[str, Any] = dict(  # a shared conv + 128 torso, many envs (PPO paper's Atari setup, scaled down)
    total_timesteps=10_000_000,
    num_envs=128,
    num_steps=128,
    update_epochs=4,
    num_minibatches=32,  # minibatches of 512: 4x the gradient steps of 8 (docs/results.md)
    hidden_sizes=(128,),
    activation="relu",  # as MinAtar's own networks
    shared_trunk=True,
    hparams=dict(lr=5e-4, ent_coef=0.03),
)


# The PPO paper's MuJoCo setup (Table 3) at its budget: batches of 2048 steps (as 8 envs x 256), 10
# epochs of minibatches of 64, 1e6 steps, with CleanRL's normalisations: an hour or less per env on a
# CPU (docs/results.md#brax; sweeps/locomotion_1m.toml). The accelerator's setting (2048 envs x 16)
# is a README line.
BRAX: dict[str, Any] = dict(
    total_timesteps=1_000_000,
    num_envs=8,
    num_steps=256,
    update_epochs=10,
    num_minibatches=32,
    hparams=dict(lr=3e-4, gamma=0.99, ent_coef=0.0, norm_obs=True, scale_reward=True),
)


# The mountain cars never reach the flag with their family's defaults. Normalised observations make
# the tiny velocity visible to the policy; the rest as RL Baselines3 Zoo (discrete) and gymnax-blines
# (continuous) run PPO there. Tuned here: sweeps/tune_<env>.toml, docs/results.md.
MOUNTAIN_CAR: dict[str, Any] = dict(
    num_envs=16,
    num_steps=16,
    update_epochs=4,
    num_minibatches=4,
    hparams=dict(lr=1e-3, ent_coef=0.0, norm_obs=True),
)


MOUNTAIN_CAR_CONTINUOUS: dict[str, Any] = dict(  # the same, with twice the envs, over the continuous budget
    MOUNTAIN_CAR,
    total_timesteps=1_000_000,
    num_envs=32,
    hparams=dict(MOUNTAIN_CAR["hparams"], gamma=0.99, max_grad_norm=1.0),
)


# Acrobot in gymnax-blines' batch shape and network (16 envs x 32 steps, ReLU, a constant lr,
# gradient norm 1), at a higher lr and without the entropy bonus: tuned here, sweeps/tune_Acrobot-v1.toml.
ACROBOT: dict[str, Any] = dict(
    num_envs=16,
    num_steps=32,
    activation="relu",
    hparams=dict(lr=1e-3, ent_coef=0.0, anneal_lr=False, max_grad_norm=1.0),
)


# RLHF in miniature: undiscounted (the reward of a response is its sum), no entropy bonus (the KL
# leash is the regulariser, and the exact optimum pi*_beta is that of the leash alone).
TOY_RLHF_DEFAULTS: dict[str, Any] = dict(
    total_timesteps=500_000,
    num_envs=64,
    num_steps=16,  # two responses per env per rollout
    update_epochs=4,
    num_minibatches=4,
    hparams=dict(lr=1e-3, gamma=1.0, gae_lambda=0.95, ent_coef=0.0),
)


# XLand-MiniGrid's single-task PPO (its training/train_single_task.py: 8192 envs x 16 steps, one epoch
# of 16 minibatches, lr 1e-3, gamma 0.99, entropy 0.01, gradient norm 0.5) at a CPU's scale: 64 envs, and
# 4 epochs of 4 minibatches (256 samples each: the same gradient steps per sample as 16 of 1024 there). Its
# network is an RNN over embeddings of the view; here the MLP on the one-hot view (--torso cnn takes it
# as an image: 5x slower on a CPU, docs/results.md).
XMINIGRID: dict[str, Any] = dict(
    total_timesteps=500_000,
    torso="mlp",
    num_envs=64,
    num_steps=16,
    update_epochs=4,
    num_minibatches=4,
    hparams=dict(lr=1e-3, gamma=0.99, gae_lambda=0.95, ent_coef=0.01, max_grad_norm=0.5),
)


# MuJoCo Playground's Brax PPO for the DM Control Suite (its config/dm_control_suite_params.py: 2048 envs x
# 30 steps, 16 epochs of 32 minibatches, lr 1e-3, gamma 0.995, entropy 0.01, observation normalisation,
# rewards x 10, 6e7 steps) at a CPU's scale: 64 envs x 30 steps, 16 epochs of 4 minibatches (each sample in
# 16 gradient steps, as there); the return normalisation here in place of its fixed reward scale; no observation
# normalisation: with it, 3 of 8 seeds of CartpoleBalance balanced the pole and then fell into spinning it for
# good, without it none did (docs/results.md, MuJoCo Playground).
PLAYGROUND: dict[str, Any] = dict(
    total_timesteps=2_000_000,
    num_envs=64,
    num_steps=30,
    update_epochs=16,
    num_minibatches=4,
    hparams=dict(lr=1e-3, gamma=0.995, gae_lambda=0.95, ent_coef=0.01, scale_reward=True),
)


# Craftax's PPO (Craftax_Baselines ppo.py: 1024 envs x 64 steps, 4 epochs of 8 minibatches, lr 2e-4 annealed,
# gamma 0.99, GAE lambda 0.8, entropy 0.01, gradient norm 1.0, an MLP of 3 x 512 tanh for actor and critic,
# optimistic resets at a ratio of 16, 1e9 steps) at a CPU's scale: 64 envs x 64 steps, 4 epochs of 4 minibatches
# (1024 samples each), its network, 1e6 steps (the Craftax-1M budget).
CRAFTAX: dict[str, Any] = dict(
    total_timesteps=1_000_000,
    num_envs=64,
    num_steps=64,
    update_epochs=4,
    num_minibatches=4,
    hidden_sizes=(512, 512, 512),
    activation="tanh",
    hparams=dict(lr=2e-4, gamma=0.99, gae_lambda=0.8, ent_coef=0.01, max_grad_norm=1.0),
)


# Jumanji publishes A2C, not PPO (its jumanji/training/configs: 20-step rollouts, 64-128 envs, entropy
# 0.01, lr 1e-4 to 3e-4, GAE lambda 0.95, gamma 0.997 to 1.0, and 10^8 steps and more): its rollout
# length and entropy bonus here, in a CPU's batch and budget and PPO's update.
JUMANJI: dict[str, Any] = dict(
    total_timesteps=1_000_000,
    num_envs=64,
    num_steps=20,
    update_epochs=4,
    num_minibatches=4,
    hparams=dict(lr=3e-4, gamma=0.99, gae_lambda=0.95, ent_coef=0.01, max_grad_norm=0.5),
)


# The real MuJoCo (EnvPool) gets Brax's setting, the PPO paper's Table 3, with its one actor (an env x 2048
# steps, not 8 x 256) and CleanRL's reward clip at 10 (ppo_continuous_action.py, whose published figures
# docs/results.md compares with).
ENVPOOL_MUJOCO: dict[str, Any] = dict(BRAX, num_envs=1, num_steps=2048, hparams=dict(BRAX["hparams"], clip_reward=10.0))


# The PPO paper's Atari setting (Table 5: 8 actors x 128 steps, 3 epochs of minibatches of 32 x 8, Adam
# 2.5e-4 x alpha, epsilon 0.1 x alpha, c1 1, c2 0.01, gamma 0.99, lambda 0.95; 40M frames = 1e7 steps)
# on the Nature network, its trunk shared by policy and value (--torso nature, one 512 layer).
ENVPOOL_ATARI: dict[str, Any] = dict(
    total_timesteps=10_000_000,
    num_envs=8,
    num_steps=128,
    update_epochs=3,
    num_minibatches=4,
    hidden_sizes=(512,),
    activation="relu",
    shared_trunk=True,
    hparams=dict(lr=2.5e-4, clip_eps=0.1, anneal_clip=True, vf_coef=1.0, ent_coef=0.01, gamma=0.99,
                 gae_lambda=0.95),
)


ENV_DEFAULTS: dict[str, dict[str, Any]] = {
    "ToyRLHF-v0": TOY_RLHF_DEFAULTS,
    "CartPole-v1": CLASSIC_DISCRETE,
    "Acrobot-v1": ACROBOT,
    "MountainCar-v0": MOUNTAIN_CAR,
    "Pendulum-v1": CLASSIC_CONTINUOUS,
    "MountainCarContinuous-v0": MOUNTAIN_CAR_CONTINUOUS,
}


# Each algorithm's defaults, over the env's (default_config: `--algo X --env Y --help` shows them). TRPO and
# VPG keep the env's rollout, critic and its epochs, so that only the policy's step differs from PPO's: the
# trust region as the TRPO paper's MuJoCo runs (delta 0.01) and Spinning Up's and Tianshou's damping (0.1);
# VPG's KL target the size of a PPO update's on MuJoCo. A2C as Mnih et al. 2016 and its baselines (RL
# Baselines3 Zoo, Tianshou): 16 envs x 5 steps, n-step returns (lambda 1), RMSprop at 7e-4, no advantage
# normalisation, one step per rollout.
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {},
    "trpo": dict(hparams=dict(max_kl=0.01, cg_damping=0.1)),
    "vpg": dict(hparams=dict(kl_target=0.01)),
    "a2c": dict(num_envs=16, num_steps=5, update_epochs=1, num_minibatches=1, optimizer="rmsprop",
                hparams=dict(lr=7e-4, gae_lambda=1.0, norm_adv=False, max_grad_norm=0.5)),
}


def default_config(env_id: str, **fields) -> Config:
    """The Config a user gets for `--env env_id` (that env's defaults, as its --help shows them), with
    `fields` of Config on top; `hparams` may be a dict of HParams fields, which replace those of the
    env's point and keep the rest. From Python this is the way in: Config(env=...) alone keeps
    CartPole's defaults (Config's own), whatever the env.

        config = default_config("Pendulum-v1", num_seeds=4, hparams=dict(lr=3e-4))

    `algo` among the fields brings that algorithm's defaults too (ALGO_DEFAULTS), under the fields."""
    if env_id.startswith(BRAX_PREFIX):
        overrides = BRAX
    elif env_id.startswith(XMINIGRID_PREFIX):
        overrides = XMINIGRID
    elif env_id.startswith(JUMANJI_PREFIX):
        overrides = JUMANJI
    elif env_id.startswith(PLAYGROUND_PREFIX):
        overrides = PLAYGROUND
    elif env_id.startswith(CRAFTAX_PREFIX):
        overrides = CRAFTAX
    elif env_id.startswith(ENVPOOL_PREFIX):
        overrides = envpool_defaults(env_id[len(ENVPOOL_PREFIX):])
    elif env_id.endswith("-MinAtar"):
        overrides = MINATAR
    else:
        overrides = ENV_DEFAULTS.get(env_id)
    if overrides is None and env_id in gymnax.registered_envs:  # any other gymnax env: pick by its action space
        env, env_params = gymnax.make(env_id)
        discrete = isinstance(env.action_space(env_params), spaces.Discrete)
        overrides = CLASSIC_DISCRETE if discrete else CLASSIC_CONTINUOUS
    overrides = dict(overrides or {})  # an unknown id: Config's own (validate() reports the id)
    algo = ALGO_DEFAULTS.get(fields.get("algo", Config.algo), {})  # an unknown one: validate() reports it
    overrides = {**overrides, **algo, "hparams": {**overrides.get("hparams", {}), **algo.get("hparams", {})}}
    hparams = HParams(**overrides.pop("hparams"))
    chosen = fields.pop("hparams", {})
    for given, known, kind in ((fields, Config, "Config"), ({} if isinstance(chosen, HParams) else chosen, HParams,
                                                            "HParams")):
        names = [f.name for f in dataclasses.fields(known) if f.name != "hparams"]
        for name in given:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                raise ConfigError(f"default_config: {name!r} is not a {kind} field"
                                  + (f"; did you mean {close[0]!r}?" if close else "")
                                  + (" (HParams fields go in hparams=dict(...))" if name in HPARAM_FIELDS else ""))
    hparams = chosen if isinstance(chosen, HParams) else hparams.replace(**chosen)
    return Config(**{"env": env_id, **overrides, **fields, "hparams": hparams})


# ================================================================================================
# 2. The PPO: network -> rollout -> advantages -> objective and loss -> update -> make_train
# ================================================================================================
# --- the network and its action distributions --------------------------------------------------


# Closed-form distributions instead of distrax: distrax pulls in tfp-nightly and warns at import on
# this jax, and each of these is a few lines that the tests check against scipy. The interface, all a
# distribution gives and all the rest of the file asks of one: noise(key, shape) and sample_from(noise)
# (split so that a rollout draws all its noise in one call), sample(key), mode(), env_action(action)
# (the action as the env takes it: a squashed or scaled policy maps onto the env's bounds), log_prob,
# entropy, kl. A new one is such a class, made by ActorCritic.policy_head and named in
# ActorCritic.distribution (continuous: CONTINUOUS_DISTRIBUTIONS, --action-dist).
LOG_2PI = math.log(2.0 * math.pi)


# An illegal action's logit (invalid action masking, Huang & Ontanon 2022): its probability is exp(-1e9) = 0
# in float32 and 0 * -1e9 = 0 in the entropy and KL sums, where -inf would give NaN.
MASKED_LOGIT = -1e9


def masked_logits(logits, legal):
    """logits [..., A] with every action where legal [..., A] is False set to MASKED_LOGIT: probability 0,
    never sampled, and no gradient reaches its logit."""
    return jnp.where(legal, logits, MASKED_LOGIT)


@struct.dataclass
class Categorical:
    """A categorical over actions; with `nvec`, a factorised one over a multi-discrete action: one
    categorical per component over its own slice of the logits, independent given the state, so the
    action is [..., K] and its log-probability, entropy and KL are sums over the components."""

    logits: jax.Array  # [..., num_actions] (factorised: [..., sum(nvec)])
    nvec: tuple[int, ...] = struct.field(pytree_node=False, default=())  # the components' sizes; (): one categorical

    def parts(self, x):  # [..., sum(nvec)] -> each component's slice (one categorical: x itself)
        if not self.nvec:
            return [x]
        ends = np.cumsum(self.nvec)
        return [x[..., end - n:end] for n, end in zip(self.nvec, ends)]

    def per_component(self, values):  # each component's [...] -> the action's [...] (factorised: [..., K])
        return jnp.stack(values, axis=-1) if self.nvec else values[0]

    @staticmethod
    def noise(key, shape):  # standard Gumbel noise
        return jax.random.gumbel(key, shape)

    def sample_from(self, noise):  # the Gumbel-max trick: argmax(logits + Gumbel noise)
        return self.per_component([jnp.argmax(logits + gumbel, axis=-1).astype(jnp.int32)
                                   for logits, gumbel in zip(self.parts(self.logits), self.parts(noise))])

    def sample(self, key):
        return self.sample_from(self.noise(key, self.logits.shape))

    def mode(self):
        return self.per_component([jnp.argmax(logits, axis=-1).astype(jnp.int32) for logits in self.parts(self.logits)])

    def env_action(self, action):  # the action as the env takes it
        return action

    def log_prob(self, action):
        actions = [action[..., k] for k in range(len(self.nvec))] if self.nvec else [action]
        return summed(jnp.take_along_axis(jax.nn.log_softmax(logits), a[..., None].astype(jnp.int32), axis=-1)[..., 0]
                      for logits, a in zip(self.parts(self.logits), actions))

    def entropy(self):
        log_ps = map(jax.nn.log_softmax, self.parts(self.logits))
        return summed(-jnp.sum(jnp.exp(log_p) * log_p, axis=-1) for log_p in log_ps)

    def kl(self, other: Categorical):
        """KL[self || other] = sum_a p(a) (log p(a) - log q(a)) (factorised: summed over the components)."""
        log_ps = map(jax.nn.log_softmax, self.parts(self.logits))
        log_qs = map(jax.nn.log_softmax, self.parts(other.logits))
        return summed(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1) for log_p, log_q in zip(log_ps, log_qs))


def summed(terms):  # the components' terms added (one component: its term as it is)
    return functools.reduce(jnp.add, terms)


@struct.dataclass
class DiagGaussian:
    """A diagonal Gaussian over R^A (the default continuous policy). The env takes its sample
    clipped to the action box (VecEnv; the share of components clipped is the action_clip_frac
    metric), and the log-prob stays that of the unclipped sample."""

    mean: jax.Array  # [..., action_dim]
    log_std: jax.Array  # [..., action_dim] (a parameter broadcast by the network, or a head's: --state-std)

    @staticmethod
    def noise(key, shape):  # standard normal noise
        return jax.random.normal(key, shape)

    def sample_from(self, noise):
        return self.mean + jnp.exp(self.log_std) * noise

    def sample(self, key):
        return self.sample_from(self.noise(key, self.mean.shape))

    def mode(self):
        return self.mean

    def env_action(self, action):  # the action as the env takes it (VecEnv clips it to the box)
        return action

    def log_prob(self, action):
        z = (action - self.mean) * jnp.exp(-self.log_std)
        return jnp.sum(-0.5 * z**2 - self.log_std - 0.5 * LOG_2PI, axis=-1)

    def entropy(self):
        return jnp.sum(self.log_std + 0.5 + 0.5 * LOG_2PI, axis=-1)

    def kl(self, other: DiagGaussian):
        """KL[self || other], summed over independent dimensions."""
        variance_ratio = jnp.exp(2.0 * (self.log_std - other.log_std))
        mahalanobis = ((self.mean - other.mean) * jnp.exp(-other.log_std)) ** 2
        return jnp.sum(other.log_std - self.log_std + 0.5 * (variance_ratio + mahalanobis - 1.0), axis=-1)


# Gauss-Hermite nodes and weights: E[f(u)], u ~ N(m, s^2), is sum_k w_k f(m + sqrt(2) s x_k) / sqrt(pi).
HERMITE_NODES, HERMITE_WEIGHTS = (np.float32(x) for x in np.polynomial.hermite.hermgauss(32))


@struct.dataclass
class TanhGaussian(DiagGaussian):
    """A Gaussian squashed onto the env's action box (Haarnoja et al. 2018, App. C; the policy of
    Brax's and MuJoCo Playground's PPO): the policy samples u ~ N(mean, std), the env takes
    a = low + (tanh(u) + 1) (high - low) / 2, never clipped. Actions are kept as u: the ratio and the
    KL of a bijection's images are the Gaussian's, so only the log-prob (of a, by the change of
    variables: the Gaussian's minus log|da/du|) and the entropy differ. The entropy has no closed
    form: the Gaussian's plus E[log|da/du|], the expectation per dimension by 32-point Gauss-Hermite
    quadrature (deterministic and differentiable, within 0.003 nats per dimension for stds up to 3,
    further off for wider ones; Brax's PPO takes one sample instead). The mode is
    the Gaussian's (the env gets its image)."""

    low: tuple[float, ...] = struct.field(pytree_node=False, default=())  # [A] the env's action bounds
    high: tuple[float, ...] = struct.field(pytree_node=False, default=())

    def log_det_jacobian(self, u, trailing: int = 0):  # log |da/du| per dimension (the dimension at -1 - trailing)
        half_range = np.reshape(0.5 * (np.asarray(self.high) - np.asarray(self.low)), (-1,) + (1,) * trailing)
        return np.log(half_range).astype(np.float32) + 2.0 * (math.log(2.0) - u - jax.nn.softplus(-2.0 * u))

    def env_action(self, action):
        low, high = np.asarray(self.low, np.float32), np.asarray(self.high, np.float32)
        return low + 0.5 * (jnp.tanh(action) + 1.0) * (high - low)

    def log_prob(self, action):
        return DiagGaussian.log_prob(self, action) - jnp.sum(self.log_det_jacobian(action), axis=-1)

    def entropy(self):
        u = self.mean[..., None] + math.sqrt(2.0) * jnp.exp(self.log_std)[..., None] * HERMITE_NODES  # [..., A, K]
        expected = jnp.sum(HERMITE_WEIGHTS * self.log_det_jacobian(u, trailing=1), axis=-1) / math.sqrt(math.pi)
        return DiagGaussian.entropy(self) + jnp.sum(expected, axis=-1)


BETA_EDGE = 1e-6  # a Beta sample is kept this far inside (0, 1), where float32 log x and log(1 - x) are finite


@struct.dataclass
class Beta:
    """Independent Beta distributions over the action box (Chou et al. 2017): x in (0, 1) per
    dimension, the env takes low + x (high - low), never clipped. The network gives alpha, beta =
    1 + softplus(head), both > 1: unimodal, zero density at the bounds. Log-prob and entropy are of
    the env's action (the affine map's log(high - low) included); KL in closed form."""

    alpha: jax.Array  # [..., action_dim]
    beta: jax.Array  # [..., action_dim]
    low: tuple[float, ...] = struct.field(pytree_node=False, default=())
    high: tuple[float, ...] = struct.field(pytree_node=False, default=())

    @staticmethod
    def noise(key, shape):  # a key per action ([..., A] -> keys [...]): Beta draws are rejection-sampled
        return jax.random.split(key, shape[:-1])

    def sample_from(self, noise):
        batch, dim = self.alpha.shape[:-1], self.alpha.shape[-1]
        keys = noise.reshape(-1, *noise.shape[len(batch):])
        draws = jax.vmap(jax.random.beta)(keys, self.alpha.reshape(-1, dim), self.beta.reshape(-1, dim))
        return jnp.clip(draws.reshape(self.alpha.shape), BETA_EDGE, 1.0 - BETA_EDGE)

    def sample(self, key):
        return self.sample_from(self.noise(key, self.alpha.shape))

    def mode(self):  # (alpha - 1) / (alpha + beta - 2), both > 1
        mode = (self.alpha - 1.0) / jnp.maximum(self.alpha + self.beta - 2.0, 1e-6)
        return jnp.clip(mode, BETA_EDGE, 1.0 - BETA_EDGE)

    def env_action(self, action):
        low, high = np.asarray(self.low, np.float32), np.asarray(self.high, np.float32)
        return low + action * (high - low)

    def log_range(self):
        return np.log(np.asarray(self.high, np.float64) - np.asarray(self.low, np.float64)).astype(np.float32)

    def log_prob(self, action):
        x = jnp.clip(action, BETA_EDGE, 1.0 - BETA_EDGE)
        log_density = ((self.alpha - 1.0) * jnp.log(x) + (self.beta - 1.0) * jnp.log1p(-x)
                       - jax.scipy.special.betaln(self.alpha, self.beta))
        return jnp.sum(log_density - self.log_range(), axis=-1)

    def entropy(self):
        a, b, digamma = self.alpha, self.beta, jax.scipy.special.digamma
        h = (jax.scipy.special.betaln(a, b) - (a - 1.0) * digamma(a) - (b - 1.0) * digamma(b)
             + (a + b - 2.0) * digamma(a + b))
        return jnp.sum(h + self.log_range(), axis=-1)

    def kl(self, other: Beta):
        """KL[self || other], summed over independent dimensions (the affine map cancels)."""
        a, b, c, d, digamma = self.alpha, self.beta, other.alpha, other.beta, jax.scipy.special.digamma
        betaln = jax.scipy.special.betaln
        return jnp.sum(betaln(c, d) - betaln(a, b) + (a - c) * digamma(a) + (b - d) * digamma(b)
                       + (c - a + d - b) * digamma(a + b), axis=-1)


CONTINUOUS_DISTRIBUTIONS = {"gaussian": DiagGaussian, "tanh_gaussian": TanhGaussian, "beta": Beta}  # --action-dist
MIN_STD = 1e-3  # --state-std: std = softplus(head) + MIN_STD (gymnax-blines' and Brax's floor)


@struct.dataclass
class NetworkOutput:
    """What the network gives, read by name by every consumer (the rollout, the next-value pass, the
    loss, the KL passes, evaluation, act). `value` is the critic's value wherever one is read: the
    acting pass's is the one GAE uses (so a change to the observation the acting pass sees reaches
    the critic too), the next-value pass and the loss read the same head. A head you add goes into
    `extras` by name (an auxiliary value, PPG's; normalised values, PopArt's)."""

    dist: Any  # the policy's distribution over [...] actions (Categorical, DiagGaussian, TanhGaussian, Beta)
    value: jax.Array  # [...] (zeros without a critic)
    hidden: jax.Array  # [..., H] the recurrent state after each step (H = 0: feedforward)
    extras: dict[str, jax.Array] = struct.field(default_factory=dict)


def image_patches(image, size: int, stride: int, pad: int = 0):
    """The size x size patches of images [B, H, W, C] at a stride, zero-padded by `pad` on each side ->
    [B, H', W', C * size * size], feature c * size * size + i * size + j (pixel (i, j) of the patch, channel
    c): lax.conv_general_dilated_patches' order and values, exactly. Written as size * size strided slices:
    that function is a convolution with a one-hot kernel, which costs more than the layer's own matmul
    (docs/speed.md, "The patches as strided slices")."""
    image = jnp.pad(image, ((0, 0), (pad, pad), (pad, pad), (0, 0))) if pad else image
    batch, height, width, channels = image.shape
    rows, cols = (height - size) // stride + 1, (width - size) // stride + 1
    pixels = [image[:, i:i + stride * (rows - 1) + 1:stride, j:j + stride * (cols - 1) + 1:stride]
              for i in range(size) for j in range(size)]
    return jnp.stack(pixels, axis=-1).reshape(batch, rows, cols, channels * size * size)


class ActorCritic(nn.Module):
    """Actor and critic MLPs (separate, or one shared trunk), after a shared conv torso when
    image_shape is given and a shared GRU when recurrent_size > 0. Orthogonal init: sqrt(2) on
    hidden and conv layers, 0.01 on the policy (and std) head (a near-uniform initial policy), 1.0
    on the value head and the GRU, zero biases; with orthogonal_init=False, flax's default (LeCun
    normal kernels, zero biases).

    Called as network.apply(params, obs, first, hidden) -> NetworkOutput(dist, value, hidden,
    extras). A feedforward network takes obs of any leading shape [...] and ignores first and hidden
    (its hidden is [..., 0]). A recurrent one takes time-major sequences: obs [T, B, obs_dim], first
    [T, B] (the step begins an episode: reset), hidden [B, H] (the state before step 0), and
    returns the state after each step [T, B, H]. policy_step() is the one-step form of both.
    The policy's distribution class is `distribution` (the one place that picks it). The critic's
    layers are named critic_<i> and value_head: is_critic tells its parameters apart by that, so a
    layer you add to the critic is named critic_* too (e.g. critic_norm)."""

    action_dim: int
    discrete: bool
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    shared_trunk: bool = False
    orthogonal_init: bool = True
    image_shape: tuple[int, ...] | None = None  # (H, W, C): a conv torso over these observation columns
    image_start: int = 0  # the image's first column of the flat observation (the others pass beside the conv)
    image_torso: str = "conv"  # conv: one 3x3 convolution; nature: the Nature DQN's three (--torso)
    recurrent_size: int = 0  # > 0: a recurrent cell of this many units after the torso
    recurrent_cell: str = "gru"  # which (RECURRENT_CELLS)
    critic: bool = True  # False: no critic trunk or value head (the values are zeros)
    action_mask: bool = False  # the obs's last action_dim columns say which actions are legal (1) (discrete)
    action_nvec: tuple[int, ...] = ()  # a multi-discrete action's components: a factorised Categorical (discrete)
    action_dist: str = "gaussian"  # continuous: a key of CONTINUOUS_DISTRIBUTIONS (--action-dist)
    state_std: bool = False  # continuous Gaussians: the std from a head of its own (--state-std)
    action_low: tuple[float, ...] = ()  # continuous: the env's action bounds (the squashed and Beta policies')
    action_high: tuple[float, ...] = ()
    sequence: tuple[int, ...] = ()  # (vocab, length): --torso transformer over the response in the obs (ToyRLHF)
    transformer: tuple[int, ...] = (2, 4, 64)  # its layers, heads, width (--transformer)

    @property
    def distribution(self) -> type:
        """The class of the policy's distribution: its noise, sample, log-prob, entropy, KL and mode."""
        return Categorical if self.discrete else CONTINUOUS_DISTRIBUTIONS[self.action_dist]

    @property
    def is_recurrent(self) -> bool:
        return self.recurrent_size > 0

    @nn.compact
    def __call__(self, obs, first=None, hidden=None, whole: bool = False) -> NetworkOutput:
        if self.sequence:  # --torso transformer: a language model (whole: obs are tokens [..., L], every position)
            return self.language_model(obs, whole)
        activation = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        if self.action_mask:  # the mask is no feature: it only masks the policy's logits
            obs, legal = obs[..., :-self.action_dim], obs[..., -self.action_dim:] > 0.5
        init = orthogonal if self.orthogonal_init else lambda scale: nn.initializers.lecun_normal()

        def layer(width, scale, name):
            return dense(width, init(scale), name)

        def trunk(x, name):
            for i, width in enumerate(self.hidden_sizes):
                x = activation(layer(width, math.sqrt(2.0), f"{name}_{i}")(x))
            return x

        if self.image_shape is not None:  # flat observations [..., D]: columns image_start.. are an H x W x C image
            start, end = self.image_start, self.image_start + math.prod(self.image_shape)
            # Each convolution is its patches times a [size * size * C, width] kernel (image_patches): on
            # CPU, XLA's convolution gradient is far slower inside the update's lax.scan (docs/speed.md).
            image = obs[..., start:end].reshape(-1, *self.image_shape)
            if self.image_torso == "nature":  # Mnih et al. 2015: 84 x 84 -> 20 x 20 x 32 -> 9 x 9 x 64 -> 7 x 7 x 64
                for i, (width, size, stride) in enumerate(((32, 8, 4), (64, 4, 2), (64, 3, 1))):
                    image = nn.relu(layer(width, math.sqrt(2.0), f"conv_{i}")(image_patches(image, size, stride)))
                features = image
            else:  # one 3x3 'SAME' convolution
                features = nn.relu(layer(16, math.sqrt(2.0), "conv")(image_patches(image, 3, 1, pad=1)))  # [B, H, W, 16]
            features = features.reshape(*obs.shape[:-1], -1)  # [..., H * W * 16]; nature: [..., 3136]
            beside = [obs[..., :start], obs[..., end:]]  # a grid's other fields, flat (a pure image: none)
            obs = jnp.concatenate([features, *beside], axis=-1) if start or end < obs.shape[-1] else features
        if self.is_recurrent:
            cell = RECURRENT_CELLS[self.recurrent_cell]
            obs = hidden = cell(self.recurrent_size, init(1.0), name=self.recurrent_cell)(obs, first, hidden)
        else:
            hidden = jnp.zeros((*obs.shape[:-1], 0), jnp.float32)
        actor_features = trunk(obs, "trunk" if self.shared_trunk else "actor")
        dist = self.policy_head(actor_features, layer, legal if self.action_mask else None)
        if self.critic:
            critic_features = actor_features if self.shared_trunk else trunk(obs, "critic")
            value = layer(1, 1.0, "value_head")(critic_features)[..., 0]
        else:
            value = jnp.zeros(actor_features.shape[:-1], jnp.float32)
        return NetworkOutput(dist=dist, value=value, hidden=hidden)

    def policy_head(self, features, layer, legal):
        """The policy's head(s) on the actor's features -> its distribution (of class `distribution`)."""
        if self.discrete:
            logits = layer(self.action_dim, 0.01, "policy_head")(features)
            return Categorical(logits if legal is None else masked_logits(logits, legal), tuple(self.action_nvec))
        bounds = dict(low=tuple(self.action_low), high=tuple(self.action_high))
        if self.distribution is Beta:  # Chou et al. 2017: alpha, beta = 1 + softplus(head), both > 1
            concentrations = 1.0 + nn.softplus(layer(2 * self.action_dim, 0.01, "policy_head")(features))
            return Beta(concentrations[..., :self.action_dim], concentrations[..., self.action_dim:], **bounds)
        mean = layer(self.action_dim, 0.01, "policy_head")(features)
        if self.state_std:  # gymnax-blines' and Brax's: std = softplus(head) + MIN_STD
            log_std = jnp.log(nn.softplus(layer(self.action_dim, 0.01, "std_head")(features)) + MIN_STD)
        else:  # PPO paper's: a parameter, the same in every state
            log_std = jnp.broadcast_to(self.param("log_std", nn.initializers.zeros, (self.action_dim,)), mean.shape)
        if self.distribution is DiagGaussian:  # unbounded: the env clips its samples
            return DiagGaussian(mean, log_std)
        return self.distribution(mean, log_std, **bounds)


    def language_model(self, obs, whole: bool) -> NetworkOutput:
        """--torso transformer. The input is [start, y_0, ..., y_{L-1}] (start: token id `vocab`); position t's
        features see the start and y_<t alone (causal), so they give the logits of y_t and the value of the
        state before it, and position L's the value of the whole response (a reward model's score). From
        an observation (the response so far, ToyRLHF's): the current position's outputs [...]; whole=True,
        from tokens [..., L]: every position's, dist over [..., L + 1] and value [..., L + 1], in one pass
        (teacher forcing: pretraining, SFT, the reward model, DPO, the enumerations of section 8)."""
        vocab, length = self.sequence
        tokens, position = (obs, None) if whole else read_response(obs, vocab, length)
        inputs = jnp.concatenate([jnp.full_like(tokens[..., :1], vocab), jnp.minimum(tokens, vocab)], axis=-1)

        def trunk(name):  # [..., L + 1, width], or the current position's [..., width]
            features = Transformer(vocab + 1, length + 1, *self.transformer, name=name)(inputs)
            return features if whole else jnp.take_along_axis(features, position[..., None, None], axis=-2)[..., 0, :]

        layer = lambda width, scale, name: dense(width, orthogonal(scale), name)  # noqa: E731
        features = trunk("transformer")
        dist = self.policy_head(features, layer, None)
        if self.critic:
            value = layer(1, 1.0, "value_head")(features if self.shared_trunk else trunk("critic_transformer"))[..., 0]
        else:
            value = jnp.zeros(features.shape[:-1], jnp.float32)
        return NetworkOutput(dist=dist, value=value, hidden=jnp.zeros((*features.shape[:-1], 0), jnp.float32))


class GRU(nn.Module):
    """A GRU (Cho et al., 2014; the form of cuDNN and PyTorch, the reset gate applied after the
    recurrent matmul) over a time-major sequence, its state set to zero where an episode begins:
        h  = 0 where first_t, else h_{t-1}
        r  = sigmoid(W_r x_t + b_r + U_r h + c_r),   z = sigmoid(W_z x_t + b_z + U_z h + c_z)
        n  = tanh(W_n x_t + b_n + r * (U_n h + c_n)),   h_t = (1 - z) * n + z * h
    The input projection of every step is one matmul before the scan (speed): only U h is sequential."""

    size: int
    kernel_init: Any

    @nn.compact
    def __call__(self, inputs, first, hidden):  # [T, B, D], [T, B] bool, [B, H] -> states after each step [T, B, H]
        size = self.size
        projected = dense(3 * size, self.kernel_init, "input")(inputs)  # [T, B, 3H]: W x + b

        def blocks(key, shape):  # U_r, U_z, U_n each initialised on its own (each orthogonal when that is the init)
            return jnp.concatenate([self.kernel_init(k, (size, size)) for k in jax.random.split(key, 3)], axis=-1)

        recurrent_kernel = self.param("recurrent_kernel", blocks, (size, 3 * size))
        recurrent_bias = self.param("recurrent_bias", nn.initializers.zeros, (3 * size,))

        def step(h, inputs):
            x, first = inputs
            h = jnp.where(first[:, None], 0.0, h)
            u = h @ recurrent_kernel + recurrent_bias
            r = nn.sigmoid(x[:, :size] + u[:, :size])
            z = nn.sigmoid(x[:, size:2 * size] + u[:, size:2 * size])
            n = jnp.tanh(x[:, 2 * size:] + r * u[:, 2 * size:])
            h = (1.0 - z) * n + z * h
            return h, h

        return jax.lax.scan(step, hidden, (projected, first))[1]


def read_response(obs, vocab: int, length: int):
    """ToyRLHF's observation [..., L * V + L] -> (tokens [..., L], `vocab` where empty; the position [...],
    L after the last token)."""
    slots = obs[..., :length * vocab].reshape(*obs.shape[:-1], length, vocab)
    clock = obs[..., length * vocab:]
    tokens = jnp.where(slots.max(-1) > 0.5, jnp.argmax(slots, -1), vocab)
    return tokens, jnp.where(clock.max(-1) > 0.5, jnp.argmax(clock, -1), length)


class Transformer(nn.Module):
    """A causal (decoder-only) transformer, GPT-2's block (Radford et al. 2019): token ids [..., S] (below
    `vocab`, S <= `length`) -> features [..., S, width]. Learned token and position embeddings; per layer
    x += attention(LayerNorm(x)) with a causal mask, x += MLP(LayerNorm(x)) (4 x width, GELU); a final
    LayerNorm. Weights N(0, 0.02), as GPT-2's."""

    vocab: int  # token ids, the start token's included
    length: int  # positions
    layers: int
    heads: int
    width: int

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.02)
        batch_shape, size = tokens.shape[:-1], tokens.shape[-1]
        tokens = tokens.reshape(-1, size)
        x = nn.Embed(self.vocab, self.width, embedding_init=init, name="embed")(tokens)
        x = x + self.param("positions", init, (self.length, self.width))[:size]
        mask = nn.make_causal_mask(tokens)  # [B, 1, S, S]
        for i in range(self.layers):
            x = x + nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.width, kernel_init=init,
                                                    name=f"attention_{i}")(nn.LayerNorm(name=f"norm_{i}a")(x), mask=mask)
            y = nn.gelu(dense(4 * self.width, init, f"mlp_{i}a")(nn.LayerNorm(name=f"norm_{i}b")(x)))
            x = x + dense(self.width, init, f"mlp_{i}b")(y)
        return nn.LayerNorm(name="norm")(x).reshape(*batch_shape, size, self.width)


RECURRENT_CELLS = {"gru": GRU}  # --recurrent: each a module (size, kernel_init)(inputs [T, B, D], first, hidden)


def policy_step(network: ActorCritic, params, obs, first, hidden) -> NetworkOutput:
    """One step for a batch of envs, recurrent or not: obs [B, obs_dim], first [B] (bool), hidden
    [B, H] -> the NetworkOutput of that step (dist over [B] actions, value [B], hidden after it [B, H])."""
    return jax.tree.map(lambda x: x[0], network.apply(params, obs[None], first[None], hidden))


def initial_hidden(network: ActorCritic, batch: int):
    """The recurrent state of `batch` envs before anything is seen: zeros [batch, H] (H = 0 when feedforward)."""
    return jnp.zeros((batch, network.recurrent_size), jnp.float32)


@struct.dataclass
class RunningStats:
    """Running mean and (population) variance of a stream of batches, merged with the parallel
    formula of Chan et al. The count is float32: beyond ~1.6e7 samples it rounds, which only
    slightly changes the weight of new batches."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array
    raw: int = struct.field(pytree_node=False, default=0)  # the last `raw` columns are left as they are (an action mask)

    @classmethod
    def zeros(cls, shape=(), raw: int = 0):
        return cls(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32), jnp.zeros((), jnp.float32), raw)

    def update(self, batch):  # batch: [n, *shape]
        n = batch.shape[0]
        batch_mean, batch_var = jnp.mean(batch, axis=0), jnp.var(batch, axis=0)
        total = self.count + n
        delta = batch_mean - self.mean
        mean = self.mean + delta * n / total
        sum_squares = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        return self.replace(mean=mean, var=sum_squares / total, count=total)

    def normalize(self, x, clip):
        normalized = jnp.clip((x - self.mean) / jnp.sqrt(self.var + 1e-8), -clip, clip)
        if not self.raw:
            return normalized
        return jnp.where(jnp.arange(x.shape[-1]) >= x.shape[-1] - self.raw, x, normalized)


@struct.dataclass
class Policy:
    """What acting needs: network params and the observation statistics. Saved as params.msgpack."""

    params: Any
    obs_stats: RunningStats


def observe(policy_obs_stats: RunningStats, raw_obs, hparams: HParams):
    """The observation the network sees: normalised with these statistics when --norm-obs is on."""
    return jnp.where(hparams.norm_obs, policy_obs_stats.normalize(raw_obs, hparams.clip_obs), raw_obs)


# --- the rollout ---------------------------------------------------------------------------------


def per_env():
    """A TrainState field whose leaves hold one row per env after the agent axis ([agents, N, ...]):
    run_batch shards it over the devices an agent's envs are spread over. Every other field is the
    agent's own, whole on each of them (TrainState.sharding)."""
    return struct.field(metadata={"per_env": True})


@struct.dataclass
class TrainState:
    """Everything a run carries from one update to the next, and all that its checkpoint holds. A new
    field here is all it takes: its initial value in init_train_state (rule 4: the value runs before it
    had all along, since a checkpoint written before the field existed gets it from there), per_env()
    if it has a row per env."""

    params: Any
    opt_state: Any  # make_optimizer's
    env_state: EnvState = per_env()
    obs: jax.Array = per_env()  # [N, obs_dim] the raw observation each env is in now
    hidden: jax.Array = per_env()  # [N, H] each env's recurrent state after its last step (H = 0: feedforward)
    obs_stats: RunningStats  # of raw observations, over all envs
    reward_stats: RunningStats  # of the per-env discounted return (for --scale-reward)
    discounted_return: jax.Array = per_env()  # [N]
    kl_coef: jax.Array  # PPO-Penalty's beta, adapted after each update
    step_scale: jax.Array  # --algo vpg: the multiplier of the policy's learning rate, adapted after each update (1)
    ref_kl_coef: jax.Array  # the KL leash's beta: --ref-kl-coef, adapted after each update with --ref-kl-target
    reference: Policy  # the frozen pi_ref of the KL leash
    ref_hidden: jax.Array = per_env()  # [N, H] pi_ref's recurrent state (a recurrent reference has its own memory)
    key: jax.Array
    update: jax.Array  # updates done so far (int32)

    @classmethod
    def sharding(cls, agents, envs):
        """A prefix of the state's tree for shard_map and jit: each field's leaves get `envs` (per_env) or
        `agents`."""
        return cls(**{f.name: envs if f.metadata.get("per_env") else agents for f in dataclasses.fields(cls)})


@struct.dataclass
class Transition:
    """A rollout, every field time-major [T, N, ...]. hidden, action, dist, value and (from dist)
    log_prob are the acting pass's: the network's outputs on the observation as the policy saw it,
    so what changes that observation (noise, say) reaches GAE's values too."""

    obs: jax.Array  # as the network saw it (normalised when --norm-obs)
    first: jax.Array  # the step begins an episode (the recurrent state is reset before it)
    hidden: jax.Array  # [T, N, H] the recurrent state after the step
    action: jax.Array  # as sampled (unclipped)
    log_prob: jax.Array
    dist: Any  # the behaviour policy's distribution (for the exact KL of PPO-Penalty)
    value: jax.Array
    reward: jax.Array  # what GAE uses: scaled, clipped, minus the KL leash
    terminated: jax.Array
    done: jax.Array
    final_obs: jax.Array  # the true next observation (before any automatic reset), as the network sees it
    discounted_return: jax.Array  # per env, of raw rewards since the episode began (for --scale-reward)
    ref_kl: jax.Array  # exact KL[pi || pi_ref] at this state (0 with the leash off)
    episode_return: jax.Array  # raw return of the episode that ended here (where episode_end)
    episode_length: jax.Array
    episode_metrics: dict[str, jax.Array]  # the env's own end-of-episode figures (VecEnv.episode_metrics), where episode_end
    episode_end: jax.Array  # the episode reported ended here: done, but Atari's is the game, not a life (EnvPoolEnv)
    ref_log_prob: jax.Array | None = None  # --ref-kl-in loss: log pi_ref(a|s) of the sampled action
    ref_dist: Any = None  # --ref-kl-in loss with --ref-kl-estimator full: pi_ref(.|s)


def collect_rollout(state: TrainState, env: VecEnv, network: ActorCritic, num_steps: int, hparams: HParams,
                    leash: Leash | None = None):
    """A lax.scan over num_steps of (policy forward, sample, vmapped env step), then the reward
    processing of the whole rollout at once -> (state, [T, N] Transition): step_envs, then
    process_rollout.

    Written for speed: what needs no step-by-step order is out of the scan. The rollout's env keys,
    action noise and reset states are drawn up front in vectorised calls; the observation and reward
    statistics are updated once, from the whole rollout; reward scaling, clipping and the KL
    leash's reference policy run once on all T x N steps. So the observation statistics are frozen
    during a rollout: the policy acts on observations normalised with the statistics of the
    rollout's start (as Brax's PPO does), and the first rollout sees raw observations.

    With sharded envs (VecEnv.shards > 1) it runs on each device's envs, with the randomness of
    an unsharded run, and the statistics are updated from every device's rollout.
    """
    state, raw = step_envs(state, env, network, num_steps, hparams)
    return process_rollout(state, raw, env, network, hparams, leash)


def rollout_randomness(key, env: VecEnv, network: ActorCritic, num_steps: int):
    """step_envs' randomness, drawn before it -> (the next key, action noise (the distribution's, e.g.
    [T, N, A]), env step keys [T, N], fresh starts for every env at every step (VecEnv.resets)).
    With sharded envs, the draws are those of all the agent's envs, of which this device keeps its
    own. New randomness (observation noise, a dropout mask) comes from jax.random.fold_in(key, a
    constant of its own): another split here would change every existing run's draws."""
    all_envs = env.num_envs * env.shards
    key, noise_key, step_key, reset_key = jax.random.split(key, 4)
    noise = network.distribution.noise(noise_key, (num_steps, all_envs, env.action_dim))
    step_keys = jax.random.split(step_key, (num_steps, all_envs))
    return key, env.own(noise), env.own(step_keys), env.draw_resets(reset_key, num_steps)


def step_envs(state: TrainState, env: VecEnv, network: ActorCritic, num_steps: int, hparams: HParams):
    """The rollout's lax.scan -> (state, [T, N] Transition as the envs gave it: raw observations,
    final observations and rewards; no log_prob or ref_kl yet). Its randomness is drawn before it:
    each step's action noise (the action is dist.sample_from(noise)), env keys and fresh starts."""
    key, noise, step_keys, resets = rollout_randomness(state.key, env, network, num_steps)

    def step(carry, inputs):
        env_state, raw_obs, hidden, running_return = carry
        action_noise, keys, reset = inputs
        obs = observe(state.obs_stats, raw_obs, hparams)
        first = env_state.first
        out = policy_step(network, state.params, obs, first, hidden)
        hidden, dist = out.hidden, out.dist
        action = dist.sample_from(action_noise)
        next_obs, env_state, reward, terminated, truncated, info = env.step(keys, env_state, dist.env_action(action),
                                                                            reset)
        done = terminated | truncated
        running_return = running_return * hparams.gamma + reward  # per env, for --scale-reward
        transition = Transition(
            obs=raw_obs,  # normalised after the scan, with the same (frozen) statistics
            first=first,
            hidden=hidden,
            action=action,
            log_prob=None,  # after the scan, in one batched call
            dist=dist,
            value=out.value,
            reward=reward,
            terminated=terminated,
            done=done,
            final_obs=info["final_observation"],
            discounted_return=running_return,
            ref_kl=None,
            episode_return=info["episode_return"],
            episode_length=info["episode_length"],
            episode_metrics=info["episode_metrics"],
            episode_end=info["episode_end"],
        )
        return (env_state, next_obs, hidden, jnp.where(done, 0.0, running_return)), transition

    carry = (state.env_state, state.obs, state.hidden, state.discounted_return)
    (env_state, next_obs, hidden, running_return), traj = jax.lax.scan(step, carry, (noise, step_keys, resets))
    return state.replace(env_state=env_state, obs=next_obs, hidden=hidden, discounted_return=running_return,
                         key=key), traj


def process_rollout(state: TrainState, traj: Transition, env: VecEnv, network: ActorCritic, hparams: HParams,
                    leash: Leash | None = None):
    """step_envs' raw rollout -> (state, the Transition the update trains on): observations
    normalised, log-probabilities, rewards processed; the statistics updated from the rollout."""
    leash = leash or Leash()
    raw_obs = traj.obs
    log_prob = traj.dist.log_prob(traj.action)

    # Reward processing, in order: scale by the running std of the discounted return, clip,
    # then the KL leash (in units of log-probability, so after the scaling).
    reward_stats = state.reward_stats.update(env.gather(traj.discounted_return).reshape(-1))
    scaled = jnp.where(hparams.scale_reward, traj.reward / jnp.sqrt(reward_stats.var + 1e-8), traj.reward)
    reward = jnp.clip(scaled, -hparams.clip_reward, hparams.clip_reward)

    # The loss placement of the exact KL differentiates KL[pi || pi_ref]: it needs pi_ref(.|s) itself.
    keep_ref_dist = leash.in_loss and leash.estimator == "full"

    def on():  # (log pi_ref(a|s), KL[pi || pi_ref], pi_ref's state after, pi_ref or None) at every step, in one pass
        ref_obs = observe(state.reference.obs_stats, raw_obs, hparams)
        ref = network.apply(state.reference.params, ref_obs, traj.first, state.ref_hidden)
        return (ref.dist.log_prob(traj.action), traj.dist.kl(ref.dist), ref.hidden[-1],
                ref.dist if keep_ref_dist else None)

    def off():  # the leash is off: pi_ref := pi
        return log_prob, jnp.zeros_like(log_prob), state.ref_hidden, traj.dist if keep_ref_dist else None

    ref_log_prob, ref_kl, ref_hidden, ref_dist = jax.lax.cond((hparams.ref_kl_coef > 0) | leash.measure, on, off)
    if leash.in_loss:  # ppo_loss carries the leash; the rewards do not
        penalty, traj = 0.0, traj.replace(ref_log_prob=ref_log_prob, ref_dist=ref_dist)
    else:
        penalty = hparams.ref_kl_coef * kl_estimate(leash.estimator, log_prob, ref_log_prob, ref_kl)
    traj = traj.replace(
        obs=observe(state.obs_stats, raw_obs, hparams),
        log_prob=log_prob,
        reward=reward - penalty,
        final_obs=observe(state.obs_stats, traj.final_obs, hparams),
        ref_kl=ref_kl,
    )
    obs_stats = state.obs_stats.update(env.gather(raw_obs).reshape(-1, env.obs_dim))
    state = state.replace(obs_stats=obs_stats, reward_stats=reward_stats, ref_hidden=ref_hidden)
    return state, traj


# --- advantages ----------------------------------------------------------------------------------


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


def group_advantages(rewards, estimator: str, group_size: int, episode_length: int):
    """Critic-free advantages (--adv-estimator grpo | rloo | dr_grpo) from rewards [T, N] whose
    episodes all last `episode_length` steps and begin at t = 0: each episode's return R (its
    undiscounted sum of rewards) is compared with the returns of the other episodes of its group,
    those of the same rollout slot in `group_size` consecutive envs, and every step of the episode
    gets the episode's advantage:
        grpo     (R_i - mean_j R_j) / std_j R_j   (sample std; 0 where the group's returns are all equal)
        rloo     R_i - mean_{j != i} R_j
        dr_grpo  R_i - mean_j R_j
    Returns [T, N]."""
    steps, envs = rewards.shape
    slots = steps // episode_length
    returns = rewards.reshape(slots, episode_length, envs // group_size, group_size).sum(axis=1)  # [K, N/G, G]
    mean = returns.mean(axis=-1, keepdims=True)
    if estimator == "grpo":
        std = returns.std(axis=-1, ddof=1, keepdims=True)
        tied = returns.max(axis=-1, keepdims=True) == returns.min(axis=-1, keepdims=True)
        advantages = jnp.where(tied, 0.0, (returns - mean) / jnp.where(tied, 1.0, std))
    elif estimator == "rloo":
        advantages = (returns - mean) * group_size / (group_size - 1)  # = R_i - (sum_j R_j - R_i) / (G - 1)
    else:
        advantages = returns - mean
    per_step = jnp.broadcast_to(advantages[:, None], (slots, episode_length, *advantages.shape[1:]))
    return per_step.reshape(steps, envs)


def estimate_advantages(params, traj: Transition, config: Config, env: VecEnv, network: ActorCritic,
                        hparams: HParams):
    """The update's advantages and value targets, both [T, N]: GAE from the critic's value of every
    step's true next state (one batched pass of one step each, continuing from the state after that
    step; where no episode ended, final_obs is simply the next observation). Truncation bootstraps
    unless --no-bootstrap-truncation. Critic-free (--adv-estimator): group_advantages, no targets."""
    if not config.has_critic:  # groups may span the devices an agent's envs are sharded over
        rewards = env.gather(traj.reward)
        advantages = env.own(group_advantages(rewards, config.adv_estimator, config.group_size or config.num_envs,
                                              fixed_episode_length(config.env, config.env_params)))
        return advantages, jnp.zeros_like(advantages)
    steps = config.num_steps * env.num_envs  # this device's envs

    def next_value(part):  # (final observations, hidden states) of some steps -> their values
        obs, hidden = part
        return policy_step(network, params, obs, jnp.zeros(len(obs), bool), hidden).value

    final = (traj.final_obs.reshape(steps, -1), traj.hidden.reshape(steps, -1))
    next_values = Parts.of(config, env).map(next_value, final).reshape(config.num_steps, env.num_envs)
    terminated = jnp.where(hparams.bootstrap_truncation, traj.terminated, traj.done)
    return compute_gae(traj.reward, traj.value, next_values, terminated, traj.done, hparams.gamma, hparams.gae_lambda)


# --- the objective and the loss (PPO paper, Eq. 7-9) ---------------------------------------------


def policy_objective(ratio, advantages, hparams: HParams):
    """The per-sample surrogate objective, to be maximised, and where its clip acts -> (objective,
    clipped), both [B]. PPO paper, Eq. 7: min(r A, clip(r, 1 - eps, 1 + eps) A); clip_eps 0 (or
    inf): the unclipped surrogate r A (Table 1's baseline). Its descendants: the band's upper edge
    1 + clip_eps_high (DAPO's clip-higher), and where A < 0 the lower bound dual_clip * A (dual-clip
    PPO). `clipped` marks the samples whose ratio lies outside the band, or whose dual clip binds
    (the clip_frac metric). A new surrogate replaces this function alone, or joins it behind a
    switch: jnp.where(hparams.switch, new, objective), both finite at every HParams value (rule 5:
    no division by a clip_eps that may be 0, even in the branch not selected)."""
    low, high = hparams.clip_eps, jnp.where(hparams.clip_eps_high > 0, hparams.clip_eps_high, hparams.clip_eps)
    clipping = low > 0
    objective = jnp.minimum(ratio * advantages, jnp.clip(ratio, 1.0 - low, 1.0 + high) * advantages)
    objective = jnp.where(clipping, objective, ratio * advantages)
    clipped = clipping & ((ratio < 1.0 - low) | (ratio > 1.0 + high))
    dual = (hparams.dual_clip > 0) & (advantages < 0) & (objective < hparams.dual_clip * advantages)
    return jnp.where(dual, hparams.dual_clip * advantages, objective), clipped | dual


def kl_estimate(estimator: str, log_prob, ref_log_prob, exact_kl):
    """An estimate of KL[pi || pi_ref] at each sampled action a ~ pi (Schulman 2020, "Approximating
    KL divergence"), log rho = log pi_ref(a) - log pi(a): k1 = -log rho (unbiased), k2 = (log rho)^2 / 2
    (biased, low variance), k3 = rho - 1 - log rho (unbiased, low variance, >= 0); full: `exact_kl`,
    the closed form over all actions. (--ref-kl-estimator)"""
    log_rho = ref_log_prob - log_prob
    return {"k1": lambda: -log_rho, "k2": lambda: 0.5 * log_rho**2, "k3": lambda: jnp.expm1(log_rho) - log_rho,
            "full": lambda: exact_kl}[estimator]()


@dataclasses.dataclass(frozen=True)
class Leash:
    """The KL leash's static choices: its estimator (--ref-kl-estimator) and whether it is a term of
    the loss (--ref-kl-in loss) rather than a penalty on the rewards."""

    estimator: str = "k1"
    in_loss: bool = False
    measure: bool = False  # measure KL[pi || pi_ref] even at --ref-kl-coef 0 (a loaded --ref-params)

    @classmethod
    def of(cls, config: Config) -> Leash:
        return cls(config.ref_kl_estimator, config.ref_kl_in == "loss", config.ref_params is not None)


def value_loss(values, old_values, targets, hparams: HParams):
    """The critic's loss, a mean over samples: 0.5 * squared error; with --clip-vloss (and clipping on)
    the OpenAI-baselines clipped form, the value's move from old_values bounded by --clip-eps. A new
    value loss replaces this function alone."""
    unclipped = (values - targets) ** 2
    clipped_values = old_values + jnp.clip(values - old_values, -hparams.clip_eps, hparams.clip_eps)
    clipped = jnp.maximum(unclipped, (clipped_values - targets) ** 2)
    return 0.5 * jnp.mean(jnp.where(hparams.clip_vloss & (hparams.clip_eps > 0), clipped, unclipped))


def ppo_loss(params, batch: Batch, hparams: HParams, kl_coef, setup: Setup):
    """PPO loss on one minibatch (or a slice of it): clipped surrogate (Eq. 7), KL penalty (Eq. 8),
    value loss and entropy bonus (Eq. 9); negated for minimisation. Which terms act is data: their
    coefficients. Every term, and every diagnostic, is a mean over the samples."""
    leash = setup.leash
    out = setup.network.apply(params, batch.obs, batch.first, batch.hidden)
    dist = out.dist
    log_prob = dist.log_prob(batch.action)
    log_ratio = log_prob - batch.log_prob
    ratio = jnp.exp(log_ratio)
    # The advantages were normalised by epoch_step, over the whole minibatch (rule 2: not here).
    objective, clipped = policy_objective(ratio, batch.advantages, hparams)
    policy_loss = -jnp.mean(objective)
    kl = jnp.mean(batch.dist.kl(dist))  # exact KL[pi_old || pi]
    entropy = jnp.mean(dist.entropy())
    if setup.config.has_critic:
        v_loss = value_loss(out.value, batch.value, batch.targets, hparams)
        total = policy_loss + kl_coef * kl + hparams.vf_coef * v_loss - hparams.ent_coef * entropy
    else:  # critic-free (--adv-estimator): no value loss
        v_loss = jnp.float32(jnp.nan)
        total = policy_loss + kl_coef * kl - hparams.ent_coef * entropy
    if leash.in_loss:  # --ref-kl-in loss: + beta * mean(k), k differentiated through pi (GRPO's placement)
        exact = dist.kl(batch.ref_dist) if leash.estimator == "full" else None
        total = total + hparams.ref_kl_coef * jnp.mean(kl_estimate(leash.estimator, log_prob, batch.ref_log_prob,
                                                                   exact))
    diagnostics = {
        "policy_loss": policy_loss,
        "value_loss": v_loss,
        "entropy": entropy,
        "approx_kl": jnp.mean((ratio - 1.0) - log_ratio),  # the low-variance k3 estimator
        "clip_frac": jnp.mean(clipped.astype(jnp.float32)),
    }
    return total, diagnostics


def adaptive_kl_coef(kl_coef, kl, kl_target):
    """PPO paper, Sec. 4: halve beta when KL < d_targ / 1.5, double it when KL > 1.5 d_targ."""
    return jnp.where(kl < kl_target / 1.5, kl_coef / 2.0, jnp.where(kl > kl_target * 1.5, kl_coef * 2.0, kl_coef))


def adaptive_ref_kl_coef(ref_kl_coef, kl_seq, episodes, hparams: HParams):
    """The leash's controller (Ziegler et al. 2019, Sec. 2.2; --ref-kl-target): a proportional step
    towards the target KL per episode, clipped to +-20 %, scaled by the episodes seen over the horizon."""
    error = jnp.clip(kl_seq / hparams.ref_kl_target - 1.0, -0.2, 0.2)
    return ref_kl_coef * (1.0 + error * episodes / hparams.ref_kl_horizon)


# --- the update: rollout, GAE, epochs of minibatch steps -----------------------------------------


@struct.dataclass
class Batch:  # flat [B, ...]; recurrent: time-major [T, N, ...], whole env sequences
    obs: jax.Array
    first: jax.Array | None  # recurrent only: [T, N] reset flags
    hidden: jax.Array | None  # recurrent only: [N, H] the state each sequence starts from
    action: jax.Array
    log_prob: jax.Array
    dist: Any
    value: jax.Array
    advantages: jax.Array
    targets: jax.Array
    ref_log_prob: jax.Array | None = None  # --ref-kl-in loss (see Transition)
    ref_dist: Any = None


@dataclasses.dataclass(frozen=True)
class Setup:
    """The update's static choices, passed down whole (update_step -> epoch_step -> minibatch_step ->
    ppo_loss): a switch you add is a Config field, read as setup.config.NAME where it acts, with no
    new argument threaded through the functions between."""

    config: Config
    env: VecEnv  # this device's envs
    network: ActorCritic
    parts: Parts  # how the passes over the batch are split (speed and devices: Parts)
    leash: Leash

    @classmethod
    def of(cls, config: Config, env: VecEnv, network: ActorCritic) -> Setup:
        return cls(config, env, network, Parts.of(config, env), Leash.of(config))


def update_step(state: TrainState, _, config: Config, env: VecEnv, network, hparams: HParams):
    """One PPO iteration: rollout -> GAE -> update_epochs x num_minibatches gradient steps. A
    per-update schedule of any HParam goes where the leash's beta is set below, from state.update:
    hparams.replace(ent_coef=hparams.ent_coef * (1 - state.update / config.num_updates))."""
    setup = Setup.of(config, env, network)
    parts, start_hidden = setup.parts, state.hidden
    hparams = hparams.replace(ref_kl_coef=state.ref_kl_coef)  # the leash's beta of this update
    alpha = 1.0 - state.update / config.num_updates  # (a product, not optax's schedule: clip_eps may be inf)
    hparams = hparams.replace(clip_eps=jnp.where(hparams.anneal_clip, hparams.clip_eps * alpha, hparams.clip_eps))
    state, traj = collect_rollout(state, env, network, config.num_steps, hparams, setup.leash)
    advantages, targets = estimate_advantages(state.params, traj, config, env, network, hparams)
    recurrent = config.is_recurrent
    batch = make_batch(traj, advantages, targets, start_hidden, recurrent, parts)  # the whole agent's
    # This device's envs alone, for the KL pass (unsharded: the batch itself).
    own = make_batch(traj, advantages, targets, start_hidden, recurrent) if parts.shards > 1 else batch

    # Speed: every epoch's shuffle drawn in one vectorised call.
    shuffled = config.num_envs if recurrent else config.batch_size  # whole env sequences, or samples
    key, permutations = minibatch_orders(state.key, config.update_epochs, shuffled)
    tx, lr = build_optimizer(config, hparams, state.update, state.step_scale)
    if config.critic_apart:  # TRPO, VPG: the policy's own step, then the critic fitted by the epochs alone
        (params, opt_state, step_scale), diagnostics = policy_then_critic(state, tx, batch, own, traj, permutations,
                                                                          hparams, setup)
    else:  # PPO; A2C is its one epoch of one minibatch, at ratio 1: the policy gradient (validate)
        step_fn = functools.partial(minibatch_step, tx=tx, hparams=hparams, kl_coef=state.kl_coef, setup=setup)
        epoch = functools.partial(epoch_step, batch=batch, traj=traj, hparams=hparams, step_fn=step_fn, setup=setup)
        (params, opt_state, _), diagnostics = jax.lax.scan(epoch, (state.params, state.opt_state, jnp.array(False)),
                                                           permutations)
        step_scale = state.step_scale

    # PPO-Penalty: d = the exact mean KL between the old and the updated policy over the batch.
    new_kl = lambda part: jnp.mean(part.dist.kl(network.apply(params, part.obs, part.first, part.hidden).dist))  # noqa: E731
    kl = parts.mean(new_kl, own)
    kl_coef = jnp.where(hparams.kl_target > 0, adaptive_kl_coef(state.kl_coef, kl, hparams.kl_target), state.kl_coef)

    ended = traj.episode_end.astype(jnp.float32)
    sums = parts.device_sum({"episodes": jnp.sum(ended), "return": jnp.sum(ended * traj.episode_return),
                             "length": jnp.sum(ended * traj.episode_length), "ref_kl": jnp.mean(traj.ref_kl),
                             "ref_kl_sum": jnp.sum(traj.ref_kl),
                             **{name: jnp.sum(ended * value) for name, value in traj.episode_metrics.items()},
                             **({} if env.discrete else {"action_clip": action_clip_frac(traj.dist, traj.action, env)})})
    # The rollout's summed KL per episode ended: exactly the mean KL per episode when every episode
    # lies within a rollout (fixed-length episodes), a renewal-reward estimate of it otherwise.
    measured = (hparams.ref_kl_coef > 0) | setup.leash.measure
    ref_kl_seq = jnp.where(measured, sums["ref_kl_sum"] / sums["episodes"], jnp.nan)
    ref_kl_coef = jnp.where((hparams.ref_kl_target > 0) & (sums["episodes"] > 0),
                            adaptive_ref_kl_coef(state.ref_kl_coef, ref_kl_seq, sums["episodes"], hparams),
                            state.ref_kl_coef)
    grad_steps = diagnostics.pop("grad_steps")
    metrics = {  # one scalar each; NaN return/length when no episode ended in this update
        "episode_return": sums["return"] / sums["episodes"],
        "episode_length": sums["length"] / sums["episodes"],
        "episodes": sums["episodes"],
        **{name: jnp.mean(value) for name, value in diagnostics.items()},  # mean over epochs x minibatches
        "kl": kl,
        "kl_coef": state.kl_coef,  # the beta this update used
        "ref_kl": jnp.where(measured, sums["ref_kl"] / parts.shards, jnp.nan),  # mean over devices
        "ref_kl_seq": ref_kl_seq,
        "ref_kl_coef": state.ref_kl_coef,  # the leash's beta this update used
        **{name: sums[name] / sums["episodes"] for name in traj.episode_metrics},  # the env's own (ToyRLHF-v0)
        "grad_steps": jnp.sum(grad_steps),
        "explained_variance": (explained_variance(batch.value, batch.targets) if config.has_critic
                               else jnp.float32(jnp.nan)),  # critic-free: no values
        "learning_rate": lr,
        "param_norm": optax.tree.norm(params),  # after the update; non-finite: see the NaN guard
        **({} if env.discrete else {"action_clip_frac": sums["action_clip"] / parts.shards}),  # mean over devices
    }
    state = state.replace(params=params, opt_state=opt_state, kl_coef=kl_coef, ref_kl_coef=ref_kl_coef, key=key,
                          step_scale=step_scale, update=state.update + 1)
    return state, metrics


def action_clip_frac(dist, action, env: VecEnv):
    """The share of the rollout's action components that the env clipped to its box (VecEnv): a
    Gaussian's samples beyond the bounds; 0 for the squashed and Beta policies, which map into it."""
    taken = dist.env_action(action)
    low, high = env.action_low.ravel(), env.action_high.ravel()
    return jnp.mean(((taken < low) | (taken > high)).astype(jnp.float32))


def make_batch(traj: Transition, advantages, targets, start_hidden, recurrent: bool, parts: Parts | None = None) -> Batch:
    """What the update needs. Feedforward: flattened from [T, N, ...] to [B, ...] (B = T * N).
    Recurrent: kept time-major, with the reset flags and the state the rollout started from [N, H].
    With `parts` of sharded envs, gathered from every device's envs: the whole agent's batch."""
    batch = Batch(
        obs=traj.obs,
        first=traj.first if recurrent else None,
        hidden=start_hidden if recurrent else None,
        action=traj.action,
        log_prob=traj.log_prob,
        dist=traj.dist,
        value=traj.value,
        advantages=advantages,
        targets=targets,
        ref_log_prob=traj.ref_log_prob,
        ref_dist=traj.ref_dist,
    )
    batch = parts.all_envs(batch) if parts else batch
    return batch if recurrent else jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)


def epoch_step(carry, permutation, batch: Batch, traj: Transition, hparams: HParams, step_fn, setup: Setup):
    """One pass over the batch: a lax.scan of gradient steps over shuffled minibatches, their
    advantages normalised over each whole minibatch (--norm-adv). A minibatch is a uniformly shuffled
    set of samples (recurrent: of whole env sequences); a statistic over it belongs here (rule 2).
    Targets recomputed with each epoch's params (V-trace, PPG) go in epoch_targets. With sharded envs
    (setup.parts), `batch` is the whole agent's, and this device steps on its part of each minibatch."""
    params, num_minibatches, parts = carry[0], setup.config.num_minibatches, setup.parts
    batch = epoch_targets(params, batch, traj, hparams, setup)
    shuffle = shuffle_into_minibatches if batch.hidden is None else shuffle_sequences_into_minibatches
    own = parts.own_rows(permutation, num_minibatches)
    minibatches = shuffle(own, batch, num_minibatches)
    # The normalisation's statistics are the whole minibatch's (sharded: XLA drops the other fields' gathers).
    whole = (minibatches if own is permutation else shuffle(permutation, batch, num_minibatches)).advantages
    axes = tuple(range(1, whole.ndim))  # [M, ...]: the statistics of each minibatch
    mean, std = whole.mean(axes, keepdims=True), whole.std(axes, keepdims=True)
    advantages = minibatches.advantages
    normalised = (advantages - mean) / (std + 1e-8)
    minibatches = minibatches.replace(advantages=jnp.where(hparams.norm_adv, normalised, advantages))
    return jax.lax.scan(step_fn, carry, minibatches)


def epoch_targets(params, batch: Batch, traj: Transition, hparams: HParams, setup: Setup) -> Batch:
    """The hook before each epoch, with that epoch's params (the first: the rollout's): the batch as
    the epoch trains on it. PPO keeps the rollout's advantages and targets; V-trace or PPG recompute
    them here from `traj`, the rollout [T, N] (rewards processed, terminations, final observations,
    the behaviour policy's log-probs), into the batch's layout (feedforward: [T * N], t-major). With
    sharded envs, `traj` holds this device's envs and `batch` the whole agent's (setup.env.gather)."""
    return batch


def minibatch_step(carry, minibatch: Batch, tx: optax.GradientTransformation, hparams: HParams, kl_coef,
                   setup: Setup, loss=ppo_loss):
    """One gradient step of the optimizer `tx` (make_optimizer) on `loss`, unless --target-kl has stopped this
    update: a stopped step leaves the params and the optimizer's state as they were (a select over
    both trees, not a branch, so the whole update stays one program). The gradient and diagnostics
    are the mean of the minibatch's parts (rule 2): with sharded envs `minibatch` is this device's
    part, and every device takes the same step."""
    params, opt_state, stopped = carry
    grad = jax.grad(lambda params, part: loss(params, part, hparams, kl_coef, setup), has_aux=True)
    grads, diagnostics = setup.parts.mean(lambda part: grad(params, part), minibatch)
    approx_kl = diagnostics.get("approx_kl", 0.0)  # (a critic's loss has none: no stop)
    stopped = stopped | ((hparams.target_kl > 0) & (approx_kl > hparams.target_kl))
    diagnostics["grad_norm"] = optax.tree.norm(grads)  # before clipping; non-finite: see the NaN guard
    updates, new_opt_state = tx.update(grads, opt_state, params)
    params, opt_state = jax.tree.map(lambda old, new: jnp.where(stopped, old, new), (params, opt_state),
                                     (optax.apply_updates(params, updates), new_opt_state))
    diagnostics["grad_steps"] = 1.0 - stopped.astype(jnp.float32)
    return (params, opt_state, stopped), diagnostics


def shuffle_into_minibatches(permutation, batch: Batch, num_minibatches: int) -> Batch:
    """[B, ...] -> [M, B/M, ...] in the order of `permutation` (sampling without replacement)."""
    return jax.tree.map(lambda x: jnp.take(x, permutation, axis=0).reshape(num_minibatches, -1, *x.shape[1:]), batch)


def shuffle_sequences_into_minibatches(permutation, batch: Batch, num_minibatches: int) -> Batch:
    """Recurrent: [T, N, ...] -> [M, T, N/M, ...], whole env sequences in the order of `permutation`
    (over the N envs), each with the state it starts from: hidden [N, H] -> [M, N/M, H]."""
    def split(x, axis):
        x = jnp.take(x, permutation, axis=axis)
        return jnp.moveaxis(x.reshape(*x.shape[:axis], num_minibatches, -1, *x.shape[axis + 1:]), axis, 0)

    time_major = jax.tree.map(lambda x: split(x, 1), batch.replace(hidden=None))
    return time_major.replace(hidden=split(batch.hidden, 0))


# --- the other policy updates (--algo trpo, vpg: the PPO paper's Figure 3) -----------------------------


LINE_SEARCH_DECAY = 0.5  # TRPO's backtracking: the step times 1, 1/2, 1/4, ... (the TRPO paper's exponential decay)


def policy_then_critic(state: TrainState, tx: PolicyAndCritic, batch: Batch, own: Batch, traj: Transition,
                       permutations, hparams: HParams, setup: Setup):
    """--algo trpo and vpg: one step of the policy on the whole batch (trpo_step, vpg_step), then the
    critic fitted alone by PPO's epochs of minibatches on the value loss (critic_loss), with an
    optimizer of its own. -> ((params, opt_state, step_scale), diagnostics). The advantages are
    normalised over the whole batch (--norm-adv), as PPO's over each minibatch."""
    advantages = batch.advantages  # the whole agent's: the statistics; `own`, this device's part, steps
    normalised = (own.advantages - advantages.mean()) / (advantages.std() + 1e-8)
    own = own.replace(advantages=jnp.where(hparams.norm_adv, normalised, own.advantages))
    policy_state, critic_state = state.opt_state
    if setup.config.algo == "trpo":
        (params, policy_diagnostics), step_scale = trpo_step(state.params, own, hparams, setup), state.step_scale
    else:
        (params, policy_state, step_scale), policy_diagnostics = vpg_step(state, tx.policy, own, hparams, setup)
    if setup.config.has_critic:
        step_fn = functools.partial(minibatch_step, tx=tx.critic, hparams=hparams, kl_coef=0.0, setup=setup,
                                    loss=critic_loss)
        epoch = functools.partial(epoch_step, batch=batch, traj=traj, hparams=hparams, step_fn=step_fn, setup=setup)
        (params, critic_state, _), diagnostics = jax.lax.scan(epoch, (params, critic_state, jnp.array(False)),
                                                              permutations)
    else:  # critic-free advantages: nothing to fit
        diagnostics = {"value_loss": jnp.float32(jnp.nan), "grad_norm": jnp.float32(jnp.nan),
                       "grad_steps": jnp.zeros(())}
    return (params, (policy_state, critic_state), step_scale), {**diagnostics, **policy_diagnostics}


def critic_loss(params, batch: Batch, hparams: HParams, kl_coef, setup: Setup):
    """TRPO's and VPG's critic, fitted apart from the policy: value_loss alone (no --vf-coef: no other term
    to weigh it against)."""
    v_loss = value_loss(setup.network.apply(params, batch.obs, batch.first, batch.hidden).value, batch.value,
                        batch.targets, hparams)
    return v_loss, {"value_loss": v_loss}


def surrogate(params, batch: Batch, hparams: HParams, setup: Setup):
    """TRPO's and VPG's objective, to be maximised: the unclipped surrogate mean(r A) (at the rollout's
    params r = 1, and its gradient is the policy gradient) plus the entropy bonus -> (objective,
    diagnostics with the exact mean KL[pi_old || pi])."""
    dist = setup.network.apply(params, batch.obs, batch.first, batch.hidden).dist
    log_ratio = dist.log_prob(batch.action) - batch.log_prob
    ratio = jnp.exp(log_ratio)
    objective, entropy = jnp.mean(ratio * batch.advantages), jnp.mean(dist.entropy())
    return objective + hparams.ent_coef * entropy, {"policy_loss": -objective, "entropy": entropy,
                                                    "approx_kl": jnp.mean((ratio - 1.0) - log_ratio),
                                                    "kl": jnp.mean(batch.dist.kl(dist))}


def trpo_step(params, batch: Batch, hparams: HParams, setup: Setup):
    """TRPO (Schulman et al. 2015, Sec. 6 and Appendix C): the natural gradient x = (F + lambda I)^-1 g by
    conjugate gradient, g the surrogate's gradient and F the Fisher matrix, the Hessian of the mean
    KL[pi_old || pi] at the rollout's params (products F v forward-over-reverse, never F itself); the
    step s = sqrt(2 delta / x^T (F + lambda I) x) x, whose KL in the quadratic model is delta (--max-kl);
    then a backtracking line search that takes the first of s, s/2, s/4, ... whose surrogate improves
    and whose exact mean KL is within delta, and no step if none is. The critic's parameters have no
    gradient here (nor Fisher rows), so they stay. -> (params, diagnostics)."""
    parts, (flat, unravel) = setup.parts, ravel_pytree(params)
    measure = lambda x, part: surrogate(unravel(x), part, hparams, setup)  # noqa: E731
    gradient = parts.mean(lambda part: jax.grad(lambda x: measure(x, part)[0])(flat), batch)
    kl_gradient = lambda part: jax.grad(lambda x: measure(x, part)[1]["kl"])  # noqa: E731

    def fisher_product(v):  # (F + lambda I) v, F v = d/dt grad KL(flat + t v) at t = 0
        return parts.mean(lambda part: jax.jvp(kl_gradient(part), (flat,), (v,))[1], batch) + hparams.cg_damping * v

    direction, residual = conjugate_gradient(fisher_product, gradient, setup.config.cg_iterations)
    curvature = direction @ fisher_product(direction)  # x^T (F + lambda I) x
    step = direction * jnp.sqrt(2.0 * hparams.max_kl / jnp.where(curvature > 0, curvature, 1.0))
    before, diagnostics = parts.mean(lambda part: measure(flat, part), batch)
    fractions = LINE_SEARCH_DECAY ** jnp.arange(setup.config.line_search_steps, dtype=jnp.float32)
    objectives, tried = jax.lax.map(lambda f: parts.mean(lambda part: measure(flat + f * step, part), batch),
                                    fractions)
    accepted = (objectives > before) & (tried["kl"] <= hparams.max_kl)
    fraction = jnp.where(jnp.any(accepted), fractions[jnp.argmax(accepted)], 0.0)  # the first accepted, or none
    taken = jnp.where(jnp.any(accepted), tried["approx_kl"][jnp.argmax(accepted)], 0.0)
    return unravel(flat + fraction * step), {
        **{name: diagnostics[name] for name in ("policy_loss", "entropy")}, "approx_kl": taken,
        "clip_frac": jnp.float32(0.0), "line_search_fraction": fraction,
        "cg_residual": residual / (jnp.linalg.norm(gradient) + 1e-12)}


def conjugate_gradient(matvec, b, iterations: int):
    """x ~ A^-1 b for a symmetric positive definite A given as a product, matvec(v) = A v, by `iterations`
    steps of conjugate gradient from x = 0 (Nocedal and Wright, Algorithm 5.2), a lax.scan -> (x, the
    norm of the residual b - A x). A residual of exactly 0 ends the progress (no division by 0)."""
    def step(carry, _):
        x, r, p, rr = carry
        ap = matvec(p)
        curvature = p @ ap
        alpha = jnp.where(curvature > 0, rr / jnp.where(curvature > 0, curvature, 1.0), 0.0)
        x, r = x + alpha * p, r - alpha * ap
        rr_next = r @ r
        p = r + jnp.where(rr > 0, rr_next / jnp.where(rr > 0, rr, 1.0), 0.0) * p
        return (x, r, p, rr_next), None

    (x, _, _, rr), _ = jax.lax.scan(step, (jnp.zeros_like(b), b, b, b @ b), None, length=iterations)
    return x, jnp.sqrt(rr)


def vpg_step(state: TrainState, tx: optax.GradientTransformation, batch: Batch, hparams: HParams, setup: Setup):
    """The PPO paper's "vanilla PG, adaptive" (Sec. 6.1): one step of the optimizer on the policy gradient
    (the gradient of the unclipped surrogate at the rollout's params), at the learning rate times
    state.step_scale, which then follows the exact mean KL between the old and new policy towards
    --kl-target (adaptive_step_scale) -> ((params, the policy's optimizer state, step_scale), diagnostics)."""
    grads, diagnostics = setup.parts.mean(
        lambda part: jax.grad(lambda p: surrogate(p, part, hparams, setup), has_aux=True)(state.params), batch)
    grads = jax.tree.map(jnp.negative, grads)  # ascent on the surrogate
    updates, policy_state = tx.update(grads, state.opt_state[0], state.params)
    params = optax.apply_updates(state.params, updates)
    after = setup.parts.mean(lambda part: surrogate(params, part, hparams, setup)[1], batch)
    step_scale = jnp.where(hparams.kl_target > 0, adaptive_step_scale(state.step_scale, after["kl"], hparams.kl_target),
                           state.step_scale)
    return (params, policy_state, step_scale), {
        "policy_loss": diagnostics["policy_loss"], "entropy": diagnostics["entropy"], "approx_kl": after["approx_kl"],
        "clip_frac": jnp.float32(0.0), "step_scale": state.step_scale}


STEP_SCALE_BOUND = 100.0  # VPG's step size stays within [1/100, 100] x --lr (KL-adaptive learning rates are bounded)


def adaptive_step_scale(step_scale, kl, kl_target):
    """VPG's step size as the PPO paper adapts it (Sec. 6.1, "a rule similar to" Sec. 4's for beta, turned
    round): divided by 1.5 when KL > 1.5 d_targ, multiplied by 1.5 when KL < d_targ / 1.5; within
    STEP_SCALE_BOUND, so that a policy whose KL no step moves (one gone deterministic: no gradient) cannot
    grow it without end, to a step that overflows."""
    scale = jnp.where(kl > 1.5 * kl_target, step_scale / 1.5, jnp.where(kl < kl_target / 1.5, step_scale * 1.5,
                                                                         step_scale))
    return jnp.clip(scale, 1.0 / STEP_SCALE_BOUND, STEP_SCALE_BOUND)


def learning_rate(hparams: HParams, update, num_updates):
    """The learning rate of (0-based) update `update`: --lr, with --anneal-lr linearly towards 0 over
    the run (optax's linear schedule, by update as in CleanRL, so an update whose steps --target-kl
    skipped does not shift it)."""
    annealed = optax.linear_schedule(hparams.lr, 0.0, num_updates)(update)
    return jnp.where(hparams.anneal_lr, annealed, hparams.lr)


def explained_variance(predictions, targets):
    """1 - Var[targets - predictions] / Var[targets]: 1 is perfect, 0 no better than the mean."""
    return 1.0 - jnp.var(targets - predictions) / jnp.var(targets)


def make_optimizer(hparams: HParams, learning_rate, rule: str = "adam") -> optax.GradientTransformation:
    """The optimizer, and the one place to change it: global-norm clipping (--max-grad-norm), Adam
    (--adam-eps; `rule` rmsprop: RMSprop, --optimizer), then the step of size `learning_rate` (update_step
    passes this update's, from
    learning_rate(); a schedule over gradient steps, count -> lr, works too). build_optimizer calls it,
    for the state and the steps alike. It is built inside the traced update from traced HParams, so a
    sweep over --lr, --adam-eps or --max-grad-norm compiles once; the state's tree must not depend on
    their values.
    Parameter groups: optax.multi_transform with actor_critic_labels (README, "Hacking ppo_jax")."""
    scale = (optax.scale_by_adam(b1=0.9, b2=0.999, eps=hparams.adam_eps) if rule == "adam"
             else optax.scale_by_rms(decay=0.99, eps=hparams.adam_eps, eps_in_sqrt=False))  # g / (sqrt(v) + eps)
    return optax.chain(
        optax.clip_by_global_norm(hparams.max_grad_norm),
        scale,
        optax.scale_by_learning_rate(learning_rate),
    )


class PolicyAndCritic(NamedTuple):
    """--algo trpo and vpg: the policy's optimizer and the critic's, each with a state of its own
    (opt_state = (the policy's, the critic's)), each moving its own parameters alone
    (actor_critic_labels: a shared trunk is the policy's). TRPO's policy takes no optimizer's step."""

    policy: optax.GradientTransformation
    critic: optax.GradientTransformation

    def init(self, params):
        return self.policy.init(params), self.critic.init(params)


def build_optimizer(config: Config, hparams: HParams, update, step_scale=1.0):
    """-> (the optimizer of (0-based) update `update`, its learning rate): make_optimizer at
    learning_rate(). Where the optimizer is built, for its state (init_train_state, update 0) and
    for its steps (update_step): one place, so the two always agree. --algo trpo and vpg: a
    PolicyAndCritic (VPG's policy at the learning rate times its `step_scale`)."""
    lr = learning_rate(hparams, update, config.num_updates)
    tx = make_optimizer(hparams, lr, config.optimizer)
    if not config.critic_apart:
        return tx, lr
    only = lambda group, tx: optax.multi_transform({group: tx, **{other: optax.set_to_zero()  # noqa: E731
                                                                  for other in ("actor", "critic") if other != group}},
                                                   actor_critic_labels)
    policy = make_optimizer(hparams, lr * step_scale, config.optimizer) if config.algo == "vpg" else optax.set_to_zero()
    return PolicyAndCritic(only("actor", policy), only("critic", tx)), lr


def is_critic(path) -> bool:
    """Whether a parameter is the critic's alone, by its path in the params tree (a JAX key path, or
    "/"-joined names): a module on it is named critic* or value_* (ActorCritic names the critic's
    layers so; name a layer you add to the critic likewise). Loading a critic-free run's policy and
    the optimizer's parameter groups (actor_critic_labels) ask this, nowhere else."""
    names = path.split("/") if isinstance(path, str) else [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return any(name.startswith(("critic", "value_")) for name in names)  # (not an attention's `value`)


def actor_critic_labels(params):
    """The params tree with each leaf replaced by "critic" (is_critic) or "actor" (the rest: the policy,
    and a shared trunk or torso): the labels optax.multi_transform takes for two parameter groups."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "critic" if is_critic(path) else "actor", params)


# --- make_train: init, then one lax.scan over updates ---------------------------------------------


def make_env(config: Config) -> VecEnv:
    return vec_env(config.env, config.num_envs, config.env_params)


def make_network(config: Config, env: VecEnv) -> ActorCritic:
    torso = env.default_torso if config.torso == "auto" else config.torso
    image_start, image_shape = env.image if torso in ("cnn", "nature") else (0, None)
    bounds = {} if env.discrete else dict(action_low=tuple(env.action_low.ravel().tolist()),
                                          action_high=tuple(env.action_high.ravel().tolist()))
    return ActorCritic(env.action_dim, env.discrete, tuple(config.hidden_sizes), config.activation,
                       config.shared_trunk, image_shape=image_shape, image_start=image_start,
                       recurrent_size=config.recurrent_size if config.is_recurrent else 0,
                       recurrent_cell=config.recurrent, critic=config.has_critic,
                       action_mask=env.action_mask_size > 0, action_nvec=env.action_nvec,
                       action_dist=config.action_dist, state_std=config.state_std,
                       image_torso="nature" if torso == "nature" else "conv",
                       sequence=env.sequence if torso == "transformer" else (),
                       transformer=tuple(config.transformer), **bounds)


def init_policy(key, env: VecEnv, network: ActorCritic, hparams: HParams, obs) -> Policy:
    """Fresh params (orthogonal or default init, by hparams.ortho_init; a Gaussian's log std at
    hparams.log_std_init, in every state for --state-std) and empty statistics. A Python bool
    ortho_init compiles that init alone; a traced one (it differs across a batch of agents) compiles
    both and selects (compile time: each init is its own XLA compile)."""
    inputs = (obs[None], jnp.ones((1, len(obs)), bool), initial_hidden(network, len(obs)))  # one step of [N] envs
    if isinstance(hparams.ortho_init, bool):
        params = network.clone(orthogonal_init=hparams.ortho_init).init(key, *inputs)
    else:
        orthogonal = network.init(key, *inputs)
        default = network.clone(orthogonal_init=False).init(key, *inputs)
        params = jax.tree.map(lambda a, b: jnp.where(hparams.ortho_init, a, b), orthogonal, default)
    layers = params["params"]
    if "log_std" in layers:  # a Gaussian policy (continuous actions), its std a parameter
        params = {**params, "params": {**layers, "log_std": jnp.full_like(layers["log_std"], hparams.log_std_init)}}
    if "std_head" in layers:  # --state-std: softplus(head) + MIN_STD, the head's bias set to give exp(log_std_init)
        softplus = jnp.maximum(jnp.exp(hparams.log_std_init) - MIN_STD, 1e-6)
        bias = jnp.full_like(layers["std_head"]["bias"], jnp.log(jnp.expm1(softplus)))  # softplus's inverse
        params = {**params, "params": {**layers, "std_head": {**layers["std_head"], "bias": bias}}}
    return Policy(params, RunningStats.zeros((env.obs_dim,), env.action_mask_size))


def init_train_state(key, config: Config, env: VecEnv, network: ActorCritic, hparams: HParams,
                     initial: Policy | None = None, reference: Policy | None = None) -> TrainState:
    """The state before the first update: `initial` (default: a fresh policy) is where training
    starts; `reference` (default: that same starting policy) is the KL leash's pi_ref."""
    key, init_key, reset_key = jax.random.split(key, 3)
    obs, env_state = env.reset(reset_key)
    initial = init_policy(init_key, env, network, hparams, obs) if initial is None else initial
    reference = initial if reference is None else reference
    return TrainState(
        params=initial.params,
        opt_state=build_optimizer(config, hparams, 0)[0].init(initial.params),
        env_state=env_state,
        obs=obs,
        hidden=initial_hidden(network, env.num_envs),
        obs_stats=initial.obs_stats,
        reward_stats=RunningStats.zeros(),
        discounted_return=jnp.zeros(env.num_envs, jnp.float32),
        kl_coef=jnp.asarray(hparams.kl_coef, jnp.float32),
        step_scale=jnp.ones((), jnp.float32),
        ref_kl_coef=jnp.asarray(hparams.ref_kl_coef, jnp.float32),
        reference=reference,
        ref_hidden=initial_hidden(network, env.num_envs),
        key=key,
        update=jnp.zeros((), jnp.int32),
    )


def train_updates(state: TrainState, hparams: HParams, length: int, num_active=None, *, config: Config,
                  env: VecEnv, network: ActorCritic):
    """`length` updates as one lax.scan -> (state, metrics, each [length]). With `num_active` (an int32
    scalar, the same for every agent of a batch), the updates from index num_active on are skipped
    and their metrics are NaN: so a run's last, shorter chunk reuses the chunk's compiled program.
    The skip is a lax.cond on an unbatched predicate, so under vmap it still runs one branch."""
    step = functools.partial(update_step, config=config, env=env, network=network, hparams=hparams)
    if num_active is None:
        return jax.lax.scan(step, state, None, length=length)
    step = jax.jit(step)  # traced once, not twice: eval_shape and the cond share the trace (compile time)
    shapes = jax.eval_shape(step, state, None)[1]
    skip = lambda state: (state, jax.tree.map(lambda m: jnp.full(m.shape, jnp.nan, m.dtype), shapes))  # noqa: E731
    body = lambda state, i: jax.lax.cond(i < num_active, lambda s: step(s, None), skip, state)  # noqa: E731
    return jax.lax.scan(body, state, jnp.arange(length))


def make_train_parts(config: Config, shards: int = 1):
    """The two programs a run is made of: init(key, hparams) -> TrainState, and
    advance(state, hparams, length, num_active=None) -> (TrainState, metrics [length]), which a
    checkpointed run calls once per chunk of updates. Policies named by --init-params and
    --ref-params are read here and become constants of the program. With shards > 1, advance is
    the program of one of the devices an agent's envs are sharded over (inside run_batch's
    shard_map): its state holds that device's envs; init's holds all of them."""
    env = make_env(config)
    network = make_network(config, env)
    own_envs = env if shards == 1 else vec_env(config.env, config.num_envs // shards, config.env_params, shards)
    initial = load_policy(config, env, network, config.init_params, "--init-params")
    reference = load_policy(config, env, network, config.ref_params, "--ref-params")

    def init(key, hparams: HParams) -> TrainState:
        return init_train_state(key, config, env, network, hparams, initial, reference)

    advance = functools.partial(train_updates, config=config, env=own_envs, network=network)
    return init, advance


def make_train(config: Config):
    """Returns the pure function train(key, hparams) -> (TrainState, metrics): init, then all the
    updates in one lax.scan.

    Only `config`'s static fields shape the program; `config.hparams` is not read here. The
    metrics are a dict of float32 arrays of shape [num_updates]. A run split into chunks of updates
    (run_batch, --checkpoint-every) gives bit-identical results to its two halves compiled as
    run_batch compiles them (init with init_xla_options, the updates with xla_options): the tests
    check it. Jitted as one program, train's init is optimised with the rest, so its floats can
    differ from run_batch's in the last bits.
    """
    init, advance = make_train_parts(config)

    def train(key, hparams: HParams):
        return advance(init(key, hparams), hparams, config.num_updates)

    return train


def read_policies(config: Config, env: VecEnv, network: ActorCritic, path: str, flag: str) -> Policy:
    """Every seed of a params.msgpack written by an earlier run (leaves [seeds, ...]), checked
    against this run's network; a ConfigError names what does not fit. No pickle: msgpack only."""
    template = jax.eval_shape(
        lambda key: init_policy(key, env, network, HParams(), jnp.zeros((1, env.obs_dim))), jax.random.PRNGKey(0)
    )
    given = path
    if os.path.isdir(path):  # a run directory (or a sweep's point-K): its params.msgpack
        path = os.path.join(path, "params.msgpack")
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {given}: a directory without params.msgpack: give a finished run's directory "
                              "(a sweep's: SWEEP_DIR/setting-S/point-K) or a params.msgpack")
    try:
        with open(path, "rb") as f:
            saved = serialization.msgpack_restore(f.read())
    except OSError as error:
        raise ConfigError(f"{flag} {path}: cannot read it ({error.strerror})") from None
    except Exception:  # msgpack raises several types on garbage
        raise ConfigError(f"{flag} {path}: not a params.msgpack written by ppo_jax") from None
    expected = flax.traverse_util.flatten_dict(serialization.to_state_dict(template), sep="/")
    found = flax.traverse_util.flatten_dict(saved, sep="/") if isinstance(saved, dict) else {}
    if not network.critic:  # a critic-free run starts from (or is leashed to) the policy of a run with a critic
        found = {name: value for name, value in found.items() if not is_critic(name)}
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    saved_env = None  # the env of the run that wrote it, from its config.json beside it
    with contextlib.suppress(OSError, ValueError, AttributeError):
        with open(os.path.join(os.path.dirname(path), "config.json")) as f:
            saved_env = json.load(f).get("env")
    another_env = (f"a policy of {saved_env} (its run's config.json), and this run is on {config.env}: give a "
                   f"{config.env} run's params" if saved_env not in (None, config.env) else None)
    if missing or extra:
        raise ConfigError(f"{flag} {path}: " + (another_env or (
            f"its parameters do not match this network (missing {missing[:3]}, unexpected {extra[:3]}): another "
            "--env, or other --hidden-sizes / --shared-trunk / --recurrent / --torso / --transformer than the run that "
            "saved it?")))
    num_seeds = {np.shape(value)[0] if np.ndim(value) else 0 for value in found.values()}
    if len(num_seeds) != 1 or 0 in num_seeds:
        raise ConfigError(f"{flag} {path}: its entries hold different numbers of seeds {sorted(num_seeds)}: corrupt?")
    for name, leaf in expected.items():
        shape = tuple(np.shape(found[name])[1:])
        if shape != leaf.shape:
            raise ConfigError(f"{flag} {path}: " + (another_env or f"{name} has shape {shape}, this run's network "
                                                    f"needs {leaf.shape} (another --env, --hidden-sizes or "
                                                    "--transformer?)"))
    arrays = {name: np.asarray(value, np.float32) for name, value in found.items()}
    return serialization.from_state_dict(template, flax.traverse_util.unflatten_dict(arrays, sep="/"))


def load_policy(config: Config, env: VecEnv, network: ActorCritic, path: str | None, flag: str) -> Policy | None:
    """Seed `config.params_index` of a params.msgpack (see read_policies); None without a path."""
    if path is None:
        return None
    policies = read_policies(config, env, network, path, flag)
    num_seeds = len(policies.obs_stats.count)
    if not config.params_index < num_seeds:
        raise ConfigError(f"{flag} {path}: holds {num_seeds} seed(s); --params-index {config.params_index} "
                          "must be smaller")
    return jax.tree.map(lambda x: jnp.asarray(x[config.params_index]), policies)


# ================================================================================================
# 3. Environments: gymnax vmapped over envs, and Brax through gymnax's interface
# ================================================================================================


@struct.dataclass
class EnvState:
    env_state: Any  # the gymnax state, batched over envs
    episode_return: jax.Array  # [N] return of the running episode so far
    episode_length: jax.Array  # [N]

    @property
    def first(self):  # [N] bool: the current observation begins an episode (a recurrent policy resets there)
        return self.episode_length == 0


def override_env_params(env_params, overrides: Sequence[str]):
    """Apply "name=value" overrides to a gymnax EnvParams, keeping each field's type (number or string)."""
    fields = {field.name: getattr(env_params, field.name) for field in dataclasses.fields(env_params)
              if getattr(env_params, field.name) is not None}  # (None: a table the env builds itself)
    changes = {}
    for item in overrides:
        name, _, text = item.partition("=")
        if name not in fields or not text:
            raise ConfigError(f"--env-params {item!r}: give name=value with a name from {sorted(fields)}")
        kind = type(fields[name]) if isinstance(fields[name], bool | int | float | str) else float
        try:
            changes[name] = parse_bool(text, f"--env-params {item!r}") if kind is bool else kind(text)
        except ValueError:
            raise ConfigError(f"--env-params {item!r}: {name} needs a {kind.__name__} value") from None
        if name == "max_steps_in_episode" and changes[name] < 1:
            raise ConfigError(f"--env-params {item!r}: the time limit must be a positive number of steps")
    return env_params.replace(**changes)


def is_discrete(space) -> bool:
    """Whether an action space is discrete: a Discrete, or a Tuple of them (a multi-discrete action)."""
    return isinstance(space, spaces.Discrete) or bool(getattr(space, "spaces", ()))


ENV_AXIS = "envs"  # the mesh axis over which run_batch shards an agent's envs (--env-devices)


class VecEnv:
    """A gymnax env vmapped over `num_envs`, with thin, pure additions: observations flattened to
    float32 vectors; continuous actions clipped to the action space's bounds (the policy's log-prob
    stays that of the unclipped sample); per-env episode return and length, reported in `info` at
    the step an episode ends; and automatic resets to states drawn in advance.

    gymnax's own `step` draws a reset state at every step (and throws it away unless the episode
    ended): two threefry hashes per step, each a 5-iteration loop of small ops on CPU, which were
    most of a CartPole step's cost. So VecEnv does the reset itself, from `resets` that a rollout
    draws for all its steps in one vectorised call (`resets`). Same semantics: where an episode
    ends, the next observation is a fresh start and `info["final_observation"]` the one before it.
    An env that overrides gymnax's `step` (bsuite's DeepSea keeps metrics across resets) is stepped
    through its own `step` instead. A Brax env's reset builds a physics state, too costly to draw for
    every step: `resets` are then reset keys, and the envs are reset on the steps where one ended.

    With shards > 1, the VecEnv is one device's share of an agent's envs, inside a shard_map over
    ENV_AXIS (run_batch, --env-devices): it steps num_envs of the agent's num_envs x shards envs,
    and its draws are those of the whole set, of which it keeps its own part (`own`), so each env
    gets the same randomness as in an unsharded run.
    """

    def __init__(self, env_id: str, num_envs: int, env_params: Sequence[str] = (), shards: int = 1):
        self.env, self.env_params = make_gymnax(env_id, env_params)
        self.lazy_resets = getattr(self.env, "lazy_resets", False)
        self.num_envs = num_envs  # the envs stepped here
        self.shards = shards
        action_space = self.env.action_space(self.env_params)
        # A Tuple of Discrete spaces is a multi-discrete action: a factorised Categorical, its logits side by side.
        self.action_nvec = tuple(int(space.n) for space in getattr(action_space, "spaces", ()))
        self.discrete = is_discrete(action_space)
        if self.discrete:
            self.action_dim = sum(self.action_nvec) if self.action_nvec else int(action_space.n)
        else:
            self.action_shape = tuple(action_space.shape)
            self.action_dim = int(np.prod(self.action_shape))
            self.action_low = np.broadcast_to(np.asarray(action_space.low, np.float32), self.action_shape)
            self.action_high = np.broadcast_to(np.asarray(action_space.high, np.float32), self.action_shape)
        self.obs_shape = tuple(self.env.observation_space(self.env_params).shape)
        self.obs_dim = int(np.prod(self.obs_shape))
        # (first column, (H, W, C)) of an image in the flat observation, for the conv torso: an image
        # observation, or the grid field an adapter knows of (Jumanji's); None: no image.
        self.image = (0, self.obs_shape) if len(self.obs_shape) == 3 else getattr(self.env, "image_columns", None)
        self.image_by_default = len(self.obs_shape) == 3 or getattr(self.env, "image_by_default", False)
        self.default_torso = "cnn" if self.image_by_default else "mlp"  # --torso auto
        # (vocab, length) of a response the observation holds, for --torso transformer (ToyRLHF's); (): none
        self.sequence = getattr(self.env, "sequence", lambda params: ())(self.env_params)
        self.own_step = type(self.env).step is not GymnaxEnvironment.step
        self.episode_metrics = getattr(self.env, "episode_metrics", ())  # info entries reported where episodes end
        self.action_mask_size = getattr(self.env, "action_mask_size", 0)  # the obs's last columns: 1 = a legal action
        # Lazy resets from a pool (Craftax's optimistic resets): each block of reset_ratio envs shares one fresh
        # start per step, so a step builds num_envs / reset_ratio worlds; blocks lie within a device's envs.
        self.reset_ratio = math.gcd(int(getattr(self.env_params, "reset_ratio", 1)), num_envs)

    def _flat(self, obs):  # [..., *obs_shape] -> [..., obs_dim] float32
        batch_shape = obs.shape[:obs.ndim - len(self.obs_shape)]
        return obs.reshape(*batch_shape, self.obs_dim).astype(jnp.float32)

    def _reset(self, keys):  # keys [..., N] -> flat obs [..., N, obs_dim], gymnax states [..., N]
        reset = functools.partial(self.env.reset_env, params=self.env_params)
        for _ in range(keys.ndim - 1):
            reset = jax.vmap(reset)
        obs, env_state = reset(keys)
        return self._flat(obs), env_state

    def _fresh(self, keys):  # lazy resets: keys [N] -> fresh starts for the N envs, one per block of reset_ratio
        if self.reset_ratio == 1:
            return self._reset(keys)
        pool = self._reset(keys[::self.reset_ratio])
        return jax.tree.map(lambda x: jnp.repeat(x, self.reset_ratio, axis=0), pool)

    def gather(self, x, axis: int = 1):
        """Every device's part of x, whose `axis` runs over this device's envs: all num_envs x shards
        envs in order, the whole agent's (unsharded: x)."""
        return gather_envs(x, self.shards, axis)

    def own(self, x, axis: int = 1):
        """This device's part of x, whose `axis` runs over all num_envs x shards envs (x itself unsharded)."""
        if self.shards == 1:
            return x
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(ENV_AXIS) * self.num_envs, self.num_envs, axis)

    def reset(self, key) -> tuple[jax.Array, EnvState]:
        obs, env_state = self._reset(self.own(jax.random.split(key, self.num_envs * self.shards), axis=0))
        zeros = jnp.zeros(self.num_envs, jnp.float32)
        return obs, EnvState(env_state, zeros, jnp.zeros(self.num_envs, jnp.int32))

    def episode_limit(self, default: int = 10_000) -> int:
        """The env's time limit in steps (`default` for an env without one)."""
        return int(getattr(self.env_params, "max_steps_in_episode", default))

    def resets(self, keys):
        """Fresh starts for every env at each of num_steps steps, from keys [num_steps, all envs] (all:
        num_envs x shards), in one vectorised call: (flat obs [num_steps, N, obs_dim], gymnax states
        [num_steps, N]); with lazy resets (Brax), only their keys [num_steps, N]."""
        keys = self.own(keys)
        return keys if self.lazy_resets else self._reset(keys)

    def draw_resets(self, key, num_steps: int):
        """resets() from keys split from `key`."""
        return self.resets(jax.random.split(key, (num_steps, self.num_envs * self.shards)))

    def step(self, keys, state: EnvState, action, resets):
        """keys: [N] keys for the env's own randomness; action: [N] int32 (discrete) or
        [N, action_dim] float32 (continuous, unclipped); resets: one step of resets(), the
        states envs whose episode ends now continue from."""
        action = self.bounded(action)
        if self.own_step:
            obs, env_state, reward, terminated, truncated, info = jax.vmap(
                self.env.step, in_axes=(0, 0, 0, None)
            )(keys, state.env_state, action, self.env_params)
            final_obs, obs = self._flat(info["final_observation"]), self._flat(obs)
            env_info = info
        else:
            final_obs, env_state, reward, terminated, env_info = jax.vmap(
                self.env.step_env, in_axes=(0, 0, 0, None)
            )(keys, state.env_state, action, self.env_params)
            truncated = jax.vmap(self.env.is_truncated, in_axes=(0, None))(env_state, self.env_params)
            final_obs = obs = self._flat(final_obs)
        reward = reward.astype(jnp.float32)
        terminated = terminated.astype(bool)
        truncated = truncated.astype(bool)
        done = terminated | truncated
        if not self.own_step:  # where an episode ended, continue from the drawn fresh start
            select = jax.vmap(lambda d, fresh, old: jax.tree.map(lambda a, b: jax.lax.select(d, a, b), fresh, old))
            if self.lazy_resets:  # reset only on steps where some episode ended (under vmap: always)
                reset_ended = lambda: select(done, self._fresh(resets), (obs, env_state))  # noqa: E731
                obs, env_state = jax.lax.cond(jnp.any(done), reset_ended, lambda: (obs, env_state))
            else:
                obs, env_state = select(done, resets, (obs, env_state))
        metrics = {name: env_info[name].astype(jnp.float32) for name in self.episode_metrics}
        state, info = self.account(state, env_state, reward, done, final_obs, metrics)
        return obs, state, reward, terminated, truncated, info

    def bounded(self, action):
        """The policy's action as the env takes it: continuous ones [N, *action_shape], clipped to its bounds."""
        if self.discrete:
            return action
        return jnp.clip(action.reshape(self.num_envs, *self.action_shape), self.action_low, self.action_high)

    @staticmethod
    def account(state: EnvState, env_state, score, episode_end, final_obs, episode_metrics) -> tuple[EnvState, dict]:
        """The episode accounting every VecEnv shares: the running return (of `score`: the reward, or Atari's
        unclipped game score) and length, reported in info and restarted where the reported episode ends
        (`episode_end`) -> (the next EnvState, with env_state, info)."""
        episode_return = state.episode_return + score
        episode_length = state.episode_length + 1
        info = {
            "final_observation": final_obs,
            "episode_return": episode_return,  # meaningful where episode_end
            "episode_length": episode_length,
            "episode_metrics": episode_metrics,
            "episode_end": episode_end,  # the episode reported (its return and length) ended here
        }
        return EnvState(env_state, jnp.where(episode_end, 0.0, episode_return),
                        jnp.where(episode_end, 0, episode_length)), info


# A Brax env seen through gymnax's interface, so VecEnv and everything after it treat it as any other
# continuous-control env. brax is imported only here, only when asked for.
BRAX_PREFIX = "brax:"


BRAX_BACKENDS = ("generalized", "positional", "spring", "mjx")


# Brax envs that cannot run with the pinned JAX, and why (refused in one line by check_env_id).
BRAX_BROKEN = {"swimmer": "its fluid forces call jnp.clip(a_min=...), which JAX 0.10 removed (brax 0.14.2)"}


BRAX_INSTALL = "pip install -r requirements-brax.txt"


@struct.dataclass
class BraxEnvParams(GymnaxEnvParams):
    max_steps_in_episode: int = 1000  # the time limit: truncation, flagged apart from termination
    backend: str = struct.field(pytree_node=False, default="generalized")  # Brax's physics pipeline


@struct.dataclass
class BraxEnvState(GymnaxEnvState):  # and gymnax's `time`: steps since the reset
    brax: Any = None  # brax.envs.State: the physics state, obs, reward, done


class BraxEnv(GymnaxEnvironment):
    """A raw Brax env (no Brax wrappers): Brax's `done` is the termination (e.g. a fallen hopper); the
    time limit is gymnax's (state.time >= max_steps_in_episode: truncation), and resets are VecEnv's,
    so the final observation is kept and truncation bootstraps. Actions are in [-1, 1]."""

    lazy_resets = True  # a reset builds a physics state: VecEnv resets only where an episode ended

    def __init__(self, name: str, backend: str):
        super().__init__()
        self.brax_name = name
        self.brax_env = brax_environment(name, backend)

    @property
    def default_params(self) -> BraxEnvParams:
        return BraxEnvParams()

    @staticmethod
    def policy_obs(obs):  # the suite's observation -> what the policy sees
        return obs

    def reset_env(self, key, params):
        state = traced_once(self.brax_env.reset)(key)
        return self.policy_obs(state.obs), BraxEnvState(brax=state, time=jnp.zeros((), jnp.int32))

    def step_env(self, key, state, action, params):
        brax_state = traced_once(self.brax_env.step)(state.brax, action)
        next_state = BraxEnvState(brax=brax_state, time=state.time + 1)
        return self.policy_obs(brax_state.obs), next_state, brax_state.reward, brax_state.done > 0.5, {}

    @property
    def name(self) -> str:
        return BRAX_PREFIX + self.brax_name

    def action_space(self, params=None):
        return spaces.Box(-1.0, 1.0, (self.brax_env.action_size,), jnp.float32)

    def observation_space(self, params):
        return spaces.Box(-jnp.inf, jnp.inf, (self.brax_env.observation_size,), jnp.float32)


@functools.cache
def traced_once(function):
    """A Brax env's reset or step as one jax.jit per process, so that every program that calls it again
    (init, updates, evaluation; a second run) reuses its trace: an MJX step takes seconds to trace (its
    lowering: docs/speed.md)."""
    return jax.jit(function)


@functools.cache
def brax_environment(name: str, backend: str):
    """Brax's env, built once per process (building its physics system takes seconds: 10 s for the
    generalized inverted pendulum here, and every program of a run makes its env)."""
    from brax import envs as brax_envs  # the optional dependency

    return brax_envs.get_environment(name, backend=backend)


def brax_names() -> list[str]:
    from brax import envs as brax_envs

    return sorted(brax_envs._envs)  # Brax's registry has no public listing


# A MuJoCo Playground env (the playground package: --env playground:CartpoleBalance), which speaks Brax's
# interface: BraxEnv with the suite's own registry. playground is imported only here, only when asked for.
PLAYGROUND_PREFIX = "playground:"


PLAYGROUND_IMPLS = ("jax", "warp")


PLAYGROUND_INSTALL = "pip install -r requirements-playground.txt"


@struct.dataclass
class PlaygroundParams(GymnaxEnvParams):
    max_steps_in_episode: int = 0  # the time limit; make_gymnax sets the suite's own episode_length (1000)
    impl: str = struct.field(pytree_node=False, default="jax")  # MJX's: jax (any device) or warp (CUDA GPUs)


class PlaygroundEnv(BraxEnv):
    """A MuJoCo Playground env through BraxEnv: the suite's `done` is the termination (a fall; a NaN in
    the physics), its episode_length gymnax's time limit (truncation: it bootstraps), resets VecEnv's,
    actions in [-1, 1]. The DM Control Suite tasks observe one vector; where an env's observation is a
    dict (locomotion's actor and critic views), the policy gets its "state" entry."""

    def __init__(self, name: str, impl: str):
        GymnaxEnvironment.__init__(self)
        self.brax_name = name
        self.brax_env, self.episode_length = playground_environment(name, impl)

    @property
    def default_params(self) -> PlaygroundParams:
        return PlaygroundParams(max_steps_in_episode=self.episode_length)

    @staticmethod
    def policy_obs(obs):
        return obs["state"] if isinstance(obs, dict) else obs

    @property
    def name(self) -> str:
        return PLAYGROUND_PREFIX + self.brax_name

    def observation_space(self, params):
        size = self.brax_env.observation_size
        shape = tuple(size["state"]) if isinstance(size, dict) else (size,)
        return spaces.Box(-jnp.inf, jnp.inf, shape, jnp.float32)


@functools.cache
def playground_environment(name: str, impl: str):
    """(the suite's env, its episode_length), built once per process."""
    from mujoco_playground import registry  # the optional dependency

    env = registry.load(name, config_overrides={"impl": impl})
    return env, int(registry.get_default_config(name).episode_length)


def playground_impl(overrides: Sequence[str]) -> str:  # --env-params impl=..., before the env (and its limit) exists
    return override_env_params(PlaygroundParams(max_steps_in_episode=1), overrides).impl


def playground_names() -> list[str]:
    from mujoco_playground import registry

    return sorted(registry.ALL_ENVS)


# An XLand-MiniGrid env (the xminigrid package: --env xminigrid:MiniGrid-Empty-8x8) seen through gymnax's
# interface. xminigrid is imported only here, only when asked for.
XMINIGRID_PREFIX = "xminigrid:"


XMINIGRID_INSTALL = "pip install -r requirements-xminigrid.txt"


@struct.dataclass
class XMiniGridParams(GymnaxEnvParams):
    max_steps_in_episode: int = 0  # the time limit; make_gymnax sets the suite's own (e.g. 4 x height x width)


@struct.dataclass
class XMiniGridState(GymnaxEnvState):  # and gymnax's `time`: xminigrid's step_num
    timestep: Any  # the suite's TimeStep: its State and observation


class XMiniGridEnv(GymnaxEnvironment):
    """An XLand-MiniGrid env, stepped by its own reset(params, key) and step(params, timestep, action).
    dm_env's convention: a LAST step with discount 0 is the termination (the goal reached); one with
    discount 1 the suite's time limit, which is gymnax's here (state.time = step_num >= max_steps:
    truncation, so it bootstraps). The reward is the suite's (1 - 0.9 x steps / limit at the goal).
    Observations: the agent's egocentric view, [V, V, 2] integer tiles and colours, as a one-hot
    float image [V, V, NUM_TILES + NUM_COLORS] (a Dense layer on it is the suite's baseline's tile and
    colour embeddings summed over the view; --torso cnn takes it as an image)."""

    def __init__(self, name: str):
        super().__init__()
        import xminigrid  # the optional dependency
        from xminigrid.core.constants import NUM_COLORS, NUM_TILES

        self.xminigrid_name = name
        self.xminigrid_env, self.xminigrid_params = xminigrid.make(name)
        self.num_tiles, self.num_colors = int(NUM_TILES), int(NUM_COLORS)

    def suite_params(self, params: XMiniGridParams):
        return self.xminigrid_params.replace(max_steps=int(params.max_steps_in_episode))

    def encode(self, obs):  # [V, V, 2] uint8 -> [V, V, tiles + colours] one-hot float32
        return jnp.concatenate([jax.nn.one_hot(obs[..., 0], self.num_tiles),
                                jax.nn.one_hot(obs[..., 1], self.num_colors)], axis=-1)

    @property
    def default_params(self) -> XMiniGridParams:
        return XMiniGridParams(max_steps_in_episode=int(self.xminigrid_params.max_steps))

    def reset_env(self, key, params):
        timestep = self.xminigrid_env.reset(self.suite_params(params), key)
        return self.encode(timestep.observation), XMiniGridState(timestep=timestep, time=timestep.state.step_num)

    def step_env(self, key, state, action, params):
        timestep = self.xminigrid_env.step(self.suite_params(params), state.timestep, action)
        terminated = timestep.last() & (timestep.discount == 0)
        next_state = XMiniGridState(timestep=timestep, time=timestep.state.step_num)
        return self.encode(timestep.observation), next_state, timestep.reward, terminated, {}

    @property
    def name(self) -> str:
        return XMINIGRID_PREFIX + self.xminigrid_name

    def action_space(self, params=None):
        return spaces.Discrete(self.xminigrid_env.num_actions(self.xminigrid_params))

    def observation_space(self, params):
        view = self.xminigrid_params.view_size
        return spaces.Box(0.0, 1.0, (view, view, self.num_tiles + self.num_colors), jnp.float32)


def xminigrid_names() -> list[str]:
    """The ids --env xminigrid: takes: the suite's MiniGrid-* ports (its XLand-MiniGrid-R* envs need a
    benchmark's rulesets, a download: not yet)."""
    import xminigrid

    return [name for name in xminigrid.registered_environments() if name.startswith("MiniGrid-")]


# A Jumanji env (the jumanji package: --env jumanji:Snake-v1) seen through gymnax's interface. jumanji
# is imported only here, only when asked for.
JUMANJI_PREFIX = "jumanji:"


JUMANJI_INSTALL = "pip install -r requirements-jumanji.txt"


JUMANJI_MAX_ACTIONS = 4096  # a multi-discrete action is one categorical over the product of its parts


# The envs whose grid goes through the conv torso by default (--torso auto), where it was measured to help; --torso
# cnn takes any env's grid (docs/results.md, "Jumanji": Tetris's lines fell with it at a CPU budget).
JUMANJI_GRID_TORSO = ("Snake-v1",)


@struct.dataclass
class JumanjiParams(GymnaxEnvParams):
    max_steps_in_episode: int = 0  # the time limit; make_gymnax sets the suite's own (or 10,000 where it has none)


@struct.dataclass
class JumanjiState(GymnaxEnvState):  # and gymnax's `time`: steps since the reset
    suite: Any  # jumanji's State
    suite_truncated: jax.Array = False  # the suite ended the episode with discount 1 (its own time limit)


class JumanjiEnv(GymnaxEnvironment):
    """A Jumanji env, stepped by its own reset(key) -> (state, timestep) and step(state, action).
    dm_env's convention: a LAST step with discount 0 is the termination; one with discount 1 the
    suite's time limit, a truncation (it bootstraps), as is gymnax's own (state.time >=
    max_steps_in_episode). Observations: the suite's structured observation, each field but the mask
    flattened to float32 and concatenated in the suite's order; its `action_mask` goes last, raw
    (action_mask_size columns: the network masks its logits with them, Huang & Ontanon 2022, and
    RunningStats leaves them unnormalised). A multi-discrete action whose mask is over the joint action
    (Tetris, BinPack, Minesweeper) is one categorical over the product of its parts (exact under that
    mask); one whose mask is per component (the agents of Cleaner, RobotWarehouse, LevelBasedForaging,
    Connector; JobShop's machines), or too many joint values, a factorised categorical (a Tuple action
    space). A multi-agent env's per-agent rewards are summed (one policy, the team's reward), and its
    episode ends with all its agents' (discount 0 for every agent: terminated)."""

    def __init__(self, name: str):
        super().__init__()
        import jumanji  # the optional dependency

        self.jumanji_name = name
        self.jumanji_env = jumanji.make(name)
        num_values = getattr(self.jumanji_env.action_spec, "num_values", 1)  # none: continuous (check_env_id refuses)
        self.num_values = tuple(int(n) for n in np.ravel(num_values))
        self.multi_discrete = np.ndim(num_values) > 0
        observation = jax.eval_shape(self.jumanji_env.reset, jax.random.PRNGKey(0))[1].observation
        self.obs_size = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(self.features(observation)))
        self.image_columns = self.grid_columns(observation)
        self.image_by_default = name in JUMANJI_GRID_TORSO
        mask = getattr(observation, "action_mask", None)
        self.action_mask_size = 0 if mask is None else int(np.prod(mask.shape))
        self.mask_shape = None if mask is None else tuple(mask.shape)
        joint_mask = self.mask_shape in ((int(np.prod(self.num_values)),), self.num_values)
        self.factorised = self.multi_discrete and not (joint_mask or (mask is None and np.prod(self.num_values) <= JUMANJI_MAX_ACTIONS))

    @staticmethod
    def features(observation):  # every field of the suite's observation but its action mask
        if hasattr(observation, "_replace") and hasattr(observation, "action_mask"):
            return [value for field, value in observation._asdict().items() if field != "action_mask"]
        return observation

    @classmethod
    def grid_columns(cls, observation) -> tuple[int, tuple[int, int, int]] | None:
        """Where the observation's grid lies in the flat one encode() makes: (its first column, (H, W, C)),
        for the first field named grid, board or walls of 2 or 3 dims (a 2-D one has one channel); None
        without one. The network's conv torso takes it as an image (VecEnv.image): with --torso cnn, or by
        default for the envs of JUMANJI_GRID_TORSO."""
        if not hasattr(observation, "_asdict"):
            return None
        start = 0
        for field, value in observation._asdict().items():
            if field == "action_mask":
                continue
            if field in ("grid", "board", "walls") and len(getattr(value, "shape", ())) in (2, 3):
                return start, (*value.shape, 1)[:3]
            start += sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(value))
        return None

    def encode(self, observation):  # the suite's observation -> flat float32 [obs_size + action_mask_size]
        parts = [jnp.ravel(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(self.features(observation))]
        if self.action_mask_size:
            parts.append(jnp.ravel(observation.action_mask).astype(jnp.float32))
        return jnp.concatenate(parts)

    def decode(self, action):  # our action -> the suite's (joint multi-discrete: its parts; factorised: as is)
        if not self.multi_discrete or self.factorised:
            return action
        return jnp.stack(jnp.unravel_index(action, self.num_values)).astype(jnp.int32)

    @property
    def default_params(self) -> JumanjiParams:
        return JumanjiParams(max_steps_in_episode=int(getattr(self.jumanji_env, "time_limit", None) or 10_000))

    def reset_env(self, key, params):
        state, timestep = self.jumanji_env.reset(key)
        return self.encode(timestep.observation), JumanjiState(suite=state, time=jnp.zeros((), jnp.int32),
                                                               suite_truncated=jnp.zeros((), bool))

    def step_env(self, key, state, action, params):
        suite, timestep = self.jumanji_env.step(state.suite, self.decode(action))
        last = timestep.last()
        discount = jnp.max(timestep.discount)  # per agent in a multi-agent env: 0 once every agent's episode ended
        next_state = JumanjiState(suite=suite, time=state.time + 1, suite_truncated=last & (discount > 0))
        return self.encode(timestep.observation), next_state, jnp.sum(timestep.reward), last & (discount == 0), {}

    def is_truncated(self, state, params):
        return state.suite_truncated | (state.time >= params.max_steps_in_episode)

    @property
    def name(self) -> str:
        return JUMANJI_PREFIX + self.jumanji_name

    def action_space(self, params=None):
        if self.factorised:
            return spaces.Tuple([spaces.Discrete(n) for n in self.num_values])
        return spaces.Discrete(int(np.prod(self.num_values)))

    def observation_space(self, params):
        return spaces.Box(-jnp.inf, jnp.inf, (self.obs_size + self.action_mask_size,), jnp.float32)


def jumanji_names() -> list[str]:
    import jumanji

    return sorted(jumanji.registered_environments())


def check_jumanji_env(env_id: str) -> None:
    """Raise ConfigError where the jumanji env's actions or mask are ones this adapter does not take."""
    try:
        env = JumanjiEnv(env_id[len(JUMANJI_PREFIX):])
    except Exception as error:  # e.g. Sokoban-v0 downloads its levels on construction
        raise ConfigError(f"--env {env_id}: jumanji could not make it ({type(error).__name__}: "
                          f"{str(error).splitlines()[0][:200] if str(error) else ''}): use another Jumanji env") from None
    spec = env.jumanji_env.action_spec
    if not hasattr(spec, "num_values"):
        raise ConfigError(f"--env {env_id}: its actions are {type(spec).__name__}, not discrete or multi-discrete; "
                          "ppo_jax takes Jumanji's discrete and multi-discrete actions: use another Jumanji env")
    if not env.factorised and np.prod(env.num_values) > JUMANJI_MAX_ACTIONS:
        raise ConfigError(f"--env {env_id}: its mask is over a multi-discrete action of {int(np.prod(env.num_values))} "
                          f"joint values (over {JUMANJI_MAX_ACTIONS}; a factorised policy cannot keep a joint mask): "
                          "use another Jumanji env")
    per_component = (len(env.num_values), env.num_values[0])
    if env.factorised and env.mask_shape is not None and (env.mask_shape != per_component or len(set(env.num_values)) > 1):
        raise ConfigError(f"--env {env_id}: its action mask has shape {env.mask_shape}, neither one entry per joint "
                          f"action {env.num_values} nor one row per component {per_component}: use another Jumanji env")


# A Craftax env (the craftax package: --env craftax:Craftax-Classic-Symbolic-v1) seen through gymnax's
# interface. craftax is imported only here, only when asked for.
CRAFTAX_PREFIX = "craftax:"


CRAFTAX_INSTALL = "pip install -r requirements-craftax.txt"


CRAFTAX_NAMES = ("Craftax-Classic-Symbolic-v1", "Craftax-Classic-Pixels-v1", "Craftax-Symbolic-v1", "Craftax-Pixels-v1")


@struct.dataclass
class CraftaxParams(GymnaxEnvParams):
    max_steps_in_episode: int = 0  # the time limit; make_gymnax sets the suite's own (10,000 Classic, 100,000 Craftax)
    reset_ratio: int = struct.field(pytree_node=False, default=16)  # envs per fresh world drawn at a step (VecEnv)


@struct.dataclass
class CraftaxState(GymnaxEnvState):  # and gymnax's `time`: the suite's timestep
    suite: Any  # Craftax's EnvState: the world, the player, its achievements


class CraftaxEnv(GymnaxEnvironment):
    """A Craftax env, stepped by its own reset_env(key, params) and step_env(key, state, action, params)
    (its NoAutoReset env: resets are VecEnv's, so the final observation is kept). The suite's game over
    is death, lava or (Craftax) the boss beaten, or its time limit: here the first three terminate and
    the limit is gymnax's (state.time = the suite's timestep >= max_steps_in_episode: truncation, so it
    bootstraps). The reward is the suite's (achievements unlocked, health gained or lost / 10). Symbolic
    observations are the suite's flat vector (the map one-hot, then the inventory) for the MLP, as its
    baselines take them; pixel observations an image for --torso cnn. Every episode reports which of the
    suite's achievements it unlocked (`achievement_<name>`, 0 or 1: their means are the success rates of
    the Craftax paper) and how many (`achievements`). A fresh world costs many steps' worth of compute, so
    VecEnv resets lazily and from a pool (reset_ratio: Craftax's baselines' optimistic resets)."""

    lazy_resets = True

    def __init__(self, name: str):
        super().__init__()
        from craftax.craftax_env import make_craftax_env_from_name  # the optional dependency

        self.craftax_name = name
        self.craftax_env = make_craftax_env_from_name(name, auto_reset=False)
        if "Classic" in name:
            from craftax.craftax_classic.constants import Achievement
        else:
            from craftax.craftax.constants import Achievement
        self.achievement_names = tuple(a.name.lower() for a in sorted(Achievement, key=lambda a: a.value))
        self.episode_metrics = ("achievements", *(f"achievement_{a}" for a in self.achievement_names))

    def suite_params(self, params: CraftaxParams, limit=None):
        limit = params.max_steps_in_episode if limit is None else limit
        return self.craftax_env.default_params.replace(max_timesteps=limit)

    @property
    def default_params(self) -> CraftaxParams:
        return CraftaxParams(max_steps_in_episode=int(self.craftax_env.default_params.max_timesteps))

    def reset_env(self, key, params):
        obs, suite = self.craftax_env.reset_env(key, self.suite_params(params))
        return obs, CraftaxState(suite=suite, time=suite.timestep)

    def step_env(self, key, state, action, params):
        obs, suite, reward, _, _ = self.craftax_env.step_env(key, state.suite, action, self.suite_params(params))
        # The suite's game over without its time limit (gymnax's, is_truncated): death, lava, the boss.
        terminated = self.craftax_env.is_terminal(suite, self.suite_params(params, jnp.iinfo(jnp.int32).max))
        unlocked = suite.achievements.astype(jnp.float32)
        info = {"achievements": unlocked.sum(),
                **{f"achievement_{name}": unlocked[i] for i, name in enumerate(self.achievement_names)}}
        return obs, CraftaxState(suite=suite, time=suite.timestep), reward, terminated, info

    @property
    def name(self) -> str:
        return CRAFTAX_PREFIX + self.craftax_name

    def action_space(self, params=None):
        return spaces.Discrete(int(self.craftax_env.num_actions))

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, tuple(self.craftax_env.observation_space(self.suite_params(params)).shape),
                          jnp.float32)


def craftax_names() -> list[str]:
    import craftax  # noqa: F401  (the ids are the suite's make_craftax_env_from_name's; this checks it is there)

    return list(CRAFTAX_NAMES)


# EnvPool (Weng et al. 2022, arXiv:2206.10558): the PPO paper's own simulators, MuJoCo and the ALE, as
# C++ pools of envs, stepped from inside the program by a host callback (EnvPoolEnv). envpool is
# imported only here, only when asked for.
ENVPOOL_PREFIX = "envpool:"


ENVPOOL_INSTALL = "pip install -r requirements-envpool.txt"


# The families whose envs ppo_jax runs (a Box observation; a Discrete or Box action).
ENVPOOL_FAMILIES = ("envpool.mujoco.gym", "envpool.atari", "envpool.classic_control", "envpool.box2d")


# Atari as the PPO paper trained on it (Mnih et al. 2015's preprocessing; EnvPool's defaults give the
# rest: 84 x 84 grayscale, frame skip 4 with max-pooling, 4 stacked frames, up to 30 no-op starts):
# a life lost ends an episode of the PPO's (no bootstrap), and rewards are clipped to their sign. The
# episode a run reports is the whole game and its unclipped score (EnvPoolEnv).
ENVPOOL_ATARI_TRAINING = {"episodic_life": True, "reward_clip": True}


# envpool.make's arguments that the adapter sets itself (not --env-params).
ENVPOOL_RESERVED = ("num_envs", "batch_size", "num_threads", "seed", "env_seed", "max_num_players",
                    "thread_affinity_offset", "base_path", "gym_reset_return_info")


@struct.dataclass
class EnvPoolParams(GymnaxEnvParams):
    max_steps_in_episode: int = 1000  # EnvPool's max_episode_steps (its time limit: truncation)
    options: tuple = struct.field(pytree_node=False, default=())  # envpool.make's keyword arguments, as pairs


class EnvPoolSuite(GymnaxEnvironment):
    """An EnvPool task seen through gymnax's interface for what is asked of it before anything runs (its
    spaces, its time limit, --env-params). It has no functional step: the pool's envs live in C++, and
    EnvPoolEnv steps them."""

    def __init__(self, name: str):
        super().__init__()
        from envpool.registration import registry  # the optional dependency

        self.envpool_name = name
        self.family = registry.specs[name][0]
        self.atari = self.family == "envpool.atari"

    @functools.cache
    def spec(self, options: tuple):
        import envpool

        with warnings.catch_warnings():  # gymnasium's notes on float64 bounds cast to float32, at each space made
            warnings.simplefilter("ignore", UserWarning)
            spec = envpool.make_spec(self.envpool_name, **dict(options))
            return types.SimpleNamespace(config=spec.config, observation_space=spec.observation_space,
                                         action_space=spec.action_space)

    def params(self, overrides: Sequence[str]) -> EnvPoolParams:
        """The task's EnvPoolParams: its family's training options (Atari's), then --env-params name=value,
        each a field of the task's EnvPool config (max_steps_in_episode: its max_episode_steps)."""
        options = dict(ENVPOOL_ATARI_TRAINING if self.atari else {})
        config = self.spec(()).config._asdict()
        for item in overrides:
            name, _, text = item.partition("=")
            name = "max_episode_steps" if name == "max_steps_in_episode" else name
            known = sorted(set(config) - set(ENVPOOL_RESERVED))
            if name not in known or not text:
                raise ConfigError(f"--env-params {item!r}: give name=value with a name from {known}")
            kind = type(config[name])
            try:
                options[name] = parse_bool(text, f"--env-params {item!r}") if kind is bool else kind(text)
            except (ValueError, TypeError):
                raise ConfigError(f"--env-params {item!r}: {name} needs a {kind.__name__} value") from None
        limit = int(self.spec(tuple(sorted(options.items()))).config.max_episode_steps)
        if limit < 1:
            raise ConfigError("--env-params max_steps_in_episode: the time limit must be a positive number of steps")
        return EnvPoolParams(max_steps_in_episode=limit, options=tuple(sorted(options.items())))

    @property
    def default_params(self) -> EnvPoolParams:
        return self.params(())

    @property
    def name(self) -> str:
        return ENVPOOL_PREFIX + self.envpool_name

    def action_space(self, params: EnvPoolParams | None = None):
        space = self.spec((params or self.default_params).options).action_space
        return spaces.Discrete(int(space.n)) if hasattr(space, "n") else self.box(space)

    def observation_space(self, params: EnvPoolParams):
        return self.box(self.spec(params.options).observation_space)

    @staticmethod
    def box(space) -> spaces.Box:  # a gymnasium Box as gymnax's, float32 (MuJoCo's are float64)
        return spaces.Box(np.asarray(space.low, np.float32), np.asarray(space.high, np.float32), tuple(space.shape),
                          jnp.float32)


def envpool_names() -> list[str]:
    """EnvPool's ids in the families ppo_jax runs, without the duplicate spellings (phys2d/...)."""
    from envpool.registration import registry

    return sorted(name for name, (family, *_) in registry.specs.items() if family in ENVPOOL_FAMILIES and "/" not in name)


# The pools of this process, by number: a pool's envs live in C++, and the program holds only its number.
ENVPOOL_POOLS: dict[int, Any] = {}


def on_host_over_agents(function, outputs):
    """function(*arrays) -> arrays, every argument and output with a leading axis of envs, as a host
    callback whose one call serves every agent of a batch: under vmap (at any depth) the agents' axis is
    folded into the envs', so all their envs step in one pool, each agent its own slice of it in agent
    order. outputs(M) gives the results' ShapeDtypeStructs for M envs. To JAX it is a pure callback (an
    IO effect may not sit in the vmapped lax.cond that skips a last chunk's spare updates): what keeps
    the calls in order, each once, is that each takes a result of the one before (the pool's numbers,
    handed back by every call, so that no call's inputs are the same twice and XLA cannot hoist it out
    of a loop or merge two) and every result is used."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return jax.pure_callback(function, outputs(args[0].shape[0]), *args)

    @call.def_vmap
    def over_agents(axis_size, in_batched, *args):
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(args, in_batched)]
        out = call(*[x.reshape(-1, *x.shape[2:]) for x in args])  # [agents x envs, ...]
        out = jax.tree.map(lambda x: x.reshape(axis_size, -1, *x.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return call


class EnvPoolEnv(VecEnv):
    """An EnvPool env (`envpool:NAME`): MuJoCo's and Atari's real simulators inside the one program. Its
    envs step in a C++ pool (EnvPool's own threads), reached by a host callback at each step; a batch's
    agents share one pool, each its own slice of envs, seeded from its key (so an agent's envs are the
    same whatever else is in the pool). The state the program carries is the pool's number, per env.

    EnvPool resets an env on the step after its episode ended, ignoring that step's action. Here that
    step is taken at once, inside the same callback, for the envs whose episode ended alone: so the
    PPO sees what every other VecEnv gives, the first observation of the next episode as `obs` and the
    final one as info's final_observation, and the reset step is no transition of the policy's.

    Atari (ENVPOOL_ATARI_TRAINING): the PPO's episodes end with a life (terminated) and its rewards are
    clipped; the episode reported (episode_return, episode_length, evaluation) is the whole game with
    its unclipped score, ending at game over or the time limit (info's episode_end), as CleanRL reports
    it. Observations are the stacked frames as H x W x C images scaled to [0, 1].

    Limits: one device (the pool is this host's; run_batch puts the batch on one device), one process,
    and a checkpoint cannot hold the pool: a resumed run restarts its episodes (restart_envs)."""

    def __init__(self, env_id: str, num_envs: int, env_params: Sequence[str] = (), shards: int = 1):
        if shards != 1:
            raise ValueError("an EnvPool env runs on one device (its pool is this host's)")
        super().__init__(env_id, num_envs, env_params, shards)
        self.own_step = True
        self.atari = self.env.atari
        spec = self.env.spec(self.env_params.options)
        self.obs_dtype = np.uint8 if spec.observation_space.dtype == np.uint8 else np.float32  # frames stay bytes
        self.pool_action_dtype = np.int32 if self.discrete else spec.action_space.dtype  # MuJoCo's: float64
        if self.atari:  # [C, H, W] stacked frames -> an H x W x C image for the conv torso
            channels, height, width = self.obs_shape
            self.image, self.image_by_default, self.default_torso = (0, (height, width, channels)), True, "nature"
        self.host_reset = on_host_over_agents(self.open_pool, lambda m: (
            jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m, *self.obs_shape), self.obs_dtype)))
        self.host_step = on_host_over_agents(self.step_pools, lambda m: (
            jax.ShapeDtypeStruct((m,), jnp.int32), *[jax.ShapeDtypeStruct((m, *self.obs_shape), self.obs_dtype)] * 2,
            *[jax.ShapeDtypeStruct((m,), jnp.float32)] * 2, *[jax.ShapeDtypeStruct((m,), jnp.bool_)] * 3))

    def _flat(self, obs):
        if self.atari:  # [..., C, H, W] bytes -> [..., H * W * C] in [0, 1]
            obs = jnp.moveaxis(jnp.asarray(obs), -3, -1).astype(jnp.float32) / 255.0
            return obs.reshape(*obs.shape[:-3], self.obs_dim)
        return super()._flat(obs)

    def open_pool(self, seeds):
        """Host: a new pool of len(seeds) envs, env i seeded with seeds[i] -> (its number per env, the
        first observations)."""
        import envpool

        with warnings.catch_warnings():  # (as in EnvPoolSuite.spec; the pool makes its spaces once, here)
            warnings.simplefilter("ignore", UserWarning)
            pool = envpool.make(self.env.envpool_name, env_type="gymnasium", num_envs=len(seeds),
                                env_seed=[int(s) for s in seeds], **dict(self.env_params.options))
            obs, _ = pool.reset()
            pool.action_space  # noqa: B018
        number = len(ENVPOOL_POOLS) + 1
        ENVPOOL_POOLS[number] = pool
        return np.full(len(seeds), number, np.int32), np.asarray(obs, self.obs_dtype)

    def step_pools(self, numbers, actions):
        """Host: one step of every env of the pools in `numbers` (per env; whole pools, in order) ->
        (the numbers, next observations, final observations, rewards, scores (unclipped), terminated,
        truncated, episode_end)."""
        results, start = [], 0
        while start < len(numbers):
            pool = ENVPOOL_POOLS.get(int(numbers[start]))
            if pool is None:
                raise RuntimeError(f"EnvPool pool {int(numbers[start])} is not in this process (a checkpoint's "
                                   "envs must be restarted: restart_envs)")
            rows = slice(start, start + pool.config["num_envs"])
            obs, reward, terminated, truncated, info = pool.step(np.asarray(actions[rows], self.pool_action_dtype))
            final_obs, next_obs, done = obs, obs, terminated | truncated
            if done.any():  # EnvPool's reset step, taken now for the ended envs alone: its action is ignored
                ended = np.flatnonzero(done).astype(np.int32)
                next_obs = obs.copy()
                next_obs[ended] = pool.step(np.zeros((len(ended), *actions.shape[1:]), self.pool_action_dtype),
                                            ended)[0]
            score = info["reward"] if self.atari else reward  # Atari: the unclipped reward
            episode_end = (info["terminated"].astype(bool) | truncated) if self.atari else done  # Atari: game over
            results.append((next_obs, final_obs, reward, score, terminated, truncated, episode_end))
            start = rows.stop
        next_obs, final_obs, reward, score, terminated, truncated, episode_end = map(np.concatenate, zip(*results))
        return (np.array(numbers, np.int32), next_obs.astype(self.obs_dtype), final_obs.astype(self.obs_dtype),
                reward.astype(np.float32), score.astype(np.float32), terminated.astype(bool), truncated.astype(bool),
                episode_end.astype(bool))

    def reset(self, key) -> tuple[jax.Array, EnvState]:
        seeds = jax.random.randint(key, (self.num_envs,), 0, np.iinfo(np.int32).max, jnp.int32)
        numbers, obs = self.host_reset(seeds)
        zeros = jnp.zeros(self.num_envs, jnp.float32)
        return self._flat(obs), EnvState(numbers, zeros, jnp.zeros(self.num_envs, jnp.int32))

    def resets(self, keys):  # the pool resets its envs itself
        return None

    def step(self, keys, state: EnvState, action, resets):
        numbers, obs, final_obs, reward, score, terminated, truncated, episode_end = self.host_step(
            state.env_state, self.bounded(action))
        state, info = self.account(state, numbers, score, episode_end, self._flat(final_obs), {})
        return self._flat(obs), state, reward, terminated, truncated, info


def envpool_defaults(name: str) -> dict[str, Any] | None:
    """--env envpool:NAME's defaults: the PPO paper's Atari or MuJoCo setting, for classic control the
    gymnax env's of that name (None: Config's; an unknown name is validate's to report)."""
    try:
        from envpool.registration import registry

        family = registry.specs[name][0]
    except (ImportError, KeyError):
        return None
    return {"envpool.atari": ENVPOOL_ATARI, "envpool.mujoco.gym": ENVPOOL_MUJOCO}.get(family, ENV_DEFAULTS.get(name))


def vec_env(env_id: str, num_envs: int, env_params: Sequence[str] = (), shards: int = 1) -> VecEnv:
    """The VecEnv of an env id: EnvPool's host-stepped adapter for envpool:NAME, VecEnv for every other."""
    return (EnvPoolEnv if env_id.startswith(ENVPOOL_PREFIX) else VecEnv)(env_id, num_envs, env_params, shards)


# RLHF in miniature (README, "RLHF in miniature"): a response of `length` tokens from a vocabulary
# of `vocab`, one token per step. A fixed random bigram "language" B, a gold preference and a proxy
# reward model fitted to preferences labelled by the gold one; the reward is one of the three
# (`mode`), and every episode reports all of them. All tables are built from `seed` (toy_rlhf_params).
TOY_RLHF = "ToyRLHF-v0"


TOY_RLHF_MODES = ("fluency", "gold", "proxy", "learned")  # learned: a transformer reward model (--lm-stage reward)


@struct.dataclass
class ToyRLHFParams(GymnaxEnvParams):
    vocab: int = struct.field(pytree_node=False, default=16)
    length: int = struct.field(pytree_node=False, default=8)
    seed: int = struct.field(pytree_node=False, default=0)
    mode: str = struct.field(pytree_node=False, default="proxy")  # the reward: fluency | gold | proxy
    n_labels: int = struct.field(pytree_node=False, default=1000)  # preference pairs the proxy is fitted to
    fluency_weight: float = struct.field(pytree_node=False, default=0.5)  # lambda of the gold reward
    repeat_penalty: float = struct.field(pytree_node=False, default=3.0)  # B's logits of repeating a token are this much lower
    max_steps_in_episode: int = struct.field(pytree_node=False, default=1 << 30)  # episodes end by termination alone
    reward_model: str = struct.field(pytree_node=False, default="")  # mode=learned: a --lm-stage reward run's directory
    # Built by toy_rlhf_params (None until then):
    log_bigram: jax.Array | None = None  # [V + 1, V] log B(next | previous); row V: the first token
    gold_weights: jax.Array | None = None  # [V] w*: the gold value of each of the first two copies of a token
    proxy_weights: jax.Array | None = None  # [V] the reward model's value of every copy of a token
    gold_standard: jax.Array | None = None  # [2] mean and std of the raw gold reward under B
    proxy_standard: jax.Array | None = None  # [2] the same for the proxy
    rm_network: Any = struct.field(pytree_node=False, default=None)  # mode=learned: the reward model's network,
    rm_params: Any = None  # its params (one model's),
    rm_standard: jax.Array | None = None  # [2] and its score's mean and std under B


@struct.dataclass
class ToyRLHFState(GymnaxEnvState):
    tokens: jax.Array  # [L] int32, `vocab` where still empty


def array_module(x):  # the env's tables and rewards serve the JAX env and the NumPy ground truth alike
    return np if isinstance(x, np.ndarray) else jnp


def bag_of_tokens(tokens, vocab: int):
    """tokens [..., L] (vocab where empty) -> counts [..., V] float32."""
    return (tokens[..., None] == array_module(tokens).arange(vocab)).sum(-2).astype(np.float32)


def sequence_fluency(tokens, log_bigram):
    """sum_t log B(y_t | y_{t-1}) over the filled tokens of [..., L] (y_{-1}: the start row)."""
    xp, vocab = array_module(tokens), log_bigram.shape[1]
    previous = xp.concatenate([xp.full_like(tokens[..., :1], vocab), tokens[..., :-1]], -1)
    filled = tokens < vocab
    return xp.where(filled, log_bigram[previous, xp.minimum(tokens, vocab - 1)], 0.0).sum(-1)


def gold_reward(tokens, p: ToyRLHFParams, standard=None):
    """The true preference of [..., L] responses: sum_v w*_v min(c_v, 2) + lambda * fluency (it
    values fluency and saturates on repetition), standardised to mean 0, std 1 under B."""
    counts = bag_of_tokens(tokens, p.vocab)
    raw = array_module(tokens).minimum(counts, 2.0) @ p.gold_weights + p.fluency_weight * sequence_fluency(
        tokens, p.log_bigram)
    mean, std = p.gold_standard if standard is None else standard
    return (raw - mean) / std


def proxy_reward(tokens, p: ToyRLHFParams, standard=None):
    """The reward model: w_hat . c (bag of tokens: blind to order and fluency, and it never saturates),
    standardised under B."""
    mean, std = p.proxy_standard if standard is None else standard
    return (bag_of_tokens(tokens, p.vocab) @ p.proxy_weights - mean) / std


def learned_reward(tokens, p: ToyRLHFParams):
    """mode=learned: the reward model's score of whole responses [..., L] (its value head after the last
    token), standardised under B."""
    mean, std = p.rm_standard
    return (p.rm_network.apply(p.rm_params, tokens, whole=True).value[..., -1] - mean) / std


def proxy_token_reward(weight, p: ToyRLHFParams):
    """A token's share of the standardised proxy reward, from its weight (or the weights [V]): a
    response's proxy reward is the sum over its tokens (the env pays it token by token; the exact
    optimum's recursion uses it)."""
    mean, std = p.proxy_standard
    return (weight - mean / p.length) / std


def sample_bigram(rng: np.random.Generator, log_bigram, length: int, num: int) -> np.ndarray:
    """num responses drawn from B -> tokens [num, L] int32 (inverse CDF, one uniform per token)."""
    cdf = np.cumsum(np.exp(np.asarray(log_bigram, np.float64)), axis=1)
    tokens = [np.full(num, cdf.shape[1], np.int32)]  # the start row
    for _ in range(length):
        below = cdf[tokens[-1]] < rng.random(num)[:, None] * cdf[tokens[-1], -1:]
        tokens.append(below.sum(1).astype(np.int32))
    return np.stack(tokens[1:], 1)


def fit_bradley_terry(features, labels, l2: float = 1e-2, iterations: int = 30) -> np.ndarray:
    """Bradley-Terry reward model: logistic regression of labels [n] (1: the first response is
    preferred) on feature differences [n, V], P(first preferred) = sigmoid(w . x), with an L2 term
    (bag-of-tokens counts sum to L, so w is otherwise fixed only up to a constant); Newton's method
    in float64."""
    features, labels = np.asarray(features, np.float64), np.asarray(labels, np.float64)
    w = np.zeros(features.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(features @ w)))
        grad = features.T @ (p - labels) / len(labels) + l2 * w
        hessian = (features.T * (p * (1 - p))) @ features / len(labels) + l2 * np.eye(len(w))
        w = w - np.linalg.solve(hessian, grad)
    return w


STANDARDISING_SAMPLES = 1 << 14  # responses from B over which the gold and proxy rewards are standardised


def toy_rlhf_params(overrides: tuple[str, ...] = ()) -> ToyRLHFParams:
    """ToyRLHF-v0's EnvParams (built_toy_rlhf_params), a reward model's directory made absolute: the tables
    are cached by the overrides, and a relative path names another model from another directory."""
    return built_toy_rlhf_params(tuple(f"reward_model={os.path.abspath(o.split('=', 1)[1])}"
                                       if o.startswith("reward_model=") and o.split("=", 1)[1] else o
                                       for o in overrides))


@functools.lru_cache(maxsize=8)
def built_toy_rlhf_params(overrides: tuple[str, ...] = ()) -> ToyRLHFParams:
    """ToyRLHF-v0's EnvParams with its tables, built deterministically from `seed` (NumPy's PCG64, in
    milliseconds; the same ops in eager JAX took seconds): B's logits standard normal x 2, the
    diagonal lowered by repeat_penalty (a language that rarely repeats a token); w* standard normal;
    then the proxy, fitted to n_labels pairs of responses from B whose labels are drawn from the gold
    Bradley-Terry model, P(y1 preferred to y2) = sigmoid(gold(y1) - gold(y2))."""
    p = override_env_params(ToyRLHFParams(), overrides)
    if p.vocab < 2 or p.length < 1 or p.n_labels < 1 or p.mode not in TOY_RLHF_MODES:
        raise ConfigError(f"--env-params: {TOY_RLHF} needs vocab >= 2, length >= 1, n_labels >= 1 and mode one of "
                          f"{', '.join(TOY_RLHF_MODES)} (got vocab={p.vocab} length={p.length} n_labels={p.n_labels} "
                          f"mode={p.mode})")
    rng, v = np.random.default_rng(p.seed), p.vocab
    logits = 2.0 * rng.standard_normal((v + 1, v)) - p.repeat_penalty * np.eye(v + 1, v)
    log_bigram = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    p = p.replace(log_bigram=log_bigram.astype(np.float32), gold_weights=rng.standard_normal(v).astype(np.float32))
    pool = sample_bigram(rng, p.log_bigram, p.length, STANDARDISING_SAMPLES)
    raw = gold_reward(pool, p, standard=(0.0, 1.0))
    p = p.replace(gold_standard=np.array([raw.mean(), raw.std()], np.float32))
    first, second = (sample_bigram(rng, p.log_bigram, p.length, p.n_labels) for _ in range(2))
    preferred = rng.random(p.n_labels) < 1.0 / (1.0 + np.exp(gold_reward(second, p) - gold_reward(first, p)))
    weights = fit_bradley_terry(bag_of_tokens(first, v) - bag_of_tokens(second, v), preferred).astype(np.float32)
    p = p.replace(proxy_weights=weights)
    raw = proxy_reward(pool, p, standard=(0.0, 1.0))
    p = p.replace(proxy_standard=np.array([raw.mean(), raw.std()], np.float32))
    if p.mode == "learned":
        network, params = load_reward_model(p)
        p = p.replace(rm_network=network, rm_params=params, rm_standard=np.array([0.0, 1.0], np.float32))
        raw = batched_scores(lambda tokens: learned_scores(tokens, p), pool)
        p = p.replace(rm_standard=np.array([raw.mean(), raw.std()], np.float32))
    elif p.reward_model:
        raise ConfigError(f"--env-params reward_model={p.reward_model}: only with mode=learned (the reward it gives)")
    return p


def load_reward_model(p: ToyRLHFParams):
    """mode=learned: (network, params) of the reward model in the run directory `reward_model` (--lm-stage
    reward), checked against this env's vocab and length."""
    where = f"--env-params reward_model={p.reward_model}"
    if not p.reward_model:
        raise ConfigError(f"--env-params mode=learned needs reward_model=DIR, a --lm-stage reward run's directory")
    config = load_run_config(p.reward_model, where)
    if config.lm_stage != "reward" or config.env != TOY_RLHF:
        raise ConfigError(f"{where}: not a reward model (its config.json has --env {config.env} --lm-stage "
                          f"{config.lm_stage}): give the directory of a run with --lm-stage reward")
    theirs = toy_rlhf_params(tuple(o for o in config.env_params if not o.startswith(("mode=", "reward_model="))))
    if (theirs.vocab, theirs.length) != (p.vocab, p.length):
        raise ConfigError(f"{where}: its reward model scores responses of {theirs.length} tokens of {theirs.vocab}, "
                          f"this env's are {p.length} of {p.vocab}: train one at vocab={p.vocab} length={p.length}")
    env = make_env(dataclasses.replace(config, num_envs=1))
    network = make_network(config, env)
    policies = read_policies(config, env, network, os.path.join(p.reward_model, "params.msgpack"), where)
    return network, jax.tree.map(lambda x: np.asarray(x[0]), policies.params)


def batched_scores(score, tokens: np.ndarray, batch: int = 1 << 14) -> np.ndarray:
    """score (calling a jitted function: one compile per shape, whatever the params) over responses [n, L]
    in batches -> [n] float64."""
    return np.concatenate([np.asarray(score(jnp.asarray(tokens[i:i + batch])), np.float64)
                           for i in range(0, len(tokens), batch)])


@functools.partial(jax.jit, static_argnums=0)
def response_values(network, params, tokens):  # the value head after the last token of responses [n, L] -> [n]
    return network.apply(params, tokens, whole=True).value[..., -1]


learned_scores = jax.jit(learned_reward)  # (tokens, p): the env params' tables are arguments, not constants


class ToyRLHF(GymnaxEnvironment):
    """The response so far is the observation: one-hot tokens per slot (zeros where empty), then the
    position one-hot; the action is the next token; the episode terminates after `length` tokens.
    The reward of a step is the step's share of the mode's sequence reward (they sum to it); every
    step's info holds the response's gold_reward, proxy_reward, fluency and repeat_frac
    (the fraction of its tokens that repeat an earlier one, normalised to 1 for a single repeated
    token), which become metrics at the step an episode ends."""

    episode_metrics = ("gold_reward", "proxy_reward", "fluency", "repeat_frac")

    @property
    def default_params(self) -> ToyRLHFParams:
        return toy_rlhf_params()

    def reset_env(self, key, params: ToyRLHFParams):
        state = ToyRLHFState(time=jnp.zeros((), jnp.int32), tokens=jnp.full(params.length, params.vocab, jnp.int32))
        return self.get_obs(state, params), state

    def get_obs(self, state: ToyRLHFState, params: ToyRLHFParams, key=None):
        slots = jax.nn.one_hot(state.tokens, params.vocab, dtype=jnp.float32).reshape(-1)
        return jnp.concatenate([slots, jax.nn.one_hot(state.time, params.length, dtype=jnp.float32)])

    def step_env(self, key, state: ToyRLHFState, action, params: ToyRLHFParams):
        params = jax.tree.map(jnp.asarray, params)  # the tables are NumPy arrays (toy_rlhf_params)
        v, length = params.vocab, params.length
        t = state.time
        previous = jnp.where(t > 0, state.tokens[jnp.maximum(t - 1, 0)], v)
        fluency = params.log_bigram[previous, action]
        tokens = state.tokens.at[t].set(action)
        if params.mode == "learned":  # the reward model's score of the whole response, paid at its last token
            score = learned_reward(tokens, params)
            reward = jnp.where(t + 1 >= length, score, 0.0)
        elif params.mode == "fluency":
            reward = fluency
        elif params.mode == "gold":  # w*_a for the first two copies of a, lambda * log B, and the mean spread over L
            copies = jnp.sum(state.tokens == action)
            mean, std = params.gold_standard
            reward = (jnp.where(copies < 2, params.gold_weights[action], 0.0) + params.fluency_weight * fluency
                      - mean / length) / std
        else:
            reward = proxy_token_reward(params.proxy_weights[action], params)
        state = ToyRLHFState(time=t + 1, tokens=tokens)
        distinct = jnp.sum(bag_of_tokens(tokens, v) > 0)
        info = {
            "gold_reward": gold_reward(tokens, params),
            "proxy_reward": score if params.mode == "learned" else proxy_reward(tokens, params),
            "fluency": sequence_fluency(tokens, params.log_bigram),
            "repeat_frac": (t + 1 - distinct) / jnp.maximum(t, 1),
        }
        return self.get_obs(state, params), state, reward.astype(jnp.float32), t + 1 >= length, info

    @staticmethod
    def sequence(params: ToyRLHFParams) -> tuple[int, int]:  # the response in the observation (--torso transformer)
        return params.vocab, params.length

    @property
    def name(self) -> str:
        return TOY_RLHF

    @property
    def num_actions(self) -> int:
        return self.default_params.vocab

    def action_space(self, params: ToyRLHFParams):
        return spaces.Discrete(params.vocab)

    def observation_space(self, params: ToyRLHFParams):
        return spaces.Box(0.0, 1.0, (params.length * (params.vocab + 1),), jnp.float32)


def make_gymnax(env_id: str, overrides: Sequence[str] = ()):
    """(env, env_params) for a gymnax id or `brax:NAME`, with the --env-params overrides applied."""
    if env_id.startswith(BRAX_PREFIX):
        params = override_env_params(BraxEnvParams(), overrides)
        return BraxEnv(env_id[len(BRAX_PREFIX):], params.backend), params
    if env_id.startswith(XMINIGRID_PREFIX):
        env = XMiniGridEnv(env_id[len(XMINIGRID_PREFIX):])
        return env, override_env_params(env.default_params, overrides)
    if env_id.startswith(JUMANJI_PREFIX):
        env = JumanjiEnv(env_id[len(JUMANJI_PREFIX):])
        return env, override_env_params(env.default_params, overrides)
    if env_id.startswith(CRAFTAX_PREFIX):
        env = CraftaxEnv(env_id[len(CRAFTAX_PREFIX):])
        return env, override_env_params(env.default_params, overrides)
    if env_id.startswith(PLAYGROUND_PREFIX):
        impl = playground_impl(overrides)
        env = PlaygroundEnv(env_id[len(PLAYGROUND_PREFIX):], impl)
        return env, override_env_params(env.default_params.replace(impl=impl), overrides)
    if env_id.startswith(ENVPOOL_PREFIX):
        env = EnvPoolSuite(env_id[len(ENVPOOL_PREFIX):])
        return env, env.params(overrides)
    if env_id == TOY_RLHF:
        return ToyRLHF(), toy_rlhf_params(tuple(overrides))
    env, params = gymnax.make(env_id)
    return env, override_env_params(params, overrides)


# Envs whose episodes all last the same number of steps, as the critic-free estimators need
# (--adv-estimator): env id -> (env, env_params) -> that length. A test runs each to check it.
FIXED_EPISODE_LENGTH = {
    "Pendulum-v1": lambda env, p: p.max_steps_in_episode,  # never terminates: its time limit ends every episode
    "Catch-bsuite": lambda env, p: min(env.rows - 1, p.max_steps_in_episode),  # the ball falls a row per step
    "DeepSea-bsuite": lambda env, p: min(env.size, p.max_steps_in_episode),  # a row per step
    "MemoryChain-bsuite": lambda env, p: min(p.memory_length + 1, p.max_steps_in_episode),
    "UmbrellaChain-bsuite": lambda env, p: min(p.chain_length, p.max_steps_in_episode),
    "SimpleBandit-bsuite": lambda env, p: 1,
    "BernoulliBandit-misc": lambda env, p: p.max_steps_in_episode,
    "GaussianBandit-misc": lambda env, p: p.max_steps_in_episode,
    TOY_RLHF: lambda env, p: min(p.length, p.max_steps_in_episode),
}


def fixed_episode_length(env_id: str, overrides: Sequence[str] = ()) -> int | None:
    """The one length of every episode of this env (with these --env-params), or None if it varies."""
    if env_id not in FIXED_EPISODE_LENGTH:
        return None
    return int(FIXED_EPISODE_LENGTH[env_id](*make_gymnax(env_id, overrides)))


def check_suite_id(env_id: str, prefix: str, names, package: str, install: str) -> None:
    """Raise ConfigError where a suite's package is missing or `env_id` names none of its envs (`prefix`
    alone: the listing)."""
    try:
        known = names()
    except ImportError:
        raise ConfigError(f"--env {env_id} needs {package}, which is not installed: {install}") from None
    name = env_id[len(prefix):]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5) if name else []
        hint = f"did you mean {', '.join(prefix + c for c in close)}?" if close else \
            f"it has {', '.join(prefix + n for n in known)}"
        raise ConfigError(f"--env {env_id!r}: {'no env named' if name else 'give an env name'}; {hint}")


def check_env_id(env_id: str, overrides: Sequence[str] = ()) -> None:
    """Raise ConfigError for an unknown env id, a missing brax, or an unknown Brax backend."""
    if env_id.startswith(BRAX_PREFIX):
        try:
            names = brax_names()
        except ImportError:
            raise ConfigError(f"--env {env_id} needs brax, which is not installed: {BRAX_INSTALL}") from None
        name = env_id[len(BRAX_PREFIX):]
        if name not in names:
            listed = [known for known in names if known not in BRAX_BROKEN and known != "fast"]  # (fast: Brax's test env)
            raise ConfigError(f"--env {env_id!r}: Brax has no such env; it has "
                              f"{', '.join(BRAX_PREFIX + known for known in listed)}")
        if name in BRAX_BROKEN:
            raise ConfigError(f"--env {env_id}: Brax's {name} does not run with this JAX: {BRAX_BROKEN[name]}; "
                              "use another Brax env")
        backend = override_env_params(BraxEnvParams(), overrides).backend
        if backend not in BRAX_BACKENDS:
            raise ConfigError(f"--env-params backend={backend}: Brax's backends are {', '.join(BRAX_BACKENDS)}")
        try:
            brax_environment(name, backend)
        except ValueError as error:  # an env that runs on some backends only (Brax's own check)
            raise ConfigError(f"--env {env_id} --env-params backend={backend}: Brax refuses it ({error}); "
                              "try another backend (generalized runs every env)") from None
    elif env_id.startswith(XMINIGRID_PREFIX + "XLand-MiniGrid-"):
        raise ConfigError(f"--env {env_id}: XLand-MiniGrid's R* envs draw their tasks from a benchmark's rulesets "
                          "(a download), which ppo_jax does not load yet: use a MiniGrid-* id (--env xminigrid: lists them)")
    elif env_id.startswith(XMINIGRID_PREFIX):
        check_suite_id(env_id, XMINIGRID_PREFIX, xminigrid_names, "xminigrid", XMINIGRID_INSTALL)
    elif env_id.startswith(JUMANJI_PREFIX):
        check_suite_id(env_id, JUMANJI_PREFIX, jumanji_names, "jumanji", JUMANJI_INSTALL)
        check_jumanji_env(env_id)
    elif env_id.startswith(PLAYGROUND_PREFIX):
        check_suite_id(env_id, PLAYGROUND_PREFIX, playground_names, "playground", PLAYGROUND_INSTALL)
        impl = playground_impl(overrides)
        if impl not in PLAYGROUND_IMPLS:
            raise ConfigError(f"--env-params impl={impl}: MuJoCo Playground's implementations are {', '.join(PLAYGROUND_IMPLS)}")
        try:
            playground_environment(env_id[len(PLAYGROUND_PREFIX):], impl)
        except Exception as error:  # e.g. the locomotion robots' assets, cloned from mujoco_menagerie on first use
            raise ConfigError(f"--env {env_id}: MuJoCo Playground could not make it ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:200] if str(error) else ''}): use another Playground env") from None
    elif env_id.startswith(CRAFTAX_PREFIX):
        check_suite_id(env_id, CRAFTAX_PREFIX, craftax_names, "craftax", CRAFTAX_INSTALL)
        if override_env_params(CraftaxParams(max_steps_in_episode=1), overrides).reset_ratio < 1:
            raise ConfigError("--env-params reset_ratio: give a positive number of envs per fresh world (1: a world each)")
    elif env_id.startswith(ENVPOOL_PREFIX):
        check_suite_id(env_id, ENVPOOL_PREFIX, envpool_names, "envpool", ENVPOOL_INSTALL)
        EnvPoolSuite(env_id[len(ENVPOOL_PREFIX):]).params(overrides)
    elif env_id == TOY_RLHF:
        toy_rlhf_params(tuple(overrides))
    elif env_id not in gymnax.registered_envs:
        close = difflib.get_close_matches(env_id, [*gymnax.registered_envs, TOY_RLHF], n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "see gymnax.registered_envs, brax:NAME, xminigrid:NAME, jumanji:NAME, craftax:NAME or playground:NAME"
        raise ConfigError(f"--env {env_id!r} is not a gymnax environment: {hint}")


# ================================================================================================
# 4. Running: validation, a batch of agents compiled once and sharded over devices, chunks,
#    checkpoints, the NaN guard, signals
# ================================================================================================


STATIC_FIELDS = {f.name for f in dataclasses.fields(Config)} - {"hparams"}


CHOICES = {name: typing.get_args(hint) for name, hint in typing.get_type_hints(Config).items()
           if typing.get_origin(hint) is Literal}  # the Literal fields: --activation, --torso, --recurrent, ...


HPARAM_FIELDS = {f.name for f in dataclasses.fields(HParams)}


DISTRIBUTED_FIELDS = ("distributed", "coordinator_address", "num_processes", "process_id", "distributed_timeout")


RUN_FIELDS = {  # not part of a spec: they change how a run is driven and reported, never its results
    "run_dir", "table_rows", "sweep", "sweep_set", "sweep_chunk", "pbt_interval", "env_devices", "compile_cache",
    "checkpoint_every", "resume", "eval", "episodes", "point", "rank_by", "deterministic", "render", "quiet", "tensorboard", "eval_every",
    "eval_episodes", "wandb_project", "wandb_entity", "wandb_group", "exp_name",
    *DISTRIBUTED_FIELDS}


# The run-only fields a sweep's settings take from the command line (resumed: from its points' config.json).
SWEEP_RUN_FIELDS = ("checkpoint_every", "sweep_chunk", "eval_every", "eval_episodes")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_hparams(h: HParams, where: str = "", algo: str = "ppo") -> None:
    """Raise ConfigError for the first out-of-range hyperparameter (`where` prefixes the message) of
    --algo `algo`."""
    def bad(message):
        raise ConfigError(where + message)

    if not h.lr > 0:
        bad(f"--lr {h.lr}: the learning rate must be > 0")
    for name in ("gamma", "gae_lambda"):
        if not 0.0 <= getattr(h, name) <= 1.0:
            bad(f"{flag(name)} {getattr(h, name)}: must be in [0, 1]")
    for name in ("clip_eps", "clip_eps_high", "kl_coef", "kl_target", "ref_kl_coef", "ref_kl_target", "target_kl",
                 "ent_coef", "vf_coef", "adam_eps"):
        if not getattr(h, name) >= 0:
            bad(f"{flag(name)} {getattr(h, name)}: must be >= 0")
    for name in ("max_grad_norm", "clip_obs", "clip_reward"):
        if not getattr(h, name) > 0:
            bad(f"{flag(name)} {getattr(h, name)}: must be > 0 (inf turns clipping off)")
    if h.clip_eps_high > 0 and h.clip_eps == 0:
        bad(f"--clip-eps-high {h.clip_eps_high} moves the clip band's upper edge, but --clip-eps 0 turns clipping "
            "off: give --clip-eps too, e.g. --clip-eps 0.2")
    if not (h.dual_clip == 0 or h.dual_clip > 1):
        bad(f"--dual-clip {h.dual_clip}: must be > 1 (the paper's 3), or 0 (off)")
    if not h.max_kl > 0:
        bad(f"--max-kl {h.max_kl}: TRPO's trust region must be > 0 (the TRPO paper's 0.01)")
    if not h.cg_damping >= 0:
        bad(f"--cg-damping {h.cg_damping}: must be >= 0 (0.1: Spinning Up's and Tianshou's)")
    if h.kl_target > 0 and h.kl_coef == 0 and algo != "vpg":  # (vpg: the target of its step size)
        bad(f"--kl-target {h.kl_target} adapts beta, but --kl-coef is 0 and would stay 0: "
            "give a starting beta, e.g. --kl-coef 1")
    if not h.ref_kl_horizon > 0:
        bad(f"--ref-kl-horizon {h.ref_kl_horizon}: must be > 0 (episodes)")
    if not math.isfinite(h.log_std_init):
        bad(f"--log-std-init {h.log_std_init}: must be a finite number (a log std: 0 is std 1, -0.5 std 0.61)")
    if h.ref_kl_target > 0 and h.ref_kl_coef == 0:
        bad(f"--ref-kl-target {h.ref_kl_target} adapts the leash's beta, but --ref-kl-coef is 0 and would stay 0: "
            "give a starting beta, e.g. --ref-kl-coef 0.1")


def check_run_dir_is_new(run_dir: str | None) -> None:
    if run_dir is None or not os.path.exists(run_dir):
        return
    what = "sweep" if is_sweep_dir(run_dir) else "run" if os.path.isfile(os.path.join(run_dir, "config.json")) else None
    if what:
        raise ConfigError(f"--run-dir {run_dir} already holds a {what}: continue it with --resume {run_dir} (one "
                          "stopped before its first checkpoint starts again there), or pick a new directory")
    raise ConfigError(f"--run-dir {run_dir} already exists: pick a new directory (nothing is overwritten)")


FIELD_ZERO = {"table_rows": "no table", "sweep_chunk": "all agents at once", "checkpoint_every": "about 20 chunks",
              "eval_every": "never", "pbt_interval": "no population-based training",
              "env_devices": "auto"}


def check_language_model(config: Config, env, env_params) -> None:
    """--torso transformer and --lm-stage: an env whose observation holds a response, a transformer that
    fits, and each stage's inputs."""
    sequence = getattr(env, "sequence", None)
    if config.torso == "transformer" and sequence is None:
        raise ConfigError(f"--torso transformer reads a response from the observation: {config.env}'s holds none "
                          f"(use it on {TOY_RLHF}, or another --torso)")
    layers, heads, width = config.transformer
    if config.torso == "transformer" and (min(layers, heads, width) < 1 or width % heads):
        raise ConfigError(f"--transformer {layers} {heads} {width}: layers, heads and width must be positive and the "
                          "heads must divide the width (e.g. 2 4 64)")
    if config.torso == "transformer" and (config.hparams.norm_obs or config.is_recurrent):
        raise ConfigError("--torso transformer reads the tokens from the raw observation and is its own memory: "
                          "drop --norm-obs and --recurrent")
    stage = config.lm_stage
    if stage == "none":
        return
    if config.torso != "transformer":
        raise ConfigError(f"--lm-stage {stage} trains a language model: add --torso transformer (on {TOY_RLHF})")
    for name in ("lm_steps", "lm_batch_size", "lm_data"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: must be a positive integer")
    if not config.label_scale > 0:
        raise ConfigError(f"--label-scale {config.label_scale}: must be > 0 (larger: labels closer to gold's ranking)")
    if not 0.0 <= config.label_noise < 0.5:
        raise ConfigError(f"--label-noise {config.label_noise}: a fraction in [0, 0.5)")
    if stage == "reward" and not config.has_critic:
        raise ConfigError("--lm-stage reward: its score is the value head: drop --adv-estimator (a critic is needed)")
    if stage in ("reward", "dpo", "ipo") and not (config.ref_params or config.init_params):
        raise ConfigError(f"--lm-stage {stage}: its pairs are sampled from --ref-params (the SFT model's directory)")
    if stage in ("dpo", "ipo"):
        if not config.lm_betas or min(config.lm_betas) <= 0:
            raise ConfigError(f"--lm-betas {' '.join(map(str, config.lm_betas))}: each beta must be > 0 (e.g. 0.1 0.3 1)")
        all_responses(env_params.vocab, env_params.length)  # the end points are exact
    elif config.num_seeds != 1:
        raise ConfigError(f"--lm-stage {stage} trains one model (the next stage reads it): drop --num-seeds")


def validate(config: Config, check_run_dir: bool = True) -> None:
    """Raise ConfigError for the first invalid setting, before anything is compiled."""
    check_env_id(config.env, config.env_params)
    env, env_params = make_gymnax(config.env, config.env_params)
    for name in ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches", "num_seeds",
                 "recurrent_size"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: must be a positive integer")
    # (observation_space only when asked: a Brax env's builds its physics state, op by op)
    if config.torso in ("cnn", "nature") and not (getattr(env, "image_columns", None)
                                                  or len(env.observation_space(env_params).shape) == 3):
        raise ConfigError(f"--torso {config.torso} needs image observations (H x W x C) or a grid; {config.env}'s "
                          "are not: use --torso mlp")
    height, width, _ = vec_env(config.env, 1, config.env_params).image[1] if config.torso == "nature" else (36, 36, 0)
    if min(height, width) < 36:
        raise ConfigError(f"--torso nature needs images of 36 x 36 or more (its first convolution is 8 x 8, stride 4); "
                          f"{config.env}'s are {height} x {width}: use --torso cnn")
    for name, choices in CHOICES.items():  # a spec file or Python may give any string
        if getattr(config, name) not in choices:
            raise ConfigError(f"{flag(name)} {getattr(config, name)!r}: use one of {', '.join(choices)}")
    check_action_dist(config, env.action_space(env_params))
    check_language_model(config, env, env_params)
    if not config.hidden_sizes or min(config.hidden_sizes) < 1:
        raise ConfigError(f"--hidden-sizes {config.hidden_sizes}: give one or more positive widths, e.g. 64 64")
    if config.eval_episodes < 1:
        raise ConfigError(f"--eval-episodes {config.eval_episodes}: must be a positive integer")
    for name in ("table_rows", "sweep_chunk", "checkpoint_every", "env_devices", "eval_every", "pbt_interval"):
        if (getattr(config, name) or 0) < 0:
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: must be >= 0 (0: {FIELD_ZERO[name]})")
    if config.batch_size % config.num_minibatches:
        raise ConfigError(
            f"--num-minibatches {config.num_minibatches} does not divide the batch "
            f"(--num-envs {config.num_envs} x --num-steps {config.num_steps} = {config.batch_size})"
        )
    if config.is_recurrent and config.num_envs % config.num_minibatches:
        raise ConfigError(f"--num-minibatches {config.num_minibatches} does not divide --num-envs {config.num_envs}: "
                          f"with --recurrent {config.recurrent}, a minibatch is a set of whole env sequences")
    if config.minibatch_size < 2:
        raise ConfigError(f"--num-minibatches {config.num_minibatches}: minibatches of {config.minibatch_size} "
                          "sample(s) cannot be normalised; use fewer minibatches")
    if config.slices < 0 or (config.slices and config.minibatch_size % config.slices):
        raise ConfigError(f"--slices {config.slices}: must divide the minibatch of {config.minibatch_size} samples "
                          "(or 0: auto)")
    if config.env_devices > 1 and config.env.startswith(ENVPOOL_PREFIX):
        raise ConfigError(f"--env-devices {config.env_devices}: {config.env} runs on one device (its envs step in a "
                          "pool of this host's, EnvPool): use 0 or 1")
    if config.env_devices > 1 and not shards_fit(config, config.env_devices):
        what = (f"the {config.num_envs // config.num_minibatches} env sequences of a minibatch"
                if config.is_recurrent else f"the minibatch of {config.minibatch_size} samples")
        slices = f", leaving each device a part that --slices {config.slices} divides" if config.slices > 1 else ""
        raise ConfigError(f"--env-devices {config.env_devices}: must divide --num-envs {config.num_envs} and "
                          f"{what}{slices}; or use 0 (auto) or 1 (no sharding)")
    if config.slices > 1 and config.is_recurrent:
        raise ConfigError(f"--slices {config.slices}: slices are for feedforward networks; with "
                          f"--recurrent {config.recurrent} use 0 or 1")
    validate_estimator(config)
    if config.total_timesteps < config.batch_size:
        raise ConfigError(f"--total-timesteps {config.total_timesteps} is less than one batch "
                          f"({config.batch_size} = --num-envs x --num-steps)")
    validate_hparams(config.hparams, algo=config.algo)
    validate_algo(config)
    if config.params_index < 0:
        raise ConfigError(f"--params-index {config.params_index}: must be >= 0")
    if check_run_dir:
        check_run_dir_is_new(config.run_dir)
    if config.init_params or config.ref_params:
        env = make_env(config)
        network = make_network(config, env)
        load_policy(config, env, network, config.init_params, "--init-params")
        load_policy(config, env, network, config.ref_params, "--ref-params")


def check_action_dist(config: Config, space) -> None:
    """--action-dist and --state-std against the env's action space."""
    if is_discrete(space):
        for name, default in (("action_dist", "gaussian"), ("state_std", False)):
            if getattr(config, name) != default:
                raise ConfigError(f"{flag(name)}: {config.env}'s actions are discrete (a categorical policy): leave it "
                                  "out")
        return
    if config.action_dist == "beta" and config.state_std:
        raise ConfigError("--state-std: the Beta policy has no std (its head gives alpha and beta): leave it out")
    bounded = np.all(np.isfinite(np.asarray(space.low))) and np.all(np.isfinite(np.asarray(space.high)))
    if config.action_dist != "gaussian" and not bounded:
        raise ConfigError(f"--action-dist {config.action_dist} maps onto the action bounds, and {config.env}'s are not "
                          "finite: use --action-dist gaussian")


def validate_algo(config: Config) -> None:
    """--algo's needs: A2C is one gradient step per rollout (more would be PPO without its clip); TRPO's
    iterations."""
    if config.algo == "a2c" and (config.update_epochs, config.num_minibatches) != (1, 1):
        raise ConfigError(f"--algo a2c takes one gradient step per rollout: --update-epochs 1 --num-minibatches 1 "
                          f"(given {config.update_epochs} and {config.num_minibatches}; more steps on a batch are PPO: "
                          "--algo ppo, with --clip-eps 0 for no clip)")
    for name in ("cg_iterations", "line_search_steps"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: must be a positive integer")


def validate_estimator(config: Config) -> None:
    """The critic-free estimators' needs (--adv-estimator, --group-size), which a sweep spec may also set."""
    estimator, group = config.adv_estimator, config.group_size
    if estimator == "gae":
        if group:
            raise ConfigError(f"--group-size {group} is for the critic-free estimators: add --adv-estimator grpo, "
                              "rloo or dr_grpo, or drop --group-size")
        return
    if group < 0 or config.num_envs % max(group, 1) or (group or config.num_envs) < 2:
        raise ConfigError(f"--group-size {group}: groups of at least 2 envs that divide --num-envs {config.num_envs} "
                          "(0: all the envs are one group)")
    length = fixed_episode_length(config.env, config.env_params)
    if length is None:
        raise ConfigError(f"--adv-estimator {estimator} needs episodes of one fixed length, whole in each rollout; "
                          f"{config.env}'s end at varying steps: use --adv-estimator gae, or an env such as "
                          f"{', '.join(list(FIXED_EPISODE_LENGTH)[:3])}")
    if config.num_steps % length:
        raise ConfigError(f"--num-steps {config.num_steps}: --adv-estimator {estimator} needs whole episodes in a "
                          f"rollout, and {config.env}'s last {length} steps: use a multiple, e.g. --num-steps "
                          f"{length * max(1, round(config.num_steps / length))}")


@dataclasses.dataclass
class RunResult:
    state: TrainState  # numpy leaves with a leading [batch] axis (agents: points x seeds)
    metrics: dict[str, np.ndarray]  # name -> [batch, updates done]; includes env_steps
    lower_seconds: float  # tracing and lowering both programs (init and a chunk of updates)
    compile_seconds: float  # compiling them (the init on a second thread)
    run_seconds: float
    num_devices: int = 1  # the batch axis was sharded over this many devices
    steps_run: int = 0  # environment steps this call ran, all agents together (less than the run's when resumed)
    config: Config | None = None  # what ran

    @property
    def steps_per_second(self) -> float:
        """Environment steps per second, all agents of the batch together (NaN: nothing ran)."""
        return self.steps_run / self.run_seconds if self.run_seconds else math.nan

    def policy(self, agent: int = 0) -> TrainedPolicy:
        """The final policy of agent `agent` of the batch (a run's seed), as load_run gives a saved one."""
        return TrainedPolicy(self.config, Policy(*jax.tree.map(lambda x: jnp.asarray(x[agent]),
                                                               (self.state.params, self.state.obs_stats))))


@dataclasses.dataclass
class Checkpoint:
    """Where a run stands between two chunks: host copies, every leaf with a leading [batch] axis."""

    state: TrainState
    metrics: dict[str, np.ndarray]  # name -> [batch, updates done], without env_steps

    @property
    def updates_done(self) -> int:
        return int(self.state.update[0])


def chunk_length(config: Config) -> int:
    """Updates per chunk: --checkpoint-every, or about 20 chunks per run; with --eval-every, the
    largest length no longer that divides it, so that chunks end where evaluations fall."""
    length = config.checkpoint_every or -(-config.num_updates // 20)
    if config.eval_every:
        length = max(d for d in range(1, min(length, config.eval_every) + 1) if config.eval_every % d == 0)
    return length


def with_env_steps(metrics: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
    num_agents, num_updates = next(iter(metrics.values())).shape
    updates = np.arange(1, num_updates + 1, dtype=np.int64)  # host-side: no int32 overflow
    return {**metrics, "env_steps": np.broadcast_to(updates * batch_size, (num_agents, num_updates))}


def config_json(config: Config) -> str:
    """The resolved Config as config.json holds it (and TensorBoard shows it)."""
    return json_text(dataclasses.asdict(config))


def json_text(tree) -> str:
    """Strict JSON, which every parser reads: NaN (nothing measured) as null, an infinite float as
    1e999 (a JSON number too large for a double: Python, JavaScript and NumPy read it back as inf).
    json.dumps alone writes NaN and Infinity, which strict parsers refuse."""
    infinite = "\x00inf"  # a string no path or env id holds, replaced by the number once encoded

    def strict(node):
        if isinstance(node, dict):
            return {key: strict(value) for key, value in node.items()}
        if isinstance(node, list | tuple):
            return [strict(value) for value in node]
        if isinstance(node, float) and not math.isfinite(node):
            return None if math.isnan(node) else ("-" if node < 0 else "") + infinite
        return node

    text = json.dumps(strict(tree), indent=2, allow_nan=False)
    return text.replace(json.dumps(infinite), "1e999").replace(json.dumps("-" + infinite), "-1e999")


def seed_keys(config: Config):
    return jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)


def stack_hparams(points: Sequence[HParams]) -> HParams:
    """[HParams, ...] -> one HParams whose leaves are arrays with a leading [len(points)] axis."""
    def stack(*values):
        array = np.asarray(values)
        return array if array.dtype == bool else array.astype(np.float32)

    return jax.tree.map(stack, *points)


def largest_in_any_process(value: int) -> int:
    """The largest of every process's `value` (with --distributed a collective: every process calls it)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def to_host(tree):
    """Device arrays -> numpy; across hosts, gather every host's shards first."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, tree)


SHARD_SAMPLES = 512  # --env-devices auto: each device keeps at least this many samples of a minibatch


def shards_fit(config: Config, shards: int) -> bool:
    """Whether an agent's envs can be sharded over `shards` devices: it must divide the envs and each
    minibatch (recurrent: its env sequences), and a device's part of a minibatch must divide into --slices."""
    recurrent = config.is_recurrent
    units = config.num_envs // config.num_minibatches if recurrent else config.minibatch_size
    return (config.num_envs % shards == 0 and units % shards == 0
            and (config.minibatch_size // shards) % max(1, config.slices) == 0)


def batch_devices(config: Config, agents: int) -> tuple[list, int]:
    """(devices, shards): the devices a group of `agents` is sharded over, and over how many of them
    each agent's envs are (1: not sharded). At most one device per agent (padding more would only
    repeat work); where there are more devices than agents, each agent's envs over up to
    devices // agents of them (--env-devices; auto: while each device keeps SHARD_SAMPLES samples
    of a minibatch). Across hosts every host's devices must take part, one agent or more each."""
    if config.env.startswith(ENVPOOL_PREFIX):  # its pool is this host's, reached from one device's program
        return jax.devices()[:1], 1
    if jax.process_count() > 1:
        return jax.devices(), 1
    most = jax.device_count() // agents
    most = min(most, config.env_devices) if config.env_devices else most
    shards = next((n for n in range(most, 1, -1) if shards_fit(config, n)
                   and (config.env_devices or config.minibatch_size // n >= SHARD_SAMPLES)), 1)
    return jax.devices()[:agents * shards], shards


def agents_at_once(agents: int, chunk_size: int) -> int:
    """How many of a batch's agents run_batch runs together: all, or groups of chunk_size (--sweep-chunk)."""
    return min(chunk_size or agents, agents)


@dataclasses.dataclass
class LoweredBatch:
    """A batch's two programs lowered, not compiled (lower_batch), and its agents laid out for them:
    in groups of `group` (padded by repeating the last agent), each group's inputs on its devices."""

    init: Any  # jax.stages.Lowered: (a group's keys, its HParams) -> its TrainState
    advance: Any  # (TrainState, HParams, updates to run) -> (TrainState, metrics [group, chunk_length])
    size: int  # the batch's agents (without the padding)
    group: int
    num_devices: int
    put: Callable  # (host array, PartitionSpec) -> the array on the group's devices
    state_specs: TrainState  # of PartitionSpecs
    group_keys: list
    group_hparams: list
    lower_seconds: float
    place_hparams: Callable  # host HParams leaves [size] -> per group, on its devices (as group_hparams)
    exploit: Callable  # (a group's TrainState, parents [size]) -> each agent's state that of its parent (PBT)

    def groups(self, tree) -> list:  # host leaves [size, ...] -> per group, padded, on its devices (as `specs`)
        padded = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[-1:], len(self.group_keys) * self.group
                                                                     - self.size, axis=0)]), tree)
        return [jax.tree.map(lambda spec, field: jax.tree.map(
            lambda x: self.put(x[i * self.group:(i + 1) * self.group], spec), field), self.state_specs, padded)
            for i in range(len(self.group_keys))]


def lower_batch(config: Config, keys, hparams: HParams, chunk_size: int = 0, batched: Sequence[str] = ()) -> LoweredBatch:
    """run_batch's programs for a batch (keys [B, 2], HParams leaves [B]), jitted with their
    shardings and lowered, for this machine, or inside lowering_for(...), for the platforms named
    there (the accelerators' branches taken). The HParams `batched` are an input per agent even
    where the batch starts them equal (PBT changes them)."""
    timer = time.perf_counter()
    keys = np.asarray(keys)
    size = keys.shape[0]
    group = agents_at_once(size, chunk_size)
    devices, shards = batch_devices(config, group)
    num_devices = len(devices)
    group = -(-group // (num_devices // shards)) * (num_devices // shards)  # a multiple of the devices' rows
    num_groups = -(-size // group)
    pad = lambda x: np.concatenate([x, np.repeat(x[-1:], num_groups * group - size, axis=0)])  # noqa: E731
    # An hparam with one value across the batch is passed once, not vmapped (speed: a lax.cond on
    # an unbatched switch runs one branch; on a batched one, vmap must run both and select).
    varies = jax.tree.map(lambda x: bool(np.any(x != x[:1])), hparams).replace(**{name: True for name in batched})
    points, hparams = hparams, jax.tree.map(lambda x, v: pad(x) if v else x[0], hparams, varies)
    keys = pad(keys)
    slice_of = lambda x, v, i: x[i * group:(i + 1) * group] if v else x  # noqa: E731

    init, advance = make_train_parts(config, shards)
    if not varies.ortho_init:  # then a constant of the init program, which compiles that init alone
        traced_init, ortho_init = init, bool(hparams.ortho_init)
        init = lambda key, hp: traced_init(key, hp.replace(ortho_init=ortho_init))  # noqa: E731
    length = chunk_length(config)
    if group == 1:  # one agent: no vmap (a batch axis of 1 made the rollout's small ops ~40% slower on CPU)
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        add_axis = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        unbatch = lambda hp: jax.tree.map(lambda x, v: x[0] if v else x, hp, varies)  # noqa: E731
        init_batch = lambda keys, hp: add_axis(init(keys[0], unbatch(hp)))  # noqa: E731
        advance_batch = lambda state, hp, n: add_axis(advance(first(state), unbatch(hp), length, n))  # noqa: E731
    else:
        hparams_axes = jax.tree.map(lambda v: 0 if v else None, varies)
        init_batch = jax.vmap(init, in_axes=(0, hparams_axes))
        advance_batch = jax.vmap(lambda state, hp, n: advance(state, hp, length, n), in_axes=(0, hparams_axes, None))
    # The chunk program's input state is donated to its output on accelerators (memory). Not on CPU,
    # where donating ran slower and a state's extra copy in host memory is small.
    donated = () if on_cpu() else 0
    batched, replicated = PartitionSpec("batch"), PartitionSpec()

    def copy_agents(state: TrainState, parents) -> TrainState:  # PBT's exploit: a gather over the agents
        # A child draws new randomness: a sweep's points of one seed share their keys (common random
        # numbers), so a copy that kept its own key or its parent's would act as its parent's twin.
        agents = jnp.arange(parents.shape[0])
        fresh = jax.vmap(lambda key, a: jax.random.fold_in(jax.random.fold_in(key, PBT_SEED), a))(state.key, agents)
        key = jnp.where((parents != agents)[:, None], fresh, state.key)
        return jax.tree.map(lambda x: jnp.take(x, parents, axis=0), state).replace(key=key)

    env_leaves = PartitionSpec("batch", ENV_AXIS)  # [agents, envs, ...]
    state_specs = TrainState.sharding(batched, env_leaves)
    if num_devices == 1:
        # One device (the usual CPU case): a plain jit, no sharding machinery.
        init_batch = jax.jit(init_batch)
        advance_batch = jax.jit(advance_batch, donate_argnums=donated)
        exploit = jax.jit(copy_agents)
        put = lambda x, spec: jax.device_put(x)  # noqa: E731
    else:
        mesh = Mesh(np.asarray(devices).reshape(-1, shards), ("batch", ENV_AXIS))
        hparams_specs = jax.tree.map(lambda v: batched if v else replicated, varies)
        named = lambda specs: jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)  # noqa: E731
        if shards > 1:  # each device runs advance on its envs; out: the metrics are equal across ENV_AXIS
            advance_batch = jax.shard_map(advance_batch, mesh=mesh, in_specs=(state_specs, hparams_specs, replicated),
                                          out_specs=(state_specs, batched), check_vma=False)
        init_batch = jax.jit(init_batch, in_shardings=(named(batched), named(hparams_specs)),
                             out_shardings=named(state_specs))
        advance_batch = jax.jit(advance_batch, donate_argnums=donated,
                                in_shardings=(named(state_specs), named(hparams_specs), named(replicated)),
                                out_shardings=(named(state_specs), named(batched)))
        exploit = jax.jit(copy_agents, in_shardings=(named(state_specs), named(replicated)),
                          out_shardings=named(state_specs))

        def put(x, spec):  # each host supplies the shards of its own devices
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])

    group_keys = [put(slice_of(keys, True, i), batched) for i in range(num_groups)]

    def place_hparams(points: HParams) -> list:
        hparams = jax.tree.map(lambda x, v: pad(np.asarray(x)) if v else np.asarray(x)[0], points, varies)
        return [jax.tree.map(lambda x, v: put(slice_of(x, v, i), batched if v else replicated), hparams, varies)
                for i in range(num_groups)]

    def exploit_parents(state: TrainState, parents) -> TrainState:  # one group: PBT runs its population as one
        parents = np.concatenate([parents, np.arange(size, group)]).astype(np.int32)  # the padding keeps its own
        return exploit(state, put(parents, replicated))

    group_hparams = place_hparams(points)
    with collector_paused():
        lowered_init = lower(init_batch, group_keys[0], group_hparams[0])
        lowered_advance = lower(advance_batch, lowered_init.out_info, group_hparams[0], put(np.int32(length), replicated))
    return LoweredBatch(lowered_init, lowered_advance, size, group, num_devices, put, state_specs, group_keys,
                        group_hparams, time.perf_counter() - timer, place_hparams, exploit_parents)


def run_batch(config: Config, keys, hparams: HParams, chunk_size: int = 0, on_chunk=None, timed_runs: int = 0,
              start: Checkpoint | None = None, population: Population | None = None) -> RunResult:
    """Train a batch of agents of one static config: keys [B, 2] and HParams leaves [B] are vmapped
    together. Two jitted programs (lower_batch): init, and a chunk of chunk_length(config) updates,
    which the run calls until every update is done (its state donated, on accelerators). The batch
    axis is sharded over batch_devices (padded to a multiple of the device count by repeating the
    last agent; the padding is dropped after; on CPU, a device per core); where there are more
    devices than agents, each agent's envs are sharded too (a 2-D mesh, batch x ENV_AXIS: the chunk
    program is a shard_map, each device's program stepping its envs). With chunk_size, the agents
    run in groups of that many through the same compiled programs (each chunk of updates, group
    after group).

    on_chunk(updates_done, metrics, state) is called once when the programs are compiled and
    after every chunk: metrics so far [B, updates_done] with env_steps, and state() fetches the
    TrainState [B] to the host. If it returns True, the run stops there. `start` continues a run
    from a checkpoint instead of init. For benchmarks: with timed_runs > 0 the whole batch runs
    timed_runs more times after the first (a warm-up), and run_seconds is the median of those.
    `population`: population-based training, its exploit and explore before every chunk that begins
    at a multiple of its interval (a resumed run redoes the step its checkpoint came before), the
    HParams each agent trained with and whom it copied in its metrics (pbt_ columns)."""
    lowered = lower_batch(config, keys, hparams, chunk_size, population.pbt.explore if population else ())
    size, num_groups, put = lowered.size, len(lowered.group_keys), lowered.put
    if population and num_groups > 1:
        raise ConfigError(f"chunk_size {chunk_size} splits the population of {size} agents: PBT copies between the "
                          "agents of one program")
    length, replicated = chunk_length(config), PartitionSpec()
    timer = time.perf_counter()
    # Compile time: XLA compiles the init program on a second thread while this one compiles the chunk program.
    with collector_paused(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        init_compiled = pool.submit(lowered.init.compile, init_xla_options())
        compiled_advance, compiled_init = lowered.advance.compile(xla_options(config)), init_compiled.result()
    compile_seconds = time.perf_counter() - timer

    def host_state(states):
        return jax.tree.map(lambda *parts: np.concatenate(parts)[:size], *[to_host(s) for s in states])

    def advance_to_host(state, hparams, active):  # a chunk, its metrics fetched (on accelerators: waited for)
        state, chunk_metrics = compiled_advance(state, hparams, active)
        return state, to_host(chunk_metrics)

    seconds = []
    for _ in range(1 + timed_runs):
        run_start = time.perf_counter()
        if start is None:
            states, metrics = [compiled_init(lowered.group_keys[i], lowered.group_hparams[i])
                               for i in range(num_groups)], None
        else:
            states, metrics = lowered.groups(start.state), start.metrics
            if config.env.startswith(ENVPOOL_PREFIX):
                states = restart_envs(config, states)
        first_done = done = 0 if start is None else start.updates_done
        if population:
            values = population.current(metrics)
            group_hparams = lowered.place_hparams(population.with_values(hparams, values))
        else:
            group_hparams = lowered.group_hparams
        if on_chunk:
            on_chunk(done, None if metrics is None else with_env_steps(metrics, config.batch_size),
                     lambda: host_state(states))
        stop = False
        while done < config.num_updates and not stop:
            num_active = min(length, config.num_updates - done)
            parents = None
            if population and done % population.pbt.interval == 0 and done:  # exploit and explore
                parents, values = population.step(done, metrics, values)
                states[0] = lowered.exploit(states[0], parents)
                group_hparams = lowered.place_hparams(population.with_values(hparams, values))
            parts = []
            for i in range(num_groups):
                active = put(np.int32(num_active), replicated)
                states[i], chunk_metrics = call_interruptibly(advance_to_host, states[i], group_hparams[i], active)
                parts.append(chunk_metrics)
            new = jax.tree.map(lambda *p: np.concatenate(p)[:size, :num_active], *parts)
            new |= population.columns(values, parents, num_active) if population else {}
            if metrics is not None:  # (an older checkpoint's lack metrics added since: NaN before the resume)
                metrics = {name: np.concatenate([metrics.get(name, np.full((size, done), np.nan, np.float32)),
                                                 new[name]], 1) for name in new}
            metrics = new if metrics is None else metrics
            done += num_active
            stop = on_chunk and on_chunk(done, with_env_steps(metrics, config.batch_size), lambda: host_state(states))
        seconds.append(time.perf_counter() - run_start)
    run_seconds = float(np.median(seconds[-timed_runs:])) if timed_runs else seconds[0]
    return RunResult(host_state(states), with_env_steps(metrics, config.batch_size), lowered.lower_seconds,
                     compile_seconds, run_seconds, lowered.num_devices, (done - first_done) * config.batch_size * size,
                     config)


def restart_envs(config: Config, states: list) -> list:
    """A resumed run of an EnvPool env: a checkpoint cannot hold the pool's envs (they live in C++), so
    each group's agents get a new pool, its envs seeded from each agent's key as it is now (so not the
    seeds the run began with), and begin new episodes; everything else the checkpoint saved goes on
    (params, optimizer, statistics, PPO-Penalty's and the leash's betas). Not bit-identical to a run
    never stopped, as every other env's resume is."""
    env = make_env(config)
    network = make_network(config, env)

    def restart(state: TrainState) -> TrainState:
        obs, env_state = env.reset(jax.random.fold_in(state.key, RESTART_ENVS))
        hidden = initial_hidden(network, env.num_envs)
        return state.replace(env_state=env_state, obs=obs, hidden=hidden, ref_hidden=hidden,
                             discounted_return=jnp.zeros(env.num_envs, jnp.float32))

    program = jax.jit(jax.vmap(restart))
    return [program(state) for state in states]


RESTART_ENVS = 0x5EED  # restart_envs' fold_in constant (new randomness gets a constant of its own)


def call_interruptibly(fn, *args):
    """fn(*args) on a worker thread while the main thread waits for it. Python runs signal handlers
    only in the main thread, between bytecodes, and a compiled program runs in the thread that calls
    it: so a Ctrl-C during a chunk is seen at once (StopRequests), not when the chunk ends."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        future = pool.submit(fn, *args)
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                continue
    finally:
        pool.shutdown(wait=False)  # after a KeyboardInterrupt the chunk goes on: main() exits without it


def exit_at_once(message: str):
    """A second Ctrl-C: print, then end the process without waiting for the chunk under way (Python
    would join its worker thread first). Checkpoints are written atomically: the last one stays."""
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def run(config: Config) -> RunResult:
    """Compile and run config.num_seeds seeds of the config's HParams point as one program, writing
    nothing: result.metrics[name] is [seeds, updates], result.policy(seed) acts (TrainedPolicy).
    A run with outputs, checkpoints and a run directory is main(["--env", ...]), as the CLI. A bad
    setting raises ConfigError (the CLI's one-line message) before anything is compiled."""
    validate(config, check_run_dir=False)
    hparams = stack_hparams([config.hparams] * config.num_seeds)
    return run_batch(config, seed_keys(config), hparams, config.sweep_chunk)


GUARDED_METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm", "param_norm", "kl")


def guarded_metrics(config: Config) -> tuple[str, ...]:
    """The metrics the NaN guard watches (a critic-free run has no value loss: NaN by design)."""
    return tuple(name for name in GUARDED_METRICS if config.has_critic or name != "value_loss")


def first_nonfinite(metrics: dict[str, np.ndarray], start: int = 0, names=GUARDED_METRICS) -> str | None:
    """The NaN guard: where the first non-finite loss, gradient norm, parameter norm or KL is, from
    update index `start` on ("update U, seed S: M = v"), or None. (Episode returns and ref_kl are
    NaN by design where no episode ended or the leash is off.)"""
    bad = np.stack([~np.isfinite(metrics[name][:, start:]) for name in names])  # [metric, seed, update]
    if not bad.any():
        return None
    update = int(np.argmax(bad.any(axis=(0, 1))))
    metric, seed = np.argwhere(bad[:, :, update])[0]
    name = names[metric]
    return f"update {start + update + 1}, seed {seed}: {name} = {metrics[name][seed, start + update]}"


def agreed_stop(stop: StopRequests) -> bool:
    """Whether to stop after this chunk: every process stops, or none. Decided from the agreed value
    alone (a signal that lands after the exchange is this process's for the next chunk: reading the
    flag again here would stop this process alone)."""
    agreed = largest_in_any_process(stop.signal or 0)
    if agreed:
        stop.signal = agreed
    return agreed != 0


class StopRequests:
    """SIGINT (Ctrl-C) and SIGTERM during a run ask it to stop after the current chunk of updates
    (a compiled chunk cannot be interrupted); a second Ctrl-C stops at once, losing that chunk."""

    def __init__(self):
        self.signal, self.previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python installs handlers only there
            self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        at_once = "Ctrl-C again" if signum == signal.SIGINT else "a SIGINT (Ctrl-C)"
        self.signal = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this chunk of updates to save a checkpoint "
              f"({at_once}: stop now and lose the chunk)", file=sys.stderr, flush=True)

    def __exit__(self, *exception):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


EVAL_METRICS = ("eval_return", "eval_return_deterministic")  # --eval-every's columns


class Evaluations:
    """--eval-every's results for a batch of agents (a run's seeds, a sweep setting's points x seeds):
    EVAL_METRICS [agents, num_updates], NaN where no evaluation fell. When a chunk ends on a multiple
    of eval_every, evaluate's programs (sampled, and the policy's mode; compiled at the first) run on
    every agent's policy, agent a with its HParams and key a: the keys --eval --seed SEED uses on
    that agent's run, so that each mean is what --eval of its policy gives. `so_far`: a resumed
    run's evaluations (from its checkpoint)."""

    def __init__(self, config: Config, hparams: HParams, keys, so_far: dict[str, np.ndarray] | None = None):
        self.config, self.hparams, self.keys, self.programs = config, hparams, np.asarray(keys), None
        self.values = {name: np.full((len(self.keys), config.num_updates), np.nan, np.float32)
                       for name in EVAL_METRICS} if config.eval_every else {}
        for name, values in (so_far or {}).items():
            self.values[name][:, :values.shape[1]] = values

    def add(self, done: int, metrics, state=None):
        """metrics with the evaluation columns up to update `done`, evaluating first if one falls there
        and `state` is given -> (metrics, the host state if it was fetched, else None)."""
        host = None
        if state is not None and self.config.eval_every and done % self.config.eval_every == 0:
            host = state()
            self.programs = self.programs or {name: evaluation_program(self.config, self.config.eval_episodes, mode)
                                              for name, mode in zip(EVAL_METRICS, (False, True))}
            policies = Policy(host.params, host.obs_stats)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # an agent none of whose episodes ended: NaN
                for name, program in self.programs.items():
                    self.values[name][:, done - 1] = np.nanmean(np.asarray(program(policies, self.keys, self.hparams)), 1)
        return {**metrics, **{name: values[:, :done] for name, values in self.values.items()}}, host


def without_evaluations(start: Checkpoint | None) -> tuple[Checkpoint | None, dict[str, np.ndarray]]:
    """A checkpoint's metrics split into run_batch's and the evaluations so far (--eval-every's: the
    recorder's, not run_batch's)."""
    if start is None:
        return None, {}
    evaluations = {name: start.metrics[name] for name in EVAL_METRICS if name in start.metrics}
    return dataclasses.replace(start, metrics={k: v for k, v in start.metrics.items() if k not in EVAL_METRICS}), evaluations


class RunRecorder:
    """run_batch's on_chunk for a single run: after every chunk of updates, evaluate the policies
    (--eval-every), append metrics.csv, apply the NaN guard, save the checkpoint (never a non-finite
    one), update the progress line, and stop if a signal asked for it. run_dir None (not the writing
    host): nothing is written. `evaluations`: those of the run so far (from its checkpoint, resumed)."""

    def __init__(self, config: Config, run_dir: str | None, stop: StopRequests,
                 evaluations: dict[str, np.ndarray] | None = None, written: int = 0):
        self.config, self.run_dir, self.stop = config, run_dir, stop
        self.done = self.progress = self.diverged = None
        self.trackers: list[Tracker] = []  # --tensorboard, --wandb-project: from update `written` on
        if run_dir is not None:
            self.trackers = trackers(run_dir, [f"seed_{i}" for i in range(config.num_seeds)],
                                     [config] * config.num_seeds, written)
        self.last_finite: TrainState | None = None  # the state of the last checkpoint (None: none yet)
        self.evaluations = Evaluations(config, stack_hparams([config.hparams] * config.num_seeds), seed_keys(config),
                                       evaluations)

    def write(self, function, *args) -> None:
        if self.run_dir is not None:
            function(*args)

    def __call__(self, done: int, metrics, state) -> bool:
        csv_path = None if self.run_dir is None else os.path.join(self.run_dir, "metrics.csv")
        if self.done is None:  # compiled; the run starts (when resumed: fill rows a kill may have cut off)
            self.done, self.time = done, time.perf_counter()
            for tracker in self.trackers:
                tracker.started()
            self.progress = Progress(self.config.num_updates, done, self.config.quiet or jax.process_index() > 0)
            if metrics is not None:
                self.last_finite = state()
                self.write(append_metrics_csv, csv_path, self.evaluations.add(done, metrics)[0])
            return False
        metrics, host = self.evaluations.add(done, metrics, state)
        self.write(append_metrics_csv, csv_path, metrics)
        for tracker in self.trackers:
            tracker.add(metrics)
        self.diverged = first_nonfinite(metrics, self.done, guarded_metrics(self.config))
        if self.diverged:
            return True
        self.last_finite = state() if host is None else host
        metrics_only = {name: value for name, value in metrics.items() if name != "env_steps"}
        self.write(save_checkpoint, self.run_dir, self.config, Checkpoint(self.last_finite, metrics_only))
        now = time.perf_counter()
        returns = metrics["episode_return"][:, self.done:done]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: no episode ended in the chunk
            mean_return = np.nanmean(returns)
        rate = (done - self.done) * self.config.batch_size * self.config.num_seeds / (now - self.time)
        # Decided before the progress line is shown, so a signal sent on seeing it stops after the next chunk.
        stop = agreed_stop(self.stop)
        self.progress.show(done, f"update {done}/{self.config.num_updates}  return {mean_return:.1f}  "
                                 f"{rate:,.0f} env steps/s")
        self.done, self.time = done, now
        return stop


def train_run(config: Config, run_dir: str | None, start: Checkpoint | None = None) -> tuple[RunResult, str]:
    """A single run (config.num_seeds seeds) into its run directory, chunk by chunk (see
    RunRecorder), from `start` when resumed, then its outputs (write_outputs) -> (result, status):
    "complete", "interrupted by SIGINT/SIGTERM" or "diverged at update U, seed S: M = v"."""
    start, evaluations = without_evaluations(start)
    with StopRequests() as stop:
        recorder = RunRecorder(config, run_dir, stop, evaluations, start.updates_done if start else 0)
        hparams = stack_hparams([config.hparams] * config.num_seeds)
        summaries = None
        try:
            result = run_batch(config, seed_keys(config), hparams, config.sweep_chunk, recorder, start=start)
            recorder.progress.end()
            done = result.metrics["env_steps"].shape[1]
            result = dataclasses.replace(result, metrics=recorder.evaluations.add(done, result.metrics)[0])
            if recorder.diverged:  # keep the last finite state: the final params are not worth having
                result, status = dataclasses.replace(result, state=recorder.last_finite), f"diverged at {recorder.diverged}"
            elif result.metrics["env_steps"].shape[1] < config.num_updates:
                status = f"interrupted by {signal.Signals(stop.signal).name}"
            else:
                status = "complete"
            if run_dir is not None:
                summaries = write_outputs(run_dir, config, result, status)
        finally:
            for tracker in recorder.trackers:
                tracker.close(summaries, run_dir and os.path.join(run_dir, "curve.png"))
    return result, status


# ================================================================================================
# 5. Sweeps: specs, the batch of points x seeds, their outputs
# ================================================================================================


@dataclasses.dataclass
class Sweep:
    """A resolved sweep: every static setting (one compile each) runs every point x every seed."""

    name: str
    configs: list[Config]  # one per static setting; .hparams is that setting's base point
    points: list[dict[str, Any]]  # HParams overrides of each point
    labels: list[str]
    swept: list[str]  # the HParams fields that vary between points
    normalized_score: bool
    spec_text: str
    rank_by: str = "episode_return"  # the metric that ranks the points (Config.rank_by)
    pbt: Pbt | None = None  # population-based training over the points ([pbt], --pbt-interval)

    def hparams(self, config: Config) -> list[HParams]:
        return [dataclasses.replace(config.hparams, **point) for point in self.points]

    def keys(self, config: Config) -> np.ndarray:  # [points * seeds, 2], point-major: agent p * S + s
        return np.tile(np.asarray(seed_keys(config)), (len(self.points), 1))

    @property
    def metric(self) -> str:  # the ranking metric as the table and figures name it
        return "return" if self.rank_by == "episode_return" else self.rank_by


def coerce(name: str, value, template, where: str):
    """A spec value, checked against the type of the field's default."""
    ok = False
    if isinstance(template, bool):
        ok = isinstance(value, bool)
    elif isinstance(template, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(template, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(template, tuple):
        element = type(template[0]) if template else str
        ok = isinstance(value, list | tuple) and all(type(v) is element for v in value)
        value = tuple(value) if ok else value
    else:  # str or None
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{where}: {name} = {value!r} has the wrong type (like {template!r})")
    return value


def apply_overrides(config: Config, overrides: dict[str, Any], where: str, allowed=STATIC_FIELDS | HPARAM_FIELDS):
    """Config with `overrides` (Config or HParams field names) applied; unknown keys are errors."""
    static, hparams = {}, {}
    for name, value in overrides.items():
        if name not in allowed:
            raise ConfigError(f"{where}: unknown key {name!r}; known keys: {', '.join(sorted(allowed))}")
        if name in HPARAM_FIELDS:
            hparams[name] = coerce(name, value, getattr(HParams(), name), where)
        else:
            static[name] = coerce(name, value, getattr(Config(), name) if getattr(Config(), name) is not None else "",
                                  where)
    return dataclasses.replace(config, **static, hparams=dataclasses.replace(config.hparams, **hparams))


def expand_grid(grid: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The cartesian product of {field: [values]}, in the spec's order; {} gives one empty point."""
    for name, values in grid.items():
        if name not in HPARAM_FIELDS:
            raise ConfigError(f"{where}: {name!r} is not an HParams field (static settings go in [[static]]); "
                              f"known: {', '.join(sorted(HPARAM_FIELDS))}")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: {name} needs a non-empty list of values, e.g. {name} = [0.1, 0.2]")
    points = [{}]
    for name, values in grid.items():
        points = [{**point, name: coerce(name, value, getattr(HParams(), name), where)}
                  for point in points for value in values]
    return points


def sample_random(spec: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """Random search: `count` points, each field drawn from log_uniform/uniform [lo, hi] or a choice."""
    spec = dict(spec)
    count, seed = spec.pop("count", None), spec.pop("seed", 0)
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"{where}: count = {count!r}: give the number of random points, e.g. count = 16")
    rng = np.random.default_rng(seed)
    for name in spec:
        if name not in HPARAM_FIELDS:
            raise ConfigError(f"{where}: {name!r} is not an HParams field; known: {', '.join(sorted(HPARAM_FIELDS))}")
    draws = {name: distribution(name, dist, where) for name, dist in spec.items()}
    return [{name: coerce(name, draw(kind, args, rng), getattr(HParams(), name), where)
             for name, (kind, args) in draws.items()} for _ in range(count)]


def distribution(name: str, dist, where: str) -> tuple[str, list]:
    """A spec's { log_uniform = [lo, hi] }, { uniform = [lo, hi] } or { choice = [...] }, checked -> (kind, args)."""
    if not (isinstance(dist, dict) and len(dist) == 1 and set(dist) <= {"log_uniform", "uniform", "choice"}):
        raise ConfigError(f"{where}: {name} needs one of {{ log_uniform = [lo, hi] }}, "
                          "{ uniform = [lo, hi] }, { choice = [...] }")
    (kind, args), = dist.items()
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}: {name}.choice needs a non-empty list")
    elif not (isinstance(args, list) and len(args) == 2 and all(isinstance(a, int | float) for a in args)
              and args[0] < args[1] and (kind == "uniform" or args[0] > 0)):
        raise ConfigError(f"{where}: {name}.{kind} needs [lo, hi] with lo < hi" +
                          (" and lo > 0" if kind == "log_uniform" else ""))
    return kind, list(args)


def draw(kind: str, args: list, rng: np.random.Generator):
    """One value of a distribution() (random search's points, PBT's resampling)."""
    if kind == "choice":
        return args[int(rng.integers(len(args)))]
    lo, hi = args
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) if kind == "log_uniform" else float(rng.uniform(lo, hi))


def format_value(value) -> str:
    if isinstance(value, list | tuple):
        return ",".join(format_value(v) for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


def resolve_sweep(spec: dict[str, Any], name: str, spec_text: str, cli: Config, explicit: dict[str, Any]) -> Sweep:
    """Turn a parsed spec into configs and points. Precedence, lowest first: the env's defaults,
    the spec's [base], its [[static]] entry, then the flags given on the command line."""
    where = f"--sweep {name}"
    known = {"name", "normalized_score", "rank_by", "base", "grid", "random", "static", "pbt"}
    for key in spec:
        if key not in known:
            raise ConfigError(f"{where}: unknown top-level key {key!r}; known: {', '.join(sorted(known))}")
    base = spec.get("base", {})
    statics = spec.get("static", [{}])
    if not isinstance(base, dict) or not isinstance(statics, list) or not all(isinstance(x, dict) for x in statics):
        raise ConfigError(f"{where}: [base] must be a table and [[static]] an array of tables")
    configs = []
    for i, static in enumerate(statics):
        env = explicit.get("env", static.get("env", base.get("env", cli.env)))
        algo = explicit.get("algo", static.get("algo", base.get("algo", cli.algo)))  # its defaults under the spec's
        check_env_id(env)
        config = apply_overrides(default_config(env, algo=algo), base, f"{where} [base]",
                                 STATIC_FIELDS - RUN_FIELDS | HPARAM_FIELDS)
        config = apply_overrides(config, static, f"{where} [[static]] {i + 1}", STATIC_FIELDS - RUN_FIELDS | HPARAM_FIELDS)
        config = apply_overrides(config, explicit, "command line")
        config = dataclasses.replace(config, **{name: getattr(cli, name) for name in SWEEP_RUN_FIELDS})
        validate(config, check_run_dir=False)
        configs.append(config)

    grids = spec.get("grid", [{}] if "random" not in spec else [])
    grids = [grids] if isinstance(grids, dict) else grids
    points = [point for i, grid in enumerate(grids) for point in expand_grid(grid, f"{where} [[grid]] {i + 1}")]
    if "random" in spec:
        randoms = sample_random(spec["random"], f"{where} [random]")
        overlap = {k for p in points for k in p} & {k for r in randoms for k in r}
        if overlap:
            raise ConfigError(f"{where}: {sorted(overlap)} appear in both [grid] and [random]")
        points = [{**point, **sample} for point in (points or [{}]) for sample in randoms]
    if not points:
        raise ConfigError(f"{where}: no points to run: give at least one [[grid]] (an empty one is the base point)")
    swept = [k for k in HPARAM_FIELDS  # the fields whose value (the point's, else the base's) differs between points
             if any(len({format_value(p.get(k, getattr(config.hparams, k))) for p in points}) > 1 for config in configs)]
    swept.sort(key=lambda k: [f.name for f in dataclasses.fields(HParams)].index(k))
    labels = [", ".join(f"{k}={format_value(v)}" for k, v in point.items()) or "base" for point in points]
    for config in configs:
        for label, hparams in zip(labels, [dataclasses.replace(config.hparams, **p) for p in points]):
            validate_hparams(hparams, f"{where}, point {label!r} on {config.env}: ", config.algo)
    rank_by = spec.get("rank_by", "episode_return")
    check_rank_by(rank_by, configs[0], f"{where}: rank_by =")
    pbt = None
    if cli.pbt_interval != 0 and ("pbt" in spec or cli.pbt_interval):  # (--pbt-interval 0: none; None: the spec's)
        table = {**spec.get("pbt", {}), **({"interval": cli.pbt_interval} if cli.pbt_interval else {})}
        pbt, configs = resolve_pbt(table, where, points, swept, spec.get("random", {}), configs, rank_by)
    sweep = Sweep(spec.get("name", name), configs, points, labels, swept, bool(spec.get("normalized_score", False)),
                  spec_text, rank_by, pbt)
    check_score_layout(sweep, where)
    return sweep


def metric_names(config: Config) -> list[str]:
    """The columns of metrics.csv a run of `config` writes (its program traced, not compiled)."""
    config = dataclasses.replace(config, init_params=None, ref_params=None)  # (their files: not needed to trace)
    _, metrics = jax.eval_shape(make_train(config), jax.random.PRNGKey(0), config.hparams)
    return ["env_steps", *sorted(metrics), *(EVAL_METRICS if config.eval_every else ())]


def check_rank_by(name, config: Config, where: str) -> None:
    if name == "episode_return":
        return
    if name in EVAL_METRICS and not config.eval_every:
        raise ConfigError(f"{where} {name!r}: --eval-every's evaluation; give --eval-every N (and --eval-episodes)")
    names = metric_names(config) if isinstance(name, str) else []
    if name not in names:
        raise ConfigError(f"{where} {name!r}: not a metric of this sweep's runs; rank by one of {', '.join(names)}")


def sweep_from_flags(cli: Config, explicit: dict[str, Any]) -> Sweep:
    """--sweep-set name=v1,v2 ... as a one-grid spec."""
    grid = {}  # a name given twice: its values together
    for item in cli.sweep_set:
        name, _, values = item.partition("=")
        where = f"--sweep-set {item!r}"
        if name in STATIC_FIELDS:
            raise ConfigError(f"{where}: {name} is static (it shapes the compiled program), so it cannot be swept "
                              "from flags: give a spec file (--sweep FILE) a [[static]] table per value")
        if name not in HPARAM_FIELDS or not values:
            close = difflib.get_close_matches(name, HPARAM_FIELDS, n=1)
            raise ConfigError(f"{where}: give name=v1,v2,... with an HParams field name, e.g. lr=1e-4,3e-4"
                              + (f" (did you mean {close[0]}?)" if close else ""))
        try:
            parsed = [parse_bool(v, where) if isinstance(getattr(HParams(), name), bool) else float(v)
                      for v in values.split(",")]
        except ValueError:
            raise ConfigError(f"{where}: {name} takes numbers") from None
        merged = grid.setdefault(name, [])
        for value in parsed:
            if value in merged:
                raise ConfigError(f"{where}: {name}={format_value(value)} is given twice: give each value once "
                                  "(--num-seeds repeats a point)")
            merged.append(value)
    explicit = {k: v for k, v in explicit.items() if k not in grid}
    text = "\n".join(f"# --sweep-set {item}" for item in cli.sweep_set)
    return resolve_sweep({"grid": grid}, "cli", text, cli, explicit)


def load_sweep(cli: Config, explicit: dict[str, Any]) -> Sweep:
    """Read --sweep PATH (stdlib tomllib: data only, nothing is evaluated) or --sweep-set flags."""
    if cli.sweep and cli.sweep_set:
        raise ConfigError("--sweep and --sweep-set: use one of them (put the grid in the file)")
    if not cli.sweep:
        return sweep_from_flags(cli, explicit)
    try:
        with open(cli.sweep, "rb") as f:
            text = f.read().decode()
        spec = tomllib.loads(text)
    except OSError as error:
        raise ConfigError(f"--sweep {cli.sweep}: cannot read it ({error.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--sweep {cli.sweep}: not valid TOML ({error})") from None
    return resolve_sweep(spec, os.path.splitext(os.path.basename(cli.sweep))[0], text, cli, explicit)


# --- population-based training (Jaderberg et al. 2017): a sweep's points as a population ---------


PBT_KEYS = ("interval", "fraction", "perturb", "resample", "explore", "rank_by", "distributions")


PBT_SEED = 0x9B7  # the exploit and explore draws' seed, with the run's --seed (new randomness gets a constant of its own)


@dataclasses.dataclass(frozen=True)
class Pbt:
    """A sweep's [pbt] table. Each seed s is a population of its own: seed s of every point. Every
    `interval` updates, in each population ranked by `rank_by` over the interval, the worst `fraction`
    each copy a random agent of the best `fraction` (exploit: its whole TrainState, but for a random
    key of its own) and then change each `explore`d HParam (explore): with probability `resample` a new draw
    from its distribution (the spec's [random] one, else the grid's values), otherwise the parent's
    value times a factor of `perturb` (a value the field does not take keeps the parent's). The child
    takes its parent's envs too, mid-episode: the observation statistics, recurrent state and running
    discounted return it takes belong to those episodes."""

    interval: int
    fraction: float = 0.25  # truncation selection (Jaderberg et al.: the bottom 20-25 % copy the top); at least 1
    perturb: tuple[float, ...] = (0.8, 1.2)  # Jaderberg et al.'s factors
    resample: float = 0.25  # Ray Tune's resample_probability
    explore: tuple[str, ...] = ()  # default: the swept HParams that are numbers
    rank_by: str = "episode_return"  # default: the sweep's
    distributions: tuple[tuple[str, str, tuple], ...] = ()  # (field, log_uniform|uniform|choice, its arguments)

    def toml(self) -> list[str]:  # sweep.toml's [pbt] table, everything resolved
        lines = ["[pbt]"] + [f"{name} = {toml_value(getattr(self, name))}"
                             for name in ("interval", "fraction", "perturb", "resample", "explore", "rank_by")]
        return lines + ["[pbt.distributions]"] + [f"{name} = {{ {kind} = {toml_value(list(args))} }}"
                                                  for name, kind, args in self.distributions]


def resolve_pbt(table: dict[str, Any], where: str, points: list[dict[str, Any]], swept: list[str],
                random_spec: dict[str, Any], configs: list[Config], rank_by: str) -> tuple[Pbt, list[Config]]:
    """A spec's [pbt] (with --pbt-interval's interval) checked against its sweep -> (Pbt, the configs
    with chunks that end where PBT steps: --checkpoint-every, else the largest divisor of the interval
    (and of --eval-every) no longer than the default chunk). Each problem: one line, before compiling."""
    where = f"{where} [pbt]"
    if not isinstance(table, dict) or set(table) - set(PBT_KEYS):
        raise ConfigError(f"{where}: a table of {', '.join(PBT_KEYS)}")
    number = lambda value: isinstance(value, int | float) and not isinstance(value, bool)  # noqa: E731
    interval = table.get("interval")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(f"{where}: interval = {interval!r}: give the updates between exploit steps, e.g. "
                          "interval = 10 (or --pbt-interval 10)")
    if len(points) < 2:
        raise ConfigError(f"{where}: a population of one point: give a [[grid]] or [random] of several points "
                          "(each seed's population is every point's agent of that seed)")
    fraction = table.get("fraction", Pbt.fraction)
    if not number(fraction) or not 0 < fraction <= 0.5:
        raise ConfigError(f"{where}: fraction = {fraction!r}: give more than 0 and at most 0.5 (the worst fraction "
                          "of a population copy the best fraction; at least one agent)")
    perturb = table.get("perturb", list(Pbt.perturb))
    if not isinstance(perturb, list) or not perturb or not all(number(f) and f > 0 for f in perturb):
        raise ConfigError(f"{where}: perturb = {perturb!r}: give positive factors, e.g. perturb = [0.8, 1.2]")
    resample = table.get("resample", Pbt.resample)
    if not number(resample) or not 0 <= resample <= 1:
        raise ConfigError(f"{where}: resample = {resample!r}: a probability, 0 to 1")
    explore = table.get("explore", [name for name in swept if not isinstance(getattr(HParams(), name), bool)])
    if not isinstance(explore, list) or not all(isinstance(name, str) for name in explore):
        raise ConfigError(f"{where}: explore = {explore!r}: a list of HParams fields, e.g. explore = [\"lr\"]")
    for name in explore:
        if name in STATIC_FIELDS:
            raise ConfigError(f"{where}: explore {name!r} is static (it shapes the compiled program, so it cannot "
                              "change while the population trains): explore HParams fields")
        if name not in HPARAM_FIELDS:
            raise ConfigError(f"{where}: explore {name!r} is not an HParams field; known: {', '.join(sorted(HPARAM_FIELDS))}")
        if isinstance(getattr(HParams(), name), bool):
            raise ConfigError(f"{where}: explore {name!r} is an on/off switch: PBT perturbs numbers")
    if not explore:
        raise ConfigError(f"{where}: nothing to explore: the points differ in no number; give explore = [\"lr\", ...]")
    given = table.get("distributions", {})
    if not isinstance(given, dict) or set(given) - set(explore):
        raise ConfigError(f"{where}: distributions: a table of the explored fields' distributions, "
                          "e.g. lr = { log_uniform = [1e-4, 1e-2] }")
    distributions = []
    for name in explore:
        if name in given or name in random_spec:
            kind, args = distribution(name, given.get(name, random_spec.get(name)), f"{where} distributions")
        else:  # the grid's values of the field (the base's where a point leaves it)
            kind, args = "choice", sorted({float(point.get(name, getattr(configs[0].hparams, name))) for point in points})
        distributions.append((name, kind, tuple(args)))
    rank_by = table.get("rank_by", rank_by)
    check_rank_by(rank_by, configs[0], f"{where}: rank_by =")
    chunked = []
    for config in configs:
        agents = len(points) * config.num_seeds
        if interval >= config.num_updates:
            raise ConfigError(f"{where}: interval = {interval} is not below {config.env}'s {config.num_updates} "
                              "updates: no exploit step would happen; give a shorter interval")
        if config.checkpoint_every and interval % config.checkpoint_every:
            raise ConfigError(f"--checkpoint-every {config.checkpoint_every} does not divide [pbt] interval = "
                              f"{interval}: chunks end where PBT steps; give a divisor of it")
        if config.sweep_chunk and config.sweep_chunk < agents:
            raise ConfigError(f"--sweep-chunk {config.sweep_chunk} splits the population of {agents} agents: PBT "
                              "copies between the agents of one program; drop --sweep-chunk")
        if config.env.startswith(ENVPOOL_PREFIX):
            raise ConfigError(f"{where}: {config.env}'s envs live in EnvPool's C++ pool, outside the program: an "
                              "agent's episodes cannot be copied to another; PBT needs a JAX env")
        common = math.gcd(interval, config.eval_every) if config.eval_every else interval
        every = config.checkpoint_every or max(d for d in range(1, min(common, chunk_length(config)) + 1)
                                               if common % d == 0)
        chunked.append(dataclasses.replace(config, checkpoint_every=every))
    pbt = Pbt(interval, float(fraction), tuple(float(f) for f in perturb), float(resample), tuple(explore), rank_by,
              tuple(distributions))
    return pbt, chunked


class Population:
    """PBT's decisions over one static setting's batch (agents point-major: a = p * seeds + s): whom each
    agent copies and the HParams it goes on with. Made on the host from the metrics every process
    holds (so every process decides alike) with numpy's generator seeded by the run's seed, the seed
    and the update (so a resumed sweep decides as it would have); the copy is a gather on the device
    (LoweredBatch.exploit)."""

    def __init__(self, pbt: Pbt, config: Config, points: int, hparams: HParams):
        self.pbt, self.config, self.points, self.seeds = pbt, config, points, config.num_seeds
        self.initial = {name: np.asarray(getattr(hparams, name), np.float32) for name in pbt.explore}  # [agents]
        self.draws = {name: (kind, list(args)) for name, kind, args in pbt.distributions}
        self.copies = max(1, int(pbt.fraction * points))  # per population and step (at most half: fraction <= 0.5)

    def current(self, metrics: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """The explored HParams of the last update run (metrics.csv's pbt_ columns), or the initial ones."""
        if metrics is None:
            return dict(self.initial)
        return {name: np.asarray(metrics[f"pbt_{name}"][:, -1], np.float32) for name in self.pbt.explore}

    def scores(self, metrics: dict[str, np.ndarray], done: int) -> np.ndarray:
        """[agents]: rank_by's mean over the interval's updates that have it; -inf for an agent with none,
        or whose losses went non-finite (it is replaced first)."""
        recent = slice(done - self.pbt.interval, done)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # no value in the interval: NaN
            score = np.nanmean(metrics[self.pbt.rank_by][:, recent], axis=1)
        diverged = np.any([~np.isfinite(metrics[name][:, recent]).all(axis=1) for name in guarded_metrics(self.config)
                           if name in metrics], axis=0)
        return np.where(np.isfinite(score) & ~diverged, score, -np.inf)

    def step(self, done: int, metrics: dict[str, np.ndarray], values: dict[str, np.ndarray]):
        """Exploit and explore after `done` updates -> (parents [agents]: the agent each copies, itself
        if none; the explored HParams from now on)."""
        score, n = self.scores(metrics, done), self.copies
        parents, values = np.arange(self.points * self.seeds), {name: v.copy() for name, v in values.items()}
        for s in range(self.seeds):
            agents = np.arange(self.points) * self.seeds + s
            order = agents[np.argsort(-score[agents], kind="stable")]  # best first; ties: the lower point
            rng = np.random.default_rng([PBT_SEED, self.config.seed, s, done])
            for child in np.sort(order[-n:]):
                parents[child] = parent = order[int(rng.integers(n))]
                for name in self.pbt.explore:
                    values[name][child] = self.explored(name, float(values[name][parent]), rng)
        return parents, values

    def explored(self, name: str, value: float, rng: np.random.Generator) -> float:
        resampled = rng.random() < self.pbt.resample
        factor = self.pbt.perturb[int(rng.integers(len(self.pbt.perturb)))]
        new = float(draw(*self.draws[name], rng)) if resampled else value * factor
        try:  # e.g. gamma above 1: the parent's value
            validate_hparams(dataclasses.replace(self.config.hparams, **{name: new}), "", self.config.algo)
        except ConfigError:
            return value
        return float(np.float32(new))

    def columns(self, values: dict[str, np.ndarray], parents: np.ndarray | None, updates: int) -> dict[str, np.ndarray]:
        """A chunk's pbt_ columns [agents, updates]: the values each agent trained with, and the point whose
        state it began the update from (its own but at the first update after a copy)."""
        own = np.arange(self.points * self.seeds) // self.seeds
        parent = np.repeat(own[:, None], updates, axis=1).astype(np.float32)
        if parents is not None:
            parent[:, 0] = parents // self.seeds
        return {**{f"pbt_{name}": np.repeat(value[:, None], updates, axis=1) for name, value in values.items()},
                "pbt_parent": parent}

    def with_values(self, hparams: HParams, values: dict[str, np.ndarray]) -> HParams:
        return hparams.replace(**{name: values[name] for name in self.pbt.explore})


def random_policy_return(config: Config, num_envs: int = 64, seed: int = 0) -> float:
    """Mean return of complete episodes under uniformly random actions (legal ones, where the env
    masks them: the 0 of normalised scores), over one episode limit's worth of steps in num_envs envs."""
    return float(random_policy_program(config, num_envs)(jax.random.PRNGKey(seed)))


def random_policy_program(config: Config, num_envs: int):
    """random_policy_return's jitted program: key -> the mean return."""
    env = vec_env(config.env, num_envs, config.env_params)
    space = env.env.action_space(env.env_params)
    steps = min(env.episode_limit(default=1000), 10_000) + 1  # one whole episode even at the limit (Freeway: 2500)

    def step(carry, inputs):
        obs, env_state = carry
        action_keys, step_keys, reset = inputs
        if env.action_mask_size or env.action_nvec:  # uniform over the legal actions (factorised: per component)
            legal = obs[:, -env.action_mask_size:] > 0.5 if env.action_mask_size else jnp.ones((num_envs, env.action_dim), bool)
            action = Categorical(masked_logits(jnp.zeros(legal.shape), legal), env.action_nvec).sample(action_keys[0])
        else:
            action = jax.vmap(space.sample)(action_keys)
            action = action if env.discrete else action.reshape(num_envs, env.action_dim)
        obs, env_state, _, terminated, truncated, info = env.step(step_keys, env_state, action, reset)
        done = info["episode_end"].astype(jnp.float32)
        return (obs, env_state), (done * info["episode_return"], done)

    @functools.partial(jax.jit, compiler_options=xla_options())
    def rollout(key):
        reset_key, action_key, step_key, resets_key = jax.random.split(key, 4)
        inputs = (jax.random.split(action_key, (steps, num_envs)), jax.random.split(step_key, (steps, num_envs)),
                  env.draw_resets(resets_key, steps))
        _, (returns, done) = jax.lax.scan(step, env.reset(reset_key), inputs)
        return returns.sum() / done.sum()

    return rollout


@dataclasses.dataclass
class SweepSetting:
    """The results of one static setting: metrics [points, seeds, updates]."""

    config: Config
    result: RunResult
    random_return: float | None

    def per_point(self, name: str) -> np.ndarray:
        metric = self.result.metrics[name]
        return metric.reshape(-1, self.config.num_seeds, *metric.shape[1:])

    def diverged(self) -> np.ndarray:  # [points, seeds]: a loss, KL or norm went non-finite (the NaN guard's test)
        bad = [~np.isfinite(self.per_point(name)).all(axis=-1) for name in guarded_metrics(self.config)]
        return np.any(bad, axis=0)

    def final(self, name: str = "episode_return") -> np.ndarray:  # [points, seeds]; NaN where the agent diverged
        final = (last_evaluation(self.result.metrics, name)[0] if name in EVAL_METRICS else  # (--eval-every's)
                 final_return(self.result.metrics, name=name)).reshape(-1, self.config.num_seeds)
        return np.where(self.diverged(), np.nan, final)  # (its policy acts on NaNs)

    def final_iqm(self, name: str = "episode_return") -> np.ndarray:  # [points]: over the seeds that did not diverge
        return np.array([finite_iqm(final) for final in self.final(name)])

    def ranking(self, name: str = "episode_return") -> np.ndarray:
        """The points, best first: by final_iqm(name); ties (e.g. CartPole's 500) by the mean area under
        the return's curve, the point that got there sooner first."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a point whose every seed diverged: NaN, last
            return best_first(self.final_iqm(name), np.nanmean(self.auc(), axis=1))

    def auc(self) -> np.ndarray:  # [points, seeds]: mean return over all updates (area under the curve / steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: no episode ended
            auc = np.nanmean(self.per_point("episode_return"), axis=-1)
        return np.where(self.diverged(), np.nan, auc)


def setting_name(sweep: Sweep, i: int) -> str:
    """Static setting i by its number, env and what it sets where the settings differ:
    "1:CartPole-v1", "2:ToyRLHF-v0 update_epochs=10"."""
    specs = [run_spec(config) for config in sweep.configs]
    differ = [name for name in specs[i] if name != "env" and len({json.dumps(spec.get(name)) for spec in specs}) > 1]
    return " ".join([f"{i + 1}:{sweep.configs[i].env}"] + [f"{name}={format_value(specs[i][name])}" for name in differ])


def setting_title(sweep: Sweep, i: int, wrap: int = 0) -> str:
    """Static setting i, short, for figure panels and the progress line: its number, its env, and
    only what the spec sets differently between the settings (not what follows from each env's own
    defaults): "2: CartPole-v1", "3: ToyRLHF-v0 update_epochs=10"; wrap: lines of at most this many
    characters. setting_name is the full label."""
    specs = [run_spec(config) for config in sweep.configs]
    spec_set = {name for spec, config in zip(specs, sweep.configs)  # beyond the env's defaults, in some setting
                for name, value in run_spec(default_config(config.env, algo=config.algo)).items()
                if spec[name] != value}
    spec_set.add("algo")  # (the algorithm's defaults follow from it, as the env's from the env)
    differ = [name for name in specs[i] if name in spec_set - {"env"} and len({json.dumps(s[name]) for s in specs}) > 1]
    title = " ".join([f"{i + 1}: {sweep.configs[i].env}"] + [f"{name}={format_value(specs[i][name])}" for name in differ])
    return "\n".join(textwrap.wrap(title, wrap, break_on_hyphens=False)) if wrap else title


# A sweep directory: its resolved spec, the sweep's tables and figures, and per static setting a
# directory with the setting's checkpoint (all its points x seeds) and a run directory per point
# (config.json, metrics.csv, params.msgpack, summary.json: --eval, load_run and --init-params take it).
SWEEP_SPEC = "sweep.toml"


def is_sweep_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SWEEP_SPEC))


def setting_dir(run_dir: str, i: int) -> str:
    return os.path.join(run_dir, f"setting-{i + 1}")


def point_dir(run_dir: str, i: int, p: int) -> str:
    return os.path.join(setting_dir(run_dir, i), f"point-{p}")


def sweep_fingerprint(sweep: Sweep, fields: set[str] | None = None) -> str:
    """What fixes a sweep's results (every setting's run_spec, the points), as a short hash:
    sweep.toml records it, and --resume refuses a sweep.toml that no longer gives it. `fields`: only
    these of each run_spec, those a sweep.toml names (one written before a field existed leaves it at
    its default, which keeps the behaviour of its day: rule 4)."""
    specs = [{name: value for name, value in run_spec(config).items() if fields is None or name in fields}
             for config in sweep.configs]
    what = [sweep.name, sweep.normalized_score, specs, sweep.points] + ([dataclasses.asdict(sweep.pbt)] if sweep.pbt else [])
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "inf" if value == math.inf else "-inf" if value == -math.inf else "nan" if value != value else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string


def resolved_sweep_toml(sweep: Sweep, source: str) -> str:
    """The sweep with everything resolved, in the spec format: `--sweep` on this file runs the same
    configs and points again (one [[grid]] per point)."""
    lines = [f"# Resolved from {source} on {datetime.datetime.now():%Y-%m-%d %H:%M}: every static setting",
             "# in full, one [[grid]] per point. `python ppo_jax.py --sweep <this file>` runs it again.",
             f"# fingerprint {sweep_fingerprint(sweep)} (--resume checks that this file still gives it)",
             f"name = {toml_value(sweep.name)}", f"normalized_score = {toml_value(sweep.normalized_score)}",
             f"rank_by = {toml_value(sweep.rank_by)}", ""]
    for config in sweep.configs:
        lines.append("[[static]]")
        fields = {**dataclasses.asdict(config), **dataclasses.asdict(config.hparams)}
        for name, value in fields.items():
            if name not in RUN_FIELDS and name != "hparams" and value is not None:
                lines.append(f"{name} = {toml_value(value)}")
        lines.append("")
    for label, point in zip(sweep.labels, sweep.points):
        lines.append(f"[[grid]]  # {label}")
        lines.extend(f"{name} = [{toml_value(value)}]" for name, value in point.items())
        lines.append("")
    if sweep.pbt:
        lines.extend(sweep.pbt.toml() + [""])
    lines.append("# The spec as given:")
    lines.extend(f"# {line}" for line in sweep.spec_text.splitlines())
    return "\n".join(lines) + "\n"


def results_rows(sweep: Sweep, settings: list[SweepSetting]) -> list[list[str]]:
    """results.csv: one row per setting x point x seed: every HParam, final return, area under the
    curve, --eval-every's last evaluations, the ranking metric's final value (nothing that depends
    on the machine's speed: a resumed sweep writes the same bytes)."""
    hparam_names = [f.name for f in dataclasses.fields(HParams)]
    evaluated = list(EVAL_METRICS) if sweep.configs[0].eval_every else []  # --eval-every's, at the last evaluation
    ranked = [sweep.rank_by] if sweep.rank_by not in ("episode_return", *evaluated) else []  # the ranking metric's
    rows = [["static", "env", "point", "label", "seed"] + hparam_names + ["final_return", "auc"] +
            [f"last_{name}" for name in evaluated] + [f"final_{name}" for name in ranked]]
    for i, setting in enumerate(settings):
        values = [setting.final(), setting.auc()] + [setting.final(name) for name in evaluated + ranked]
        for p, hparams in enumerate(sweep.hparams(setting.config)):
            for seed in range(setting.config.num_seeds):
                rows.append([setting_name(sweep, i), setting.config.env, str(p), sweep.labels[p], str(seed)] +
                            [format_value(getattr(hparams, n)) for n in hparam_names] +
                            [f"{value[p, seed]:.6g}" for value in values])
    return rows


def score_layout(sweep: Sweep) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Who is compared with whom in the normalised score -> (the methods' labels, cells[m][t]: the
    (static setting, point) of method m on task t). A method is a point and a task a static setting;
    where the settings run several --algo (sweeps/figure3.toml), a method is an algorithm (x point)
    and a task an env, as in the PPO paper's Table 1 (check_score_layout: one setting per env x algo)."""
    algos = list(dict.fromkeys(config.algo for config in sweep.configs))
    envs = list(dict.fromkeys(config.env for config in sweep.configs))
    setting = {(config.env, config.algo): i for i, config in enumerate(sweep.configs)}
    if len(algos) == 1 or len(setting) != len(sweep.configs) or len(setting) != len(envs) * len(algos):
        return sweep.labels, [[(i, p) for i in range(len(sweep.configs))] for p in range(len(sweep.points))]
    labels = [algo if len(sweep.points) == 1 else f"{algo} {label}" for algo in algos for label in sweep.labels]
    return labels, [[(setting[env, algo], p) for env in envs] for algo in algos for p in range(len(sweep.points))]


def check_score_layout(sweep: Sweep, where: str) -> None:
    """A normalised score over several --algo compares them env by env: every env once with each."""
    several = len({config.algo for config in sweep.configs}) > 1
    if sweep.normalized_score and several and score_layout(sweep)[0] is sweep.labels:
        raise ConfigError(f"{where}: normalized_score over several algos compares them env by env: give each env "
                          "exactly one [[static]] per algo (or set normalized_score = false)")


def normalized_scores(settings: list[SweepSetting], cells: list[list[tuple[int, int]]] | None = None) -> np.ndarray:
    """Each run's final return as a normalised score, [methods, seeds, tasks] (score_layout's cells;
    default: the points of each static setting): (final - random) / the task's unit, its best
    method's mean final return above random; a diverged run scores 0, the random policy's level
    (leaving it out would flatter the method); the seeds that every setting has."""
    if cells is None:
        cells = [[(i, p) for i in range(len(settings))] for p in range(len(settings[0].final()))]
    seeds = min(setting.config.num_seeds for setting in settings)
    finals = [[settings[i].final()[p] for i, p in row] for row in cells]  # [methods][tasks] -> [seeds]
    randoms = [settings[i].random_return for i, _ in cells[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a method whose every seed diverged: NaN, not the best
        units = [np.nanmax([np.nanmean(row[t]) for row in finals]) - randoms[t] for t in range(len(randoms))]
    return np.array([[np.nan_to_num((row[t][:seeds] - randoms[t]) / units[t], nan=0.0) for t in range(len(units))]
                     for row in finals]).transpose(0, 2, 1)


AGGREGATES = ("iqm", "median", "mean", "optimality_gap")


def aggregate_scores(scores: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """rliable's aggregates (Agarwal et al. 2021) of each point's scores [points, seeds, settings]:
    the interquartile mean of all runs, the median and mean over settings of the mean over seeds,
    and the optimality gap (1 - mean of min(score, 1)), each with the 95 % percentile interval of a
    stratified bootstrap (seeds resampled within each setting), seeded -> (estimates [points, 4],
    intervals [points, 2, 4]), in AGGREGATES' order. With one seed the bootstrap has nothing to
    resample: no interval (NaN), not a zero-width one."""
    from rliable import library, metrics

    def aggregates(x):
        return np.array([metrics.aggregate_iqm(x), metrics.aggregate_median(x), metrics.aggregate_mean(x),
                         metrics.aggregate_optimality_gap(x)])

    with numpy_seeded(seed):
        estimates, intervals = library.get_interval_estimates(dict(enumerate(scores)), aggregates, reps=reps)
    intervals = np.array([intervals[p] for p in range(len(scores))])
    return np.array([estimates[p] for p in range(len(scores))]), intervals if scores.shape[1] > 1 else intervals * np.nan


@contextlib.contextmanager
def numpy_seeded(seed: int):
    """NumPy's global generator seeded, and restored after: rliable's stratified bootstrap draws its
    resamples from it (the random_state it takes does not reach them)."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def performance_profiles(scores: np.ndarray, taus: np.ndarray, reps: int = 1000, seed: int = 0):
    """rliable's performance profile of each point: the fraction of its runs scoring above each tau,
    with 95 % stratified-bootstrap bands -> (profiles [points, taus], bands [points, 2, taus])."""
    from rliable import library

    with numpy_seeded(seed):
        profiles, bands = library.create_performance_profile(dict(enumerate(scores)), taus, reps=reps)
    return np.array([profiles[p] for p in range(len(scores))]), np.array([bands[p] for p in range(len(scores))])


def best_first(values: np.ndarray, ties: np.ndarray | None = None) -> np.ndarray:
    """The points' indices, highest value first, NaN (diverged) last; ties by `ties` (higher first,
    NaN last), then in point order."""
    keys = [-np.nan_to_num(values, nan=-np.inf)] if ties is None else [-np.nan_to_num(ties, nan=-np.inf),
                                                                        -np.nan_to_num(values, nan=-np.inf)]
    return np.lexsort([np.arange(len(values)), *keys])


def summarize_sweep(sweep: Sweep, settings: list[SweepSetting], run_dir: str = "SWEEP_DIR") -> tuple[list[list[str]], str]:
    """summary.csv rows and the printed table: per point, the ranking metric's (sweep.rank_by: the
    return unless the spec says) final value, its interquartile mean over seeds with its 95 %
    bootstrap interval (iqm_and_ci: none with fewer than 2 seeds; summary.csv also mean +- std), and
    the area under the return's curve, best IQM first; where the best point's policy is."""
    rows = [["static", "env", "point", "label"] + sweep.swept +
            ["metric", "final_mean", "final_std", "final_iqm", "final_ci_low", "final_ci_high", "auc_mean", "auc_std",
             "num_seeds"]]
    text = []
    metric = sweep.metric
    for i, setting in enumerate(settings):
        final, auc = setting.final(sweep.rank_by), setting.auc()
        final_mean, final_std = np.nanmean(final, 1), np.nanstd(final, 1)
        auc_mean, auc_std = np.nanmean(auc, 1), np.nanstd(auc, 1)
        iqms = [iqm_and_ci(final[p]) for p in range(len(sweep.points))]
        digits = 1 if sweep.rank_by in ("episode_return", *EVAL_METRICS) else 3  # returns: tens to hundreds; others near 1
        result = setting.result
        timing = ("run before the resume" if result.steps_run == 0 else
                  f"compile {result.lower_seconds + result.compile_seconds:.1f} s, run {result.run_seconds:.1f} s, "
                  f"{result.steps_per_second:,.0f} agent-steps/s")
        text.append(f"\n{setting_name(sweep, i)}: {len(sweep.points)} points x {setting.config.num_seeds} seeds, {timing}"
                    + (f", random policy {setting.random_return:.1f}" if setting.random_return is not None else ""))
        # With 2 or 3 seeds the bootstrap's 2.5 and 97.5 percentiles are the lowest and highest seed.
        interval_name = "min, max" if 2 <= setting.config.num_seeds <= 3 else "95 % CI"
        width, header = max(len(label) for label in sweep.labels), f"final {metric} IQM [{interval_name}]"
        column = max(28, len(header))
        text.append(f"  rank  point  {'label'.ljust(width)}  {header:>{column}}  {'diverged':>8}  "
                    f"{'area under curve':>18}")
        ranking = setting.ranking(sweep.rank_by)
        for rank, p in enumerate(ranking):
            iqm, low, high = iqms[p]
            interval = "[no CI: < 2 seeds]" if np.isfinite(iqm) and np.isnan(low) else f"[{low:.{digits}f}, {high:.{digits}f}]"
            text.append(f"  {rank + 1:>4}  {p:>5}  {sweep.labels[p].ljust(width)}  "
                        f"{f'{iqm:.{digits}f} {interval}':>{column}}  "
                        f"{f'{np.isnan(final[p]).sum()}/{final.shape[1]}':>8}  {f'{auc_mean[p]:.1f} ± {auc_std[p]:.1f}':>18}")
            hparams = sweep.hparams(setting.config)[p]
            rows.append([setting_name(sweep, i), setting.config.env, str(p), sweep.labels[p]] +
                        [format_value(getattr(hparams, n)) for n in sweep.swept] + [sweep.rank_by] +
                        [f"{v:.6g}" for v in (final_mean[p], final_std[p], iqm, low, high, auc_mean[p], auc_std[p])] +
                        [str(setting.config.num_seeds)])
        best = f"{i + 1}:{ranking[0]}" if len(sweep.configs) > 1 else str(ranking[0])
        top = iqms[ranking[0]][0]
        tied = sum(iqm == top or (np.isnan(iqm) and np.isnan(top)) for iqm, _, _ in iqms) - 1  # (NaN: none finite)
        text.append(f"  best point's policy: {point_dir(run_dir, i, ranking[0])}/params.msgpack "
                    f"(--eval {run_dir} --point {best})"
                    + (f"; it ties with {tied} other point(s) at {iqms[ranking[0]][0]:.{digits}f}: ties rank by the "
                       "area under the curve" if tied else ""))
    return rows, "\n".join(text)


def summarize_scores(sweep: Sweep, settings: list[SweepSetting], scores: np.ndarray, estimates: np.ndarray,
                     intervals: np.ndarray, labels: list[str] | None = None) -> tuple[list[list[str]], str]:
    """aggregates.csv rows and the printed table of the normalised scores' aggregates, best IQM first;
    a row per method (score_layout's `labels`; default: the points)."""
    labels = sweep.labels if labels is None else labels
    by_algo = labels is not sweep.labels
    rows = [["point", "label"] + [f"{name}{end}" for name in AGGREGATES for end in ("", "_ci_low", "_ci_high")]
            + ["runs", "settings"]]
    text = [f"\nnormalised score (random policy 0, best {'algo' if by_algo else 'point'} 1) over "
            f"{scores.shape[2]} {'env' if by_algo else 'setting'}(s) x {scores.shape[1]} "
            "seeds: rliable's aggregates, 95 % stratified-bootstrap CIs (a diverged run scores 0; optimality gap: "
            "lower is better)",
            "  " + "  ".join(f"{name.replace('_', ' ').replace('iqm', 'IQM'):>21}" for name in AGGREGATES)
            + ("  algo" if by_algo else "  point")]
    for p in best_first(estimates[:, 0]):
        cells = [f"{estimates[p, m]:.3f} " + ("[no CI: 1 seed]" if np.isnan(intervals[p, 0, m]) else
                                              f"[{intervals[p, 0, m]:.2f}, {intervals[p, 1, m]:.2f}]")
                 for m in range(len(AGGREGATES))]
        text.append("  " + "  ".join(f"{cell:>21}" for cell in cells) + f"  {labels[p]}")
        rows.append([str(p), labels[p]] + [f"{v:.6g}" for m in range(len(AGGREGATES))
                                                 for v in (estimates[p, m], intervals[p, 0, m], intervals[p, 1, m])]
                    + [str(scores.shape[1] * scores.shape[2]), str(scores.shape[2])])
    return rows, "\n".join(text)


def iqm(values: np.ndarray, axis=None):
    """The interquartile mean as rliable defines it: the mean of what remains after cutting 25 % of
    the values at each end (scipy's trim_mean)."""
    from scipy import stats

    return stats.trim_mean(values, 0.25, axis=axis)


def iqm_and_ci(values: np.ndarray, reps: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """One point's final returns over seeds (NaN, a diverged seed, left out) -> (interquartile mean,
    the 2.5 and 97.5 percentiles of its bootstrap over the seeds): rliable's IQM and percentile
    interval for one task, vectorised (rliable resamples in a Python loop); `reps` resamplings of the
    seeds with a fixed seed: reproducible. Fewer than 2 seeds: no interval (NaN), not a zero-width one."""
    finite = values[np.isfinite(values)]
    if finite.size < 2:
        return finite_iqm(finite), math.nan, math.nan
    resampled = finite[np.random.default_rng(seed).integers(0, finite.size, (reps, finite.size))]
    low, high = np.percentile(iqm(resampled, axis=1), [2.5, 97.5])
    return finite_iqm(finite), float(low), float(high)


def finite_iqm(values: np.ndarray) -> float:
    """The IQM of the finite values (NaN marks a diverged seed); NaN if none is finite."""
    finite = values[np.isfinite(values)]
    return float(iqm(finite)) if finite.size else math.nan


def value_axis(values: np.ndarray):
    """(place, log) for a swept parameter's values: a log axis where its positive finite values span
    10x or more, 0 ("off") placed at the axis' left edge; inf at the right edge. place(x) -> positions."""
    finite = values[np.isfinite(values) & (values > 0)]
    log = bool(finite.size > 1 and finite.max() / finite.min() >= 10 and not np.any(values < 0))
    low, high = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)

    def place(x):
        x = np.where(np.asarray(x, float) == np.inf, high * 4 if log else high + 0.25 * ((high - low) or 1), x)
        return np.where(x == 0, low / 4, x) if log else x

    return place, log


def plot_final_vs(ax, name: str, sweep: Sweep, setting: SweepSetting) -> None:
    """The ranking metric's final value against one swept parameter: a line per combination of the
    other swept parameters at the IQM over seeds with its 95 % bootstrap CI (the table's statistic;
    no band with one seed); the base value marked."""
    import matplotlib.pyplot as plt

    hparams = sweep.hparams(setting.config)
    values = np.array([float(getattr(h, name)) for h in hparams])
    place, log = value_axis(values)
    mean, low, high = np.array([iqm_and_ci(final) for final in setting.final(sweep.rank_by)]).T  # as the table ranks
    others = [other for other in sweep.swept if other != name]
    combinations = {}  # the other parameters' values -> the points with them
    for p, h in enumerate(hparams):
        combinations.setdefault(tuple(format_value(getattr(h, other)) for other in others), []).append(p)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(combinations)))
    for color, (combination, points) in zip(colors, combinations.items()):
        points = sorted(points, key=lambda p: values[p])
        label = ", ".join(f"{other}={v}" for other, v in zip(others, combination)) or "all points"
        if len(points) == 1:  # a point alone: its CI as an error bar
            bar = np.nan_to_num([mean[points] - low[points], high[points] - mean[points]])
            ax.errorbar(place(values[points]), mean[points], bar, fmt="o", color=color, ms=4, label=label)
            continue
        ax.plot(place(values[points]), mean[points], "o-", color=color, lw=1.3, ms=4, label=label)
        ax.fill_between(place(values[points]), low[points], high[points], color=color, alpha=0.15)
    base = float(getattr(setting.config.hparams, name))
    ax.axvline(place(base), color="gray", ls=":", lw=1, label=f"base ({format_value(base)})")
    if log:
        ax.set_xscale("log")
        ax.minorticks_off()
    distinct = sorted(set(values.tolist()))
    ax.set_xticks(place(distinct), ["off" if v == 0 and log else format_value(v) for v in distinct], fontsize=7)
    metric = sweep.metric
    ax.set(xlabel=name + (" (log axis)" if log else ""), ylabel=f"final {metric} (IQM over seeds, 95 % CI)")
    ax.grid(alpha=0.3)


FEW_POINTS = 8  # curves.png draws each panel's best 8 in colour
PANELS_PER_ROW = 4  # a sweep's figures wrap their panels (one per static setting) after this many


def panel_grid(plt, n: int, width: float, height: float):
    """A figure of n panels of width x height inches, PANELS_PER_ROW to a row, the unused ones hidden
    -> (figure, the n axes in reading order)."""
    cols = min(n, PANELS_PER_ROW)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def plot_sweep(run_dir: str, sweep: Sweep, settings: list[SweepSetting]) -> None:
    """curves.png (a curve per point, one panel per static setting, one legend beside them; with
    many points only the best 3 shaded min-max over seeds, the best drawn on top, and beyond
    FEW_POINTS only each panel's best FEW_POINTS in colour, the rest faint grey), final_vs_<param>.png
    per swept parameter, algos.png where the settings run several --algo (a panel per env, a curve per
    algo), and normalized.png when the spec asks for the score. Best: by rank_by."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, points = len(settings), len(sweep.points)
    colors = plt.cm.viridis(np.linspace(0, 0.95, points))
    fig, axes = panel_grid(plt, n, 5.5, 4.2)
    shown = set()  # the points drawn in colour in some panel
    for ax, (i, setting) in zip(axes, enumerate(settings)):
        steps = setting.result.metrics["env_steps"][0]
        returns = setting.per_point("episode_return")  # [points, seeds, updates]
        ranking = setting.ranking(sweep.rank_by)
        for rank, p in reversed(list(enumerate(ranking))):  # the best last: on top
            faint = points > FEW_POINTS and rank >= FEW_POINTS
            shown |= set() if faint else {p}
            plot_seeds(ax, steps, returns[p], sweep.labels[p], "0.75" if faint else colors[p],
                       band=points <= 4 or rank < 3, lw=2.2 if rank == 0 else 0.8 if faint else 1.1,
                       alpha=1.0 if rank < 3 else 0.5 if faint else 0.7, zorder=3 if rank == 0 else 1 if faint else 2)
        ax.set(xlabel="environment steps (per agent)", ylabel="episode return (smoothed)")
        ax.set_title(setting_title(sweep, i, wrap=48), fontsize=10)
        ax.grid(alpha=0.3)
    handles = [matplotlib.lines.Line2D([], [], color=colors[p], lw=1.5, label=sweep.labels[p]) for p in sorted(shown)]
    if len(shown) < points:
        handles.append(matplotlib.lines.Line2D([], [], color="0.75", lw=0.8, label=f"the other {points - len(shown)}"))
    metric = sweep.metric
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
               title=(f"point (bold: best by final {metric} IQM; shaded: min-max of the best 3"
                      + (f"; grey: beyond each panel's best {FEW_POINTS})" if len(shown) < points else ")"))
               if points > 4 else "point (shaded: min-max)", title_fontsize=7)
    fig.tight_layout()
    save_figure(fig, os.path.join(run_dir, "curves.png"), dpi=110)

    labels, cells = score_layout(sweep)
    if labels is not sweep.labels:  # several --algo: algos.png, a panel per env, a curve per algo (the paper's Fig. 3)
        fig, axes = panel_grid(plt, len(cells[0]), 4.5, 3.6)
        for ax, task in zip(axes, range(len(cells[0]))):
            for m, row in enumerate(cells):
                i, p = row[task]
                if i < len(settings):
                    returns = settings[i].per_point("episode_return")[p]
                    plot_seeds(ax, settings[i].result.metrics["env_steps"][0], returns, labels[m], f"C{m}", band=True,
                               lw=1.3, alpha=0.8, zorder=2)
            ax.set(xlabel="environment steps (per agent)", ylabel="episode return (smoothed)")
            ax.set_title(sweep.configs[cells[0][task][0]].env, fontsize=10)
            ax.grid(alpha=0.3)
        fig.legend(handles=[matplotlib.lines.Line2D([], [], color=f"C{m}", lw=1.5, label=label)
                            for m, label in enumerate(labels)], loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=8, title="algorithm (shaded: min-max over seeds)", title_fontsize=7)
        fig.tight_layout()
        save_figure(fig, os.path.join(run_dir, "algos.png"), dpi=110)

    for name in sweep.swept:
        fig, axes = panel_grid(plt, n, 5, 3.8)
        for ax, (i, setting) in zip(axes, enumerate(settings)):
            plot_final_vs(ax, name, sweep, setting)
            ax.set_title(setting_title(sweep, i, wrap=48), fontsize=10)
        fig.tight_layout()  # then the legend beside the panels, however long (save_figure's tight box takes it in)
        fig.legend(*axes[-1].get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.95))
        save_figure(fig, os.path.join(run_dir, f"final_vs_{name}.png"), dpi=110)


def plot_scores(run_dir: str, sweep: Sweep, scores: np.ndarray, estimates: np.ndarray, intervals: np.ndarray,
                profiled: int = 5, labels: list[str] | None = None) -> None:
    """normalized.png: rliable's interval-estimate figure, a panel per aggregate, a row per point (or
    score_layout's method: `labels`) (the best IQM at the top); performance_profile.png: the profiles
    of the best `profiled` of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rliable import plot_utils

    names = sweep.labels if labels is None else labels
    order = best_first(estimates[:, 0])[::-1]  # rliable draws its first row at the bottom
    labels = [names[p] for p in order]
    colors = dict(zip(names, plt.cm.viridis(np.linspace(0, 0.95, len(names)))))
    height = max(1.5, 0.3 * len(labels))
    fig, axes = plot_utils.plot_interval_estimates(
        {names[p]: estimates[p] for p in order}, {names[p]: intervals[p] for p in order},
        [name.replace("_", " ").replace("iqm", "IQM") for name in AGGREGATES], algorithms=labels, colors=colors,
        xlabel="", subfigure_width=3.0, row_height=height / len(labels))
    for ax in axes:  # rliable's sizes are for slides
        ax.tick_params(labelsize=8)
        ax.title.set_fontsize(10)
    by_algo = names is not sweep.labels
    fig.text(0.4, -0.4 / height, f"normalised score (random policy 0, best {'algo' if by_algo else 'point'} 1) over "
             f"{scores.shape[2]} {'env' if by_algo else 'setting'}(s) x {scores.shape[1]} seeds, 95 % "
             "stratified-bootstrap CIs", ha="center", fontsize=9)
    save_figure(fig, os.path.join(run_dir, "normalized.png"), dpi=110)

    best = best_first(estimates[:, 0])[:profiled]
    low, high = min(scores[best].min(), 1.0), max(scores[best].max(), 1.0)  # the profiled runs' range
    taus = np.linspace(low - 0.02 * (high - low), high, 81)
    profiles, bands = performance_profiles(scores[best], taus)
    fig, ax = plt.subplots(figsize=(6, 4))
    plot_utils.plot_performance_profiles(
        {names[p]: profile for p, profile in zip(best, profiles)}, taus,
        {names[p]: band for p, band in zip(best, bands)}, colors=colors, ax=ax,
        xlabel=r"normalised score $\tau$", ylabel=r"fraction of runs with score > $\tau$", labelsize="medium",
        ticklabelsize="small")
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(f"{sweep.name}: the best {len(best)} point(s), {scores.shape[1] * scores.shape[2]} runs each",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, os.path.join(run_dir, "performance_profile.png"), dpi=110)


def write_sweep_outputs(run_dir: str, sweep: Sweep, settings: list[SweepSetting]) -> str:
    """After each static setting: rewrite the summaries, plots and results.csv of the settings so far
    (results.csv last: once it has every setting's rows, the sweep's outputs are complete); the
    normalised scores' aggregates over the settings (rliable's bootstraps: seconds) once all are done."""
    with warnings.catch_warnings():  # nan-means of points where no episode ended are NaN, as they should be
        warnings.simplefilter("ignore", RuntimeWarning)
        rows, text = summarize_sweep(sweep, settings, run_dir)
        write_csv(os.path.join(run_dir, "summary.csv"), rows)
        plot(plot_sweep, run_dir, sweep, settings)
        if sweep.normalized_score and len(settings) == len(sweep.configs):
            labels, cells = score_layout(sweep)
            scores = normalized_scores(settings, cells)
            estimates, intervals = aggregate_scores(scores)
            rows, score_text = summarize_scores(sweep, settings, scores, estimates, intervals, labels)
            write_csv(os.path.join(run_dir, "aggregates.csv"), rows)
            plot(plot_scores, run_dir, sweep, scores, estimates, intervals, 5, labels)
            text += "\n" + score_text
        if settings[-1].config.env == TOY_RLHF:
            text += "\n" + write_rlhf_outputs(run_dir, sweep, settings)
        if sweep.pbt:
            text += "\n" + "\n".join(write_pbt_outputs(run_dir, sweep, i, setting) for i, setting in enumerate(settings))
        write_csv(os.path.join(run_dir, "results.csv"), results_rows(sweep, settings))
    return text


def write_csv(path: str, rows: list[list[str]]) -> None:
    table = io.StringIO()
    csv.writer(table).writerows(rows)
    write_atomically(path, table.getvalue().encode())


class SweepRecorder:
    """run_batch's on_chunk for one static setting of a sweep, as RunRecorder is a run's: after every
    chunk, append each point's metrics.csv, save the setting's checkpoint, feed the trackers, move
    the progress line, and stop if a signal asked for it. run_dir None (not the writing host):
    nothing is written. A point that diverges runs on (its NaNs are its result): no NaN guard.
    --eval-every evaluates every point x seed (Evaluations), into the points' metrics.csv."""

    def __init__(self, sweep: Sweep, i: int, run_dir: str | None, stop: StopRequests, progress: Progress,
                 done_before: int, tracked: list[Tracker], evaluations: Evaluations):
        self.sweep, self.i, self.config, self.run_dir = sweep, i, sweep.configs[i], run_dir
        self.stop, self.progress, self.done_before, self.tracked = stop, progress, done_before, tracked
        self.agents, self.done, self.evaluations = len(sweep.points) * self.config.num_seeds, None, evaluations

    def show(self, done: int) -> None:
        self.progress.show(self.done_before + done * self.agents, f"setting {setting_title(self.sweep, self.i)}: "
                           f"update {done}/{self.config.num_updates} x {self.agents} agents")

    def write_points(self, metrics) -> None:  # each point's rows, as a run of its seeds writes them
        if self.run_dir is None:
            return
        seeds = self.config.num_seeds
        for p in range(len(self.sweep.points)):
            append_metrics_csv(os.path.join(point_dir(self.run_dir, self.i, p), "metrics.csv"),
                               {name: values[p * seeds:(p + 1) * seeds] for name, values in metrics.items()})

    def __call__(self, done: int, metrics, state) -> bool:
        if self.done is None:  # compiled; the setting starts (resumed: fill the rows a kill may have cut off)
            self.done = done
            for tracker in self.tracked:
                tracker.started()
            if metrics is not None:
                self.write_points(self.evaluations.add(done, metrics)[0])
            self.show(done)
            return False
        metrics, host = self.evaluations.add(done, metrics, state)  # (every process evaluates: it fetched the state)
        self.write_points(metrics)
        for tracker in self.tracked:
            tracker.add(metrics)
        host = state() if host is None else host  # every process takes part in fetching it
        if self.run_dir is not None:
            save_checkpoint(setting_dir(self.run_dir, self.i), self.config,
                            Checkpoint(host, {name: value for name, value in metrics.items() if name != "env_steps"}))
        stop = agreed_stop(self.stop)
        self.show(done)
        self.done = done
        return stop


def start_setting(run_dir: str, sweep: Sweep, i: int) -> None:
    """The setting's directory and a run directory per point with its config.json (kept if there)."""
    config = sweep.configs[i]
    for p, hparams in enumerate(sweep.hparams(config)):
        where = point_dir(run_dir, i, p)
        with writing(where):
            os.makedirs(where, exist_ok=True)
        if not os.path.exists(os.path.join(where, "config.json")):
            write_atomically(os.path.join(where, "config.json"),
                             config_json(dataclasses.replace(config, hparams=hparams, run_dir=where)).encode())


def write_point_outputs(run_dir: str, sweep: Sweep, i: int, setting: SweepSetting, missing_only: bool = False) -> None:
    """A finished setting's points, each as a run's outputs (write_outputs, without curve.png):
    params.msgpack of its seeds and summary.json ("diverged at ..." for a point that did)."""
    seeds, result = setting.config.num_seeds, setting.result
    for p, hparams in enumerate(sweep.hparams(setting.config)):
        where = point_dir(run_dir, i, p)
        if missing_only and os.path.exists(os.path.join(where, "summary.json")):
            continue
        part = slice(p * seeds, (p + 1) * seeds)
        config = dataclasses.replace(setting.config, hparams=hparams, run_dir=where)
        point = dataclasses.replace(result, state=jax.tree.map(lambda x: x[part], result.state), config=config,
                                    metrics={name: values[part] for name, values in result.metrics.items()},
                                    steps_run=result.steps_run // len(sweep.points))
        diverged = first_nonfinite(point.metrics, 0, guarded_metrics(config))
        write_outputs(where, config, point, f"diverged at {diverged}" if diverged else "complete", curve=False)


def pbt_ancestry(metrics: dict[str, np.ndarray], seeds: int, agent: int) -> np.ndarray:
    """[updates]: the agent whose metrics row holds `agent`'s ancestor at each update (itself after its
    last copy, the agent it copied before that, and so back: the schedule its lineage trained with)."""
    parent, updates = metrics["pbt_parent"], metrics["pbt_parent"].shape[1]
    rows, a = np.empty(updates, int), agent
    for u in reversed(range(updates)):
        rows[u] = a
        if int(parent[a, u]) != a // seeds:  # a copied at update u + 1: before it, its parent's history
            a = int(parent[a, u]) * seeds + agent % seeds
    return rows


def write_pbt_outputs(run_dir: str, sweep: Sweep, i: int, setting: SweepSetting) -> str:
    """A finished PBT setting: lineage.csv (at every exploit step, each agent's parent, its score over
    the interval and the HParams it went on with), pbt.png (the population's return and each explored
    HParam over time, the best agent's lineage bold) and best/, a run directory of each seed's best
    agent (params.msgpack; metrics.csv: its lineage's rows; config.json: seed 0's final HParams)."""
    config, pbt, metrics = setting.config, sweep.pbt, setting.result.metrics
    seeds, points = config.num_seeds, len(sweep.points)
    hparams = stack_hparams([h for h in sweep.hparams(config) for _ in range(seeds)])
    population = Population(pbt, config, points, hparams)
    rows = [["update", "seed", "point", "parent", "score"] + list(pbt.explore)]
    for done in range(pbt.interval, config.num_updates, pbt.interval):
        score = population.scores(metrics, done)
        for seed in range(seeds):
            for p in range(points):
                a = p * seeds + seed
                rows.append([str(done), str(seed), str(p), str(int(metrics["pbt_parent"][a, done])), f"{score[a]:.6g}"]
                            + [f"{metrics[f'pbt_{name}'][a, done]:.9g}" for name in pbt.explore])  # (float32: exact)
    where = setting_dir(run_dir, i)
    write_csv(os.path.join(where, "lineage.csv"), rows)
    final_scores = population.scores(metrics, config.num_updates).reshape(points, seeds)  # PBT's own ranking
    best = np.argmax(final_scores, axis=0) * seeds + np.arange(seeds)  # [seeds]: each population's best agent
    lineages = np.stack([pbt_ancestry(metrics, seeds, a) for a in best])  # [seeds, updates]
    steps = np.arange(config.num_updates)
    lineage_metrics = {name: values[lineages, steps] for name, values in metrics.items()}
    best_dir = os.path.join(where, "best")
    final = {name: float(metrics[f"pbt_{name}"][best[0], -1]) for name in pbt.explore}
    best_config = dataclasses.replace(config, hparams=dataclasses.replace(config.hparams, **final), run_dir=best_dir)
    with writing(best_dir):
        os.makedirs(best_dir, exist_ok=True)
    if not os.path.exists(os.path.join(best_dir, "summary.json")):
        write_atomically(os.path.join(best_dir, "config.json"), config_json(best_config).encode())
        result = dataclasses.replace(setting.result, state=jax.tree.map(lambda x: x[best], setting.result.state),
                                     metrics=lineage_metrics, config=best_config,
                                     steps_run=setting.result.steps_run // points)
        append_metrics_csv(os.path.join(best_dir, "metrics.csv"), lineage_metrics)
        write_outputs(best_dir, best_config, result, "complete", curve=False)
    plot(plot_pbt, os.path.join(where, "pbt.png"), sweep, setting, lineages)
    copies = sum(row[2] != row[3] for row in rows[1:])
    found = ", ".join(f"{name} {format_value(value)}" for name, value in final.items())
    return (f"PBT, setting {setting_name(sweep, i)}: {copies} copies in {len(rows[1:]) // (points * seeds)} exploit "
            f"steps x {seeds} population(s) of {points}; seed 0's best agent (point {best[0] // seeds}) ended with "
            f"{found}: {best_dir}/params.msgpack (--eval {run_dir} --point {i + 1}:best); lineage.csv, pbt.png")


def plot_pbt(path: str, sweep: Sweep, setting: SweepSetting, lineages: np.ndarray) -> None:
    """pbt.png for seed 0's population: its agents' returns and explored HParams over env steps (thin),
    the best agent's lineage bold (the schedule the population found)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, seeds, pbt = setting.result.metrics, setting.config.num_seeds, sweep.pbt
    steps, names = metrics["env_steps"][0], ["episode_return", *[f"pbt_{name}" for name in pbt.explore]]
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for p in range(len(sweep.points)):
            ax.plot(steps, metrics[name][p * seeds], color="0.6", lw=0.7, alpha=0.7)
        ax.plot(steps, metrics[name][lineages[0], np.arange(len(steps))], color="C3", lw=2.0,
                label="the best agent's lineage")
        values = metrics[name][::seeds]
        if name != "episode_return" and np.nanmin(values) > 0 and np.nanmax(values) / np.nanmin(values) > 10:
            ax.set_yscale("log")
        ax.set(xlabel="environment steps (per agent)", ylabel=name.removeprefix("pbt_"))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, title=f"seed 0's {len(sweep.points)} agents (grey)", title_fontsize=7)
    fig.suptitle(f"PBT on {setting.config.env}: every {pbt.interval} updates the worst {pbt.fraction:g} copy the best",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def run_sweep(sweep: Sweep, run_dir: str | None, chunk_size: int = 0, quiet: bool = False,
              flags: Config | None = None, resume: str | None = None) -> tuple[list[SweepSetting], str]:
    """Each static setting: one compile, all points x seeds as one batch, checkpointed after every
    chunk (SweepRecorder); its points' outputs and the sweep's tables written as it finishes.
    `resume`: the sweep directory to continue (every process reads it): a finished setting is read
    back from its checkpoint, the one under way continues from it. run_dir: where to write (None:
    not the writing process). `flags`: the command line's (its trackers). -> (the settings run,
    "complete" or "interrupted by SIGTERM/SIGINT in setting S at update U/N")."""
    total = sum(len(sweep.points) * config.num_seeds * config.num_updates for config in sweep.configs)
    progress, settings, done_before, text = Progress(total, quiet=quiet), [], 0, ""
    with StopRequests() as stop:
        for i, config in enumerate(sweep.configs):
            keys = sweep.keys(config)
            hparams = stack_hparams([h for h in sweep.hparams(config) for _ in range(config.num_seeds)])
            agents = len(sweep.points) * config.num_seeds
            start = None
            if resume is not None and os.path.exists(os.path.join(setting_dir(resume, i), CHECKPOINT)):
                start = load_checkpoint(setting_dir(resume, i), config, keys, f"--resume {resume}")
            if run_dir is not None:
                start_setting(run_dir, sweep, i)
            if start is not None and start.updates_done == config.num_updates:  # finished before the resume
                result = RunResult(start.state, with_env_steps(start.metrics, config.batch_size), 0.0, 0.0, 0.0,
                                   config=config)
                random_return = random_policy_return(config) if sweep.normalized_score else None
                settings.append(SweepSetting(config, result, random_return))
                if run_dir is not None:
                    write_point_outputs(run_dir, sweep, i, settings[-1], missing_only=True)
                    text = write_sweep_outputs(run_dir, sweep, settings)
                done_before += agents * config.num_updates
                continue
            progress.show(done_before + (start.updates_done * agents if start else 0),
                          f"setting {setting_title(sweep, i)}: compiling")
            tracked = []
            if run_dir is not None:  # a tracker's run per point x seed, named by the point's values
                names = [f"{i + 1}-{config.env}/{label.replace(', ', ',')}/seed_{seed}" for label in sweep.labels
                         for seed in range(config.num_seeds)]
                tracked = trackers(run_dir, names, [dataclasses.replace(config, hparams=h)
                                                    for h in sweep.hparams(config) for _ in range(config.num_seeds)],
                                   start.updates_done if start else 0, flags=flags)
            start, evaluations = without_evaluations(start)
            recorder = SweepRecorder(sweep, i, run_dir, stop, progress, done_before, tracked,
                                     Evaluations(config, hparams, keys, evaluations))
            population = Population(sweep.pbt, config, len(sweep.points), hparams) if sweep.pbt else None
            summaries = None
            try:
                result = run_batch(config, keys, hparams, chunk_size, recorder, start=start, population=population)
                progress.end()
                done = result.metrics["env_steps"].shape[1]
                result = dataclasses.replace(result, metrics=recorder.evaluations.add(done, result.metrics)[0])
                if done < config.num_updates:
                    return settings, (f"interrupted by {signal.Signals(stop.signal).name} in setting "
                                      f"{setting_name(sweep, i)} at update {done}/{config.num_updates}")
                random_return = random_policy_return(config) if sweep.normalized_score else None
                settings.append(SweepSetting(config, result, random_return))
                summaries = [{"status": "complete", "final_return": float(final), "auc": float(auc)}
                             for final, auc in zip(settings[-1].final().ravel(), settings[-1].auc().ravel())]
            finally:
                for tracker in tracked:
                    tracker.close(summaries)
            done_before += agents * config.num_updates
            collapsed = penalty_collapsed(hparams.kl_target, result.metrics).reshape(len(sweep.points), -1).any(axis=1)
            if collapsed.any() and run_dir is not None:
                points = " ".join(f"[{label}]" for label, bad in zip(sweep.labels, collapsed) if bad)
                print(f"warning: setting {setting_name(sweep, i)}, point(s) {points}: {PENALTY_COLLAPSED}",
                      file=sys.stderr)
            if run_dir is not None:
                write_point_outputs(run_dir, sweep, i, settings[-1])
                text = write_sweep_outputs(run_dir, sweep, settings)
    if run_dir is not None:
        print(text)
    return settings, "complete"


# ================================================================================================
# 6. Outputs: the run directory, checkpoints, progress
# ================================================================================================


TABLE_COLUMNS = (  # (metric, header, format)
    ("env_steps", "steps", "{:.0f}"),
    ("episode_return", "return", "{:.1f}"),
    ("episode_length", "length", "{:.1f}"),
    ("policy_loss", "pi_loss", "{:.4f}"),
    ("value_loss", "v_loss", "{:.4g}"),
    ("entropy", "entropy", "{:.3f}"),
    ("approx_kl", "approx_kl", "{:.5f}"),
    ("clip_frac", "clip", "{:.3f}"),
    ("kl_coef", "beta", "{:.3g}"),  # shown only when PPO-Penalty is on
    ("ref_kl", "ref_kl", "{:.4f}"),  # shown only when the KL leash is on
    ("explained_variance", "expl_var", "{:.3f}"),
    ("learning_rate", "lr", "{:.2e}"),
    ("eval_return", "eval", "{:.1f}"),  # --eval-every's, sampled and with the policy's mode: only with it
    ("eval_return_deterministic", "eval_det", "{:.1f}"),
)


def final_return(metrics: dict[str, np.ndarray], fraction: float = 0.1, name: str = "episode_return") -> np.ndarray:
    """Per seed: mean return (or another per-episode metric) of the episodes that ended in the last
    `fraction` of updates."""
    num_updates = metrics[name].shape[1]
    tail = slice(num_updates - max(1, int(num_updates * fraction)), None)
    returns, counts = metrics[name][:, tail], metrics["episodes"][:, tail]
    with np.errstate(invalid="ignore"):  # NaN where no episode ended in the tail
        return np.sum(np.where(counts > 0, returns * counts, 0.0), axis=1) / np.sum(counts, axis=1)


def no_final_return(finals: np.ndarray) -> str:
    """Why final_return has no value (NaN) for some seeds: no episode of theirs ended in the last 10 %
    of updates."""
    which = "any seed" if np.isnan(finals).all() else "seed(s) " + " ".join(map(str, np.flatnonzero(np.isnan(finals))))
    return (f"no final return for {which}: no episode ended in the last 10 % of updates (episodes longer than a "
            "rollout's reach, or a policy that never ends one): train longer, or cut episodes with "
            "--env-params max_steps_in_episode=N")


def last_evaluation(metrics: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, int]:
    """--eval-every's metric `name` at its last evaluation -> (per agent [agents], the update; 0: none)."""
    values = metrics.get(name, np.full((1, 1), np.nan))
    evaluated = np.flatnonzero(np.isfinite(values).any(axis=0))
    if not evaluated.size:
        return np.full(len(values), np.nan), 0
    return values[:, evaluated[-1]], int(evaluated[-1] + 1)


def format_table(metrics: dict[str, np.ndarray], rows: int) -> str:
    """Every few updates, each metric averaged over seeds (NaN-aware; '-' where no episode ended);
    with --eval-every's evaluations, the updates they fell on."""
    num_updates = metrics["episode_return"].shape[1]
    updates = np.arange(num_updates)
    if "eval_return" in metrics and np.isfinite(metrics["eval_return"]).any():
        updates = np.flatnonzero(np.isfinite(metrics["eval_return"]).any(axis=0))
    picks = sorted(set(updates[np.linspace(0, len(updates) - 1, min(rows, len(updates))).round().astype(int)]))
    columns = [(name, title, fmt) for name, title, fmt in TABLE_COLUMNS if name in metrics and
               (name not in ("kl_coef", "ref_kl") or np.any(np.nan_to_num(metrics[name]) != 0))]
    header = ["update"] + [title for _, title, _ in columns]
    lines = [header]
    for i in picks:
        line = [str(i + 1)]
        for name, _, fmt in columns:
            column = metrics[name][:, i]
            value = np.nanmean(column) if np.any(np.isfinite(column)) else float("nan")
            line.append("-" if np.isnan(value) else fmt.format(value))
        lines.append(line)
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def new_run_dir(requested: str | None, name: str, first_file: str, text: Callable[[str], str]) -> str:
    """Create a fresh run directory (`requested`, or runs/<safe name>-<timestamp>; never an existing one)
    holding its first file (config.json or sweep.toml: text(the directory's path)), before anything
    compiles. One that cannot be made or written is a ConfigError (exit 2) and leaves nothing behind."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name)  # a filesystem-safe form (brax:ant -> brax_ant: no colon)
    path, suffix = requested or os.path.join("runs", f"{name}-{stamp}"), 1
    while True:
        try:
            os.makedirs(path)
            break
        except FileExistsError:
            if requested is not None:  # it appeared since validate(): nothing is overwritten
                raise ConfigError(f"--run-dir {path} already exists: pick a new directory") from None
            suffix += 1
            path = os.path.join("runs", f"{name}-{stamp}-{suffix}")
        except OSError as error:
            raise ConfigError(f"--run-dir {path}: {reason(error)}: give a directory on a writable disk") from None
    try:
        with writing(os.path.join(path, first_file)), open(os.path.join(path, first_file), "x") as f:
            f.write(text(path))
    except WriteError as error:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, first_file))
            os.rmdir(path)
        raise ConfigError(f"--run-dir {path}: {error}") from None
    return path


def last_update_in_csv(path: str) -> int:
    """The update number of metrics.csv's last row (0 when there is no file or no row yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            last = f.read().decode().rstrip("\n").rsplit("\n", 1)[-1]
    except FileNotFoundError:
        return 0
    return int(last.split(",")[0]) if last[:1].isdigit() else 0


def append_metrics_csv(path: str, metrics: dict[str, np.ndarray]) -> None:
    """Append the rows of the updates that metrics.csv does not have yet (one row per update per
    seed, update-major), so the file only ever grows, and a run resumed after a kill between its
    checkpoint and its rows fills the gap. Floats are written with 9 significant digits: float32
    values read back exactly."""
    names = ["env_steps"] + sorted(name for name in metrics if name != "env_steps")
    num_seeds, num_updates = metrics["env_steps"].shape
    first = last_update_in_csv(path)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    if not os.path.exists(path):
        writer.writerow(["update", "seed"] + names)
    else:  # its own columns: a run begun by an older ppo_jax, resumed, lacks the metrics added since
        with open(path, newline="") as f:
            names = next(csv.reader(f), ["update", "seed"] + names)[2:]
    missing = np.full((num_seeds, num_updates), np.nan, np.float32)
    for update in range(first, num_updates):
        for seed in range(num_seeds):
            row = [metrics.get(name, missing)[seed, update] for name in names]
            writer.writerow([update + 1, seed] + [f"{v:.9g}" if isinstance(v, float | np.floating) else v for v in row])
    size = os.path.getsize(path) if os.path.exists(path) else 0
    with writing(path):
        try:
            with open(path, "a", newline="") as f:
                f.write(buffer.getvalue())  # one write per chunk
        except OSError:
            with contextlib.suppress(OSError):
                os.truncate(path, size)  # no partial row (a full disk may take part of the write)
            raise


class WriteError(Exception):
    """An output could not be written (a full disk, a read-only or vanished directory): one line
    that names the file and the reason; .errno says which."""

    def __init__(self, message: str, code: int | None):
        super().__init__(message)
        self.errno = code


def reason(error: OSError) -> str:
    return (error.strerror or str(error)).lower()


@contextlib.contextmanager
def writing(path: str):
    """Every write of a run's outputs goes through here: an OSError becomes a WriteError naming the file."""
    try:
        yield
    except OSError as error:
        raise WriteError(f"cannot write {path}: {reason(error)}", error.errno) from None


def write_atomically(path: str, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`: a kill mid-write leaves
    the previous version whole; a failed write leaves no temporary file."""
    temporary = f"{path}.tmp{os.getpid()}"
    with writing(path):
        try:
            with open(temporary, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise


TEMPORARY_FILE = re.compile(r".+\.tmp\d+")  # write_atomically's, left by a kill between write and rename


def save_figure(fig, path: str, dpi: int) -> None:
    import matplotlib.pyplot as plt

    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=dpi, bbox_inches="tight")  # with legends beside the axes
    plt.close(fig)
    write_atomically(path, image.getvalue())


def plot(function, *args) -> None:
    """Draw a figure of the outputs; one that cannot be written is a warning line, not a lost run
    (the metrics and the checkpoint are written first)."""
    try:
        function(*args)
    except WriteError as error:
        print(f"warning: {error} (the plot is skipped; the data are saved)", file=sys.stderr)


def plot_seeds(ax, steps, returns, label: str, color=None, band: bool = True, seed_lines: bool = False,
               **line) -> bool:
    """One curve from returns [seeds, updates]: each seed smoothed by a moving average over ~2 % of
    the updates (NaN-aware: updates where no episode ended are left out), then the mean over seeds
    where every seed has a value (a mean of the seeds that happen to have one would jump between
    them), shaded (band) from the lowest to the highest seed wherever two have one; seed_lines: each
    seed thin as well. `line`: matplotlib's options for the curve. -> whether any seed had a value."""
    window = max(1, returns.shape[1] // 50)
    kernel = np.ones(window)
    finite = np.isfinite(returns)
    convolve = lambda rows: np.stack([np.convolve(row, kernel, "same") for row in rows])  # noqa: E731
    with np.errstate(invalid="ignore"):
        smoothed = convolve(np.where(finite, returns, 0.0)) / convolve(finite.astype(float))
    have = np.isfinite(smoothed).sum(axis=0)
    every, several = have == len(smoothed), have >= 2  # (each line joins the updates it has: episodes may be sparse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if seed_lines and len(smoothed) > 1:
            for seed in smoothed:
                ax.plot(steps[np.isfinite(seed)], seed[np.isfinite(seed)], color=color, lw=0.5, alpha=0.45,
                        zorder=line.get("zorder", 1) - 0.25)
        if every.any():
            ax.plot(steps[every], np.mean(smoothed[:, every], 0), color=color, label=label, **{"lw": 1.3, **line})
        if band and several.any():
            ax.fill_between(steps[several], np.nanmin(smoothed[:, several], 0), np.nanmax(smoothed[:, several], 0),
                            color=color, alpha=0.15, zorder=line.get("zorder", 1) - 0.5)
    return bool(have.any())


def plot_curve(path: str, metrics: dict[str, np.ndarray], title: str) -> None:
    """Return vs env steps: mean over seeds, shaded min..max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    returns = metrics["episode_return"]
    seeds = returns.shape[0]
    label = f"mean of the {seeds} seeds (where each has a return), shaded min-max, thin: each seed" if seeds > 1 else "1 seed"
    if not plot_seeds(ax, metrics["env_steps"][0], returns, label, "C0", seed_lines=True, lw=1.8):
        ax.text(0.5, 0.5, "no episode ended in this run", transform=ax.transAxes, ha="center", va="center", color="0.4")
        ax.set_xlim(0, metrics["env_steps"][0, -1])
    for name, marker, what in (("eval_return", "o", "sampled"), ("eval_return_deterministic", "s", "the mode")):
        evaluated = np.isfinite(metrics.get(name, np.full(returns.shape, np.nan))).any(axis=0)
        if evaluated.any():  # --eval-every's evaluations: complete episodes, unsmoothed
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.plot(metrics["env_steps"][0][evaluated], np.nanmean(metrics[name][:, evaluated], 0), marker,
                        ms=4, ls="--", lw=0.8, label=f"--eval-every: {what}, mean of {seeds}")
    ax.set(xlabel="environment steps (per seed)", ylabel="episode return (smoothed)", title=title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def write_outputs(run_dir: str, config: Config, result: RunResult, status: str = "complete",
                  curve: bool = True) -> list[dict]:
    """params.msgpack, summary.json and curve.png as of the updates done so far, each replaced
    atomically (metrics.csv and the checkpoint are written after every chunk) -> each seed's summary
    (for the trackers)."""
    finals = final_return(result.metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no seed's episode ended: NaN, written null
        mean = float(np.nanmean(finals))
    summary = {
        "status": status,  # complete, interrupted (resume it with --resume) or diverged at update N
        "final_return_per_seed": [float(x) for x in finals],  # null: no episode ended (final_return_note)
        "final_return_mean": mean,
        "env_steps_per_seed": int(result.metrics["env_steps"][0, -1]),
        "updates_done": int(result.metrics["env_steps"].shape[1]),
        "num_updates": config.num_updates,
        "lower_seconds": result.lower_seconds,
        "compile_seconds": result.compile_seconds,
        "run_seconds": result.run_seconds,  # of this process (a resumed run's own part)
        "env_steps_per_second": result.steps_per_second,
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
    }
    if np.isnan(finals).any():
        summary["final_return_note"] = no_final_return(finals)
    for name in EVAL_METRICS:  # --eval-every: the last evaluation, per seed, and at which update
        values, update = last_evaluation(result.metrics, name)
        if update:
            summary[f"last_{name}_per_seed"] = [float(x) for x in values]
            summary[f"last_{name}_update"] = update
    if result.state is not None:  # None: diverged in its first chunk, no finite policy to keep
        final_policy = Policy(result.state.params, result.state.obs_stats)  # leading [num_seeds] axis
        write_atomically(os.path.join(run_dir, "params.msgpack"), serialization.to_bytes(jax.device_get(final_policy)))
    write_atomically(os.path.join(run_dir, "summary.json"), json_text(summary).encode())
    if curve:
        plot(plot_curve, os.path.join(run_dir, "curve.png"), result.metrics, f"PPO on {config.env}")
    del summary["final_return_per_seed"], summary["final_return_mean"]
    return [{**summary, "final_return": float(final)} for final in finals]


# --- checkpoints ---------------------------------------------------------------------------------


# One msgpack file (flax.serialization; no pickle): the whole TrainState of every seed, the metrics
# so far, and the config it was written under. Saved after every chunk of updates, atomically.
CHECKPOINT = "checkpoint.msgpack"


CHECKPOINT_FORMAT = "ppo_jax checkpoint 2"
OLD_CHECKPOINT_FORMAT = "ppo_jax checkpoint 1"  # the optimizer's state on one raveled vector: still resumes


def run_spec(config: Config) -> dict[str, Any]:
    """What fixes a run's results: every Config and HParams field except the RUN_FIELDS, flat."""
    fields = {**dataclasses.asdict(config), **dataclasses.asdict(config.hparams)}
    return json.loads(json.dumps({name: value for name, value in fields.items()
                                  if name not in RUN_FIELDS and name != "hparams"}))  # JSON's own types


def children(node) -> list:  # a pytree node's immediate children, with their jax key paths
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]


def teach_serialization(tree) -> None:
    """Register with flax's serialization every pytree node type in `tree` that it does not know (Brax's
    MJX State, a suite's state classes), as a dict of its children by jax's key names, so that an env's
    state checkpoints like the rest of the TrainState."""
    def state_dict(node):
        return {jax.tree_util.keystr(path, simple=True): serialization.to_state_dict(child)
                for path, child in children(node)}

    def restore(target, state):
        treedef = jax.tree_util.tree_structure(target, is_leaf=lambda x: x is not target)
        return treedef.unflatten([serialization.from_state_dict(child, state[jax.tree_util.keystr(path, simple=True)])
                                  for path, child in children(target)])

    stack = [tree]
    while stack:
        node = stack.pop()
        kids = children(node)
        if node is None or (len(kids) == 1 and kids[0][1] is node):  # no children, or a leaf (an array)
            continue
        if serialization.to_state_dict(node) is node:  # flax returns what it does not know
            serialization.register_serialization_state(type(node), state_dict, restore)
        stack.extend(child for _, child in kids)


def save_checkpoint(run_dir: str, config: Config, checkpoint: Checkpoint) -> None:
    teach_serialization(checkpoint.state)
    data = {
        "format": CHECKPOINT_FORMAT,
        "config": json.dumps(run_spec(config)),
        "state": serialization.to_state_dict(jax.device_get(checkpoint.state)),
        "metrics": checkpoint.metrics,
    }
    write_atomically(os.path.join(run_dir, CHECKPOINT), serialization.msgpack_serialize(data))


def flat_adam_moments_as_trees(found: dict[tuple, Any], template: TrainState) -> dict[tuple, Any]:
    """A checkpoint of OLD_CHECKPOINT_FORMAT, whose optimizer stepped one raveled parameter vector,
    in today's layout: Adam's moments [seeds, P] cut into the params' leaves (ravel_pytree's order)."""
    found = dict(found)
    leaves = jax.tree_util.tree_leaves_with_path(serialization.to_state_dict(template.params))
    ends = np.cumsum([math.prod(leaf.shape[1:]) for _, leaf in leaves])
    for moment in ("mu", "nu"):
        flat = found.pop(("opt_state", "1", moment), None)
        if not isinstance(flat, np.ndarray) or flat.ndim != 2:
            continue
        for (path, leaf), part in zip(leaves, np.split(flat, ends[:-1], axis=1)):
            found[("opt_state", "1", moment, *(str(k.key) for k in path))] = part.reshape(leaf.shape)
    return found


def abstract_train_state(config: Config, keys=None) -> TrainState:
    """Shapes and dtypes of the TrainState of the agents of `keys` (default: config.num_seeds
    seeds), nothing computed."""
    init, _ = make_train_parts(config)
    return jax.eval_shape(jax.vmap(init, in_axes=(0, None)), seed_keys(config) if keys is None else keys, config.hparams)


def load_checkpoint(run_dir: str, config: Config, keys=None, where: str | None = None) -> Checkpoint:
    """Read RUN_DIR's checkpoint and check it against `config` (RUN_DIR's config.json; a sweep's
    setting: its config, and keys of its agents, points x seeds); a ConfigError names what is
    missing, corrupt or does not fit."""
    path = os.path.join(run_dir, CHECKPOINT)
    keys = seed_keys(config) if keys is None else keys
    where = where or f"--resume {run_dir}"
    try:
        with open(path, "rb") as f:
            data = serialization.msgpack_restore(f.read())
    except OSError as error:
        raise ConfigError(f"{where}: cannot read {CHECKPOINT} ({error.strerror}); a run writes it after its "
                          "first chunk of updates") from None
    except Exception:  # msgpack raises several types on garbage
        data = None
    if not isinstance(data, dict) or data.get("format") not in (CHECKPOINT_FORMAT, OLD_CHECKPOINT_FORMAT) or not {"config", "state", "metrics"} <= set(data):
        raise ConfigError(f"{where}: {path} is corrupt or not a ppo_jax checkpoint: the run cannot continue from it")
    # A field added to Config later is missing from older checkpoints: its default keeps the older
    # behaviour (that is the rule for new fields), so the default is what they were written with.
    saved, expected, default = json.loads(data["config"]), run_spec(config), run_spec(Config())
    for name in expected:
        if saved.get(name, default.get(name)) != expected[name]:
            raise ConfigError(f"{where}: the checkpoint was written with {flag(name)} {saved.get(name)}, but config.json "
                              f"says {expected[name]}: restore config.json, or start a new run")
    template = abstract_train_state(config, keys)
    teach_serialization(template)
    # Paths as tuples of keys, not joined strings: a suite's dict keys may hold "/" (Playground's "reward/upright").
    want = flax.traverse_util.flatten_dict(serialization.to_state_dict(template), keep_empty_nodes=True)
    state = data["state"]
    found = flax.traverse_util.flatten_dict(state, keep_empty_nodes=True) if isinstance(state, dict) else {}
    if data["format"] == OLD_CHECKPOINT_FORMAT:
        found = flat_adam_moments_as_trees(found, template)
    empty = flax.traverse_util.empty_node  # a field or state without leaves (optax's EmptyState)
    found.update({name: empty for name, leaf in want.items() if leaf is empty and name not in found})
    missing = [name for name in want if name not in found]
    if missing:  # written before these TrainState fields existed: their initial values (rule 4)
        init, _ = make_train_parts(config)
        fresh = jax.jit(jax.vmap(init, in_axes=(0, None)))(keys, config.hparams)
        fresh = flax.traverse_util.flatten_dict(serialization.to_state_dict(jax.device_get(fresh)))
        found.update({name: np.asarray(fresh[name]) for name in missing})
    for name, leaf in want.items():
        value = found.get(name)
        if leaf is empty or leaf is None:  # (None: a field the env's state leaves unset, e.g. Brax's)
            found[name] = leaf
            continue
        if not isinstance(value, np.ndarray) or value.shape != leaf.shape or value.dtype != leaf.dtype:
            got = "nothing" if value is None else f"{np.shape(value)} {getattr(value, 'dtype', type(value).__name__)}"
            raise ConfigError(f"{where}: checkpoint entry state/{'/'.join(name)} is {got}, this config needs {leaf.shape} "
                              f"{leaf.dtype}: the checkpoint does not belong to this config")
    state = serialization.from_state_dict(template, flax.traverse_util.unflatten_dict(found))
    checkpoint = Checkpoint(state, data["metrics"])
    shapes = {np.shape(value) for value in checkpoint.metrics.values()}
    if shapes != {(len(keys), checkpoint.updates_done)}:
        raise ConfigError(f"{where}: the checkpoint's metrics have shapes {sorted(shapes)}, expected "
                          f"{(len(keys), checkpoint.updates_done)}: it is corrupt")
    return checkpoint


# --- progress ------------------------------------------------------------------------------------


def clock(seconds: float) -> str:
    return "?" if not math.isfinite(seconds) else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


TENSORBOARD_MISSING = "--tensorboard needs tensorboardX, which is not installed: pip install -r requirements.txt"


WANDB_MISSING = "--wandb-project needs wandb, which is not installed: pip install -r requirements-wandb.txt"


TRACKER_TAGS = {  # CleanRL's names, where it has one; the other metrics go under ppo/
    "episode_return": "charts/episodic_return", "episode_length": "charts/episodic_length",
    "learning_rate": "charts/learning_rate", "policy_loss": "losses/policy_loss", "value_loss": "losses/value_loss",
    "entropy": "losses/entropy", "approx_kl": "losses/approx_kl", "clip_frac": "losses/clipfrac",
    "explained_variance": "losses/explained_variance", "eval_return": "eval/episodic_return",
    "eval_return_deterministic": "eval/episodic_return_deterministic"}


class Tracker:
    """What --tensorboard and --wandb-project share: one run per agent (seed, or point x seed); add()
    hands the updates not written yet of metrics [agents, updates so far] (with env_steps) to write()
    on a worker thread, while the next chunk runs, with charts/SPS once per chunk; close() waits."""

    def __init__(self, written: int = 0):
        self.pool, self.pending = concurrent.futures.ThreadPoolExecutor(1), []
        self.written, self.time = written, time.perf_counter()

    def started(self) -> None:
        """The program is compiled and runs: charts/SPS counts from here."""
        self.time = time.perf_counter()

    def add(self, metrics: dict[str, np.ndarray]) -> None:
        steps = metrics["env_steps"]
        done, now = steps.shape[1], time.perf_counter()
        if done == self.written:
            return
        sps = (steps[0, done - 1] - (steps[0, self.written - 1] if self.written else 0)) / (now - self.time)
        new = {name: np.array(values[:, self.written:done]) for name, values in metrics.items()}
        self.pending.append(self.pool.submit(self.write, new, float(sps)))
        self.written, self.time = done, now

    @staticmethod
    def rows(metrics: dict[str, np.ndarray], agent: int, sps: float):
        """(env steps, {tag: value}) per update of one agent, NaN left out (no episode ended, a
        critic-free value loss); charts/SPS in the last."""
        updates = metrics["env_steps"].shape[1]
        for update in range(updates):
            values = {TRACKER_TAGS.get(name, f"ppo/{name}"): float(metrics[name][agent, update])
                      for name in metrics if name != "env_steps" and math.isfinite(metrics[name][agent, update])}
            if update == updates - 1:
                values["charts/SPS"] = sps
            yield int(metrics["env_steps"][agent, update]), values

    def write(self, metrics: dict[str, np.ndarray], sps: float) -> None:
        raise NotImplementedError

    def close(self, summaries: Sequence[dict] | None = None, image: str | None = None) -> None:
        """Wait for the writes. At the end of a run, `summaries`: each agent's final figures, and
        `image`: the curve's PNG (for a tracker that keeps them)."""
        self.pool.shutdown(wait=True)
        for future in self.pending:
            future.result()  # a failed write is raised here


class TensorBoard(Tracker):
    """--tensorboard: an event directory per agent under `root`, named by `names`; each update is one
    event holding all its scalars at x = env steps (an event per scalar cost ~10x the time)."""

    def __init__(self, root: str, names: Sequence[str], config: Config, written: int = 0):
        try:
            from tensorboardX import summary
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.writer import FileWriter
        except ImportError:
            raise ConfigError(TENSORBOARD_MISSING) from None
        super().__init__(written)
        self.Summary = Summary
        self.writers = [FileWriter(os.path.join(root, name)) for name in names]
        for writer in self.writers:
            writer.add_summary(summary.text("config", f"```\n{config_json(config)}\n```"), 0)

    def write(self, metrics: dict[str, np.ndarray], sps: float) -> None:  # on the worker thread
        for agent, writer in enumerate(self.writers):
            for step, values in self.rows(metrics, agent, sps):
                writer.add_summary(self.Summary(value=[self.Summary.Value(tag=tag, simple_value=value)
                                                       for tag, value in values.items()]), step)
            writer.flush()

    def close(self, summaries: Sequence[dict] | None = None, image: str | None = None) -> None:
        super().close()
        for writer in self.writers:
            writer.close()


class WandB(Tracker):
    """--wandb-project: a W&B run per agent, named `<exp name>/<name>`, grouped by --wandb-group (else
    the experiment name), with the config (and a sweep point's hyperparameters); each update one
    history row at step = env steps. At the end each run gets its summary (summary.json's figures,
    its own final return) and curve.png.
    The runs' ids live in RUN_DIR/wandb.json, so a resumed run continues the same W&B runs.
    WANDB_MODE=offline (no network) keeps them in RUN_DIR/wandb/ for `wandb sync`. The runs open on
    the worker thread, while the program compiles (importing wandb and starting its service take a
    while: the README's Tracking section has the figure)."""

    def __init__(self, run_dir: str, names: Sequence[str], configs: Sequence[Config], written: int = 0):
        super().__init__(written)
        self.runs: list = []
        self.pending.append(self.pool.submit(self.open, run_dir, names, configs))

    def open(self, run_dir: str, names: Sequence[str], configs: Sequence[Config]) -> None:  # on the worker thread
        import wandb

        config = configs[0]
        experiment = config.exp_name or os.path.basename(os.path.normpath(run_dir))
        ids_path = os.path.join(run_dir, "wandb.json")
        ids = {}
        if os.path.exists(ids_path):  # a resumed run (or a sweep's earlier setting)
            with open(ids_path) as f:
                ids = json.load(f)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=len(names) > 1)
        for name, agent_config in zip(names, configs):
            self.runs.append(wandb.init(
                project=config.wandb_project, entity=config.wandb_entity, group=config.wandb_group or experiment,
                name=f"{experiment}/{name}", id=ids.get(name), resume="allow" if name in ids else None, dir=run_dir,
                config={**json.loads(config_json(agent_config)), "agent": name}, reinit="create_new",
                settings=settings))
            ids[name] = self.runs[-1].id
        write_atomically(ids_path, json.dumps(ids, indent=2).encode())
        self.Image, self.teardown = wandb.Image, wandb.teardown
        if self.runs[0].settings.mode == "offline":
            print(f"W&B offline: {len(names)} run(s) in {os.path.join(run_dir, 'wandb')}/; upload them with "
                  f"`wandb sync {os.path.join(run_dir, 'wandb')}/offline-run-*`")

    def write(self, metrics: dict[str, np.ndarray], sps: float) -> None:  # on the worker thread
        for agent, run in enumerate(self.runs):
            for step, values in self.rows(metrics, agent, sps):
                run.log(values, step=step)

    def close(self, summaries: Sequence[dict] | None = None, image: str | None = None) -> None:
        try:
            super().close()
        finally:
            for run, summary in zip(self.runs, summaries or [{}] * len(self.runs)):
                run.summary.update(summary)
                if image and os.path.exists(image):
                    run.log({"curve": self.Image(image)}, commit=False)
                run.finish(exit_code=0 if summary.get("status") == "complete" else 1)
            if self.runs:
                self.teardown()  # waits for W&B's service to have written every record (finish() may not)


def trackers(run_dir: str, names: Sequence[str], configs: Sequence[Config], written: int = 0,
             flags: Config | None = None) -> list[Tracker]:
    """The trackers that `flags` (default: the configs' own) ask for, a run per agent named `names`
    (configs: each agent's), written from update `written` on."""
    flags = flags or configs[0]
    tracked: list[Tracker] = []
    try:
        if flags.tensorboard:
            tracked.append(TensorBoard(os.path.join(run_dir, "tb"), names, configs[0], written))
        if flags.wandb_project:
            tracking = {name: getattr(flags, name) for name in ("wandb_project", "wandb_entity", "wandb_group", "exp_name")}
            tracked.append(WandB(run_dir, names, [dataclasses.replace(c, **tracking) for c in configs], written))
    except BaseException:
        for tracker in tracked:
            tracker.close()
        raise
    return tracked


class Progress:
    """The live progress line: a bar over all the work, elapsed time, ETA, then a message. On a
    terminal it redraws one line; in a log file, one line per report. With quiet, nothing."""

    def __init__(self, total: int, done: int = 0, quiet: bool = False):
        self.total, self.first, self.quiet = total, done, quiet
        self.start, self.open_line = time.perf_counter(), False

    def show(self, done: int, message: str) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / (done - self.first) * (self.total - done) if done > self.first else math.nan
        bar = "#" * round(30 * done / self.total)
        line = f"[{bar:<30}] {100 * done / self.total:3.0f}%  elapsed {clock(elapsed)}  ETA {clock(eta)}  {message}"
        if sys.stdout.isatty():
            print("\r" + line + "\033[K", end="", flush=True)
            self.open_line = True
        else:
            print(line, flush=True)

    def end(self) -> None:
        if self.open_line:
            print(flush=True)
            self.open_line = False


# ================================================================================================
# 7. Evaluation: a trained policy on complete episodes, and a GIF of one
# ================================================================================================


DRAWABLE_ENVS = ("CartPole-v1", "Pendulum-v1", "Acrobot-v1", "MountainCar-v0", "MountainCarContinuous-v0",
                 "Catch-bsuite", "Asterix-MinAtar", "Breakout-MinAtar", "Freeway-MinAtar", "Seaquest-MinAtar",
                 "SpaceInvaders-MinAtar", "Pong-misc", "PointRobot-misc", "MetaMaze-misc", "FourRooms-misc")


def act(network: ActorCritic, policy: Policy, raw_obs, first, hidden, hparams: HParams, deterministic: bool, key):
    """A saved policy's action in every env (flat observations [N, obs_dim], `first` [N]: the step
    begins an episode), its mode (argmax; the Gaussian's mean) or a sample, and its recurrent state
    after the step -> (action, hidden)."""
    observed = observe(policy.obs_stats, raw_obs, hparams)
    out = policy_step(network, policy.params, observed, first, hidden)
    return out.dist.env_action(out.dist.mode() if deterministic else out.dist.sample(key)), out.hidden


class TrainedPolicy:
    """A trained run's policy, to act with from Python (see load_run). act(obs) takes one raw
    observation as the gymnax env gives it (or a batch of them) and returns the action as the env
    takes it (continuous: clipped to the action space): the policy's mode without a key, a sample
    with one. A recurrent policy keeps its state between calls; reset() begins a new episode."""

    def __init__(self, config: Config, policy: Policy):
        self.config, self.policy = config, policy
        self.env = make_env(dataclasses.replace(config, num_envs=1))
        self.network = make_network(config, self.env)
        self._act = jax.jit(functools.partial(act, self.network), static_argnames="deterministic")
        self.reset()

    def reset(self) -> None:
        self.hidden = None  # the next act() begins an episode

    def act(self, obs, key=None):
        obs = jnp.asarray(obs)
        single = obs.ndim == len(self.env.obs_shape)
        if obs.shape[obs.ndim - len(self.env.obs_shape):] != self.env.obs_shape or obs.ndim > len(self.env.obs_shape) + 1:
            raise ValueError(f"act: an observation of {self.config.env} has shape {self.env.obs_shape} (a batch: "
                             f"[n, {', '.join(map(str, self.env.obs_shape))}]); got {obs.shape}")
        flat = self.env._flat(obs[None] if single else obs)
        first = jnp.full(len(flat), self.hidden is None)
        hidden = initial_hidden(self.network, len(flat)) if self.hidden is None else self.hidden
        action, self.hidden = self._act(self.policy, flat, first, hidden, self.config.hparams, key is None,
                                        jax.random.PRNGKey(0) if key is None else key)
        if not self.env.discrete:
            action = jnp.clip(action.reshape(len(flat), *self.env.action_shape), self.env.action_low,
                              self.env.action_high)
        return action[0] if single else action


def load_run(run_dir: str, seed: int = 0, point: str | int | None = None) -> TrainedPolicy:
    """The final policy of seed `seed` of the run in run_dir (its config.json and params.msgpack),
    or of a sweep's point (point: as --point takes it, K or S:K or a label):

        policy = load_run("runs/CartPole-v1-20261202-120000")
        action = policy.act(obs)                      # or policy.act(obs, key): a sample
        best = load_run("runs/sweep-lr-20261202-120000", point=3, seed=1)
    """
    if point is not None or (os.path.isdir(run_dir) and is_sweep_dir(run_dir)):
        if point is None:
            raise ConfigError(f"load_run {run_dir}: a sweep: give point=K (results.csv's point column, or its label)")
        run_dir = find_point(run_dir, str(point), "load_run point")
    config = load_run_config(run_dir, "load_run")
    env = make_env(config)
    policies = read_policies(config, env, make_network(config, env), os.path.join(run_dir, "params.msgpack"),
                             f"load_run {run_dir}:")
    num_seeds = len(policies.obs_stats.count)
    if not 0 <= seed < num_seeds:
        raise ConfigError(f"load_run {run_dir}: holds {num_seeds} seed(s); seed {seed} is not one of them")
    return TrainedPolicy(config, jax.tree.map(lambda x: jnp.asarray(x[seed]), policies))


def evaluate(config: Config, policies: Policy, episodes: int, deterministic: bool, seed: int = 0) -> np.ndarray:
    """Returns [seeds, episodes]: for every seed of `policies` (leaves [seeds, ...]), the raw return
    of the first episode of each of `episodes` envs (NaN if it did not end within the episode
    limit). One jitted program (evaluation_program): a while loop until every episode has ended,
    vmapped over seeds; seed s's randomness is key s of split(PRNGKey(seed), seeds)."""
    num_seeds = len(policies.obs_stats.count)
    keys = jax.random.split(jax.random.PRNGKey(seed), num_seeds)
    hparams = stack_hparams([config.hparams] * num_seeds)
    return np.asarray(evaluation_program(config, episodes, deterministic)(policies, keys, hparams))


def evaluation_program(config: Config, episodes: int, deterministic: bool):
    """evaluate's jitted program: (policies, keys, HParams), each [seeds] -> returns [seeds, episodes]."""
    env = vec_env(config.env, episodes, config.env_params)
    network = make_network(config, env)

    def one_seed(policy: Policy, key, hparams: HParams):
        reset_key, key = jax.random.split(key)
        obs, env_state = env.reset(reset_key)

        def step(carry):
            obs, env_state, hidden, key, returns, ended, t = carry
            key, action_key, step_key, reset_key = jax.random.split(key, 4)
            action, hidden = act(network, policy, obs, env_state.first, hidden, hparams, deterministic, action_key)
            resets = jax.tree.map(lambda x: x[0], env.draw_resets(reset_key, 1))
            obs, env_state, _, terminated, truncated, info = env.step(
                jax.random.split(step_key, episodes), env_state, action, resets)
            done = info["episode_end"]
            returns = jnp.where(done & ~ended, info["episode_return"], returns)
            return obs, env_state, hidden, key, returns, ended | done, t + 1

        unfinished = lambda carry: ~jnp.all(carry[5]) & (carry[6] <= env.episode_limit())  # noqa: E731
        carry = (obs, env_state, initial_hidden(network, episodes), key, jnp.zeros(episodes),
                 jnp.zeros(episodes, bool), 0)
        _, _, _, _, returns, ended, _ = jax.lax.while_loop(unfinished, step, carry)
        return jnp.where(ended, returns, jnp.nan)

    return jax.jit(jax.vmap(one_seed), compiler_options=xla_options())


def render_program(config: Config, deterministic: bool):
    """render_episode's jitted program: (one seed's policy, key) -> the env states, rewards and
    dones of an episode limit's steps of one env."""
    env = VecEnv(config.env, 1, config.env_params)
    network = make_network(config, env)
    limit = env.episode_limit()

    @functools.partial(jax.jit, compiler_options=xla_options())
    def episode(policy: Policy, key):
        reset_key, action_key, step_key, resets_key = jax.random.split(key, 4)
        obs, env_state = env.reset(reset_key)
        resets = env.draw_resets(resets_key, limit)

        def step(carry, inputs):
            obs, env_state, hidden = carry
            action_key, step_key, reset = inputs
            action, hidden = act(network, policy, obs, env_state.first, hidden, config.hparams, deterministic,
                                 action_key)
            next_obs, next_state, reward, terminated, truncated, _ = env.step(step_key[None], env_state, action, reset)
            return (next_obs, next_state, hidden), (env_state.env_state, reward[0], (terminated | truncated)[0])

        inputs = (jax.random.split(action_key, limit), jax.random.split(step_key, limit), resets)
        return jax.lax.scan(step, (obs, env_state, initial_hidden(network, 1)), inputs)[1]

    return episode


def render_episode(config: Config, policy: Policy, path: str, deterministic: bool, seed: int = 0,
                   quiet: bool = False) -> int:
    """Write one episode of `policy` (one seed) as a GIF with gymnax's visualizer; returns its length.
    quiet: no progress line."""
    from gymnax.visualize import Visualizer

    env = VecEnv(config.env, 1, config.env_params)
    limit = env.episode_limit()
    states, rewards, dones = jax.device_get(render_program(config, deterministic)(policy, jax.random.PRNGKey(seed)))
    length = int(np.argmax(dones)) + 1 if dones.any() else limit
    frames = [jax.tree.map(lambda x: x[t, 0], states) for t in range(length)]
    import matplotlib

    matplotlib.use("Agg")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")  # gymnasium's classic-control renderer starts pygame:
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # no sound card or display needed
    temporary = f"{path}.tmp{os.getpid()}.gif"
    progress, every = Progress(length, quiet=quiet), max(1, length // 50)

    class Drawing(Visualizer):  # gymnax's, moving the progress line as it draws (a frame takes ~0.1 s)
        def update(self, frame):
            if (frame + 1) % every == 0 or frame + 1 == length:
                progress.show(frame + 1, f"rendering frame {frame + 1}/{length}")
            return super().update(frame)

    Drawing(env.env, env.env_params, frames, np.cumsum(rewards[:length])).animate(temporary)
    progress.end()
    os.replace(temporary, path)
    return length


# ================================================================================================
# 8. RLHF in miniature: the exact KL-regularised optimum, best-of-n, the over-optimisation figure, and the
#    loop with a language model (pretraining, SFT, a reward model, DPO and IPO; every response listed)
# ================================================================================================


def toy_rlhf_tables(p: ToyRLHFParams) -> dict[str, np.ndarray]:
    """The env's tables in float64, and each token's per-step proxy reward (standardised: a response's
    proxy reward is the sum over its tokens)."""
    p = p.replace(**{name: np.asarray(getattr(p, name), np.float64) for name in
                     ("log_bigram", "gold_weights", "gold_standard", "proxy_weights", "proxy_standard")})
    return {"log_bigram": p.log_bigram, "gold_weights": p.gold_weights, "gold_standard": p.gold_standard,
            "proxy_token": proxy_token_reward(p.proxy_weights, p)}


def optimal_policy(p: ToyRLHFParams, beta: float) -> np.ndarray:
    """pi*_beta(y) ∝ B(y) exp(proxy(y) / beta), the optimum of E[proxy] - beta KL[pi || B] (Korbak et al.
    2022, arXiv:2205.11275), as conditionals [L, V + 1, V] (position, previous token or the start row V,
    next token). Because the proxy is a sum over tokens and B is Markov, it is Markov too, by a backward
    recursion over positions: log Z_t(prev) = logsumexp_v [log B(v | prev) + r(v) / beta + log Z_{t+1}(v)],
    pi*(v | prev, t) = exp(log B(v | prev) + r(v) / beta + log Z_{t+1}(v) - log Z_t(prev))."""
    tables = toy_rlhf_tables(p)
    log_bigram, reward = tables["log_bigram"], tables["proxy_token"]
    log_z_next = np.zeros(p.vocab)  # log Z_L = 0
    conditionals = np.zeros((p.length, p.vocab + 1, p.vocab))
    for t in reversed(range(p.length)):
        scores = log_bigram + reward / beta + log_z_next  # [V + 1, V]
        log_z = np.logaddexp.reduce(scores, axis=1)
        conditionals[t] = np.exp(scores - log_z[:, None])
        log_z_next = log_z[:p.vocab]
    return conditionals


def markov_expectations(p: ToyRLHFParams, conditionals: np.ndarray) -> dict[str, float]:
    """Exact expectations over responses of the Markov policy `conditionals` [L, V + 1, V]: gold and
    proxy reward, fluency, and KL[pi || B] per response. Gold's saturating term needs each token's
    count capped at 2: a forward pass over (previous token, capped count) per token."""
    tables = toy_rlhf_tables(p)
    log_bigram, v = tables["log_bigram"], p.vocab
    start = np.zeros(v + 1)
    start[v] = 1.0
    previous, proxy, fluency, kl = start, 0.0, 0.0, 0.0
    for t in range(p.length):
        pi = conditionals[t]
        proxy += previous @ pi @ tables["proxy_token"]
        fluency += previous @ np.sum(pi * log_bigram, axis=1)
        kl += previous @ np.sum(pi * (np.log(np.maximum(pi, 1e-300)) - log_bigram), axis=1)
        previous = np.append(previous @ pi, 0.0)
    saturating = 0.0
    for token in range(v):  # E[min(c_token, 2)]: a distribution over (previous token, count capped at 2)
        state = np.zeros((v + 1, 3))
        state[v, 0] = 1.0
        for t in range(p.length):
            moved = np.einsum("pc,pv->vc", state, conditionals[t])  # [V, 3]
            hit = moved[token].copy()
            moved[token] = 0.0
            moved[token, 1:] += hit[:2]
            moved[token, 2] += hit[2]
            state = np.vstack([moved, np.zeros((1, 3))])
        saturating += tables["gold_weights"][token] * (state.sum(0) @ np.array([0.0, 1.0, 2.0]))
    mean, std = tables["gold_standard"]
    gold = (float(saturating) + p.fluency_weight * fluency - mean) / std
    return {"gold_reward": float(gold), "proxy_reward": float(proxy), "fluency": float(fluency), "kl": float(kl)}


def best_of_n(p: ToyRLHFParams, ns: Sequence[int], samples: int = 1 << 16, seed: int = 1):
    """Best-of-n against the proxy from B: for each n, the expected gold and proxy reward of the
    response with the highest proxy reward of n drawn from B, by the unbiased order-statistics
    estimator over one pool of `samples` responses (Nakano et al. 2021, Appendix), ties broken at
    random; and its KL[pi_n || B] = log n - (n - 1) / n (Stiennon et al. 2020's bound, exact for distinct
    rewards)."""
    rng = np.random.default_rng(seed)
    pool = sample_bigram(rng, p.log_bigram, p.length, samples)
    proxy, gold = proxy_reward(pool, p).astype(np.float64), gold_reward(pool, p).astype(np.float64)
    order = np.lexsort((rng.random(samples), proxy))  # by proxy, ties at random
    proxy, gold = proxy[order], gold[order]
    from scipy.special import gammaln

    rank = np.arange(1, samples + 1)  # the i-th smallest is the best of n with probability C(i-1, n-1) / C(M, n)
    rows = []
    for n in ns:
        log_weight = (gammaln(rank) - gammaln(n) - gammaln(rank - n + 1)) - (
            gammaln(samples + 1) - gammaln(n + 1) - gammaln(samples - n + 1))
        weight = np.where(rank >= n, np.exp(np.where(rank >= n, log_weight, 0.0)), 0.0)
        rows.append({"n": int(n), "kl": math.log(n) - (n - 1) / n, "gold_reward": float(weight @ gold),
                     "proxy_reward": float(weight @ proxy)})
    return rows


def policy_responses(config: Config, policies: Policy, num: int, seed: int = 0):
    """num responses sampled from each seed's trained ToyRLHF-v0 policy (leaves [seeds, ...]) ->
    (tokens [seeds, num, L], log pi(y) [seeds, num]): one jitted program, vmapped over seeds."""
    seeds = len(policies.obs_stats.count)
    return responses_program(config, num)(policies, jax.random.split(jax.random.PRNGKey(seed), seeds))


def responses_program(config: Config, num: int):
    """policy_responses' jitted program: (policies [seeds], keys [seeds]) -> (tokens, log pi(y))."""
    env = make_env(dataclasses.replace(config, num_envs=num))
    network, p = make_network(config, env), env.env_params
    get_obs = jax.vmap(env.env.get_obs, in_axes=(0, None))

    def responses(policy: Policy, key):
        tokens = jnp.full((num, p.length), p.vocab, jnp.int32)
        hidden, log_prob = initial_hidden(network, num), jnp.zeros(num)
        for t, key in enumerate(jax.random.split(key, p.length)):
            obs = get_obs(ToyRLHFState(time=jnp.full(num, t), tokens=tokens), p)
            out = policy_step(network, policy.params, observe(policy.obs_stats, obs, config.hparams),
                              jnp.full(num, t == 0), hidden)
            hidden, dist = out.hidden, out.dist
            action = dist.sample_from(network.distribution.noise(key, (num, env.action_dim)))
            log_prob, tokens = log_prob + dist.log_prob(action), tokens.at[:, t].set(action)
        return tokens, log_prob

    return jax.jit(jax.vmap(responses))


def kl_to_language(run_dir: str, num: int = 1 << 14) -> np.ndarray:
    """KL[pi || B] per response of each seed of a ToyRLHF-v0 run's final policy (e.g. a reference
    pretrained on fluency), by Monte Carlo over num responses: E_pi[log pi(y) - log B(y)]."""
    config = load_run_config(run_dir, "kl_to_language")
    env = make_env(config)
    policies = read_policies(config, env, make_network(config, env), os.path.join(run_dir, "params.msgpack"),
                             f"kl_to_language {run_dir}:")
    tokens, log_prob = policy_responses(config, policies, num)
    return np.mean(np.asarray(log_prob, np.float64) - sequence_fluency(np.asarray(tokens), env.env_params.log_bigram),
                   axis=1)


FRONTIER_BETAS = tuple(np.logspace(-2, 1.5, 36))  # the exact curves' leash coefficients (pi*_beta) ...
FRONTIER_NS = tuple(2**k for k in range(11))  # ... and best-of-n's n


def exact_frontier(p: ToyRLHFParams, betas: Sequence[float] = FRONTIER_BETAS,
                   ns: Sequence[int] = FRONTIER_NS) -> dict[str, list[dict]]:
    """The ground truth the PPO runs are measured against: {"optimum": gold, proxy, fluency and KL of
    pi*_beta for each beta, "best_of_n": the same for n = 1 ... 1024}."""
    optimum = [{"beta": float(beta), **markov_expectations(p, optimal_policy(p, beta))} for beta in betas]
    return {"optimum": optimum, "best_of_n": best_of_n(p, ns)}


def gao_fit(d: np.ndarray, gain: np.ndarray, form: str) -> dict[str, float]:
    """Least-squares fit of Gao et al. 2022's (arXiv:2210.10760) gold-reward forms to gains over the
    reference at d = sqrt(KL): "rl" gain = d (alpha - beta log d), "bon" gain = d (alpha - beta d);
    -> alpha, beta, R^2 and the points fitted."""
    keep = np.isfinite(d) & np.isfinite(gain) & (d > 0)
    d, gain = d[keep], gain[keep]
    basis = np.stack([d, -d * np.log(d) if form == "rl" else -d * d], 1)
    (alpha, beta), *_ = np.linalg.lstsq(basis, gain, rcond=None)
    residual = gain - basis @ np.array([alpha, beta])
    r2 = 1.0 - np.sum(residual**2) / np.sum((gain - gain.mean()) ** 2)
    return {"alpha": float(alpha), "beta": float(beta), "r2": float(r2), "points": int(len(d))}


def objective_label(point: dict[str, Any]) -> str:  # the sweep point without its leash coefficient
    return ", ".join(f"{k}={format_value(v)}" for k, v in point.items() if k != "ref_kl_coef") or "base"


def setting_label(config: Config) -> str:  # a ToyRLHF setting: its estimator, epochs and reward model
    model = [o.split("=", 1)[1] for o in config.env_params if o.startswith("reward_model=")]
    return (f"{config.adv_estimator}, {config.update_epochs} epochs"
            + (f", reward model {os.path.basename(os.path.normpath(model[-1]))}" if model else ""))


def rlhf_endpoints(sweep: Sweep, settings: list[SweepSetting]) -> list[dict[str, Any]]:
    """One row per setting x point x seed of a ToyRLHF-v0 sweep: where each run ended (gold, proxy,
    KL per response, repeat_frac over the last 10 % of updates) and its gold at the first update."""
    rows = []
    for i, setting in enumerate(settings):
        metrics, config = setting.result.metrics, setting.config
        final = {name: final_return(metrics, name=name).reshape(-1, config.num_seeds)
                 for name in ("gold_reward", "proxy_reward", "ref_kl_seq", "repeat_frac")}
        first_gold = metrics["gold_reward"][:, 0].reshape(-1, config.num_seeds)
        for p, point in enumerate(sweep.points):
            for seed in range(config.num_seeds):
                rows.append({"setting": setting_label(config), "setting_index": i,
                             "objective": objective_label(point),
                             "ref_kl_coef": float(point.get("ref_kl_coef", config.hparams.ref_kl_coef)), "seed": seed,
                             **{name: float(values[p, seed]) for name, values in final.items()},
                             "start_gold": float(first_gold[p, seed])})
    return rows


def rlhf_truth(config: Config, index: int):
    """A ToyRLHF setting's ground truth: (label, the exact pi*_beta and best-of-n curves, beta -> pi*_beta's
    expectations); the curves None where none is exact (mode=learned without a reference's file)."""
    p = make_gymnax(config.env, config.env_params)[1]
    if p.mode == "learned":  # every response listed, against the run's reference (the SFT model)
        truth = enumerated_truth(config, p)
        label = f"reward model {os.path.basename(os.path.normpath(p.reward_model))}"
        return (label, None, None) if truth is None else (label, truth.frontier(), truth.optimum)
    return ("" if index == 0 else f"env {index}", exact_frontier(p),
            lambda coef: markov_expectations(p, optimal_policy(p, coef)))


def write_rlhf_outputs(run_dir: str, sweep: Sweep, settings: list[SweepSetting]) -> str:
    """A ToyRLHF-v0 sweep's over-optimisation outputs: rlhf_endpoints.csv, rlhf_frontier.csv (the
    exact pi*_beta and best-of-n curves), rlhf_fits.csv (Gao et al.'s forms fitted to each setting and
    objective's end points, and to best-of-n) and rlhf.png; returns the printed summary."""
    endpoints = rlhf_endpoints(sweep, settings)
    sources = {}  # the exact optimum of each setting's objective: {its env and reference: (label, frontier, optimum)}
    for row in endpoints:
        config = settings[row["setting_index"]].config
        key = (config.env_params, config.ref_params or config.init_params)
        if key not in sources:
            sources[key] = rlhf_truth(config, len(sources))
        row["source"] = sources[key][0]
        row.update({f"exact_{name}": math.nan for name in ("gold_reward", "proxy_reward", "kl")})
        if sources[key][1] is not None and row["ref_kl_coef"] > 0:  # k1 in the reward: the same objective
            optimum = sources[key][2](row["ref_kl_coef"])
            row.update({f"exact_{name}": optimum[name] for name in ("gold_reward", "proxy_reward", "kl")})
    frontiers = {label: frontier for label, frontier, _ in sources.values() if frontier is not None}
    if not frontiers:
        return "no exact optimum: the reference is each seed's random initial policy (give --ref-params)"
    columns = list(endpoints[0])
    write_csv(os.path.join(run_dir, "rlhf_endpoints.csv"), [columns] + [[row[c] for c in columns] for row in endpoints])
    curve = [["source", "curve", "beta_or_n", "kl", "gold_reward", "proxy_reward"]]
    for label, frontier in frontiers.items():
        curve += [[label, "optimum", r["beta"], r["kl"], r["gold_reward"], r["proxy_reward"]] for r in frontier["optimum"]]
        curve += [[label, "best_of_n", r["n"], r["kl"], r["gold_reward"], r["proxy_reward"]]
                  for r in frontier["best_of_n"]]
    write_csv(os.path.join(run_dir, "rlhf_frontier.csv"), curve)
    fits, groups = [["fit", "form", "alpha", "beta", "r2", "points"]], {}
    for row in endpoints:
        groups.setdefault((row["setting"], row["objective"]), []).append(row)
    for (setting, objective), rows in groups.items():
        d = np.sqrt(np.maximum([r["ref_kl_seq"] for r in rows], 0.0))
        fit = gao_fit(d, np.array([r["gold_reward"] - r["start_gold"] for r in rows]), "rl")
        fits.append([f"PPO {setting}, {objective}", "rl", *fit.values()])
    for label, frontier in frontiers.items():
        bon = frontier["best_of_n"]
        fit = gao_fit(np.sqrt([r["kl"] for r in bon]),
                      np.array([r["gold_reward"] - bon[0]["gold_reward"] for r in bon]), "bon")
        fits.append([f"best-of-n (exact){label and ', ' + label}", "bon", *fit.values()])
    write_csv(os.path.join(run_dir, "rlhf_fits.csv"), fits)
    plot(plot_rlhf, run_dir, frontiers, endpoints, settings)
    closeness = []  # per setting and objective: PPO's mean end point against pi*_beta, median over coefficients
    for (setting, objective), rows in groups.items():
        ratios = [r[name] / r[f"exact_{key}"] - 1 for r in rows if r["ref_kl_coef"] > 0
                  for name, key in (("ref_kl_seq", "kl"), ("proxy_reward", "proxy_reward"))]
        closeness.append(f"{setting}, {objective}: {np.median(np.abs(ratios)):.0%}")
    peaks = []
    for label, frontier in frontiers.items():
        peak = max(frontier["optimum"], key=lambda r: r["gold_reward"])
        peaks.append(f"{label + ': ' if label else ''}exact pi*_beta's gold peaks at {peak['gold_reward']:.2f} (beta "
                     f"{peak['beta']:.3g}, KL {peak['kl']:.2f}); at beta -> 0 it is "
                     f"{frontier['optimum'][0]['gold_reward']:.2f} (KL {frontier['optimum'][0]['kl']:.1f})")
    lines = ["RLHF in miniature: " + "; ".join(peaks) + ". Gao et al.'s forms (R^2): "
             + "; ".join(f"{row[0]} {row[4]:.2f}" for row in fits[1:]),
             "End points against pi*_beta at the same coefficient (median |KL and proxy / exact - 1|): "
             + "; ".join(closeness),
             "outputs: rlhf.png, rlhf_endpoints.csv, rlhf_frontier.csv, rlhf_fits.csv"]
    return "\n".join(lines)


def plot_rlhf(run_dir: str, frontiers: dict[str, dict[str, list[dict]]], endpoints: list[dict],
              settings: list[SweepSetting]):
    """rlhf.png. Top: gold and proxy reward against sqrt(KL[pi || pi_ref]): the exact pi*_beta and
    best-of-n curves (one colour per source: the settings' reward models), each PPO run's end point (coloured by the leash's coefficient, one marker per
    setting and objective), and the first setting's unleashed run over its updates. Bottom: the final
    gold, proxy and KL against the coefficient (mean over seeds; colour: setting, line: objective)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))
    coefs = sorted({row["ref_kl_coef"] for row in endpoints})
    shades = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(coefs)))
    groups = list(dict.fromkeys((row["setting"], row["objective"]) for row in endpoints))
    setting_names = list(dict.fromkeys(row["setting"] for row in endpoints))
    objectives = list(dict.fromkeys(row["objective"] for row in endpoints))
    markers, styles = "os^vDPX*<>", ["-", "--", ":", "-."]
    unleashed = [i for i, row in enumerate(endpoints) if row["setting_index"] == 0 and row["ref_kl_coef"] == 0]
    for ax, name in ((axes[0, 0], "gold_reward"), (axes[0, 1], "proxy_reward")):
        for f, (source, frontier) in enumerate(frontiers.items()):
            for curve, style, label in (("optimum", "-", "exact $\\pi^*_\\beta$"), ("best_of_n", "--", "best-of-n (exact)")):
                rows = frontier[curve]
                ax.plot(np.sqrt([r["kl"] for r in rows]), [r[name] for r in rows], style, lw=1.5,
                        color="k" if f == 0 else f"C{(f - 1) % 10}", label=label + (f", {source}" if source else ""))
        for g, group in enumerate(groups):
            rows = [r for r in endpoints if (r["setting"], r["objective"]) == group]
            ax.scatter(np.sqrt(np.maximum([r["ref_kl_seq"] for r in rows], 0)), [r[name] for r in rows], s=14,
                       c=[shades[coefs.index(r["ref_kl_coef"])] for r in rows], marker=markers[g % len(markers)],
                       alpha=0.7, label=f"{group[0]}, {group[1]}")
        if unleashed:  # over the updates: proxy rises while gold rises, peaks and falls
            metrics, agent = settings[0].result.metrics, unleashed[0]  # rows are agents in the batch's order
            ax.plot(np.sqrt(np.maximum(metrics["ref_kl_seq"][agent], 0)), metrics[name][agent], color="tab:red",
                    lw=0.8, alpha=0.8, label="no leash, over its updates")
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.set_xlabel("$\\sqrt{KL[\\pi \\| \\pi_{ref}]}$ (nats per response)")
        ax.set_title(name.replace("_", " ") + " (end points coloured by --ref-kl-coef, light: larger)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 2].legend(handles, labels, fontsize=7, loc="center left")
    axes[0, 2].axis("off")
    for ax, name in zip(axes[1], ("gold_reward", "proxy_reward", "ref_kl_seq")):
        for group in groups:
            rows = [r for r in endpoints if (r["setting"], r["objective"]) == group]
            mean = [np.nanmean([r[name] for r in rows if r["ref_kl_coef"] == c]) for c in coefs]
            ax.plot(coefs, mean, marker="o", ms=3, lw=1, color=f"C{setting_names.index(group[0])}",
                    ls=styles[objectives.index(group[1]) % len(styles)], label=f"{group[0]}, {group[1]}")
        ax.set_xscale("symlog", linthresh=min([c for c in coefs if c > 0], default=0.01))
        ax.set_xlabel("--ref-kl-coef")
        ax.set_title("final " + ("KL per response" if name == "ref_kl_seq" else name.replace("_", " ")))
    axes[1, 2].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    save_figure(fig, os.path.join(run_dir, "rlhf.png"), dpi=100)


# The loop with a language model (--lm-stage; README, "The loop with a language model"): InstructGPT's
# steps at a size whose every response can be listed, so each is measured against its exact optimum.
SFT_POOL = 10  # --lm-stage sft: the demonstrations are the best 1 in this many of B's responses by gold
HELD_OUT = 1024  # sequences (pairs) held out beside every stage's training set
LM_EVALS = 20  # held-out evaluations over a stage's steps (the rows of its metrics.csv)
ENUMERABLE = 1 << 20  # responses listed for the exact optima (vocab ** length at most this many)
STAGE_DATA = {"pretrain": 1, "sft": 2, "reward": 3, "dpo": 3, "ipo": 3}  # a stream of --seed's per data set: dpo and ipo
# draw reward's pairs and labels, so the three stages train on the same comparisons


def sequence_log_probs(network: ActorCritic, params, tokens):
    """log pi(y_t | y_<t) of responses [..., L] -> [..., L], every position in one pass (teacher forcing)."""
    dist = network.apply(params, tokens, whole=True).dist  # over [..., L + 1] positions: the last has no token
    padded = jnp.concatenate([tokens, jnp.zeros_like(tokens[..., :1])], axis=-1)
    return dist.log_prob(padded)[..., :-1]


def lm_loss(network: ActorCritic, params, tokens):
    """Pretraining and SFT: the mean negative log-likelihood per token (cross-entropy, nats)."""
    return -jnp.mean(sequence_log_probs(network, params, tokens))


def bradley_terry_loss(first, second, preferred):
    """The reward model's loss on pairs: -mean log sigmoid(s (r_1 - r_2)), s = +1 where the first response
    is preferred, -1 where the second (Bradley and Terry 1952; InstructGPT Eq. 1)."""
    sign = 2.0 * preferred - 1.0
    return jnp.mean(jax.nn.softplus(-sign * (first - second)))


def preference_loss(first_log_ratio, second_log_ratio, preferred, beta, kind: str = "dpo"):
    """DPO's and IPO's loss on pairs from h = s (log pi/pi_ref (y_1) - log pi/pi_ref (y_2)), log-ratios of whole
    responses, s as in bradley_terry_loss. dpo: -mean log sigmoid(beta h) (Rafailov et al. 2023, Eq. 7);
    ipo: mean (h - 1 / (2 beta))^2 (Azar et al. 2023, IPO's sampled loss)."""
    h = (2.0 * preferred - 1.0) * (first_log_ratio - second_log_ratio)
    return jnp.mean(jax.nn.softplus(-beta * h)) if kind == "dpo" else jnp.mean((h - 0.5 / beta) ** 2)


def stage_loss(network: ActorCritic, config: Config):
    """(params, batch, beta) -> (loss, {metric: value}) of --lm-stage; batch as lm_stage_data gives it."""
    def loss(params, batch, beta):
        if config.lm_stage in ("pretrain", "sft"):
            value = lm_loss(network, params, batch["tokens"])
            return value, {"loss": value, "perplexity": jnp.exp(value)}
        if config.lm_stage == "reward":
            first, second = (network.apply(params, batch[name], whole=True).value[..., -1] for name in ("first", "second"))
            value = bradley_terry_loss(first, second, batch["preferred"])
            return value, {"loss": value, "accuracy": jnp.mean((first > second) == (batch["preferred"] > 0.5))}
        first, second = (sequence_log_probs(network, params, batch[name]).sum(-1) - batch[f"{name}_ref"]
                         for name in ("first", "second"))
        value = preference_loss(first, second, batch["preferred"], beta, config.lm_stage)
        margin = (2.0 * batch["preferred"] - 1.0) * (first - second)
        return value, {"loss": value, "accuracy": jnp.mean(margin > 0), "margin": jnp.mean(margin)}

    return loss


def demonstrations(p: ToyRLHFParams, rng: np.random.Generator, num: int) -> np.ndarray:
    """--lm-stage sft's data: the best num by gold of SFT_POOL * num responses from B."""
    pool = sample_bigram(rng, p.log_bigram, p.length, SFT_POOL * num)
    return pool[np.argsort(-gold_reward(pool, p), kind="stable")[:num]]


def comparisons(config: Config, p: ToyRLHFParams, reference: Policy, rng: np.random.Generator, num: int,
                key) -> dict[str, np.ndarray]:
    """num pairs of responses sampled from the reference policy (--ref-params: the SFT model), labelled by gold's
    Bradley-Terry model, P(y_1 preferred) = sigmoid(--label-scale (gold(y_1) - gold(y_2))), a --label-noise
    fraction of the labels flipped."""
    policies = jax.tree.map(lambda x: x[None], reference)
    tokens = np.asarray(responses_program(dataclasses.replace(config, num_seeds=1), 2 * num)(
        policies, key[None])[0][0])
    first, second = tokens[:num], tokens[num:]
    preferred = rng.random(num) < 1.0 / (1.0 + np.exp(config.label_scale * (gold_reward(second, p)
                                                                             - gold_reward(first, p))))
    preferred ^= rng.random(num) < config.label_noise
    return {"first": first, "second": second, "preferred": preferred.astype(np.float32)}


def lm_stage_data(config: Config, p: ToyRLHFParams, network: ActorCritic, reference) -> tuple[dict, dict]:
    """(training set, held-out set) of --lm-stage, drawn from --seed's stream for the stage's data set."""
    rng = np.random.default_rng([config.seed, STAGE_DATA[config.lm_stage]])
    total = config.lm_data + HELD_OUT
    if config.lm_stage == "pretrain":
        data = {"tokens": sample_bigram(rng, p.log_bigram, p.length, total)}
    elif config.lm_stage == "sft":
        data = {"tokens": demonstrations(p, rng, total)}
    else:
        key = jax.random.fold_in(jax.random.PRNGKey(config.seed), STAGE_DATA[config.lm_stage])
        data = comparisons(config, p, reference, rng, total, key)
        if config.lm_stage in ("dpo", "ipo"):  # log pi_ref of every response, once
            for name in ("first", "second"):
                data[f"{name}_ref"] = policy_log_probs(network, reference.params, data[name])
    data = {name: np.asarray(value, np.float32 if value.dtype.kind == "f" else np.int32) for name, value in data.items()}
    return ({name: value[:config.lm_data] for name, value in data.items()},
            {name: value[config.lm_data:] for name, value in data.items()})


def lm_stage_program(config: Config, network: ActorCritic):
    """The stage's training as one jitted program, vmapped over agents (dpo, ipo: --lm-betas x --num-seeds;
    else one): (params, train, held_out, betas [A], keys [A]) -> (params [A], per evaluation: the training
    loss's metrics averaged over the steps since the last, and the held-out set's)."""
    loss = stage_loss(network, config)
    steps = max(1, config.lm_steps // LM_EVALS)
    h = config.hparams
    schedule = optax.linear_schedule(h.lr, 0.0 if h.anneal_lr else h.lr, steps * LM_EVALS)
    tx = make_optimizer(h, schedule)

    def train(params, data, held_out, beta, key):
        size = len(jax.tree.leaves(data)[0])

        def step(carry, key):
            params, opt_state = carry
            batch = jax.tree.map(lambda x: x[jax.random.randint(key, (config.lm_batch_size,), 0, size)], data)
            (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, beta)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), metrics

        def evaluation(carry, key):
            carry, metrics = jax.lax.scan(step, carry, jax.random.split(key, steps))
            return carry, (jax.tree.map(jnp.mean, metrics), loss(carry[0], held_out, beta)[1])

        (params, _), (trained, evaluated) = jax.lax.scan(evaluation, (params, tx.init(params)),
                                                         jax.random.split(key, LM_EVALS))
        return params, trained, evaluated

    return jax.jit(jax.vmap(train, in_axes=(None, None, None, 0, 0)))


def run_lm_stage(config: Config) -> dict[str, Any]:
    """--lm-stage: one stage of the loop, trained and measured; writes params.msgpack (every agent's: [A, ...]),
    metrics.csv, lm.png and summary.json into the run directory; returns the summary."""
    started = time.time()
    env = make_env(config)
    network, p = make_network(config, env), env.env_params
    initial = load_policy(config, env, network, config.init_params, "--init-params")
    if initial is None:
        initial = init_policy(jax.random.PRNGKey(config.seed), env, network, HParams(), jnp.zeros((1, env.obs_dim)))
    reference = load_policy(config, env, network, config.ref_params or config.init_params, "--ref-params")
    train, held_out = lm_stage_data(config, p, network, reference)
    preference = config.lm_stage in ("dpo", "ipo")
    betas = [(beta, seed) for beta in config.lm_betas for seed in range(config.num_seeds)] if preference else [(0.0, 0)]
    keys = jnp.stack([jax.random.fold_in(jax.random.PRNGKey(config.seed), seed) for _, seed in betas])
    params, trained, evaluated = lm_stage_program(config, network)(
        initial.params, train, held_out, jnp.asarray([beta for beta, _ in betas], jnp.float32), keys)
    steps = max(1, config.lm_steps // LM_EVALS) * np.arange(1, LM_EVALS + 1)
    rows = [["agent", "beta", "seed", "step", *[f"train_{k}" for k in trained], *[f"heldout_{k}" for k in evaluated]]]
    for a, (beta, seed) in enumerate(betas):
        for i, step in enumerate(steps):
            rows.append([a, beta, seed, int(step), *[f"{float(v[a, i]):.6g}" for v in trained.values()],
                         *[f"{float(v[a, i]):.6g}" for v in evaluated.values()]])
    write_csv(os.path.join(config.run_dir, "metrics.csv"), rows)
    stats = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(betas), *jnp.shape(x))), initial.obs_stats)
    write_atomically(os.path.join(config.run_dir, "params.msgpack"),
                     serialization.to_bytes(jax.device_get(Policy(params, stats))))
    summary = {"stage": config.lm_stage, **{f"heldout_{k}": float(v[0, -1]) for k, v in evaluated.items()},
               "seconds": round(time.time() - started, 1)}
    if config.lm_stage in ("pretrain", "sft"):  # B's own perplexity per token (exact), and the samples' gold
        entropy = -markov_expectations(p, np.broadcast_to(np.exp(toy_rlhf_tables(p)["log_bigram"]),
                                                           (p.length, p.vocab + 1, p.vocab)))["fluency"]
        summary["language_perplexity"] = math.exp(entropy / p.length)
        tokens, _ = policy_responses(config, Policy(params_of(params, 0, keep=True), params_of(stats, 0, keep=True)),
                                     4096)
        summary["sample_gold_reward"] = float(np.mean(gold_reward(np.asarray(tokens[0]), p)))
    if config.lm_stage == "reward":  # the ceiling: gold itself ranking the held-out pairs
        gold_first, gold_second = gold_reward(held_out["first"], p), gold_reward(held_out["second"], p)
        summary["gold_heldout_accuracy"] = float(np.mean((gold_first > gold_second) == (held_out["preferred"] > 0.5)))
        scores = batched_scores(lambda tokens: response_values(network, params_of(params, 0), tokens), held_out["first"])
        summary["gold_correlation"] = float(np.corrcoef(scores, gold_first)[0, 1])
    curve = None
    if preference:
        summary["endpoints"], curve = preference_endpoints(config, p, network, params, reference, betas)
    write_atomically(os.path.join(config.run_dir, "summary.json"), json.dumps(summary, indent=1).encode())
    plot(plot_lm_stage, config.run_dir, rows, summary.get("endpoints"), curve)
    return summary


def lm_stage_command(config: Config) -> dict[str, Any]:
    """--lm-stage from the command line: the stage, then its summary in a few lines."""
    agents = len(config.lm_betas) * config.num_seeds if config.lm_stage in ("dpo", "ipo") else 1
    print(f"ppo_jax: {config.env} --lm-stage {config.lm_stage}, {config.lm_steps} steps of {config.lm_batch_size} "
          f"on {config.lm_data} {'sequences' if config.lm_stage in ('pretrain', 'sft') else 'pairs'}"
          + (f", {agents} policies" if agents > 1 else ""))
    summary = run_lm_stage(config)
    shown = {k: v for k, v in summary.items() if k not in ("stage", "endpoints")}
    print(", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
    for row in summary.get("endpoints", []):
        print(f"beta {row['beta']:g} seed {row['seed']}: gold {row['gold_reward']:.3f}, KL {row['kl']:.3f} "
              f"(its loss's optimum: gold {row['optimum_gold_reward']:.3f}, KL {row['optimum_kl']:.3f})")
    print(f"outputs: {config.run_dir}/")
    return summary


def params_of(params, agent: int, keep: bool = False):
    """Agent `agent` of params [A, ...] (keep: as [1, ...])."""
    return jax.tree.map(lambda x: x[agent:agent + 1] if keep else x[agent], params)


def all_responses(vocab: int, length: int) -> np.ndarray:
    """Every response [vocab ** length, L] int32, in lexicographic order."""
    if vocab**length > ENUMERABLE:
        raise ConfigError(f"--env-params vocab={vocab} length={length}: {vocab}**{length} responses are too many to "
                          f"list for the exact optimum (at most {ENUMERABLE:,}): e.g. vocab=8 length=6")
    return np.stack(np.unravel_index(np.arange(vocab**length), (vocab,) * length), -1).astype(np.int32)


class Enumerated:
    """Every response of a small ToyRLHF env, with its log-probability under a reference policy (`log_ref`), the
    reward a policy is optimised for (`reward`: the env's) and gold: exact expectations of any policy given as
    log-probabilities, pi*_beta(y) ∝ pi_ref(y) exp(reward(y) / beta) (the optimum of E[reward] - beta KL[pi ||
    pi_ref]: Korbak et al. 2022; DPO's, with the labels' reward: Rafailov et al. 2023) and best-of-n."""

    def __init__(self, log_ref, reward, gold):
        self.log_ref, self.reward, self.gold = (np.asarray(x, np.float64) for x in (log_ref, reward, gold))
        self.log_ref -= np.logaddexp.reduce(self.log_ref)  # a model's log-probabilities sum to 1 up to rounding

    def expectations(self, log_pi) -> dict[str, float]:
        """gold, reward (proxy_reward) and KL[pi || pi_ref] of the policy log_pi [n]."""
        pi = np.exp(log_pi)
        return {"gold_reward": float(pi @ self.gold), "proxy_reward": float(pi @ self.reward),
                "kl": float(pi @ (log_pi - self.log_ref))}

    def optimum(self, beta: float, reward=None) -> dict[str, float]:
        """pi*_beta's expectations (of the env's reward, or of `reward` [n], e.g. gold for DPO's labels)."""
        log_pi = self.log_ref + (self.reward if reward is None else reward) / beta
        return {"beta": float(beta), **self.expectations(log_pi - np.logaddexp.reduce(log_pi))}

    def best_of_n(self, ns: Sequence[int]) -> list[dict[str, float]]:
        """Best-of-n from pi_ref by the env's reward, exactly: responses ranked by reward, F the reference's
        distribution function over the ranks, P(best of n in rank group g) = F_g^n - F_(g-1)^n, shared within a
        group of equal rewards in proportion to pi_ref (ties broken at random)."""
        values, group = np.unique(self.reward, return_inverse=True)
        ref = np.exp(self.log_ref)
        mass = np.bincount(group, ref, len(values))
        upper = np.minimum(np.cumsum(mass), 1.0)
        lower = np.concatenate([[0.0], upper[:-1]])
        rows = []
        for n in ns:
            share = (upper**n - lower**n) / np.maximum(mass, 1e-300)  # P(group) / pi_ref(group)
            log_pi = np.log(np.maximum(share[group], 1e-300)) + self.log_ref
            rows.append({"n": int(n), **self.expectations(np.where(ref > 0, log_pi, -np.inf))})
        return rows

    def frontier(self, betas=FRONTIER_BETAS, ns=FRONTIER_NS) -> dict:
        return {"optimum": [self.optimum(beta) for beta in betas], "best_of_n": self.best_of_n(ns)}


def policy_log_probs(network: ActorCritic, params, tokens) -> np.ndarray:
    """log pi(y) of responses [n, L] under one model's params -> [n] float64."""
    return batched_scores(lambda y: response_log_probs(network, params, y), tokens)


@functools.partial(jax.jit, static_argnums=0)
def response_log_probs(network: ActorCritic, params, tokens):  # log pi(y) of responses [n, L] -> [n]
    return sequence_log_probs(network, params, tokens).sum(-1)


def enumerated_truth(config: Config, p: ToyRLHFParams) -> Enumerated | None:
    """mode=learned: every response under the run's reference (--ref-params, else --init-params; None without
    either: the reference is each seed's random initial policy), scored by the reward model and gold."""
    path = config.ref_params or config.init_params
    if path is None:
        return None
    env = make_env(config)
    network = make_network(config, env)
    reference = load_policy(config, env, network, path, "--ref-params")
    tokens = all_responses(p.vocab, p.length)
    return Enumerated(policy_log_probs(network, reference.params, tokens),
                      batched_scores(lambda y: learned_scores(y, p), tokens), gold_reward(tokens, p))


def win_rates(gold, log_ref, scale: float, noise: float, tail: float = 1e-6) -> np.ndarray:
    """P(y preferred to y') with y' ~ pi_ref, for every response y [n], under the labels' model (gold's
    Bradley-Terry at `scale`, a `noise` fraction flipped), y' over the reference's most probable responses
    that hold all but `tail` of its mass (each rate is off by at most `tail`)."""
    order = np.argsort(-log_ref)
    keep = order[:np.searchsorted(np.cumsum(np.exp(log_ref[order])), 1.0 - tail) + 1]
    weights = np.exp(log_ref[keep]) / np.exp(log_ref[keep]).sum()
    rates = np.empty(len(gold))
    for i in range(0, len(gold), 2048):
        preferred = 1.0 / (1.0 + np.exp(-scale * (gold[i:i + 2048, None] - gold[keep][None])))
        rates[i:i + 2048] = (noise + (1.0 - 2.0 * noise) * preferred) @ weights
    return rates


def preference_endpoints(config: Config, p: ToyRLHFParams, network: ActorCritic, params, reference,
                         betas: list[tuple[float, int]]) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """DPO's and IPO's end points, exactly (every response listed): gold and KL[pi || pi_ref] of each agent's
    policy, beside its loss's population optimum, pi*_beta of the labels' reward: for DPO --label-scale x gold
    (Rafailov et al. 2023, Sec. 4: exact without --label-noise, where the labels are Bradley-Terry's), for IPO
    the win rate against pi_ref, P(y preferred to y'), y' ~ pi_ref (Azar et al. 2023's objective with Psi the
    identity, the pairs being pi_ref's samples). -> (rows, the optimum's curve over beta)"""
    tokens = all_responses(p.vocab, p.length)
    log_ref = policy_log_probs(network, reference.params, tokens)
    gold = gold_reward(tokens, p).astype(np.float64)
    labels = (config.label_scale * gold if config.lm_stage == "dpo"
              else win_rates(gold, log_ref, config.label_scale, config.label_noise))
    truth = Enumerated(log_ref, np.zeros(len(tokens)), gold)
    rows = []
    for a, (beta, seed) in enumerate(betas):
        log_pi = policy_log_probs(network, params_of(params, a), tokens)
        found, best = truth.expectations(log_pi), truth.optimum(beta, reward=labels)
        rows.append({"beta": beta, "seed": seed, "gold_reward": found["gold_reward"], "kl": found["kl"],
                     "optimum_gold_reward": best["gold_reward"], "optimum_kl": best["kl"]})
    curve = [truth.optimum(beta, reward=labels) for beta in FRONTIER_BETAS]
    return rows, curve


def plot_lm_stage(run_dir: str, rows: list[list], endpoints: list[dict] | None = None, curve: list[dict] | None = None):
    """lm.png: each agent's training and held-out loss over the stage's steps; DPO's and IPO's: beside it,
    gold against sqrt(KL[pi || pi_ref]) of every end point, on the exact pi*_beta curve of the labels' reward."""
    import matplotlib.pyplot as plt

    header, table = rows[0], np.array(rows[1:], dtype=object)
    fig, axes = plt.subplots(1, 2 if endpoints else 1, figsize=(13 if endpoints else 7, 4), squeeze=False)
    ax = axes[0, 0]
    if endpoints:
        right = axes[0, 1]
        right.plot(np.sqrt([r["kl"] for r in curve]), [r["gold_reward"] for r in curve], "k-",
                   label="exact $\\pi^*_\\beta$ of the labels' reward")
        betas = sorted({r["beta"] for r in endpoints})
        for b, beta in enumerate(betas):
            mine = [r for r in endpoints if r["beta"] == beta]
            right.scatter(np.sqrt([r["kl"] for r in mine]), [r["gold_reward"] for r in mine], color=f"C{b % 10}",
                          label=f"beta {beta:g}")
            right.scatter(np.sqrt(mine[0]["optimum_kl"]), mine[0]["optimum_gold_reward"], marker="x", color=f"C{b % 10}")
        right.set_xlabel("$\\sqrt{KL[\\pi \\| \\pi_{ref}]}$ (nats per response)")
        right.set_ylabel("gold reward (exact)")
        right.set_title("end points (dots) and each beta's optimum (x)")
        right.legend(fontsize=7)
    for a in sorted(set(table[:, 0])):
        mine = table[table[:, 0] == a]
        label = f"beta {mine[0, 1]}, seed {mine[0, 2]}" if len(set(table[:, 0])) > 1 else ""
        for column, style in (("train_loss", "--"), ("heldout_loss", "-")):
            ax.plot(mine[:, 3].astype(float), mine[:, header.index(column)].astype(float), style, color=f"C{a % 10}",
                    label=f"{column.replace('_', ' ')} {label}".strip())
    ax.set_xlabel("gradient step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, os.path.join(run_dir, "lm.png"), dpi=100)


# ================================================================================================
# 9. Command line
# ================================================================================================


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Two passes: read --env and --algo first, then let tyro parse everything with their defaults (so
    `--env Pendulum-v1 --help` shows Pendulum's defaults, and `--algo a2c --help` A2C's over them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_flag_words(argv)
    except ConfigError as error:
        fail(error)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=Config.env)
    pre.add_argument("--algo", default=Config.algo)
    known = pre.parse_known_args(argv)[0]
    captured = io.StringIO()  # tyro reports a bad flag in a box of many lines: made one line here
    try:
        with contextlib.redirect_stderr(captured):
            config = tyro.cli(Config, args=argv, default=default_config(known.env, algo=known.algo),
                              description=__doc__.split("\n\n")[0])
    except SystemExit as error:
        if error.code:
            fail(ConfigError(one_line_parse_error(captured.getvalue())))
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())
    return config


# Flags as other PPO code names them (CleanRL, Stable-Baselines3) -> ppo_jax's.
FLAG_SYNONYMS = {"--learning-rate": "--lr", "--clip-coef": "--clip-eps", "--clip-range": "--clip-eps",
                 "--env-id": "--env", "--n-envs": "--num-envs", "--n-steps": "--num-steps", "--n-epochs": "--update-epochs",
                 "--batch-size": "--num-minibatches (minibatches per epoch)", "--wandb-project-name": "--wandb-project",
                 "--track": "--wandb-project NAME", "--capture-video": "--eval RUN_DIR --render out.gif"}


def check_flag_words(argv: Sequence[str]) -> None:
    """Before tyro reads argv: a flag named as other PPO code names it, and a yes/no flag given a
    value (--norm-adv yes), each refused in one line that says what to write instead."""
    switches = {flag(f.name) for kind in (Config, HParams) for f in dataclasses.fields(kind) if isinstance(f.default, bool)}
    for i, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if name in FLAG_SYNONYMS:
            raise ConfigError(f"{name}: ppo_jax calls it {FLAG_SYNONYMS[name]} (python ppo_jax.py --help lists every flag)")
        positive = "--" + name[len("--no-"):] if name.startswith("--no-") else name
        following = value if equals else argv[i + 1] if i + 1 < len(argv) else ""
        if positive in switches and (equals or following and not following.startswith("-")):
            raise ConfigError(f"{name} takes no value ({following!r}): {positive} turns it on, "
                              f"--no-{positive[2:]} off")


def one_line_parse_error(text: str) -> str:
    """tyro's message (a titled box, or its plain-text form) -> its first paragraph and the first flag
    it suggests, on one line."""
    boxed = "╭" in text
    rows = [line.strip().strip("│").strip() for line in text.splitlines() if not line.strip().startswith(("╭", "╰"))]
    paragraphs, current = [], []
    for row in rows + ["-"]:
        if row and set(row) <= {"─", "-"}:  # a rule between paragraphs
            paragraphs.append(current)
            current = []
        elif row:
            current.append(row)
    paragraphs = [paragraph for paragraph in paragraphs if paragraph][0 if boxed else 1:]  # plain text: a title first
    if not paragraphs:
        return text.strip().splitlines()[0] if text.strip() else "the command line could not be parsed"
    suggestion = next((p[1].split()[0] for p in paragraphs if len(p) > 1 and p[0] == "Perhaps you meant:"), None)
    return (" ".join(paragraphs[0]).rstrip(".") + (f"; did you mean {suggestion}?" if suggestion else "")
            + " (python ppo_jax.py --help lists every flag)")


def explicit_fields(argv: Sequence[str]) -> set[str]:
    """The Config and HParams fields that flags in argv set explicitly."""
    names = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=")[0].replace("-", "_")
        if name.startswith("no_") and name[3:] in STATIC_FIELDS | HPARAM_FIELDS:
            name = name[3:]
        if name in STATIC_FIELDS | HPARAM_FIELDS:
            names.add(name)
    return names


def command_line_overrides(argv: Sequence[str], config: Config) -> dict[str, Any]:
    """The fields that flags set explicitly, with their parsed values (they win over sweep specs)."""
    return {name: getattr(config.hparams if name in HPARAM_FIELDS else config, name)
            for name in explicit_fields(argv) if name not in RUN_FIELDS}


def load_run_config(run_dir: str, flag_name: str) -> Config:
    """The Config in RUN_DIR/config.json (written when the run started)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{flag_name} {run_dir}: no such directory")
    try:
        with open(path) as f:
            fields = json.load(f)
        hparams = HParams(**fields.pop("hparams"))
        for field in dataclasses.fields(Config):  # JSON's lists back to the tuples of the fields that are tuples
            if isinstance(field.default, tuple) and field.name in fields:
                fields[field.name] = tuple(fields[field.name])
        for name in ("env_params", "sweep_set"):
            fields[name] = tuple(fields.get(name, ()))
        return Config(**fields, hparams=hparams)
    except FileNotFoundError:
        raise ConfigError(f"{flag_name} {run_dir}: {not_a_run(run_dir, flag_name)}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ConfigError(f"{flag_name} {run_dir}: config.json is not a ppo_jax config ({error})") from None


def not_a_run(path: str, flag_name: str) -> str:
    """Why `path` (a directory without config.json) is not a run directory, and which one to give."""
    parent = os.path.dirname(os.path.abspath(path))
    setting = re.fullmatch(r"setting-(\d+)", os.path.basename(os.path.abspath(path)))
    if setting and is_sweep_dir(parent):
        if flag_name == "--resume":
            return f"a static setting of the sweep in {parent}: resume the sweep, --resume {parent}"
        return (f"a static setting of the sweep in {parent}: evaluate one of its points, --eval {parent} --point "
                f"{setting.group(1)}:K (or --eval {os.path.join(path, 'point-K')})")
    with contextlib.suppress(OSError):
        runs = sorted(entry.path for entry in os.scandir(path) if entry.is_dir() and (
            os.path.isfile(os.path.join(entry.path, "config.json")) or is_sweep_dir(entry.path)))
        if runs:
            return (f"a folder of {len(runs)} runs or sweeps, not one: give one of them, e.g. {flag_name} {runs[-1]}")
    return "no config.json there: not a ppo_jax run directory (a run or a sweep's point-K directory)"


RESUME_FLAGS = {"resume", "table_rows", "compile_cache", "checkpoint_every", "quiet", "sweep_chunk", *DISTRIBUTED_FIELDS}


EVAL_FLAGS = {"eval", "episodes", "point", "deterministic", "render", "params_index", "seed", "compile_cache", "quiet"}


def check_flags(argv: Sequence[str], allowed: set[str], flag_name: str, run_dir: str) -> None:
    extra = sorted(explicit_fields(argv) - allowed)
    if extra:
        raise ConfigError(f"{flag_name} {run_dir} uses that run's own config.json: drop "
                          f"{' '.join(flag(name) for name in extra)} (it may take {' '.join(sorted(map(flag, allowed)))})")


def resume_config(cli: Config, argv: Sequence[str]) -> tuple[Config, Checkpoint | None]:
    """The run to continue: RUN_DIR's config.json with the run-only flags given now, and its checkpoint
    (None: it stopped before its first one, and starts again)."""
    check_flags(argv, RESUME_FLAGS, "--resume", cli.resume)
    sweep_dir = os.path.dirname(os.path.dirname(os.path.abspath(cli.resume)))
    if is_sweep_dir(sweep_dir):
        raise ConfigError(f"--resume {cli.resume}: a point of the sweep in {sweep_dir}: resume the sweep, "
                          f"--resume {sweep_dir}")
    config = load_run_config(cli.resume, "--resume")
    given = {name: getattr(cli, name) for name in explicit_fields(argv) & RESUME_FLAGS}
    config = dataclasses.replace(config, **given, run_dir=cli.resume)
    validate(config, check_run_dir=False)
    try:
        with open(os.path.join(cli.resume, "summary.json")) as f:
            status = json.load(f).get("status", "")
    except (OSError, ValueError):
        status = ""
    if status.startswith("diverged"):
        raise ConfigError(f"--resume {cli.resume}: that run {status}; it would diverge again from its last "
                          "checkpoint. Start a new run (e.g. a lower --lr, or --init-params RUN_DIR/params.msgpack)")
    # Stopped before its first checkpoint (nothing written but config.json): the run starts again there.
    fresh = not any(os.path.exists(os.path.join(cli.resume, name)) for name in (CHECKPOINT, "summary.json")) and \
        last_update_in_csv(os.path.join(cli.resume, "metrics.csv")) == 0
    checkpoint = None if fresh else load_checkpoint(cli.resume, config)
    if not os.access(cli.resume, os.W_OK):
        raise ConfigError(f"--resume {cli.resume}: the directory is not writable (a read-only file system?): "
                          "make it writable, or copy it to a writable disk and resume the copy")
    written = status == "complete" and os.path.exists(os.path.join(cli.resume, "params.msgpack"))
    if not fresh and checkpoint.updates_done >= config.num_updates and written:  # (else: it writes the outputs a fault cut off)
        raise ConfigError(f"--resume {cli.resume}: that run is complete ({checkpoint.updates_done}/"
                          f"{config.num_updates} updates): nothing to resume")
    return config, checkpoint


def resume_sweep(cli: Config, argv: Sequence[str]) -> tuple[Sweep, int]:
    """The sweep to continue: SWEEP_DIR/sweep.toml, resolved again, with the run-only flags given
    now, else the sweep's own (reload_sweep: --checkpoint-every, --sweep-chunk, --eval-every); refused
    if the file no longer gives the sweep that began (its fingerprint). -> (sweep, --sweep-chunk)"""
    check_flags(argv, RESUME_FLAGS, "--resume", cli.resume)
    path = os.path.join(cli.resume, SWEEP_SPEC)
    given = {name: getattr(cli, name) for name in explicit_fields(argv) & RESUME_FLAGS - {"resume"}}
    sweep = reload_sweep(cli.resume, given)
    with open(path) as f:
        text = f.read()
    recorded = re.search(r"^# fingerprint (\w+)", text, re.MULTILINE)
    named = set(tomllib.loads(text).get("static", [{}])[0])  # the fields of its day (sweep_fingerprint), and
    named |= {name for name, value in run_spec(sweep.configs[0]).items() if value is None}  # those TOML cannot hold
    if recorded is None or recorded.group(1) != sweep_fingerprint(sweep, named):
        raise ConfigError(f"--resume {cli.resume}: {path} has changed since the sweep began (its settings or points "
                          "differ from those it ran): restore it, or start a new sweep with --sweep")
    if not os.access(cli.resume, os.W_OK):
        raise ConfigError(f"--resume {cli.resume}: the directory is not writable (a read-only file system?): "
                          "make it writable, or copy it to a writable disk and resume the copy")
    try:
        with open(os.path.join(cli.resume, "results.csv")) as f:
            rows = len(f.read().splitlines()) - 1
    except OSError:
        rows = 0
    if rows == len(sweep.points) * sum(config.num_seeds for config in sweep.configs):  # written last (write_sweep_outputs)
        raise ConfigError(f"--resume {cli.resume}: that sweep is complete (results.csv has every point's rows): "
                          "nothing to resume")
    return sweep, sweep.configs[0].sweep_chunk


def reload_sweep(sweep_dir: str, given: dict[str, Any] | None = None) -> Sweep:
    """The sweep in SWEEP_DIR, its sweep.toml resolved again with its own SWEEP_RUN_FIELDS (as its
    points' config.json hold them), or those `given`."""
    own = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(point_dir(sweep_dir, 0, 0), "config.json")) as f:
            own = json.load(f)
    defaults = Config()
    fields = {name: (given or {}).get(name, own.get(name, getattr(defaults, name))) for name in SWEEP_RUN_FIELDS}
    return load_sweep(dataclasses.replace(defaults, sweep=os.path.join(sweep_dir, SWEEP_SPEC), **fields), {})


def find_point(sweep_dir: str, point: str, flag_name: str) -> str:
    """The run directory of the sweep's point `point`: K (results.csv's point column) or its label,
    S:K or S:label with several static settings."""
    sweep = reload_sweep(sweep_dir)
    settings, _, wanted = point.rpartition(":") if re.match(r"\d+:", point) else ("", "", point)
    if not settings and len(sweep.configs) > 1:
        raise ConfigError(f"{flag_name} {point}: {sweep_dir} has {len(sweep.configs)} static settings: give S:K, "
                          f"e.g. {flag_name} 2:{wanted} (setting 2's point {wanted})")
    i = int(settings or 1) - 1
    if not 0 <= i < len(sweep.configs):
        raise ConfigError(f"{flag_name} {point}: {sweep_dir} has static settings 1 to {len(sweep.configs)}")
    if wanted == "best" and sweep.pbt:  # each population's best agent (write_pbt_outputs)
        where = os.path.join(setting_dir(sweep_dir, i), "best")
        if not os.path.exists(os.path.join(where, "params.msgpack")):
            raise ConfigError(f"{flag_name} {point}: that setting has not finished (no {where}/params.msgpack): "
                              f"continue the sweep with --resume {sweep_dir}")
        return where
    if wanted == "best":  # the ranking's first: summary.csv lists each setting's points best first
        with contextlib.suppress(OSError):
            with open(os.path.join(sweep_dir, "summary.csv")) as f:
                ranked = [row["point"] for row in csv.DictReader(f) if row["static"] == setting_name(sweep, i)]
            wanted = ranked[0] if ranked else wanted
    p = int(wanted) if wanted.isdigit() else sweep.labels.index(wanted) if wanted in sweep.labels else None
    if p is None or not 0 <= p < len(sweep.points):
        raise ConfigError(f"{flag_name} {point}: {sweep_dir} has points 0 to {len(sweep.points) - 1}, labelled "
                          f"{', '.join(repr(label) for label in sweep.labels[:4])}{' ...' if len(sweep.points) > 4 else ''}")
    where = point_dir(sweep_dir, i, p)
    if not os.path.exists(os.path.join(where, "params.msgpack")):
        raise ConfigError(f"{flag_name} {point}: that point's setting has not finished (no {where}/params.msgpack): "
                          f"continue the sweep with --resume {sweep_dir}")
    return where


def run_eval(cli: Config, argv: Sequence[str]) -> np.ndarray:
    """--eval RUN_DIR: evaluate every seed of its params.msgpack; print and return returns [seeds, episodes]."""
    check_flags(argv, EVAL_FLAGS, "--eval", cli.eval)
    if os.path.isdir(cli.eval) and is_sweep_dir(cli.eval):
        if cli.point is None:
            raise ConfigError(f"--eval {cli.eval} is a sweep: choose its point with --point K (results.csv's point "
                              "column, or its label)")
        cli = dataclasses.replace(cli, eval=find_point(cli.eval, cli.point, "--point"))
    elif cli.point is not None and os.path.isdir(cli.eval):
        raise ConfigError(f"--point {cli.point}: {cli.eval} is a run, not a sweep (no {SWEEP_SPEC} there)")
    config = load_run_config(cli.eval, "--eval")
    validate(dataclasses.replace(config, init_params=None, ref_params=None), check_run_dir=False)
    if cli.episodes < 1:
        raise ConfigError(f"--episodes {cli.episodes}: must be a positive integer")
    if cli.render is not None:
        if config.env not in DRAWABLE_ENVS:
            raise ConfigError(f"--render: gymnax cannot draw {config.env}; it can draw {', '.join(DRAWABLE_ENVS)}")
        if not cli.render.endswith(".gif"):
            raise ConfigError(f"--render {cli.render}: give a path ending in .gif")
        if os.path.exists(cli.render):
            raise ConfigError(f"--render {cli.render} already exists: pick a new path (nothing is overwritten)")
        folder = os.path.dirname(os.path.abspath(cli.render))
        if not os.path.isdir(folder):
            raise ConfigError(f"--render {cli.render}: no directory {folder}: create it, or give a path in one")
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"--render {cli.render}: {folder} is not writable: give a path in a writable directory")
    env = make_env(config)
    network = make_network(config, env)
    policies = read_policies(config, env, network, os.path.join(cli.eval, "params.msgpack"), f"--eval {cli.eval}:")
    num_seeds = len(policies.obs_stats.count)
    if not cli.params_index < num_seeds:
        raise ConfigError(f"--params-index {cli.params_index}: {cli.eval} holds {num_seeds} seed(s)")
    mode = "deterministic (the policy's mode)" if cli.deterministic else "sampled actions"
    print(f"ppo_jax eval: {cli.eval} ({config.env}), {num_seeds} seed(s) x {cli.episodes} episodes, {mode}")
    returns = evaluate(config, policies, cli.episodes, cli.deterministic, cli.seed)
    for seed, row in enumerate(returns):
        unfinished = int(np.sum(np.isnan(row)))
        print(f"  seed {seed}: {np.nanmean(row):.2f} ± {np.nanstd(row):.2f}"
              + (f"  ({unfinished} episode(s) did not end within {env.episode_limit()} steps)" if unfinished else ""))
    print(f"return {np.nanmean(returns):.2f} ± {np.nanstd(returns):.2f} over {np.sum(~np.isnan(returns))} complete episodes")
    save_eval(cli, config, returns)
    if cli.render is not None:
        policy = jax.tree.map(lambda x: x[cli.params_index], policies)
        print(f"rendering seed {cli.params_index}'s episode to {cli.render} (gymnax draws each frame: seconds to "
              "minutes)", flush=True)
        length = render_episode(config, policy, cli.render, cli.deterministic, cli.seed, cli.quiet)
        print(f"rendered seed {cli.params_index}'s episode of {length} steps: {cli.render}")
    return returns


def save_eval(cli: Config, config: Config, returns: np.ndarray) -> None:
    """--eval's returns into RUN_DIR/eval-<timestamp>.json, a new file each time (NaN: null, an
    episode that did not end). One that cannot be written is a warning: the returns were printed."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(cli.eval, f"eval-{stamp}.json"), 2
    while os.path.exists(path):
        path, n = os.path.join(cli.eval, f"eval-{stamp}-{n}.json"), n + 1
    record = {"env": config.env, "episodes": cli.episodes, "deterministic": cli.deterministic, "seed": cli.seed,
              "mean": float(np.nanmean(returns)), "std": float(np.nanstd(returns)),
              "mean_per_seed": np.nanmean(returns, axis=1).tolist(), "returns": returns.tolist()}
    try:
        write_atomically(path, json_text(record).encode())
        print(f"saved: {path}")
    except WriteError as error:
        print(f"warning: {error} (the returns above are not saved)", file=sys.stderr)


def check_distributed(config: Config, argv: Sequence[str]) -> None:
    """Whether --distributed's runtime started (start_distributed), or one line on why not."""
    given = explicit_fields(argv) & set(DISTRIBUTED_FIELDS[1:])
    if not config.distributed:
        if given:
            raise ConfigError(f"{flag(sorted(given)[0])} only applies with --distributed")
        return
    if config.eval:
        raise ConfigError("--eval runs in one process: drop --distributed")
    if config.env.startswith(ENVPOOL_PREFIX):
        raise ConfigError(f"--distributed: {config.env} steps in a pool of this host's (EnvPool): run it in one "
                          "process, without --distributed")
    if DISTRIBUTED_FAILURE and str(DISTRIBUTED_FAILURE[0]).startswith("--coordinator-address"):
        raise ConfigError(str(DISTRIBUTED_FAILURE[0]))
    if DISTRIBUTED_FAILURE:
        error = str(DISTRIBUTED_FAILURE[0]).strip().splitlines() or [type(DISTRIBUTED_FAILURE[0]).__name__]
        raise ConfigError(f"--distributed: the runtime did not start ({error[0][:300]}): outside a detected cluster "
                          "(SLURM, Open MPI, Kubernetes, Cloud TPU) give --coordinator-address HOST:PORT "
                          "--num-processes N --process-id I")
    if not jax.distributed.is_initialized():
        raise ConfigError("--distributed: start it as `python ppo_jax.py --distributed ...` (the multi-process "
                          "runtime must start before JAX's backend), or call jax.distributed.initialize() "
                          "before importing ppo_jax")


def remedy(error: WriteError) -> str:
    return {errno.ENOSPC: "free space", errno.EDQUOT: "free space", errno.EROFS: "make it writable",
            errno.EACCES: "make it writable"}.get(error.errno, "fix that")


def way_back(run_dir: str, config: Config, error: WriteError) -> str:
    """After a failed write mid-run: what is intact, and how to go on."""
    if not os.path.isdir(run_dir):
        return f"{run_dir} is gone (moved or deleted?): nothing to resume; start the run again"
    try:
        done = load_checkpoint(run_dir, config).updates_done
    except ConfigError:
        return f"No checkpoint was saved yet: {remedy(error)}, then start the run again"
    return f"The checkpoint of update {done} is intact: {remedy(error)}, then python ppo_jax.py --resume {run_dir}"


def fail(error: ConfigError):
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None):
    """The CLI: a single run (returns its RunResult), a sweep with --sweep/--sweep-set (returns its
    list of SweepSetting), or --eval (returns the returns [seeds, episodes])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_config(argv)
    try:
        check_distributed(config, argv)
    except ConfigError as error:
        fail(error)
    return run_command(config, argv) if jax.process_count() == 1 else run_process(config, argv)


def run_process(config: Config, argv: list[str]):
    """--distributed: run_command in one of the processes. Process 0 reports as a single process
    does; the others print one line at the end. When another process is lost, this one ends at once
    with one line (the runtime would wait out its heartbeat timeout, then abort with a stack trace)."""
    me, ending = f"process {jax.process_index()} of {jax.process_count()}", "done"
    try:
        with contextlib.redirect_stdout(io.StringIO()) if jax.process_index() else contextlib.nullcontext():
            return run_command(config, argv)
    except SystemExit as error:
        ending = f"stopped (exit status {error.code})"
        raise
    except Exception as error:  # noqa: BLE001
        lost = any(sign in str(error) for sign in ("Gloo", "NCCL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "Connection"))
        if lost:
            print(f"error: {me}: another process stopped or cannot be reached ({str(error).strip().splitlines()[0]}). "
                  "Start the run again; --resume RUN_DIR continues from its last checkpoint", file=sys.stderr)
        else:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if jax.process_index():
            print(f"{me}: {ending} ({jax.local_device_count()} of the {jax.device_count()} "
                  f"{jax.devices()[0].platform} devices; process 0 writes the outputs)", flush=True)


PENALTY_COLLAPSED = ("kl_coef collapsed (below 1e-6): the KL per update stayed far below --kl-target, so the "
                     "penalty is inactive (a larger --lr?)")


def penalty_collapsed(kl_target, metrics: dict[str, np.ndarray]) -> np.ndarray:
    """[agents] bool: PPO-Penalty's adaptive beta ended below 1e-6, a switch on that did nothing (a beta that
    started at 0: no penalty, as --algo vpg's target is its step size's)."""
    return (np.asarray(kl_target) > 0) & (metrics["kl_coef"][:, 0] > 0) & (metrics["kl_coef"][:, -1] < 1e-6)


def check_trackers(config: Config, argv: Sequence[str]) -> None:
    """--tensorboard and --wandb-project: their library installed; the W&B flags only with a project."""
    if config.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(TENSORBOARD_MISSING)
    orphans = sorted({"wandb_entity", "wandb_group", "exp_name"} & explicit_fields(argv))
    if orphans and not config.wandb_project:
        raise ConfigError(f"{flag(orphans[0])} only applies with --wandb-project NAME")
    if config.wandb_project is not None and not config.wandb_project.strip():
        raise ConfigError("--wandb-project: give the W&B project's name")
    if config.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING)


def run_command(config: Config, argv: list[str]):
    """main() once the command line is parsed (and, with --distributed, the processes have met)."""
    if config.compile_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.compile_cache))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX reads it itself when set
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    start, sweep, writer, run_dir = None, None, jax.process_index() == 0, None  # process 0 alone writes the run directory
    try:
        eval_only = {"episodes", "point", "deterministic", "render"} & explicit_fields(argv)
        if eval_only and not config.eval:
            raise ConfigError(f"{flag(sorted(eval_only)[0])} only applies with --eval RUN_DIR")
        for name in ("rank_by", "pbt_interval"):
            if name in explicit_fields(argv) and not (config.sweep or config.sweep_set):
                raise ConfigError(f"{flag(name)} only applies to a sweep (--sweep or --sweep-set)")
        if config.eval and config.resume:
            raise ConfigError("--eval and --resume: give one of them")
        if config.eval:
            return run_eval(config, argv)
        check_trackers(config, argv)
        if config.resume and os.path.isdir(config.resume) and is_sweep_dir(config.resume):
            sweep, chunk = resume_sweep(config, argv)
            config = dataclasses.replace(config, sweep_chunk=chunk)
            run_dir = config.resume if writer else None
        elif config.resume:
            config, start = resume_config(config, argv)
            run_dir = config.resume if writer else None
            if start is None:
                print(f"{config.resume} has no checkpoint yet (stopped before its first chunk ended): the run "
                      "starts again there")
        elif config.sweep or config.sweep_set:
            sweep = load_sweep(config, command_line_overrides(argv, config))
            if "rank_by" in explicit_fields(argv):
                check_rank_by(config.rank_by, sweep.configs[0], "--rank-by")
                sweep.rank_by = config.rank_by
            if writer:
                check_run_dir_is_new(config.run_dir)
                run_dir = new_run_dir(config.run_dir, f"sweep-{sweep.name}", "sweep.toml",
                                      lambda _: resolved_sweep_toml(sweep, config.sweep or "--sweep-set"))
        else:
            validate(config, check_run_dir=writer)
            if writer:
                run_dir = new_run_dir(config.run_dir, config.env, "config.json",
                                      lambda path: config_json(dataclasses.replace(config, run_dir=path)))
                config = dataclasses.replace(config, run_dir=run_dir)
        refused = None
    except ConfigError as error:
        refused = error
    if jax.process_count() > 1 and largest_in_any_process(refused is not None) and not refused:  # all or none go on
        refused = ConfigError("another process refused the command line (its error line says why)")
    if refused:
        fail(refused)
    if config.resume and writer:
        for folder, _, names in os.walk(run_dir):  # left by a kill between a write and its rename
            for name in names:
                if TEMPORARY_FILE.fullmatch(name):
                    with contextlib.suppress(OSError):  # (a read-only directory fails at its first write)
                        os.remove(os.path.join(folder, name))

    if sweep is not None:
        agents = len(sweep.points) * sum(c.num_seeds for c in sweep.configs)
        groups = [(c, len(sweep.points) * c.num_seeds) for c in sweep.configs]  # run_batch's, per static setting
        layouts = [batch_devices(c, agents_at_once(group, config.sweep_chunk)) for c, group in groups]
        print(f"ppo_jax sweep {sweep.name!r}: {len(sweep.configs)} static setting(s) x {len(sweep.points)} point(s) "
              f"x seeds = {agents} agents, sharded over {max(len(d) for d, _ in layouts)} "
              f"{jax.devices()[0].platform} device(s)"
              + (", an agent's envs over several" if max(shards for _, shards in layouts) > 1 else "")
              + (", resumed" if config.resume else ""))
        try:
            settings, status = run_sweep(sweep, run_dir, config.sweep_chunk, config.quiet, config,
                                         config.resume)
        except KeyboardInterrupt:  # a second Ctrl-C: the chunk under way is lost, the checkpoint before it stays
            exit_at_once(f"\nstopped at once. Continue from the last checkpoint with:\n  python ppo_jax.py --resume "
                         f"{run_dir}" if writer else f"\nprocess {jax.process_index()}: stopped at once")
        except WriteError as error:
            print(f"error: {error}. {run_dir}/ holds the chunks written before it: {remedy(error)}, then continue "
                  f"with python ppo_jax.py --resume {run_dir}", file=sys.stderr)
            raise SystemExit(1)
        print(f"outputs: {run_dir}/")
        if status.startswith("interrupted"):
            if writer:
                print(f"{status}. Continue with:\n  python ppo_jax.py --resume {run_dir}", file=sys.stderr)
            raise SystemExit(128 + int(signal.Signals[status.split()[2]]))
        return settings

    if config.lm_stage != "none":
        return lm_stage_command(config)
    devices, shards = batch_devices(config, agents_at_once(config.num_seeds, config.sweep_chunk))
    print(f"ppo_jax: {config.env}, {config.num_seeds} seed(s) x {config.num_updates} updates x "
          f"{config.batch_size} steps ({config.num_envs} envs x {config.num_steps}) on {len(devices)} "
          f"{devices[0].platform} device(s)" + (f", each seed's envs over {shards}" if shards > 1 else "")
          + (f", resumed at update {start.updates_done}" if start else ""))
    try:
        result, status = train_run(config, run_dir, start)
    except KeyboardInterrupt:  # a second Ctrl-C: the chunk under way is lost, the checkpoint before it stays
        if not writer:
            exit_at_once(f"\nprocess {jax.process_index()}: stopped at once")
        if os.path.exists(os.path.join(run_dir, CHECKPOINT)):
            exit_at_once(f"\nstopped at once. Continue from the last checkpoint with:\n"
                         f"  python ppo_jax.py --resume {run_dir}")
        exit_at_once(f"\nstopped at once, before the first checkpoint: nothing to resume in {run_dir}")
    except WriteError as error:
        print(f"error: {error}. {way_back(run_dir, config, error)}", file=sys.stderr)
        raise SystemExit(1)
    if config.table_rows:
        print(format_table(result.metrics, config.table_rows))
    finals = final_return(result.metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no episode ended yet
        shown = lambda x: "none" if np.isnan(x) else f"{x:.1f}" if not abs(x) < 10 else f"{x:.3g}"  # noqa: E731  (MiniGrid's returns: < 1)
        print(f"final return (last 10% of updates): {shown(np.nanmean(finals))}"
              + (f"  per seed: {' '.join(shown(x) for x in finals)}" if len(finals) > 1 else ""))
    if np.isnan(finals).any():
        print(f"  ({no_final_return(finals)})")
    if writer and penalty_collapsed(config.hparams.kl_target, result.metrics).any():
        print(f"warning: {PENALTY_COLLAPSED}", file=sys.stderr)
    print(f"compile {result.lower_seconds + result.compile_seconds:.1f} s (lower {result.lower_seconds:.1f} + "
          f"compile {result.compile_seconds:.1f}), run {result.run_seconds:.1f} s, "
          f"{result.steps_per_second:,.0f} env steps/s")
    print(f"outputs: {run_dir}/")
    if status.startswith("diverged"):
        if writer:
            print(f"error: the run {status} (non-finite). Kept: the checkpoint of the last finite chunk; "
                  "params.msgpack holds that chunk's policy, if any. Try a lower --lr or --max-grad-norm.", file=sys.stderr)
        raise SystemExit(1)
    if status.startswith("interrupted"):
        if writer:
            print(f"{status} at update {result.metrics['env_steps'].shape[1]}/{config.num_updates}. Continue with:\n"
                  f"  python ppo_jax.py --resume {run_dir}", file=sys.stderr)
        raise SystemExit(128 + int(signal.Signals[status.split()[-1]]))
    return result


# ================================================================================================
# 10. Speed and devices: how the core's plain names run fast on a CPU and across devices. Each
#    device says why it is here; what it measured is in docs/speed.md.
# ================================================================================================


def orthogonal(scale: float):
    """Orthogonal init (Saxe et al., 2014), as flax's `orthogonal` but without LAPACK: the Q of a
    Gaussian matrix's QR (diagonal of R positive) by Gram-Schmidt, each column projected twice. Why:
    vmapped over stacked agents, flax's batched LAPACK QR deadlocked XLA's 2-thread CPU pool here
    (both threads waiting on sub-tasks queued behind them), now and then, in long sweeps."""

    def init(key, shape, dtype=jnp.float32):
        rows, cols = math.prod(shape[:-1]), shape[-1]
        tall = (rows, cols) if rows >= cols else (cols, rows)
        columns = jax.random.normal(key, tall, dtype)

        def orthonormalise(j, q):
            earlier = (jnp.arange(tall[1]) < j).astype(dtype)  # columns already orthonormal
            v = q[:, j]
            v = v - q @ (earlier * (q.T @ v))
            v = v - q @ (earlier * (q.T @ v))  # twice: orthogonal to float precision
            return q.at[:, j].set(v / jnp.linalg.norm(v))

        q = jax.lax.fori_loop(0, tall[1], orthonormalise, columns)
        return scale * (q if rows >= cols else q.T).reshape(shape)

    return init


def dense(features: int, kernel_init, name: str) -> nn.Module:
    """The networks' linear layer: flax's nn.Dense in all but speed (on CPU its kernel gradient by
    kernel_grad, chunked; on accelerators JAX's own)."""
    return Dense(features, kernel_init, grad_chunk_rows(), name=name)


class Dense(nn.Module):
    """flax's nn.Dense (same parameters, names and initialisation: kernel [D, F], zero bias) through
    `affine`, for its kernel gradient by kernel_grad; with grad_chunk 0, nn.Dense's matmul and gradient.

    Written for compile time: applied, it reads its parameters with get_variable, not param(), which
    at every apply traces the initializer (jax.eval_shape) to check the stored shape, and the update
    program applies the network five times. Parameters come from init, or from a file that
    read_policies / load_checkpoint check against this network."""

    features: int
    kernel_init: Any
    grad_chunk: int = 0

    @nn.compact
    def __call__(self, x):
        if self.is_initializing():
            kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
            bias = self.param("bias", nn.initializers.zeros, (self.features,))
        else:  # compile time: flax's param() would trace the initializer again, to check the shape
            kernel, bias = self.get_variable("params", "kernel"), self.get_variable("params", "bias")
        if not self.grad_chunk:  # JAX's own gradient of the matmul, as nn.Dense's (accelerators)
            return x @ kernel + bias
        return affine(x, kernel, bias, self.grad_chunk)


def kernel_grad(x, g, chunk: int):
    """x^T g for x [n, D], g [n, F]: a dense layer's kernel gradient, a sum over the n rows.

    Written for speed, on CPU (Dense calls it with chunk > 0): XLA's dot for x^T g, contracting over
    the rows into a small kernel, runs at a fraction of the forward's FLOP/s there. For layers with
    at least 64 inputs:
    - a small kernel (at most 128 x 128) over at least 8 chunks of `chunk` rows: one batched dot
      over the chunks, then a sum of the chunks' kernels;
    - otherwise a narrow output (F <= D / 2: the heads, MinAtar's 1600 x 128) as g^T x, [F, D],
      then transposed. The optimization barriers keep XLA from folding the transposes back into
      the dot's layout, which undoes the gain.
    Narrow inputs (CartPole's 4, the conv's 9C) and the rest stay one dot (no faster otherwise)."""
    (n, inputs), outputs = x.shape, g.shape[1]
    if inputs < 64:
        return x.T @ g
    if n % chunk == 0 and n >= 8 * chunk and inputs * outputs <= 128 * 128:
        split = lambda a: a.reshape(n // chunk, chunk, a.shape[1])  # noqa: E731
        return jnp.einsum("cri,crj->cij", split(x), split(g)).sum(0)
    if 2 * outputs <= inputs:
        barrier = jax.lax.optimization_barrier
        return barrier(barrier(g.T) @ x).T
    return x.T @ g


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def affine(x, kernel, bias, grad_chunk: int):
    """x [..., D] @ kernel [D, F] + bias [F], its kernel gradient by kernel_grad (with grad_chunk)."""
    return x @ kernel + bias


def _affine_forward(x, kernel, bias, grad_chunk):
    return x @ kernel + bias, (x, kernel)


def _affine_backward(grad_chunk, residuals, g):
    x, kernel = residuals
    rows, cols = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return g @ kernel.T, kernel_grad(rows, cols, grad_chunk), cols.sum(0)


affine.defvjp(_affine_forward, _affine_backward)


def over_slices(fn, batch, slices: int, mean: bool = False):
    """fn(batch) computed on `slices` equal consecutive slices of a flat batch (a pytree of [B, ...]
    arrays), its outputs concatenated; with mean=True, for an fn whose outputs are means over the
    samples (a loss, its gradient, diagnostics), averaged instead.

    Written for speed, on CPU: on a big minibatch the network's activations are larger than a core's
    cache, and one op on them uses the cores poorly. Each slice's computation is its own piece of
    the program (a Python loop: unrolled), cache-sized, and independent of the others, so XLA runs
    them side by side on the cores."""
    if slices == 1:
        return fn(batch)
    size = jax.tree.leaves(batch)[0].shape[0] // slices
    fn = jax.jit(fn)  # traced once for every slice (compile time)
    parts = [fn(jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch)) for i in range(slices)]
    if mean:
        return jax.tree.map(lambda *values: sum(values) / slices, *parts)
    return jax.tree.map(lambda *values: jnp.concatenate(values), *parts)


def minibatch_orders(key, epochs: int, n: int):
    """(the next key, [epochs, n] int32): each epoch's random order of the n samples (or env sequences)."""
    key, order_key = jax.random.split(key)
    return key, random_orders(jax.random.bits(order_key, order_bits_shape(epochs, n), jnp.uint32), epochs)


def random_orders(bits, rows: int):
    """[rows, n] int32, each row a uniformly random permutation of range(n), by sorting random keys,
    the rows independent; bits: uint32 random bits of order_bits_shape(rows, n).

    Written for speed: on CPU, XLA sorts one uint32 array several times faster than it argsorts
    (key, index) pairs, so each key carries its index in its low bits, and one sort of the keys
    gives the order. That leaves 32 - log2(n) random bits per key, so ceil(32 / random bits) such
    sorts are composed: two elements keep their original order only if their keys tie in every
    round, which leaves fewer such pairs (~n^2 / 2^33) than one argsort of 32-bit keys does. The
    rounds after the first shuffle positions, not elements, so the rows share them: given the shared
    rounds, the rows are independent first rounds, each composed with the same fixed permutation,
    which keeps them uniform and independent."""
    n = bits.shape[-1]
    low = jnp.uint32((1 << index_bits(n)) - 1)
    keys = (bits & ~low) | jnp.arange(n, dtype=jnp.uint32)
    positions = (jnp.sort(keys, axis=-1) & low).astype(jnp.int32)  # [rows + rounds - 1, n]
    order = positions[:rows]  # the first round: one per row
    for position in positions[rows:]:  # each later round shuffles the positions of every row alike
        order = jnp.take(order, position, axis=-1)
    return order


def index_bits(n: int) -> int:
    """The low bits of random_orders' sort keys that hold an index in range(n) (n <= 2^31: int32 indices)."""
    return max(1, (n - 1).bit_length())


def order_bits_shape(rows: int, n: int) -> tuple[int, int]:
    """The shape of the uint32 random bits that random_orders takes for `rows` permutations of range(n):
    one row per sort round, ceil(32 / random bits per key) rounds for the first row, one more per row."""
    return rows + -(-32 // (32 - index_bits(n))) - 1, n


# An agent's envs sharded over `shards` devices (run_batch, --env-devices): each device runs the
# same program on its own envs inside a shard_map over ENV_AXIS, and these two combine the devices'
# parts. Unsharded (shards 1) both are the identity.
@dataclasses.dataclass(frozen=True)
class Parts:
    """How the update's passes over a batch are computed (static): each minibatch and pass in
    `slices` consecutive slices (over_slices, --slices), on each of the `shards` devices an agent's
    envs are sharded over (over_shards, --env-devices). Parts() is the whole batch on one device."""

    slices: int = 1
    shards: int = 1

    @classmethod
    def of(cls, config: Config, env: VecEnv) -> Parts:
        return cls(slices_per_pass(config, env.shards), env.shards)

    def mean(self, fn, batch):
        """fn(batch) for an fn whose outputs are means over the samples (a loss, its gradient,
        diagnostics): the mean of its slices' and devices' parts (rule 2)."""
        return self.device_mean(over_slices(fn, batch, self.slices, mean=True))

    def map(self, fn, batch):
        """fn(batch) for an fn of each sample alone: this device's samples, slice by slice."""
        return over_slices(fn, batch, self.slices)

    def device_mean(self, tree):  # rule 3: of values each device computed on its part of the batch
        return over_shards(jax.lax.pmean, tree, self.shards)

    def device_sum(self, tree):
        return over_shards(jax.lax.psum, tree, self.shards)

    def all_envs(self, batch: Batch) -> Batch:
        """A time-major batch of this device's envs -> of every device's, in env order (the whole agent's)."""
        if self.shards == 1:
            return batch
        hidden = gather_envs(batch.hidden, self.shards, axis=0)  # [N, H]: the env axis comes first
        return gather_envs(batch.replace(hidden=None), self.shards).replace(hidden=hidden)

    def own_rows(self, permutation, num_minibatches: int):
        """Of a shuffled epoch's rows, those of each minibatch that this device steps on: its part."""
        if self.shards == 1:
            return permutation
        return permutation.reshape(num_minibatches, self.shards, -1)[:, jax.lax.axis_index(ENV_AXIS)].reshape(-1)


def gather_envs(tree, shards: int, axis: int = 1):
    """Every device's part of `tree` along `axis` (its env axis), in env order: the whole agent's."""
    if shards == 1:
        return tree
    return jax.tree.map(lambda x: jax.lax.all_gather(x, ENV_AXIS, axis=axis, tiled=True), tree)


def over_shards(collective, tree, shards: int):
    """`collective` (jax.lax.pmean or psum) of a pytree of float32 values over the devices.
    Speed: the tree is raveled into one vector, so that a gradient step waits on one all-reduce, not
    one per leaf (a collective between devices costs the same whatever it moves)."""
    if shards == 1:
        return tree
    flat, unravel = ravel_pytree(tree)
    return unravel(collective(flat, ENV_AXIS))


# On a CPU without AVX-512, a minibatch of at least this many samples runs its dots as XLA's own
# (Eigen) dots instead of YNNPACK fusions (xla_options): faster on big minibatches there, slower on
# small ones, and slower at every size on a CPU with AVX-512 (docs/speed.md).
EIGEN_DOTS_FROM_MINIBATCH = 4096


SLICE_SAMPLES = 2048  # --slices auto: a minibatch slice's activations (64 wide: 512 KB) stay in a core's cache


MAX_SLICES = 8  # and at most this many (compile time grows with each; more ran no faster)


GRAD_CHUNK_ROWS = 128  # a small Dense kernel's gradient as a sum over chunks of this many rows (kernel_grad)


# The platforms our programs are being built for when not this machine's (lowering_for): none, or
# e.g. ("cuda", "tpu").
LOWERING_FOR: tuple[str, ...] = ()


def on_cpu() -> bool:
    """Whether the programs being built are for a CPU: every branch on the platform asks this (the
    chunk program's donation, --slices auto, dense()'s gradient, the XLA options)."""
    return not LOWERING_FOR and jax.default_backend() == "cpu"


@contextlib.contextmanager
def lowering_for(*platforms: str):
    """Inside the block, programs are built for `platforms` (JAX's names: "cuda", "rocm", "tpu")
    whatever this machine has: on_cpu() is False, and lower_batch lowers for them. To check on a
    CPU that what users run on accelerators lowers there (the tests do)."""
    global LOWERING_FOR
    before, LOWERING_FOR = LOWERING_FOR, tuple(platforms)
    try:
        yield
    finally:
        LOWERING_FOR = before


def lower(program, *args):
    """A jitted program traced at `args` (arrays, or jax.ShapeDtypeStruct) and lowered for this
    machine, or for lowering_for's platforms -> jax.stages.Lowered (.compile() it, or .as_text())."""
    return program.trace(*args).lower(lowering_platforms=LOWERING_FOR or None)


def slices_per_pass(config: Config, shards: int = 1) -> int:
    """--slices, with 0 (auto) resolved: on CPU, for feedforward networks, the most slices of at
    least SLICE_SAMPLES samples of a minibatch (with sharded envs, of each device's part of it), up
    to MAX_SLICES, that divide it."""
    if config.slices or config.is_recurrent or not on_cpu():
        return config.slices or 1
    samples = config.minibatch_size // shards
    most = max(1, min(MAX_SLICES, samples // SLICE_SAMPLES))
    return max([n for n in range(1, most + 1) if samples % n == 0])


def grad_chunk_rows() -> int:
    """dense()'s grad_chunk: GRAD_CHUNK_ROWS on CPU; 0 (JAX's own gradient) on accelerators."""
    return GRAD_CHUNK_ROWS if on_cpu() else 0


@functools.cache
def cpu_has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512 (Linux's /proc/cpuinfo; True where unknown, which keeps
    XLA's defaults)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return True


def xla_options(config: Config | None = None) -> dict[str, Any] | None:
    """Options for compiling our programs (config: the run's, for the minibatch size). On CPU:
    - XLA's generated loops go through LLVM at optimisation level 1 instead of 3 (compile time):
      they run as fast, as their heavy ops, the dots, are library calls that the level does not touch.
    - Without AVX-512, from EIGEN_DOTS_FROM_MINIBATCH samples per minibatch, no YNNPACK fusions
      (speed; with AVX-512 YNNPACK is faster at every size, and stays on).
    - With $PPO_JAX_QUICK_COMPILE=1, the init's options instead (quick_compile).
    Accelerators keep XLA's defaults. Figures: docs/speed.md."""
    if not on_cpu():
        return None
    if quick_compile():
        return init_xla_options()
    options = {"xla_backend_optimization_level": 1}
    if config is not None and config.minibatch_size >= EIGEN_DOTS_FROM_MINIBATCH and not cpu_has_avx512():
        options["xla_cpu_experimental_ynn_fusion_type"] = ""  # the empty set of fusion types
    return options


def quick_compile() -> bool:
    """$PPO_JAX_QUICK_COMPILE=1 (on CPU): every program compiled as the init is (init_xla_options), in
    about half the time, to run slower loops: for short runs, where the compile is most of the time
    (the test suite sets it). Floats can differ in the last bits from an optimised compile's (and a
    run's in chunks from the same run in one program), so compare runs bit for bit only under one
    setting (--resume, under the setting the run started with, stays bit-identical)."""
    return os.environ.get("PPO_JAX_QUICK_COMPILE", "") not in ("", "0")


def init_xla_options() -> dict[str, Any] | None:
    """Options for compiling the init program, which runs once, so that only its compile time counts.
    On CPU: LLVM at optimisation level 0, and XLA's older loop emitters, which compile faster than its
    fusion emitters and make slower loops (see xla_options). Unoptimised code forms no fused multiply-adds, so the init's floats can differ in the last bits
    from those of an optimised compile: of make_train jitted as one program, say."""
    if not on_cpu():
        return None
    return {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside the block (compile time: tracing a program
    allocates many short-lived objects, and the collector's passes over them are wasted). What the
    block leaves is collected as usual afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


if __name__ == "__main__":
    main()
