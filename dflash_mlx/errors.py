import unicodedata


class DFlashError(Exception):
    """A user-facing error: its message is one line that says what to do."""


class PromptTooLong(DFlashError):
    """A prompt over what the model reads (or the server accepts): its tokens and the limit, so that
    each front end words it as its clients expect."""

    def __init__(self, tokens: int, limit: int, reader: str = "the model reads"):
        super().__init__(f"The prompt has {tokens} tokens but {reader} at most {limit}; shorten it.")
        self.tokens, self.limit = tokens, limit


class DFlashWarning(UserWarning):
    """A user-facing warning: its message is one line that says what was done."""


def printable(text: str) -> str:
    """`text` with control characters (escape sequences, newlines) written as
    escapes: a message that quotes a file can neither drive the terminal nor
    spill onto more lines."""
    return "".join(c.encode("unicode_escape").decode() if unicodedata.category(c)[0] == "C" else c
                   for c in str(text))
