"""The error type for bad user input, which the CLI reports as one line instead of a traceback."""


class UserError(ValueError):
    """Bad input from the user (file, line, sample id or argument named in the message).

    The CLI prints it as one line and exits with code 2 instead of a traceback."""
