"""docs/results.md's Atari comparison: ppo_jax's runs (their metrics.csv) beside CleanRL's
ppo_atari_envpool_xla_jax_scan curves as read off its published figure (docs/cleanrl_atari_readoff.csv).

    python docs/atari_vs_cleanrl.py runs/atari_pong runs/atari_breakout runs/atari_beamrider   # -> the png, a table
    python docs/atari_vs_cleanrl.py --read-off compare.png > docs/cleanrl_atari_readoff.csv

Each run's curve: the game scores of the training episodes that ended in the trailing 100k env steps
(their mean, each episode once), at every update. The table: that mean at each 250k steps reached, and at
the run's last update.

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


def num(x):
    """A score as docs/results.md prints it: one decimal, a true minus sign."""
    return f"{float(x):.1f}".replace("-", "\u2212")


def reading(rows):
    """CleanRL's reading of a read-off row (at most one) as 'return [low, high]'; '—' where none."""
    return "".join(f"{num(r['return'])} [{num(r['low'])}, {num(r['high'])}]" for r in rows) or "—"


def setting(config):
    """What a run's config.json says of the three places where the paper's and CleanRL's settings differ."""
    clip = "annealed" if config["hparams"]["anneal_clip"] else "fixed"
    return f"{config['update_epochs']} epochs, ε {clip}, c1 {config['hparams']['vf_coef']:g}"


def main(run_dirs, out=os.path.join(HERE, "atari_vs_cleanrl.png")):
    """A panel a game (its runs in the order given, CleanRL's line beside them); the table's rows on stdout,
    a game's later runs named by their setting."""
    with open(os.path.join(HERE, "cleanrl_atari_readoff.csv")) as f:
        readoff = list(csv.DictReader(f))
    configs = []
    for run_dir in run_dirs:
        with open(os.path.join(run_dir, "config.json")) as f:
            configs.append(json.load(f))
    game_of = lambda config: config["env"].split(":")[1].split("-")[0]  # noqa: E731
    games = list(dict.fromkeys(map(game_of, configs)))
    fig, axes = plt.subplots(1, len(games), figsize=(5 * len(games), 3.6), squeeze=False)
    print("| game | env steps (frames) | ppo_jax | CleanRL (read off its figure) |\n|---|---|---|---|")
    for ax, game in zip(axes[0], games):
        runs = [(run_dir, config) for run_dir, config in zip(run_dirs, configs) if game_of(config) == game]
        curves = [trailing_mean(run_dir) for run_dir, _ in runs]
        longest = max(steps[-1] for steps, _ in curves)
        theirs = [r for r in readoff if r["game"] == game and float(r["env_steps"]) <= longest + 1]
        x = np.array([float(r["env_steps"]) for r in theirs])
        ax.fill_between(x, [float(r["low"]) for r in theirs], [float(r["high"]) for r in theirs], color="C1", alpha=0.2)
        ax.plot(x, [float(r["return"]) for r in theirs], color="C1",
                label="CleanRL, 3 seeds: 4 epochs, ε fixed, c1 0.5 (read off its figure)")
        for i, ((_, config), (steps, score)) in enumerate(zip(runs, curves)):
            ax.plot(steps, score, color=f"C{2 * i}", label=f"ppo_jax, seed {config['seed']}: {setting(config)}")
            name = f"{game}, {setting(config)}" if i else game
            for mark in np.arange(250_000, steps[-1] + 1, 250_000):
                ours = score[np.searchsorted(steps, mark)]
                near = [r for r in theirs if abs(float(r["env_steps"]) - mark) < 1]
                print(f"| {name} | {mark / 1e6:.2f}M ({mark * 4 / 1e6:.0f}M) | {num(ours)} | {reading(near[:1])} |")
            mine = [r for r in theirs if float(r["env_steps"]) <= steps[-1] + 1]
            last = f"{float(mine[-1]['env_steps']) / 1e6:.2f}M: {reading(mine[-1:])}" if mine else "—"
            print(f"| {name} | last: {steps[-1] / 1e6:.2f}M ({steps[-1] * 4 / 1e6:.1f}M) | {num(score[-1])} | {last} |")
        ax.set(title=f"{game}-v5", xlabel="env steps (x4 frames)", ylabel="game score (trailing 100k steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    read_off(sys.argv[2]) if sys.argv[1:2] == ["--read-off"] else main(sys.argv[1:])
