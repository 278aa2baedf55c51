"""Job configuration: dataclasses, TOML + CLI parsing, and checks on the job's own numbers.

The ground floor: nothing here imports the rest of autopar. ``autopar.training.resolve`` binds the parser
to the model's argument names; ``autopar.training.preflight`` checks a whole job.
"""

from autopar.config.errors import ConfigError
from autopar.config.parse import help_text, to_toml
from autopar.config.sections import JobConfig

__all__ = ["ConfigError", "JobConfig", "help_text", "to_toml"]
