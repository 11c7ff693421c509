"""Notebooks: fresh, receipted runs of whole notebooks (fresh.py, fresh_file.py)."""
