"""Benchmarks for ppo_jax: figures to report, never asserted (shared machines are noisy).

    python bench.py            # every benchmark, a few minutes on 2 CPU cores
    python bench.py --quick    # shorter runs, about a minute

Prints a table per benchmark and writes bench.json (the figures, the machine, the versions).

Stacked agents: N CartPole-v1 agents (the classic config, different seeds) as one vmapped program,
against the same N agents run one after another, each compiled on its own (what a plain loop over
`python ppo_jax.py` costs) or sharing one compiled program (a Python loop over seeds).
"""

import argparse
import dataclasses
import json
import os
import platform
import time

import jax
import numpy as np

import ppo_jax as P


def stacked_agents(agent_counts, steps_per_agent):
    """Agent-steps/s of N stacked agents in one program vs N sequential runs."""
    config = dataclasses.replace(P.default_config("CartPole-v1"), total_timesteps=steps_per_agent, table_rows=0)
    rows = []
    single = None
    for count in agent_counts:
        config_n = dataclasses.replace(config, num_seeds=count)
        result = P.run(config_n)
        compile_seconds = result.lower_seconds + result.compile_seconds
        steps = config_n.num_updates * config_n.batch_size * count
        if single is None:  # count == 1 first: the sequential baseline
            single = (compile_seconds, result.run_seconds)
        rows.append({
            "agents": count,
            "compile_s": round(compile_seconds, 2),
            "run_s": round(result.run_seconds, 2),
            "agent_steps_per_s": round(steps / result.run_seconds),
            "stacked_total_s": round(compile_seconds + result.run_seconds, 2),
            "sequential_recompiling_s": round(count * sum(single), 2),
            "sequential_one_compile_s": round(single[0] + count * single[1], 2),
        })
        rows[-1]["speedup_vs_recompiling"] = round(rows[-1]["sequential_recompiling_s"] / rows[-1]["stacked_total_s"], 1)
        rows[-1]["speedup_vs_one_compile"] = round(rows[-1]["sequential_one_compile_s"] / rows[-1]["stacked_total_s"], 1)
        print_row(rows[-1], first=len(rows) == 1)
    return {"config": "CartPole-v1 classic (4 envs x 128 steps, 4 epochs x 4 minibatches, 64-64 tanh)",
            "steps_per_agent": config.num_updates * config.batch_size, "rows": rows}


def print_row(row, first):
    if first:
        print("  ".join(f"{k:>24}" if i else f"{k:>8}" for i, k in enumerate(row)))
    print("  ".join(f"{v:>24}" if i else f"{v:>8}" for i, v in enumerate(row.values())), flush=True)


def machine():
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
    parser.add_argument("--quick", action="store_true", help="shorter runs (about a minute)")
    parser.add_argument("--out", default="bench.json", help="where to write the figures (default: bench.json)")
    args = parser.parse_args()
    results = {"machine": machine()}
    print(f"machine: {results['machine']}")
    print("\nstacked agents (CartPole-v1 classic config): one program vs one after another")
    if args.quick:
        results["stacked_agents"] = stacked_agents([1, 8, 64], 16_384)
    else:
        results["stacked_agents"] = stacked_agents([1, 8, 64, 256], 102_400)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
