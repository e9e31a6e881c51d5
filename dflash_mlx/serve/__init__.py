"""Serving over HTTP: the app (`http_app.py`) on uvicorn (`http_server.py`), the worker
that owns the model (`worker.py`), request parsing (`requests.py`), OpenAI's and
Anthropic's response shapes (`openai_api.py`, `messages_api.py`), tool calls
(`tools.py`) and the Prometheus metrics (`metrics.py`)."""
