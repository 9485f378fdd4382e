"""The router service (DESIGN.md §2)."""
