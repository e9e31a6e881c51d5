"""The target model: the adapter over mlx-lm's models (`adapter.py`, the one module that
touches mlx-lm's internals), its caches (`caches.py`; several sequences' in `ragged.py`), the checks of a target's folder
(`files.py`) and plain mlx-lm decoding of an unwrapped target (`baseline.py`)."""
