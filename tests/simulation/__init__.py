"""Deterministic simulation of the controller (issue 18).

``model``: an in-memory API server with exactly the semantics the controller
relies on, and per-controller watch queues. ``scheduler``: a seeded scheduler
that interleaves several controllers and simulated users at every await.
``invariants``: what must hold after every step. Run ``python -m
tests.simulation --help``.
"""
