"""Benchmarks of commwire components (run through ``commwire bench``)."""
