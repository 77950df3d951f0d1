"""Thin Prefect flows and the command line over the ``pipeline`` library."""
