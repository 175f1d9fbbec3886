"""Benchmarks of harel-store: run ``python -m benchmarks.run`` (see run.py)."""

from __future__ import annotations
