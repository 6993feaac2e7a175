"""The project's own fault and fuzz suite (issue 15, item 8): a real worker against the real broker, ledger and Redis."""
