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


def check_unicode(value: object, where: str, field: str = "") -> None:
    """A DataError naming ``where`` and the field (``messages[1].content``) when a string in
    ``value`` (at any depth of lists and dicts) holds a lone surrogate: JSON may write one
    (``"\\ud800"``), but it is no character, and no tokenizer can encode it."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                at = f" {field}:" if field else ""
                raise DataError(
                    f"{where}:{at} character {err.start} is a lone surrogate ({value[err.start]!r}), not "
                    "valid Unicode (half of a UTF-16 pair cut apart); fix or drop this text"
                ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where, field)
            check_unicode(item, where, f"{field}.{key}" if field else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_unicode(item, where, f"{field}[{index}]")
