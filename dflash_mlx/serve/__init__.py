"""Serving over HTTP: the app (`http_app.py`) on uvicorn (`http_server.py`), the worker
that owns the model and parses requests (`worker.py`), OpenAI's and Anthropic's
response shapes (`openai_api.py`, `messages_api.py`) and tool calls (`tools.py`)."""
