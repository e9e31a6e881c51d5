class DFlashError(Exception):
    """A user-facing error: its message is one line that says what to do."""
