"""Validating a batch: the use case (`batch`) and its process pool for large files (`pool`)."""
