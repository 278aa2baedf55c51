"""Train a Qwen model: ``[torchrun --nproc_per_node=N] train.py --job.config FILE [--section.field VALUE ...]``."""

from __future__ import annotations

import sys

import torch.distributed as dist

from autopar.config import ConfigError, help_text, to_toml
from autopar.distributed import init_world, world_size_from_env
from autopar.job import parse_job
from autopar.log import setup_logging
from autopar.trainer import Trainer
from autopar.validate import validate


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        job = parse_job(argv)
        if job.job.print_config:
            print(to_toml(job))
            return 0
        args = validate(job, world_size_from_env())
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    world = init_world()
    setup_logging(world.rank)
    try:
        Trainer(job, args, world).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
