"""The one error every data problem raises."""


class DataError(ValueError):
    """A dataset or tokenizer that cannot be used; the message names the file and what is wrong."""
