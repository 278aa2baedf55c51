"""Choosing a parallel plan: its memory and time predicted per rank, and a simulated launch."""
