"""The pure core: commands, parser, replies, records and the state machine. No trio,
clock, files, os or sockets (docs/ARCHITECTURE.md; tests/unit/test_layers.py holds it)."""
