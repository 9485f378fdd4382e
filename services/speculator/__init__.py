"""The speculator service (DESIGN.md §2)."""
