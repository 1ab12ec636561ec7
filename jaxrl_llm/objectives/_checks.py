"""Argument checks shared by the per-token objectives: one [B, T] array and others of its shape."""

from __future__ import annotations


def check_token_shapes(fn_name: str, first_name: str, first, **others) -> None:
    """Raise ValueError unless `first` is [B, T] and every array of `others` has its shape."""
    if first.ndim != 2:
        raise ValueError(f"{fn_name}: {first_name} must be [B, T], got shape {first.shape}")
    for name, arr in others.items():
        if arr.shape != first.shape:
            raise ValueError(f"{fn_name}: {name} must have {first_name}'s shape {first.shape}, got {arr.shape}")
