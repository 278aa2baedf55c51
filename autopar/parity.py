"""`python -m autopar.parity`: the command lives in `autopar/cli/parity.py`."""

from autopar.cli.parity import cli

if __name__ == "__main__":
    cli()
