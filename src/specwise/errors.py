"""The one exception type users see: a message that says what was wrong and what is allowed.

Lives outside the engine so the harness (which never imports torch) can raise and catch it too.
"""


class SpecwiseError(ValueError):
    """Bad input or an unusable resource; the CLI prints the message without a traceback and exits 2."""
