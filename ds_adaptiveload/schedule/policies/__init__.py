"""Scheduling policies: each turns an epoch's samples into steps of per-rank micro-batches (pure Python, no torch)."""
