"""The engine: what happens to one call of a remat'd function, from the route it takes to its recompute.

See docs/how-it-works.md ("The engine's map") for the path of a call through these files.
"""
