"""``[torchrun --nproc_per_node=N] train.py --job.config FILE [--section.field VALUE ...]``: the
same as ``python -m autopar.train`` or ``autopar-train``, kept for torchrun and muscle memory."""

from autopar.cli.train import cli

if __name__ == "__main__":
    cli()
