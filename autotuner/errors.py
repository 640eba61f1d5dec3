"""The one exception type for bad input: the CLI prints it as one line and exits with code 2."""


class UserError(Exception):
    """Bad input the user can fix. The message names the problem and the fix, on one line."""

    exit_code = 2
