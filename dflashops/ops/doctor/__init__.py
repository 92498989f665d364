"""Checking a target before use: doctor and its checks, trust (host keys)."""
