"""The PyPTO backend (see backend.py for the map of its modules)."""
