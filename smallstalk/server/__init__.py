"""The running broker: the mutation loop, group commit, sessions, timers, dispatch,
policy, connections, the poller, TLS and admin checks (docs/ARCHITECTURE.md)."""
