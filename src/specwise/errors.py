"""The one exception type users see: a message that says what was wrong and what is allowed.

Lives outside the engine so the harness (which never imports torch) can raise and catch it too.
"""

from __future__ import annotations


class SpecwiseError(ValueError):
    """Bad input or an unusable resource; the CLI prints the message without a traceback and exits 2.

    `param` names the input at fault in the request's terms (``prompt``, ``max_tokens``, ``k``, ``drafter``,
    ``temperature``…) and `code` a machine-readable reason; the server puts both into OpenAI's error object, so
    rewording a message never changes the API.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
