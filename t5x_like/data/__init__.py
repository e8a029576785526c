"""Data: vocabularies, sources, objectives, packing and the deterministic loader."""
