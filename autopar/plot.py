"""`python -m autopar.plot`: the command lives in `autopar/cli/plot.py`."""

from autopar.cli.plot import cli

if __name__ == "__main__":
    cli()
