"""The one exception type users see: a clear message naming the file, field or value at fault."""


class MtpTrtError(Exception):
    """Bad input or an unmet requirement. The CLI prints the message alone, without a traceback."""
