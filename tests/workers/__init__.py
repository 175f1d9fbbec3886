"""Child processes for the crash, race, migration and fault tests (run with ``python -m``)."""
