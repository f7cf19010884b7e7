"""Shared test support: one test client, one way to start servers, the in-process harness."""
