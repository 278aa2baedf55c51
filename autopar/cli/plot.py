"""Overlay loss curves of several runs: compiled vs eager, plan A vs plan B.

    python -m autopar.plot run_a/metrics.jsonl run_b/metrics.jsonl -o curves.png [--key loss]

Each curve is labelled with its file's folder; any numeric metrics.jsonl key can be plotted.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from autopar.training.metrics.logger import read_metrics


def plot(paths: list[str], out: str, key: str = "loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for path in paths:
        records = [r for r in read_metrics(path) if r.get(key) is not None]
        if not records:
            raise ValueError(f"{path}: no records with key {key!r}")
        ax.plot([r["step"] for r in records], [r[key] for r in records], label=Path(path).parent.name or path)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    parser.add_argument("-o", "--output", required=True, help="image file to write (.png, .svg, .pdf)")
    parser.add_argument("--key", default="loss", help="metric to plot (default loss)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        parser.exit(2, "error: plotting needs matplotlib: pip install matplotlib (or autopar[plot])\n")
    try:
        plot(args.metrics, args.output, args.key)
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {args.output}")
    return 0


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
