"""One exception type for everything a user can get wrong.

The entry point prints a `UserError` as a single line and exits with status 2, so a typo'd
override or a missing file reads as one sentence, not as a traceback from every rank.
"""


class UserError(Exception):
    """Bad input: the message names the key or file and says what to do."""
