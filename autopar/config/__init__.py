"""Job configuration: dataclasses, TOML + CLI parsing, and the one validation pass."""

from autopar.config.errors import ConfigError
from autopar.config.job import JobConfig
from autopar.config.parse import help_text, parse_job, to_toml
from autopar.config.validate import model_args, validate

__all__ = ["ConfigError", "JobConfig", "help_text", "model_args", "parse_job", "to_toml", "validate"]
