"""Allocation (LAIA), cache snapshots, communication plan and accounting. Pure computation."""
