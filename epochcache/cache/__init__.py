"""The cache directory: shard files, the ledger (SQLite), leases, the budget and eviction, quarantine and repair."""
