"""autopar: plain Qwen modules, parallelized after construction, compiled, and trained."""

__version__ = "0.1.0"
