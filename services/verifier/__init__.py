"""The verifier service (DESIGN.md §2)."""
