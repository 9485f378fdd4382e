"""The speculator service (docs/architecture.md, "speculator")."""
