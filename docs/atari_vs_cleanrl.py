"""docs/results.md's Atari comparison: ppo_jax's runs (their metrics.csv) beside CleanRL's
ppo_atari_envpool_xla_jax_scan curves as read off its published figure (docs/cleanrl_atari_readoff.csv).

    python docs/atari_vs_cleanrl.py runs/atari_pong runs/atari_breakout   # -> docs/atari_vs_cleanrl.png, a table
    python docs/atari_vs_cleanrl.py --read-off compare.png > docs/cleanrl_atari_readoff.csv

Each run's curve: the game scores of the training episodes that ended in the trailing 100k env steps
(their mean, each episode once), at every update. The table: that mean at each 250k steps reached.

The read-off: CleanRL's docs/rl-algorithms/ppo/ppo_atari_envpool_xla_jax_scan/compare.png (vwxyzjn/cleanrl,
added in 2dd73af; x: global_step, env steps 0-10M; y: charts/episodic_return, the mean of 3 seeds as
plotted). Per 50k steps, the median row of its blue line's pixels within 2 pixel columns (~34k steps
each); where the lines drawn after it cover it, the span of all the lines' pixels there, its midpoint
as the reading. low and high: the pixels' span, in returns."""
import csv
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW = 100_000  # env steps


COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]  # the scan's line (blue), then the others
TOP, BOTTOM = 116, 305  # the axes' rows
# game: (column of 0M, column of 10M, (row, return), (row, return)): the figure's grid lines
PANELS = {"Pong": (874, 1165, (285, -20), (170, 10)), "Breakout": (481, 772, (296, 0), (131, 500)),
          "BeamRider": (88, 379, (179, 3000), (137, 4000))}


def read_off(png):
    """Prints the read-off CSV (game, env_steps, return, low, high, read_from) of CleanRL's figure."""
    rgb = (plt.imread(png)[..., :3] * 255).round().astype(int)
    masks = [np.abs(rgb - np.array(c)).sum(-1) < 40 for c in COLOURS]
    print("game,env_steps,return,low,high,read_from")
    for game, (x0, x10, (r0, v0), (r1, v1)) in PANELS.items():
        value = lambda row: v0 + (row - r0) * (v1 - v0) / (r1 - r0)  # noqa: E731
        for step in np.arange(0.05e6, 10e6 + 1, 0.05e6):
            x = int(round(x0 + step / 1e7 * (x10 - x0)))
            window = slice(max(x - 2, x0 + 1), min(x + 3, x10))
            rows = np.nonzero(masks[0][TOP:BOTTOM, window])[0] + TOP
            source = "blue"
            if not len(rows):
                rows = np.nonzero(np.any([m[TOP:BOTTOM, window] for m in masks[1:]], axis=0))[0] + TOP
                source = "covered"
            if not len(rows):
                continue
            reading = value(np.median(rows) if source == "blue" else (rows.min() + rows.max()) / 2)
            low, high = sorted((value(rows.max()), value(rows.min())))
            print(f"{game},{int(step)},{reading:.1f},{low:.1f},{high:.1f},{source}")


def trailing_mean(run_dir):
    """-> (env_steps [U], the trailing window's mean game score [U]) of one seed's metrics.csv."""
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r["seed"] == "0"]
    steps = np.array([float(r["env_steps"]) for r in rows])
    episodes = np.array([float(r["episodes"]) for r in rows])
    returns = np.nan_to_num(np.array([float(r["episode_return"]) for r in rows])) * episodes  # sums per update
    total, count = np.cumsum(returns), np.cumsum(episodes)
    start = np.searchsorted(steps, steps - WINDOW, side="right") - 1  # the last update before the window
    before = lambda c: np.where(start >= 0, c[np.maximum(start, 0)], 0.0)  # noqa: E731
    n = count - before(count)
    return steps, np.where(n > 0, (total - before(total)) / np.maximum(n, 1), np.nan)


def main(run_dirs, out=os.path.join(HERE, "atari_vs_cleanrl.png")):
    with open(os.path.join(HERE, "cleanrl_atari_readoff.csv")) as f:
        readoff = list(csv.DictReader(f))
    fig, axes = plt.subplots(1, len(run_dirs), figsize=(5 * len(run_dirs), 3.6), squeeze=False)
    print("| game | env steps (frames) | ppo_jax | CleanRL (read off its figure) |\n|---|---|---|---|")
    for ax, run_dir in zip(axes[0], run_dirs):
        with open(os.path.join(run_dir, "config.json")) as f:
            game = json.load(f)["env"].split(":")[1].split("-")[0]
        steps, score = trailing_mean(run_dir)
        theirs = [r for r in readoff if r["game"] == game and float(r["env_steps"]) <= steps[-1] + 1]
        x = np.array([float(r["env_steps"]) for r in theirs])
        ax.fill_between(x, [float(r["low"]) for r in theirs], [float(r["high"]) for r in theirs], color="C1", alpha=0.2)
        ax.plot(x, [float(r["return"]) for r in theirs], color="C1", label="CleanRL, 3 seeds (read off its figure)")
        ax.plot(steps, score, color="C0", label="ppo_jax, seed 0 (trailing 100k steps)")
        ax.set(title=f"{game}-v5", xlabel="env steps (x4 frames)", ylabel="game score")
        ax.grid(alpha=0.3)
        for mark in np.arange(250_000, steps[-1] + 1, 250_000):
            ours = score[np.searchsorted(steps, mark)]
            near = [r for r in theirs if abs(float(r["env_steps"]) - mark) < 1]
            cleanrl = f"{float(near[0]['return']):.1f} [{float(near[0]['low']):.1f}, {float(near[0]['high']):.1f}]" if near else "—"
            print(f"| {game} | {mark / 1e6:.2f}M ({mark * 4 / 1e6:.0f}M) | {ours:.1f} | {cleanrl} |")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    read_off(sys.argv[2]) if sys.argv[1:2] == ["--read-off"] else main(sys.argv[1:])
