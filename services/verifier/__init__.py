"""The verifier service (docs/architecture.md, "verifier")."""
