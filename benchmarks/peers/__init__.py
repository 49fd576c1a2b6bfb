"""Peers run beside hpcrl (each in its own venv) and the fetcher of CleanRL's source."""
