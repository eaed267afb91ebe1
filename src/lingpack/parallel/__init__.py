"""Context parallelism over the `context` mesh axis (see reorder.py for the token layout contract)."""
