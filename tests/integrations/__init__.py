"""Tests of the plugins in integrations/ against the real engines they plug into."""
