"""The prompt cache (`prompt_cache.py`): caches kept after a request, found again by a
later prompt's prefix; and its disk tier (`prompt_store.py`)."""
