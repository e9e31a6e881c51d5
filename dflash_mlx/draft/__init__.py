"""What proposes tokens: one module per drafter kind (`drafter.py` for DFlash 1,
`drafter2.py` for DFlash 2), the draft sources the loop asks (`source.py`), n-gram
lookup (`lookup.py`), draft trees (`tree.py`) and several sequences' drafts in one pass
(`pool.py`)."""
