"""`python -m autopar.plan`: the command lives in `autopar/cli/plan.py`."""

from autopar.cli.plan import cli

if __name__ == "__main__":
    cli()
