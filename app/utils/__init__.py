"""Small dependency-free helpers shared by every layer: atomic file writes, rank-aware logging,
dtype names."""
