"""The data directory: its layout and lock, the AOF, snapshots, bodies on disk, recovery,
the history reader and the compactor. Imports core/ only (docs/ARCHITECTURE.md)."""
