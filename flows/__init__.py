"""Prefect flows: the evolution and its deployment."""
