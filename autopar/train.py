"""`python -m autopar.train`: the command lives in `autopar/cli/train.py`."""

from autopar.cli.train import cli

if __name__ == "__main__":
    cli()
