"""Replication: the primary's feed and the replica's follower, above server/
(cli.py installs the feed's hooks on the loop; docs/ARCHITECTURE.md)."""
