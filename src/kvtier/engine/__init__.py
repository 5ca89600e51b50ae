"""The tiered KV store: tiers behind one Backend protocol, and the waterfall LRU across them."""
