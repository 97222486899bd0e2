"""Everything Ferry keeps in Redis: worker registry, KV block index, shared load; and block hashing."""
