"""Command line, demo and self-test."""
