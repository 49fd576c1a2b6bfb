"""Peers run beside hpcrl (each in its own venv) and their pinned sources, fetched at run time."""
