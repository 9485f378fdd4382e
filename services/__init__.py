"""The specinfer services (router, speculator, verifier), the ``specinfer`` command that
runs them (``services.cli``; also ``python -m services``) and ``specinfer up``."""
