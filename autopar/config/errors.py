"""The one error type for bad job input."""


class ConfigError(ValueError):
    """A job field with a value autopar cannot run; the message names the field and the fix."""
