"""`python -m autopar.probe`: the command lives in `autopar/cli/probe.py`."""

from autopar.cli.probe import cli

if __name__ == "__main__":
    cli()
