"""The tables of docs/claims.md, docs/leaderboard.md and docs/leaderboard-analysis.md, one module
per kind of table; lab/scripts/claims_tables.py renders them."""
