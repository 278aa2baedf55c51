"""Job configuration: dataclasses, TOML + CLI parsing, and checks on the job's own numbers.

The ground floor: nothing here imports the rest of autopar. ``autopar.job`` binds the parser
to the model's argument names; ``autopar.validate`` checks a whole job.
"""

from autopar.config.errors import ConfigError
from autopar.config.job import JobConfig
from autopar.config.parse import help_text, to_toml

__all__ = ["ConfigError", "JobConfig", "help_text", "to_toml"]
