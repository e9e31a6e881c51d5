"""What proposes tokens: one module per drafter kind (`drafter.py` for DFlash 1,
`drafter2.py` for DFlash 2), the draft sources the loop asks (`source.py`), n-gram
lookup (`lookup.py`) and draft trees (`tree.py`)."""
