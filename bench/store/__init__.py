"""The KV store: tiers against raw file I/O, load/compute overlap, capped-tier hit rates."""
