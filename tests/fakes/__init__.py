"""Fakes of external services that speak their real wire protocol (DESIGN habit 8)."""
