"""Mutation fuzzers for npuc's readers (see each module's docstring)."""
