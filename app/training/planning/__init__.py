"""Before a run: the --dry-run report (preflight) and the per-rank memory estimate."""
