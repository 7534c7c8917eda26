"""The Ferry operator: kopf handlers over pure domain modules."""
