"""The `ferry` command: flag/env loading, process entry points, and `ferry up`'s local stack."""
