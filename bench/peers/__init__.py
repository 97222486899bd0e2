"""Other serving systems that benchmarks measure Ferry against, each installed into a virtual environment of
its own outside the repository (no peer code lives here)."""
