"""What the kopf handlers in main.py hand off to: per kind, the reconcile that gathers the current objects from
the indexes, calls the pure domain modules (versions, modelloads, verification) and writes the result."""
