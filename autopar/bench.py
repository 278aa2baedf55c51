"""`python -m autopar.bench`: the command lives in `autopar/cli/bench.py`."""

from autopar.cli.bench import cli

if __name__ == "__main__":
    cli()
