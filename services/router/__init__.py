"""The router service (docs/architecture.md, "router")."""
