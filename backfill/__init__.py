"""Entry points: the `backfill` CLI and process orchestration for the embedded mode."""
