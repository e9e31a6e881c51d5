"""An answer the server gives instead of a completion: `APIError`, rendered in each API's own
error shape by `http_app`."""

from typing import Optional

from ..errors import PromptTooLong


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.too_long: Optional[PromptTooLong] = None  # a prompt over the limit: its tokens and the limit

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def anthropic_body(self):
        """Anthropic's shape; a prompt over the limit in the words clients such as Claude Code look for
        before they compact their history."""
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        message = self.message
        if self.too_long is not None:
            message = f"prompt is too long: {self.too_long.tokens} tokens > {self.too_long.limit} maximum"
        return {"type": "error", "error": {"type": "api_error" if self.status >= 500 else kind, "message": message}}


def too_long(e: PromptTooLong, param: str) -> APIError:
    """A prompt over the limit, in OpenAI's words and code (`context_length_exceeded`)."""
    error = APIError(400, f"This model's maximum context length is {e.limit} tokens. However, your messages "
                          f"resulted in {e.tokens} tokens. Please reduce the length of the messages.",
                     param=param, code="context_length_exceeded")
    error.too_long = e
    return error
