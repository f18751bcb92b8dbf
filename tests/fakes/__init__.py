"""Fakes of external services that speak their real wire protocol, so the code under test
runs its real clients against them."""
