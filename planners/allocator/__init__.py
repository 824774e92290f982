"""QSync's allocator (the greedy precision search) and the joint batch × precision search."""
