"""`python -m autopar.generate`: the command lives in `autopar/cli/generate.py`."""

from autopar.cli.generate import cli

if __name__ == "__main__":
    cli()
