"""Infrastructure adapters: settings, database, object store. Imports nothing above it."""
