"""specinfer services: router, speculator, verifier."""
