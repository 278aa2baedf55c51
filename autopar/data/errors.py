"""The one error every data problem raises."""


class DataError(ValueError):
    """A dataset or tokenizer that cannot be used; the message names the file and what is wrong."""


def not_utf8(path: object, err: UnicodeDecodeError) -> DataError:
    """The error of a data file that is not UTF-8, naming the first bad byte and the fix."""
    byte = err.object[err.start : err.start + 1]
    return DataError(
        f"{path}: not UTF-8 text (byte {err.start} is {byte!r}); convert it, e.g. "
        "iconv -f latin1 -t utf-8, or move it out of the dataset"
    )
